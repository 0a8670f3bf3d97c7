"""What the reasoning parsers' streams share: a reply read as it grows, split into reasoning and answer, with the
same results as reading it whole (`ReasoningStream`, server/reasoning.py; `HarmonyStream`, server/harmony.py)."""

from __future__ import annotations

import abc


class SplitStream(abc.ABC):
    """A reply's text, fed piece by piece; each piece gives the reasoning and the answer it settles."""

    buf: str  # text read and not yet given out

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer that `text`, the reply's next piece, adds."""
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """What is left at the end of the reply."""
        return self._drain(final=True)

    @abc.abstractmethod
    def _drain(self, final: bool) -> tuple[str, str]:
        """The reasoning and the answer `buf` settles (all of it when `final`), taken out of `buf`."""
