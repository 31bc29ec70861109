"""OpenAI's harmony chat format (gpt-oss): a reply is a series of messages, each
`<|channel|>NAME<|message|>TEXT` ended by `<|end|>` (another message follows, after
`<|start|>assistant`), `<|return|>` (the reply is done) or `<|call|>` (a tool call). The model
thinks in the `analysis` channel and answers in `final`.

A harmony tokenizer (genfast.llm.checkpoints.tokenizer.Tokenizer.harmony) keeps these markers in
the text it decodes, so that the text carries the structure; `HarmonyStream` splits streamed text
into (channel, text) pieces for a front end to show the final answer and set the analysis apart.
`parse_messages` reads a whole reply's messages with their recipients: a message addressed
`to=functions.NAME` (in the commentary channel, ended by `<|call|>`) is a call of tool NAME with
the message as its JSON arguments.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import TextIO

START, CHANNEL, MESSAGE, END, RETURN, CALL = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
)
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL)
# The tokens that end a harmony reply (`<|end|>` only ends a message within it).
STOP_TEXTS = (RETURN, CALL)
FINAL, ANALYSIS = "final", "analysis"


@dataclass
class HarmonyStream:
    """Incremental parser of a harmony reply's text: `push` takes text as it streams and returns
    the (channel, text) pieces that became final; text outside a message (headers, markers) is
    dropped. A message with no channel header counts as `final` (a reply that skips analysis)."""

    channel: str = FINAL
    _buffer: str = ""
    _in_header: bool = False  # between <|start|> or <|channel|> and <|message|>
    _header: str = ""
    _named: bool = False  # the header is a channel's name (it followed <|channel|>)
    messages: list[tuple[str, str]] = field(default_factory=list)  # every piece, in order

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        while self._buffer:
            at = self._buffer.find("<|")
            if at == -1 or at > 0:  # text before any marker (all of it, if there is none)
                head = self._buffer if at == -1 else self._buffer[:at]
                held = _partial_marker_suffix(head) if at == -1 else 0
                if held:
                    head = head[:-held]
                self._take(head, out)
                self._buffer = self._buffer[len(head) :]
                if at == -1:
                    break
                continue
            marker = next((m for m in MARKERS if self._buffer.startswith(m)), None)
            if marker is None:
                if any(m.startswith(self._buffer) for m in MARKERS):
                    break  # a marker still arriving
                self._take("<|", out)  # not a marker: text
                self._buffer = self._buffer[2:]
                continue
            self._buffer = self._buffer[len(marker) :]
            self._marker(marker)
        self.messages.extend(out)
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held back (the reply ended)."""
        out: list[tuple[str, str]] = []
        self._take(self._buffer, out)
        self._buffer = ""
        self.messages.extend(out)
        return out

    def text(self, channel: str = FINAL) -> str:
        """All text of one channel so far."""
        return "".join(t for c, t in self.messages if c == channel)

    def _marker(self, marker: str) -> None:
        if marker == CHANNEL:  # the channel's name follows (after a role, if <|start|> gave one)
            self._in_header, self._header, self._named = True, "", True
        elif marker == MESSAGE:
            name = self._header.split()[0] if self._named and self._header.strip() else FINAL
            self.channel = name  # of "commentary to=functions.x <|constrain|>json": its kind
            self._in_header, self._header, self._named = False, "", False
        else:  # START, or END, RETURN, CALL (the message is over): a header or nothing follows
            self._in_header, self._header, self._named = True, "", False

    def _take(self, text: str, out: list[tuple[str, str]]) -> None:
        if not text:
            return
        if self._in_header:
            self._header += text
        elif out and out[-1][0] == self.channel:
            out[-1] = (self.channel, out[-1][1] + text)
        else:
            out.append((self.channel, text))


def _partial_marker_suffix(text: str) -> int:
    """Length of the longest suffix of `text` that may begin a marker ("<" or "<|" ...)."""
    for n in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


def split_reply(text: str) -> dict[str, str]:
    """A whole harmony reply's text per channel (e.g. {'analysis': ..., 'final': ...})."""
    stream = HarmonyStream()
    stream.push(text)
    stream.finish()
    channels: dict[str, str] = {}
    for channel, piece in stream.messages:
        channels[channel] = channels.get(channel, "") + piece
    return channels


@dataclass(frozen=True)
class Message:
    """One message of a reply: its channel, its recipient (None: the user; `functions.NAME`: a
    tool) and its text."""

    channel: str
    recipient: str | None
    text: str


# The recipient stands in the header, before or after the channel: "<|start|>assistant
# to=functions.f<|channel|>commentary json" or "<|channel|>commentary to=functions.f <|constrain|>json".
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_ENDS = re.compile("|".join(re.escape(m) for m in (END, RETURN, CALL)))


def parse_messages(text: str) -> list[Message]:
    """A whole reply's messages, in order. As in HarmonyStream, text before any header is a final
    message, and text after a reply's last end marker that opens no message is dropped."""
    messages = []
    for index, segment in enumerate(_ENDS.split(text)):
        header, found, body = segment.partition(MESSAGE)
        if not found:
            if index == 0 and segment and START not in segment and CHANNEL not in segment:
                messages.append(Message(FINAL, None, segment))
            continue
        _, named, channel_part = header.partition(CHANNEL)
        words = channel_part.split()
        recipient = _RECIPIENT.search(header)
        messages.append(Message(words[0] if named and words else FINAL, recipient and recipient.group(1), body))
    return messages


class ReplyPrinter:
    """Shows a streamed harmony reply: the final answer on `out`, the other channels (the
    analysis) on `notes`, each message of theirs on its own line labelled with its channel."""

    def __init__(self, out: TextIO | None = None, notes: TextIO | None = None) -> None:
        self.out, self.notes = out or sys.stdout, notes or sys.stderr
        self.stream = HarmonyStream()
        self._noting: str | None = None  # the channel whose note is open

    def write(self, text: str) -> None:
        self._show(self.stream.push(text))

    def finish(self) -> str:
        """Close the reply; returns its final answer."""
        self._show(self.stream.finish())
        self._close_note()
        return self.stream.text(FINAL)

    def _show(self, pieces: list[tuple[str, str]]) -> None:
        for channel, text in pieces:
            if channel == FINAL:
                self._close_note()
                self.out.write(text)
                self.out.flush()
                continue
            if self._noting != channel:
                self._close_note()
                self.notes.write(f"[{channel}] ")
                self._noting = channel
            self.notes.write(text)
            self.notes.flush()

    def _close_note(self) -> None:
        if self._noting is not None:
            self.notes.write("\n")
            self.notes.flush()
            self._noting = None
