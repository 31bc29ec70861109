"""Incremental detokenization with stop strings, for streaming text as tokens arrive."""

from __future__ import annotations

from genfast.llm.tokenizer import Tokenizer


class TextStream:
    """Turns one sequence's new token ids into printable text.

    Text is released only when it is final: not the start of an unfinished UTF-8 character
    (decoded as U+FFFD) and not a possible beginning of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.text = ""  # final text, up to (excluding) any stop string
        self._released = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        decoded = self.tokenizer.decode(self.ids)
        for stop in self.stop_strings:
            at = decoded.find(stop)
            if at != -1:
                decoded = decoded[:at]
                self.stopped = True
        if not self.stopped:
            decoded = decoded.rstrip("\ufffd")  # an incomplete multi-byte character
            decoded = decoded[: len(decoded) - self._held_back(decoded)]
        self.text = decoded
        return self._release()

    def finish(self) -> str:
        """The text held back so far (generation ended)."""
        if not self.stopped:
            self.text = self.tokenizer.decode(self.ids)
        return self._release()

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self) -> str:
        new = self.text[self._released:]
        self._released = len(self.text)
        return new
