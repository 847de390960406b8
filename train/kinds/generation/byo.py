"""Your own generation data as a HeadingsDataset: one instruction in, one answer out, like the headings task.

Layouts (`data.layout`):
* `messages` — a `messages` column in the chat format trl and OpenAI use: an optional system message equal
  to the task's system prompt, one user message, one assistant message.
* `prompt_completion` — a `prompt` and a `completion` column (text).

The task's system prompt (`data.system_prompt`) is part of the task and of the bundle: a served
specialist applies it when a request brings none. Inputs are cut to `input_max_tokens`, rows with
the same input stay in one split, splits are made by seed unless a `split` column gives them, and
the same leakage check and digest discipline as the statutes apply.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

from lorafleet.train.chunks import DatasetError
from lorafleet.train.kinds.generation.headings import (
    SPLITS,
    HeadingExample,
    HeadingsDataset,
    check_no_leakage,
    check_system_prompt,
    compute_digest,
    count_tokens,
    cut_to_tokens,
)
from lorafleet.train.tables import SPLIT_NAMES, SplitSettings, TableError, TableRef, column, load_rows, split_groups


class GenerationDatasetData(SplitSettings):
    """Your own instruction → answer rows, read with `datasets` (docs/data.md)."""

    layout: Literal["messages", "prompt_completion"]
    rows: TableRef
    columns: dict[str, str] = Field(default_factory=dict, description="lorafleet's column name → the data's.")
    system_prompt: str = Field(min_length=1, description="The task's instruction (part of the task and the bundle).")
    system_prompt_max_tokens: int = Field(64, ge=1)
    input_max_tokens: int = Field(256, ge=8, le=8192, description="Token budget of an input.")
    max_train_examples: int | None = Field(None, ge=1)
    max_eval_examples: int | None = Field(None, ge=1)


def _pairs(d: GenerationDatasetData, rows: list[dict[str, Any]], what: str) -> list[tuple[str, str]]:
    if d.layout == "prompt_completion":
        return list(zip(column(rows, "prompt", d.columns, what), column(rows, "completion", d.columns, what),
                        strict=True))
    name = d.columns.get("messages", "messages")
    convs = column(rows, "messages", d.columns, what, text=False)
    out = []
    for i, conv in enumerate(convs):
        if not isinstance(conv, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
            raise TableError(f"{what} row {i}: column {name!r} must be a list of {{role, content}} messages")
        turns = [m for m in conv if m["role"] != "system"]
        for m in conv:
            if m["role"] == "system" and str(m["content"]).strip() != d.system_prompt.strip():
                raise TableError(f"{what} row {i}: its system message differs from data.system_prompt; the system "
                                 "prompt belongs to the task: drop it from the rows or put it in data.system_prompt")
        if [m["role"] for m in turns] != ["user", "assistant"]:
            raise TableError(f"{what} row {i}: needs exactly one user and then one assistant message "
                             f"(got roles {[m['role'] for m in conv]})")
        user, answer = str(turns[0]["content"]).strip(), str(turns[1]["content"]).strip()
        if not user or not answer:
            raise TableError(f"{what} row {i}: an empty {'user' if not user else 'assistant'} message")
        out.append((user, answer))
    return out


def build_byo_generation(d: GenerationDatasetData, tokenizer: Any) -> HeadingsDataset:
    """Examples from your rows; DatasetError naming the table, row and column for data that cannot be used."""
    from datasets import Dataset, DatasetDict

    check_system_prompt(d.system_prompt, tokenizer, d.system_prompt_max_tokens)
    what = f"rows {d.rows.label()}"
    try:
        rows = load_rows(d.rows, "rows")
        pairs = _pairs(d, rows, what)
        given = column(rows, "split", d.columns, what, required=False, text=False)
    except TableError as exc:
        raise DatasetError(str(exc)) from exc
    examples_all: list[HeadingExample] = []
    split_of: dict[str, str] = {}
    for i, (prompt, answer) in enumerate(pairs):
        text = cut_to_tokens(prompt, tokenizer, d.input_max_tokens)
        examples_all.append(HeadingExample(f"row{i}", f"row {i}", text, answer, count_tokens(tokenizer, text)))
        if given[i] is not None:
            name = SPLIT_NAMES.get(str(given[i]).lower())
            if name is None:
                raise DatasetError(f"{what} row {i}: split {given[i]!r} is not one of train, dev (validation), test")
            if split_of.setdefault(text, name) != name:
                raise DatasetError(f"{what} row {i}: the same input is in two splits")
    if given[0] is None:
        try:
            split_of = split_groups([ex.input for ex in examples_all], d, "the rows")  # same input → same split
        except TableError as exc:
            raise DatasetError(str(exc)) from exc
    caps = {"train": d.max_train_examples, "dev": d.max_eval_examples, "test": d.max_eval_examples}
    examples: dict[str, list[HeadingExample]] = {}
    for split in SPLITS:
        pool = [ex for ex in examples_all if split_of[ex.input] == split]
        if caps[split] is not None and len(pool) > caps[split]:
            pool = sorted(random.Random(f"{d.seed}:{split}").sample(pool, caps[split]), key=lambda e: e.id)
        if not pool:
            raise DatasetError(f"the rows leave no {split} examples; add rows or change the split fractions")
        examples[split] = pool
    data = DatasetDict({split: Dataset.from_dict({
        "id": [ex.id for ex in examples[split]],
        "messages": [ex.messages(d.system_prompt) for ex in examples[split]],
    }) for split in SPLITS})
    dataset = HeadingsDataset(examples=examples, data=data, settings=d.model_dump(mode="json"))
    try:
        check_no_leakage(dataset)
    except AssertionError as exc:
        raise DatasetError(f"the rows' own splits leak: {exc}") from exc
    dataset.digest = compute_digest(dataset)
    return dataset
