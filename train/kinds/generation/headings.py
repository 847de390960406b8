"""German statute headings as a generation task: a section's text in, its official heading out.

* **Examples.** One per section of the chosen laws that has a heading and is in force: input = the
  section's text (its paragraphs, whitespace-normalised, cut to `input_max_tokens` tokens of the base
  model's tokenizer, after a sentence end when one lies in the window's second half, else between words);
  output = its heading (`bgb:§433` → "Vertragstypische Pflichten beim Kaufvertrag"). Repealed sections
  ("(weggefallen)", "(aufgehoben)", "(gegenstandslos)", a bare "-") are skipped.
* **Format.** A `datasets.DatasetDict` (train/dev/test) in trl's conversational format: `messages` =
  [system prompt, user = the input, assistant = the heading], plus `id` (the section id). The system
  prompt is part of the task (its text is in the digest); one over `system_prompt_max_tokens` is refused.
* **Splits by section.** Sections whose cut inputs are identical form one group that stays in one split;
  groups are shuffled with `seed` and cut into test/dev/train; then each split is capped by a seeded sample.
  `check_no_leakage` asserts that no section and no input text sits in two splits.
* **Digest** = sha256 over the data settings, every example (split, id, input, heading) and the
  `datasets` fingerprint of each split.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from lorafleet.core.config import StrictModel
from lorafleet.core.settings import data_dir
from lorafleet.train.chunks import DatasetError, chunk_text
from lorafleet.train.statutes import LawStems, Section, parse_law

SPLITS = ("train", "dev", "test")
DEFAULT_SYSTEM_PROMPT = "Nenne die amtliche Überschrift dieses Gesetzesparagraphen. Antworte nur mit der Überschrift."
# Texts that mark a repealed section; statutes.py already drops "(weggefallen)" in text or title.
_REPEALED = re.compile(r"^\(?\s*(?:weggefallen|aufgehoben|gegenstandslos|entfällt)\s*\)?\.?$|^[-–—\s.]*$", re.I)


class HeadingsDataConfig(StrictModel):
    """Which statutes, how inputs are cut, how sections are split and sampled. All of it shapes the digest."""

    laws: LawStems = Field(
        default_factory=lambda: ["bgb", "stgb", "zpo", "aktg", "urhg", "markeng", "betrvg", "gmbhg"],
        min_length=1, description="File stems under LORAFLEET_DATA_DIR/gesetze.",
    )
    dev_fraction: float = Field(0.1, gt=0, lt=1, description="Share of sections (by group) that are dev.")
    test_fraction: float = Field(0.1, gt=0, lt=1, description="Share of sections (by group) that are test.")
    seed: int = Field(13, description="Fixes the section split and the samples.")
    max_train_examples: int | None = Field(
        1600, ge=1, description="Cap on training examples (seeded sample); 1,600 fit 2 CPU cores' 20-minute budget.")
    max_eval_examples: int | None = Field(150, ge=1, description="Cap on dev and on test examples, each.")
    input_max_tokens: int = Field(96, ge=8, le=4096, description="Token budget of a section's text (the input).")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, min_length=1, description="The task's instruction.")
    system_prompt_max_tokens: int = Field(64, ge=1, description="A longer system prompt is refused.")

    @model_validator(mode="after")
    def _check_fractions(self) -> HeadingsDataConfig:
        if self.dev_fraction + self.test_fraction >= 1:
            raise ValueError("dev_fraction + test_fraction must be below 1 so that some sections are left for training")
        return self


@dataclass(frozen=True)
class HeadingExample:
    id: str  # section id, e.g. "bgb:§433"
    label: str  # "§ 433"
    input: str  # the section's text, cut to the token budget
    heading: str
    input_tokens: int

    def messages(self, system_prompt: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": self.input},
            {"role": "assistant", "content": self.heading},
        ]


@dataclass
class HeadingsDataset:
    """Examples per split, the same as a trl-ready DatasetDict, the settings and the content digest."""

    examples: dict[str, list[HeadingExample]]
    data: Any  # datasets.DatasetDict: train/dev/test with columns id, messages
    settings: dict[str, Any]
    digest: str = ""
    skipped: dict[str, int] = field(default_factory=dict)  # why sections were left out → how many

    @property
    def system_prompt(self) -> str:
        return str(self.settings["system_prompt"])

    def prompts(self, split: str) -> list[list[dict[str, str]]]:
        """The conversation up to (without) the assistant turn, for generation."""
        return [ex.messages(self.system_prompt)[:-1] for ex in self.examples[split]]

    def references(self, split: str) -> list[str]:
        return [ex.heading for ex in self.examples[split]]

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {f"{split}_examples": len(self.examples[split]) for split in SPLITS}
        for split in SPLITS:
            tokens = [ex.input_tokens for ex in self.examples[split]]
            out[f"{split}_input_tokens"] = sum(tokens)
        out.update({f"skipped_{k}": v for k, v in sorted(self.skipped.items())})
        return out

    def to_frame(self) -> Any:
        """One row per (split, section): what MLflow records as the dataset input."""
        import pandas as pd

        rows = [{"split": split, "section_id": ex.id, "label": ex.label, "input": ex.input, "heading": ex.heading}
                for split in SPLITS for ex in self.examples[split]]
        return pd.DataFrame(rows)


def is_repealed(section: Section) -> bool:
    return bool(_REPEALED.match(section.text)) or bool(_REPEALED.match(section.title))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def cut_to_tokens(text: str, tokenizer: Any, max_tokens: int) -> str:
    """`text` cut to at most `max_tokens` tokens (modulo merges at the cut), after a sentence end if one is near."""
    # Tokenising a long section whole is most of the build time; a prefix of 24 characters a token holds
    # the budget unless tokens are unusually long, in which case the whole text is cut.
    head = text[: max_tokens * 24]
    if len(head) < len(text) and count_tokens(tokenizer, head) <= max_tokens:
        head = text
    return chunk_text(head, tokenizer, max_tokens)[0]


def check_system_prompt(system_prompt: str, tokenizer: Any, max_tokens: int) -> int:
    """Its token count; a DatasetError if it is over the budget."""
    n = count_tokens(tokenizer, system_prompt)
    if n > max_tokens:
        raise DatasetError(f"the system prompt has {n} tokens, over system_prompt_max_tokens={max_tokens}; "
                           "shorten it or raise the budget (every example pays for it in training and generation)")
    return n


def _seeded_sample(items: list[HeadingExample], cap: int | None, seed: int, salt: str) -> list[HeadingExample]:
    if cap is None or len(items) <= cap:
        return items
    return sorted(random.Random(f"{seed}:{salt}").sample(items, cap), key=lambda e: e.id)


def build_headings(
    cfg: HeadingsDataConfig, tokenizer: Any, *, data_root: Path | None = None
) -> HeadingsDataset:
    """Parse the laws, cut the inputs, split by section, sample, and hash the result."""
    from datasets import Dataset, DatasetDict

    root = Path(data_root) if data_root is not None else data_dir()
    check_system_prompt(cfg.system_prompt, tokenizer, cfg.system_prompt_max_tokens)
    skipped = {"no_heading": 0, "repealed": 0}
    candidates: list[HeadingExample] = []
    for stem in cfg.laws:
        for s in parse_law(root, stem).sections:
            if is_repealed(s):
                skipped["repealed"] += 1
            elif not s.title:
                skipped["no_heading"] += 1
            else:
                text = cut_to_tokens(s.text, tokenizer, cfg.input_max_tokens)
                candidates.append(HeadingExample(s.id, s.label, text, s.title, count_tokens(tokenizer, text)))
    if not candidates:
        raise DatasetError(f"the laws {cfg.laws} hold no section with a heading; choose laws such as bgb or stgb")

    groups: dict[str, list[HeadingExample]] = {}
    for ex in sorted(candidates, key=lambda e: e.id):
        groups.setdefault(ex.input, []).append(ex)
    ordered = sorted(groups.values(), key=lambda g: g[0].id)
    random.Random(cfg.seed).shuffle(ordered)
    n_test = round(len(ordered) * cfg.test_fraction)
    n_dev = round(len(ordered) * cfg.dev_fraction)
    if n_test == 0 or n_dev == 0 or n_test + n_dev >= len(ordered):
        raise DatasetError(f"{len(ordered)} sections cannot be split with dev_fraction={cfg.dev_fraction}, "
                           f"test_fraction={cfg.test_fraction} into non-empty train/dev/test; add laws")
    pools: dict[str, list[HeadingExample]] = {"test": [], "dev": [], "train": []}
    for i, group in enumerate(ordered):
        pools["test" if i < n_test else "dev" if i < n_test + n_dev else "train"].extend(group)
    caps = {"train": cfg.max_train_examples, "dev": cfg.max_eval_examples, "test": cfg.max_eval_examples}
    examples = {split: _seeded_sample(sorted(pools[split], key=lambda e: e.id), caps[split], cfg.seed, split)
                for split in SPLITS}

    data = DatasetDict({
        split: Dataset.from_dict({
            "id": [ex.id for ex in examples[split]],
            "messages": [ex.messages(cfg.system_prompt) for ex in examples[split]],
        })
        for split in SPLITS
    })
    dataset = HeadingsDataset(examples=examples, data=data, settings=cfg.model_dump(), skipped=skipped)
    check_no_leakage(dataset)
    dataset.digest = compute_digest(dataset)
    return dataset


def compute_digest(dataset: HeadingsDataset) -> str:
    content = {
        "settings": dataset.settings,
        "examples": {split: [[ex.id, ex.input, ex.heading] for ex in exs] for split, exs in dataset.examples.items()},
        "fingerprints": {split: dataset.data[split]._fingerprint for split in SPLITS},
    }
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def check_no_leakage(dataset: HeadingsDataset) -> None:
    """Raise if a section or an identical input text sits in two splits."""
    seen_ids: dict[str, str] = {}
    seen_inputs: dict[str, str] = {}
    for split in SPLITS:
        for ex in dataset.examples[split]:
            if seen_ids.setdefault(ex.id, split) != split:
                raise AssertionError(f"section {ex.id} is in both {seen_ids[ex.id]} and {split}")
            if seen_inputs.setdefault(ex.input, split) != split:
                raise AssertionError(f"the input of {ex.id} ({split}) is identical to one in {seen_inputs[ex.input]}")
        ids = [ex.id for ex in dataset.examples[split]]
        if len(ids) != len(set(ids)):
            raise AssertionError(f"a section appears twice in {split}")


__all__ = [
    "DEFAULT_SYSTEM_PROMPT", "SPLITS", "HeadingExample", "HeadingsDataConfig", "HeadingsDataset", "build_headings",
    "check_no_leakage", "check_system_prompt", "compute_digest", "cut_to_tokens", "is_repealed",
]
