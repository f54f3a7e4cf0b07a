"""The router <-> variant stream, written in one place: newline-delimited JSON, one object per line.

A step is ``{"token_id", "logprob"[, "top"]}``; the stream ends with ``{"done": true}`` or with
``{"error", "status"}``. A stream that ends with neither was cut off. The variant writes it with the
``*_line`` functions and the router reads it with :class:`LineReader`, which rejoins lines that the transport
split across chunks (a long, fast stream arrives in arbitrary pieces, not one line per chunk)."""

from __future__ import annotations

import codecs
import json
from typing import Iterator, List, Optional, Sequence, Tuple


def step_line(token_id: int, logprob: float, top: Optional[Sequence[Tuple[int, float]]] = None) -> str:
    return json.dumps({"token_id": token_id, "logprob": logprob, **({"top": [list(t) for t in top]} if top else {})}) + "\n"


def done_line() -> str:
    return json.dumps({"done": True}) + "\n"


def error_line(message: str, status: int) -> str:
    return json.dumps({"error": message, "status": status}) + "\n"


class CutOff(ValueError):
    """The stream ended in the middle of a line (the writer died while writing it)."""


class LineReader:
    """Chunks in (text, or bytes cut anywhere, inside a character too), whole decoded lines out; a partial line waits
    for the chunk that completes it."""

    def __init__(self):
        self._pending = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk) -> Iterator[dict]:
        if isinstance(chunk, (bytes, bytearray)):
            chunk = self._utf8.decode(chunk)
        lines: List[str] = (self._pending + chunk).split("\n")
        self._pending = lines.pop()
        for line in lines:
            if line.strip():
                yield json.loads(line)

    def finish(self) -> Iterator[dict]:
        """The last line when the stream ended without a newline after it: one whole object, else ``CutOff``."""
        rest, self._pending = self._pending + self._utf8.decode(b"", final=True), ""
        if rest.strip():
            try:
                step = json.loads(rest)
            except ValueError:
                raise CutOff(f"the stream ended inside a line ({rest[:80]!r})") from None
            yield step
