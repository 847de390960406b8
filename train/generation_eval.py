"""Evaluation of generated headings: greedy decoding, text metrics, the non-learned baseline, an examples table.

* **Decoding.** Greedy, batched, left padding, inputs sorted by length so a batch pads little; the answer
  is the first non-empty line of the decoded continuation (special tokens dropped). Base, LoRA and
  full fine-tune are decoded the same way.
* **Metrics** per split, named `{split}_{metric}` (callers add `base_`/`lead_` prefixes):
  `exact_match` (after `normalise_heading`), `chrf` (sacrebleu corpus chrF, 0–100, the headline),
  `rouge_l` (mean ROUGE-L F1 of rouge-score over casefolded Unicode words: its default tokenizer keeps
  only [a-z0-9] and would cut "Kündigung" in two), `pred_words` (mean length of the answers).
* **Baseline** `lead`: the section's first N words, N fitted on the training split to maximise chrF
  (`fit_lead_length`, N ≤ 16), so nothing is tuned on dev or test. A heading names what a section rules,
  and German sections state it in their first clause ("Durch den Kaufvertrag wird der Verkäufer …"); the
  lead is the strongest cheap extractive guess we know of, and the bar a model must clear to have learned
  more than copying. chrF weights recall twice as much as precision (β = 2), so on headings of ~3 words
  it rewards long answers: the fitted N is ~12 words, far longer than a heading (N = 3, the median
  heading length, scores ~20 instead of ~35 on the default data). A constant answer (the most frequent
  heading words) scores near zero on chrF.
"""

from __future__ import annotations

import logging
import re
import statistics
import unicodedata
from collections.abc import Sequence
from typing import Any

# The display every long step shares (a bar on a terminal, plain timestamped lines elsewhere) lives in core.
from lorafleet.progress import StepProgress, progress

log = logging.getLogger("lorafleet.train")

TEXT_METRICS = ("exact_match", "chrf", "rouge_l", "pred_words")
_WORD = re.compile(r"\w+", re.UNICODE)
_PARAGRAPH_MARK = re.compile(r"^\(\d+[a-z]?\)\s*")
_LABEL = re.compile(r"^(?:§+|Art\.?|Artikel)\s*\d+[a-z]?\s*[-–:.]?\s*", re.I)
_EDGE_PUNCT = " \t\"'„“”‚‘’«»*_#:;.,-–"


# ---------------------------------------------------------------- decoding


def clean_answer(text: str) -> str:
    """The first non-empty line of a generated answer, stripped."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[dict[str, str]]],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 24,
    description: str = "generate",
) -> list[str]:
    """Greedy answers to chat `prompts` (system + user messages), in input order."""
    import torch

    rendered = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in rendered]
    order = sorted(range(len(rendered)), key=lambda i: -lengths[i])  # longest first: a memory peak shows at once
    answers: list[str] = [""] * len(rendered)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only models continue from the last position
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with progress(len(rendered), description) as bar, torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                enc = tokenizer([rendered[i] for i in idx], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(device)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                                     pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                for i, text in zip(idx, texts, strict=True):
                    answers[i] = clean_answer(text)
                bar.advance(len(idx))
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return answers


# ---------------------------------------------------------------- metrics


def normalise_heading(text: str) -> str:
    """Casefolded, NFC, whitespace collapsed, a leading `§ N` label and edge quotes/punctuation removed."""
    text = unicodedata.normalize("NFC", text).strip().strip(_EDGE_PUNCT)
    text = _LABEL.sub("", text)
    return " ".join(text.strip(_EDGE_PUNCT).casefold().split())


class _WordTokenizer:
    """rouge-score tokenizer interface: casefolded Unicode words (umlauts and ß kept)."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(unicodedata.normalize("NFC", text).casefold())


def text_metrics(predictions: Sequence[str], references: Sequence[str], split: str) -> dict[str, float]:
    """`{split}_exact_match`, `{split}_chrf`, `{split}_rouge_l`, `{split}_pred_words` of `predictions`."""
    from rouge_score.rouge_scorer import RougeScorer
    from sacrebleu.metrics import CHRF

    if len(predictions) != len(references) or not references:
        raise ValueError(f"need as many predictions as references (got {len(predictions)} and {len(references)})")
    scorer = RougeScorer(["rougeL"], tokenizer=_WordTokenizer())
    rouge = [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references, strict=True)]
    exact = [normalise_heading(p) == normalise_heading(r) for p, r in zip(predictions, references, strict=True)]
    return {
        f"{split}_exact_match": sum(exact) / len(exact),
        f"{split}_chrf": CHRF().corpus_score(list(predictions), [list(references)]).score,
        f"{split}_rouge_l": sum(rouge) / len(rouge),
        f"{split}_pred_words": sum(len(p.split()) for p in predictions) / len(predictions),
    }


# ---------------------------------------------------------------- baseline


def lead_words(text: str, n: int) -> str:
    """The first `n` words of a section's text, without its leading paragraph mark `(1)`."""
    return " ".join(_PARAGRAPH_MARK.sub("", text).split()[:n]).rstrip(",;:.")


def lead_length(headings: Sequence[str]) -> int:
    """Median heading length in words (at least 1)."""
    return max(1, round(statistics.median(len(h.split()) for h in headings))) if headings else 1


def lead_baseline(inputs: Sequence[str], n_words: int) -> list[str]:
    return [lead_words(text, n_words) for text in inputs]


def fit_lead_length(inputs: Sequence[str], headings: Sequence[str], max_words: int = 16) -> int:
    """The number of lead words (1..max_words) with the best chrF on these (training) examples; ties: fewer."""
    from sacrebleu.metrics import CHRF

    if not headings:
        return 1
    chrf = CHRF()
    scores = {n: chrf.corpus_score(lead_baseline(inputs, n), [list(headings)]).score for n in range(1, max_words + 1)}
    return max(scores, key=lambda n: (scores[n], -n))


# ---------------------------------------------------------------- report


def _cell(text: str, width: int = 90) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def examples_table(rows: Sequence[dict[str, str]], columns: Sequence[str], n: int = 10) -> str:
    """A markdown table of the first `n` rows, one column per key in `columns`, long cells cut."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows[:n]]
    return "\n".join(lines)


__all__ = [
    "TEXT_METRICS", "StepProgress", "clean_answer", "examples_table", "fit_lead_length", "generate_answers",
    "lead_baseline", "lead_length", "lead_words", "normalise_heading", "progress", "text_metrics",
]
