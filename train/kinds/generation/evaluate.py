"""Evaluation of generated headings: greedy decoding, text metrics, the non-learned baseline, an examples table.

* **Decoding.** Greedy, batched, left padding, inputs sorted by length so a batch pads little; the answer
  is the first non-empty line of the decoded continuation (special tokens dropped). Base, LoRA and
  full fine-tune are decoded the same way; decoding stops at the model's end-of-sequence tokens (its
  generation config: `<end_of_turn>` too for Gemma).
* **Metrics** per split, named `{split}_{metric}` through lorafleet.core.metrics (callers add `base_`/`lead_`
  prefixes): `rouge_l` (the headline: mean ROUGE-L F1 of rouge-score over Unicode words, as headline
  generation is scored; rouge-score's default tokenizer keeps only [a-z0-9] and would cut "Kündigung" in
  two), `chrf` (sacrebleu corpus chrF, β = 2, 0–100), `chrf1` (the same with β = 1), `exact_match`,
  `pred_words` (mean length of the answers in words). Every metric sees the same text: answer and reference
  after `normalise_heading` (one normaliser, its examples in its docstring), so a difference the normaliser
  removes costs no metric anything, and an exact match of an answer with words has ROUGE-L 1.
  chrF β = 2 weighs recall twice as much as precision, so on ~3-word headings it rewards long answers
  and shared stems: a copy of the section's opening beats a correct short heading, and a wrong one-word
  answer sharing a stem still scores high (docs/benchmarks.md shows the numbers). It is reported, not gated on.
* **Baseline** `lead`: the section's first N words, N fitted on the training split to maximise ROUGE-L
  (`fit_lead_length`, N ≤ 16), so nothing is tuned on dev or test. A heading names what a section rules,
  and German sections state it in their first clause ("Durch den Kaufvertrag wird der Verkäufer …"); the
  lead is the strongest cheap extractive guess we know of, and the bar a model must clear to have learned
  more than copying. The prompted baselines (k-shot, the other packaged base) are in generation_baselines.
"""

from __future__ import annotations

import copy
import logging
import re
import statistics
import unicodedata
from collections.abc import Sequence
from typing import Any

from lorafleet.core.metrics import key

# The display every long step shares (a bar on a terminal, plain timestamped lines elsewhere) lives in core.
from lorafleet.core.progress import StepProgress, progress

log = logging.getLogger("lorafleet.train")

# The headline first; `pred_words` is a length, not a score (no "best baseline" is taken of it).
TEXT_METRICS = ("rouge_l", "chrf", "chrf1", "exact_match", "pred_words")
SCORE_METRICS = ("rouge_l", "chrf", "chrf1", "exact_match")
_WORD = re.compile(r"\w+", re.UNICODE)
_PARAGRAPH_MARK = re.compile(r"^\(\d+[a-z]?\)\s*")
_LABEL = re.compile(r"^(?:§+|Art\.?|Artikel)\s*\d+[a-z]?\s*[-–:.]?\s*", re.I)
# Footnote markers the statutes' headings carry ("Übergangsmandat *)", escaped "\*)" in the markdown, "(*)") and
# markdown footnote references ("[^1]"): a model cannot know them, so no metric should ask for them.
_FOOTNOTE = re.compile(r"\(\\?\*+\)|\\?\*+\)|\[\^[^\]]*\]")
_EDGE_PUNCT = " \t\"'„“”‚‘’«»*_#:;.,-–"


# ---------------------------------------------------------------- decoding


def clean_answer(text: str) -> str:
    """The first non-empty line of a generated answer, stripped."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def shared_prefix_length(ids: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one token of its own (0 for fewer than two)."""
    if len(ids) < 2:
        return 0
    first, limit = ids[0], min(len(x) for x in ids) - 1
    for i in range(limit):
        if any(x[i] != first[i] for x in ids):
            return i
    return max(limit, 0)


def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[dict[str, str]]],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 24,
    description: str = "generate",
    prefix_cache_min: int | None = None,
) -> list[str]:
    """Greedy answers to chat `prompts` (system + user messages), in input order.

    With `prefix_cache_min`, a token prefix that every prompt shares (a k-shot prompt's system turn and shots:
    ~85 % of its tokens) is run through the model once when it is at least that long; each batch then starts
    from a copy of its cache and computes only its own tails, padded between prefix and tail. The mask and the
    positions (counted over the mask) are those of the unpadded prompt, so the answers are the same up to float
    rounding, at a fraction of the prefill.
    """
    import torch

    rendered = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]
    order = sorted(range(len(rendered)), key=lambda i: -len(ids[i]))  # longest first: a memory peak shows at once
    answers: list[str] = [""] * len(rendered)
    shared = shared_prefix_length(ids) if prefix_cache_min is not None else 0
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if shared < (prefix_cache_min or 0) or (
            isinstance(window, int) and max(map(len, ids), default=0) + max_new_tokens > window):
        shared = 0  # too short to pay, or pads between prefix and tail would shift a sliding window
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only models continue from the last position
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sampling = {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1, "use_cache": True,
                "pad_token_id": tokenizer.pad_token_id, "temperature": None, "top_p": None, "top_k": None}
    try:
        with progress(len(rendered), description) as bar, torch.inference_mode():
            prefix_cache = None
            if shared:
                prefix = torch.tensor([ids[0][:shared]], device=device)
                prefix_cache = model(input_ids=prefix, use_cache=True).past_key_values
                log.info("%s: %d prompt tokens shared by all %d prompts run once", description, shared, len(ids))
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                if prefix_cache is None:
                    enc = tokenizer([rendered[i] for i in idx], return_tensors="pt", padding=True,
                                    add_special_tokens=False).to(device)
                    inputs, mask, extra = enc["input_ids"], enc["attention_mask"], {}
                else:
                    inputs, mask = _prefix_padded(ids, idx, shared, tokenizer.pad_token_id, device)
                    cache = copy.deepcopy(prefix_cache)
                    cache.batch_repeat_interleave(len(idx))
                    extra = {"past_key_values": cache}
                out = model.generate(input_ids=inputs, attention_mask=mask, **extra, **sampling)
                texts = tokenizer.batch_decode(out[:, inputs.shape[1] :], skip_special_tokens=True)
                for i, text in zip(idx, texts, strict=True):
                    answers[i] = clean_answer(text)
                bar.advance(len(idx))
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return answers


def _prefix_padded(ids: Sequence[Sequence[int]], idx: Sequence[int], shared: int, pad: int, device: Any
                   ) -> tuple[Any, Any]:
    """(input ids, mask) of a batch as [shared prefix][pads][own tail]: the prefix comes from the cache."""
    import torch

    tails = [list(ids[i][shared:]) for i in idx]
    width = max(len(t) for t in tails)
    head = list(ids[idx[0]][:shared])
    rows = [head + [pad] * (width - len(t)) + t for t in tails]
    masks = [[1] * shared + [0] * (width - len(t)) + [1] * len(t) for t in tails]
    return torch.tensor(rows, device=device), torch.tensor(masks, device=device)


# ---------------------------------------------------------------- metrics


def normalise_heading(text: str) -> str:
    """The text every generation metric scores (exact match, ROUGE-L, chrF), answers and references alike.

    NFC; footnote markers (`*)`, `\\*)`, `(*)`, `[^1]`) dropped; a leading label (`§ 346`, `§§ 5`, `Art. 3`,
    `Artikel 3a`) and the quotes and punctuation at both edges removed; whitespace collapsed; Unicode case
    folding, under which ß (and ẞ) become "ss", so "Straße" and "STRASSE" match, as do the old and the new
    spelling ("Anschluß", "Anschluss"); umlauts stay ("Kündigung" is not "Kundigung").

    >>> normalise_heading("§ 346 Rücktritt vom Vertrag.")
    'rücktritt vom vertrag'
    >>> normalise_heading("Zahl der Betriebsratsmitglieder *)")
    'zahl der betriebsratsmitglieder'
    >>> normalise_heading("„Gefahrübergang“")
    'gefahrübergang'
    >>> normalise_heading("Straße")
    'strasse'
    """
    text = _FOOTNOTE.sub(" ", unicodedata.normalize("NFC", text)).strip().strip(_EDGE_PUNCT)
    text = _LABEL.sub("", text)
    return " ".join(text.strip(_EDGE_PUNCT).casefold().split())


class _WordTokenizer:
    """rouge-score tokenizer interface: the Unicode words of the normalised text (`normalise_heading`)."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(normalise_heading(text))


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """ROUGE-L F1 of each prediction against its reference, over the words of the normalised texts (0–1)."""
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(["rougeL"], tokenizer=_WordTokenizer())
    return [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references, strict=True)]


def exact_match_reach(references: Sequence[str], inputs: Sequence[str], train_references: Sequence[str]
                      ) -> dict[str, float]:
    """How many references an answer that copies could match exactly: an exact-match ceiling for the data.

    `reach_train`: the share equal to a training reference (after `normalise_heading`), which a model can
    memorise; `reach_input`: the share whose words appear in a row in its own input, which it can copy;
    `reach`: either. A reference that is neither must be composed word by word, which small models rarely get
    exactly right, so exact match well above `reach` is not to be expected.
    """
    seen = {normalise_heading(r) for r in train_references}
    tok = _WordTokenizer()
    n = len(references) or 1
    in_train = in_input = either = 0
    for ref, text in zip(references, inputs, strict=True):
        a = normalise_heading(ref) in seen
        words, haystack = tok.tokenize(ref), tok.tokenize(text)
        b = bool(words) and any(haystack[i:i + len(words)] == words for i in range(len(haystack) - len(words) + 1))
        in_train, in_input, either = in_train + a, in_input + b, either + (a or b)
    return {"reach_train": in_train / n, "reach_input": in_input / n, "reach": either / n}


def chrf(predictions: Sequence[str], references: Sequence[str], beta: int = 2) -> float:
    """sacrebleu's corpus chrF (0–100) of the normalised texts (`normalise_heading`: so case-insensitive, unlike
    sacrebleu's default); β = 2 weighs recall twice as much as precision, β = 1 equally."""
    from sacrebleu.metrics import CHRF

    return float(CHRF(beta=beta).corpus_score([normalise_heading(p) for p in predictions],
                                              [[normalise_heading(r) for r in references]]).score)


def text_metrics(predictions: Sequence[str], references: Sequence[str], split: str) -> dict[str, float]:
    """`{split}_rouge_l`, `_chrf`, `_chrf1`, `_exact_match`, `_pred_words` of `predictions`, each computed on the
    texts after `normalise_heading`."""
    if len(predictions) != len(references) or not references:
        raise ValueError(f"need as many predictions as references (got {len(predictions)} and {len(references)})")
    rouge = rouge_l(predictions, references)
    answers = [normalise_heading(p) for p in predictions]
    exact = [a == normalise_heading(r) for a, r in zip(answers, references, strict=True)]
    return {
        key(split, "rouge_l"): sum(rouge) / len(rouge),
        key(split, "chrf"): chrf(predictions, references, beta=2),
        key(split, "chrf1"): chrf(predictions, references, beta=1),
        key(split, "exact_match"): sum(exact) / len(exact),
        key(split, "pred_words"): sum(len(a.split()) for a in answers) / len(answers),
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
    """The number of lead words (1..max_words) with the best mean ROUGE-L F1 (the headline) on these
    (training) examples; ties: fewer."""
    if not headings:
        return 1
    scores = {n: sum(rouge_l(lead_baseline(inputs, n), headings)) for n in range(1, max_words + 1)}
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
    "SCORE_METRICS", "TEXT_METRICS", "StepProgress", "chrf", "clean_answer", "exact_match_reach", "examples_table",
    "fit_lead_length", "generate_answers", "lead_baseline", "lead_length", "lead_words", "normalise_heading",
    "progress", "rouge_l", "shared_prefix_length", "text_metrics",
]
