"""Incremental detokenization with stop strings, for streaming text as tokens arrive."""

from __future__ import annotations

from genfast.llm.checkpoints.tokenizer import Tokenizer


class TextStream:
    """Turns one sequence's new token ids into printable text, in O(1) decode work per token.

    Each step decodes only a short window of recent ids (as vLLM does): the text of
    ids[prefix:] minus the text of ids[prefix:read] is what the new ids add. Decoding a window
    rather than a single id keeps tokenizers that merge or strip across tokens (byte-level
    pieces of one character, SentencePiece's leading space) correct. Text is released only when
    it is final: not an unfinished UTF-8 character and not a possible start of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far, cut before a stop string once one appears
        self.stopped = False
        self._prefix = 0  # window start
        self._read = 0  # ids before this are already in self.text
        self._released = 0

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        new = self._decode_new()
        if new is None:  # the window ends inside a multi-byte character
            return ""
        searched_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new
        for stop in self.stop_strings:
            at = self.text.find(stop, searched_from)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """Everything still held back (generation ended)."""
        if not self.stopped and self._read < len(self.ids):
            self.text += self.tokenizer.decode(self.ids[self._prefix :])[
                len(self.tokenizer.decode(self.ids[self._prefix : self._read])) :
            ]
        return self._release(final=True)

    def _decode_new(self) -> str | None:
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if after.endswith("\ufffd"):
            return None
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        new = self.text[self._released : end]
        self._released = max(self._released, end)
        return new

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
