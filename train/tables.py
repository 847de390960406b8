"""Bring-your-own data: tables read with `datasets.load_dataset`, their columns checked and mapped.

A table is named the way `datasets` users already name data: a Hugging Face dataset id (with its
config and split), a `datasets` folder saved with `save_to_disk`, or local JSONL / JSON / CSV /
Parquet files. Columns are mapped from the data's names to lorafleet's (`columns: {query: question}`).
Every problem names the table, the row and the column, so bad data is fixed at its source and
nothing is trained on it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from lorafleet.core.config import StrictModel

_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class TableError(ValueError):
    """A table that cannot be used; the message names the table, the row and the column."""


class TableRef(StrictModel):
    """One table: `path` is a hub id, a folder saved with `save_to_disk`, a data file, or a builder name
    (`json`, `csv`, `parquet`) with `data_files`. A plain string in YAML means `{path: …}`."""

    path: str = Field(min_length=1)
    name: str | None = Field(None, description="The dataset's config name (hub datasets with several).")
    split: str = Field("train", description="The split to read.")
    data_files: str | list[str] | None = None
    revision: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value

    def label(self) -> str:
        return f"{self.path}" + (f" ({self.name})" if self.name else "") + (
            f" [{self.split}]" if self.split != "train" else "")


def load_rows(ref: TableRef, what: str) -> list[dict[str, Any]]:
    """The rows of a table, as dicts; TableError naming the table if it cannot be read."""
    import datasets

    local = Path(ref.path).expanduser()
    try:
        if local.is_dir() and any((local / f).is_file() for f in ("dataset_dict.json", "state.json")):
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                if ref.split not in data:
                    raise TableError(f"{what} {ref.label()}: no split {ref.split!r} (splits: {', '.join(data)})")
                data = data[ref.split]
        elif local.is_file():
            builder = _BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise TableError(f"{what} {ref.path}: unknown file type {local.suffix!r}; use "
                                 f"{', '.join(sorted(_BUILDERS))} or a datasets folder")
            data = datasets.load_dataset(builder, data_files=str(local), split="train")
        else:
            data = datasets.load_dataset(ref.path, ref.name, split=ref.split, data_files=ref.data_files,
                                         revision=ref.revision)
    except TableError:
        raise
    except Exception as exc:  # datasets raises many kinds: missing files, hub errors, parse errors
        raise TableError(f"{what} {ref.label()} cannot be read: {type(exc).__name__}: {exc}") from exc
    return [dict(row) for row in data]


def column(rows: Sequence[Mapping[str, Any]], ours: str, columns: Mapping[str, str], what: str,
           *, required: bool = True, text: bool = True) -> list[Any]:
    """The values of our column `ours` (mapped through `columns`), checked row by row."""
    theirs = columns.get(ours, ours)
    if not rows:
        raise TableError(f"{what} is empty")
    if theirs not in rows[0]:
        if not required:
            return [None] * len(rows)
        hint = f"; map it with columns: {{{ours}: <your column>}}" if theirs == ours else ""
        raise TableError(f"{what}: no column {theirs!r} (columns: {', '.join(rows[0])}){hint}")
    out = []
    for i, row in enumerate(rows):
        value = row.get(theirs)
        if text:
            if value is None or (isinstance(value, str) and not value.strip()):
                raise TableError(f"{what} row {i}: column {theirs!r} is empty")
            value = str(value).strip() if not isinstance(value, str) else value.strip()
        out.append(value)
    return out


def unique_ids(ids: Sequence[Any], what: str, column_name: str) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for i, raw in enumerate(ids):
        key = str(raw)
        if key in seen:
            raise TableError(f"{what} rows {seen[key]} and {i}: duplicate {column_name} {key!r}")
        seen[key] = i
        out.append(key)
    return out


class SplitSettings(StrictModel):
    """How data without its own splits is split: by group (a document, a section), seeded."""

    dev_fraction: float = Field(0.2, ge=0, lt=1)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    seed: int = Field(13, description="Fixes the split and the caps' samples.")

    @model_validator(mode="after")
    def _fractions(self) -> SplitSettings:
        if self.dev_fraction + self.test_fraction >= 1:
            raise ValueError("dev_fraction + test_fraction must be below 1 so that some data is left for training")
        return self


def split_groups(groups: Sequence[str], s: SplitSettings, what: str) -> dict[str, str]:
    """group → train/dev/test: groups shuffled with the seed, the first test_fraction to test, then dev."""
    ordered = sorted(set(groups))
    random.Random(s.seed).shuffle(ordered)
    n_test = round(len(ordered) * s.test_fraction)
    n_dev = round(len(ordered) * s.dev_fraction)
    if n_test == 0 or len(ordered) - n_test - n_dev <= 0:
        raise TableError(f"{what}: {len(ordered)} groups are too few for test_fraction={s.test_fraction} and "
                         f"dev_fraction={s.dev_fraction}; add data or change the fractions")
    return {g: "test" if i < n_test else "dev" if i < n_test + n_dev else "train" for i, g in enumerate(ordered)}


SPLIT_NAMES = {"train": "train", "dev": "dev", "validation": "dev", "valid": "dev", "val": "dev", "test": "test"}
