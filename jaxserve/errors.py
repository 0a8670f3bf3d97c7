"""Errors about the model a user asked for."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model's files describe something jaxserve does not implement."""


class CheckpointError(ValueError):
    """A checkpoint does not match the model it claims to be."""
