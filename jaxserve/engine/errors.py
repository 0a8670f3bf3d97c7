"""Errors the engine reports to its callers."""


class EngineError(RuntimeError):
    """A request failed inside the engine (the engine itself keeps running)."""
