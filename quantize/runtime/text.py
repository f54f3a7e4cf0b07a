"""Token ids to text: the one decode that the build gate, the live canary, the reference task's accuracy and
the HTTP answers all use, so a completion is scored on the text the service returns for it."""

from __future__ import annotations

from typing import Sequence


def ids_to_text(tok, ids: Sequence[int]) -> str:
    """Special tokens dropped, spaces kept as the tokens have them (no clean-up before punctuation), for a whole
    completion and a streamed piece alike."""
    return tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
