"""What every kind's data builder shares: the error a bad data choice raises, and chunking text to a token budget."""

from __future__ import annotations

import re
from typing import Any


class DatasetError(ValueError):
    """The chosen laws and settings do not give a usable dataset; the message says what to change."""


_SENTENCE_END = re.compile(r"[.;:]\s")


def _cut_point(offsets: list[tuple[int, int]], ends: set[int], start: int, end: int) -> int:
    """Where to end a window [start, end): after a sentence end in its second half, else at a word boundary."""
    lowest = start + (end - start) // 2
    for t in range(end, lowest, -1):
        if offsets[t - 1][1] in ends:
            return t
    for t in range(end, start + 1, -1):
        if offsets[t][0] > offsets[t - 1][1]:  # whitespace between tokens t-1 and t
            return t
    return end


def chunk_text(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """Cut `text` into pieces of at most `max_tokens` tokens: after a sentence end when one lies in the
    window's second half, else between words. A chunk re-tokenised fits (modulo merges at its edges)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    if len(offsets) <= max_tokens:
        return [text]
    ends = {m.start() + 1 for m in _SENTENCE_END.finditer(text)}
    chunks: list[str] = []
    start_tok = 0
    while start_tok < len(offsets):
        end_tok = min(start_tok + max_tokens, len(offsets))
        if end_tok < len(offsets):
            end_tok = _cut_point(offsets, ends, start_tok, end_tok)
        piece = text[offsets[start_tok][0] : offsets[end_tok - 1][1]].strip()
        if piece:
            chunks.append(piece)
        start_tok = end_tok
    return chunks
