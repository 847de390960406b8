"""Token counts per input, with the base model's fast tokenizer (cached once per base).

Counts include special tokens ([CLS], [SEP], …), as the model sees them. Without a
`tokenizer.json` (e.g. a hub id that is not in the local cache) the count is an estimate:
ceil(utf-8 bytes / 3) + 2, which over-counts typical text a little (WordPiece/BPE tokens
average 3–5 bytes) so the max_input_tokens limit errs on the safe side.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from tokenizers import Tokenizer

from lorafleet.core.model_source import tokenizer_file

log = logging.getLogger(__name__)

ESTIMATE_BYTES_PER_TOKEN = 3
ESTIMATE_SPECIAL_TOKENS = 2


def estimate_tokens(text: str) -> int:
    """The documented fallback: ceil(len(utf-8 bytes) / 3) + 2."""
    return math.ceil(len(text.encode("utf-8")) / ESTIMATE_BYTES_PER_TOKEN) + ESTIMATE_SPECIAL_TOKENS


class TokenCounter:
    """Counts tokens of one base model; `exact` is False when it falls back to the estimate."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        if tokenizer is not None:
            # tokenizer.json files often carry truncation/padding to the model length (MiniLM: 128);
            # with them on, every long input would count as exactly 128 and slip past the limit.
            tokenizer.no_truncation()
            tokenizer.no_padding()
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path | None) -> TokenCounter:
        if path is None:
            return cls(None)
        return cls(Tokenizer.from_file(str(path)))

    @classmethod
    def for_source(cls, source: str) -> TokenCounter:
        try:
            path = tokenizer_file(source)
        except Exception as exc:  # a broken source only costs exactness, never availability
            log.warning("no tokenizer for %s (%s); using the byte estimate", source, exc)
            path = None
        if path is None:
            log.warning("no tokenizer.json for %s; token counts are estimates (ceil(bytes/3)+2)", source)
        return cls.from_file(path)

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    def count(self, texts: list[str]) -> list[int]:
        tok = self._tokenizer
        if tok is None:
            return [estimate_tokens(t) for t in texts]
        # encode() per text: encode_batch would spin up rayon threads on cores the workers need.
        return [len(tok.encode(t, add_special_tokens=True)) for t in texts]

    def count_in_thread(self, texts: list[str]) -> list[int]:
        """The same counts for a thread beside the event loop: `encode` holds the GIL for the whole text
        (3 MB: 2.4 s of a stalled process), `encode_batch` releases it. Serial, taking no extra core, as
        long as TOKENIZERS_PARALLELISM=false, which the gateway sets (serve/__main__.py)."""
        tok = self._tokenizer
        if tok is None:
            return [estimate_tokens(t) for t in texts]
        return [len(e) for e in tok.encode_batch(texts, add_special_tokens=True)]
