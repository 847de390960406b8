"""The `train:` section of a research config: dataset, LoRA and trainer settings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from lorafleet.core.config import PACKAGED_MINILM, ConfigError, StrictModel, apply_overrides, read_yaml, validate_model
from lorafleet.train.dropout import DROPOUT_MASKS_HELP, DropoutMasks
from lorafleet.train.precision import PRECISION_HELP, TrainPrecision
from lorafleet.train.statutes import LawStems
from lorafleet.train.tables import TableRef

QueryKind = Literal["heading", "citation"]


class SplitAndNegatives(StrictModel):
    """What every retrieval data source shares: seeded splits, caps, chunking, hard negatives.

    All but the hard-negative settings go into the dataset digest.
    """

    dev_fraction: float = Field(0.2, ge=0, lt=1, description="Share of query-bearing sections whose queries are dev.")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="Share of query-bearing sections whose queries are test.")
    seed: int = Field(13, description="Fixes the section split and the query samples.")
    max_train_queries: int | None = Field(None, ge=1, description="Cap on training queries (seeded sample).")
    max_eval_queries: int | None = Field(None, ge=1, description="Cap on dev and on test queries, each.")
    max_chunks_per_section: int | None = Field(
        2, ge=1, description="Index only the first N chunks of a long section (None: all of it). Every section "
        "is in the corpus; 2 × 126 tokens hold a section's core rule and halve the encoding work of each evaluation.",
    )
    # Hard negatives are mined at training time with the base model; they do not change the digest.
    hard_negatives: bool = Field(True, description="Add mined hard negatives to the training pairs.")
    num_negatives: int = Field(1, ge=1, le=8, description="Hard negatives per training pair.")
    negative_margin: float = Field(
        0.05, ge=0, description="A candidate counts as negative only if its base-model score is below the positive's "
        "score minus this margin, so near-duplicate sections (statutes repeat themselves) are never pushed away.",
    )
    negative_range_max: int | None = Field(
        None, ge=2, description="Negatives come from the base model's top-N candidates (None: all training sections)."
    )

    @model_validator(mode="after")
    def _check_fractions(self) -> SplitAndNegatives:
        if self.dev_fraction + self.test_fraction >= 1:
            raise ValueError("dev_fraction + test_fraction must be below 1 so that some sections are left for training")
        return self


class DataConfig(SplitAndNegatives):
    """The statutes: which laws, which queries (the default data of the retrieval kind)."""

    laws: LawStems = Field(
        default_factory=lambda: ["kschg", "tzbfg", "agg", "arbzg", "milog", "prodhaftg", "betrvg", "gmbhg"],
        min_length=1,
        description="File stems under LORAFLEET_DATA_DIR/gesetze (bgb, hgb, kschg, …).",
    )
    query_kinds: list[QueryKind] = Field(
        default_factory=lambda: ["heading", "citation"],
        min_length=1,
        description="heading: a section's heading → the section; citation: a sentence citing '§ N' of the same "
        "law, with the citation removed → § N.",
    )
    max_citations_per_section: int = Field(
        4, ge=1, description="Citation queries kept per cited section, so often-cited sections do not dominate."
    )
    min_query_words: int = Field(5, ge=1, description="Shorter citation sentences are dropped.")
    max_query_words: int = Field(48, ge=4, description="Longer citation sentences are cut to this many words.")


class DatasetData(SplitAndNegatives):
    """Your own retrieval data, read with `datasets` (see docs/data.md).

    layout `corpus`: a corpus (id, text[, title]), queries (id, text) and qrels (query_id, corpus_id[, score][,
    split]) — the BEIR/MTEB layout. layout `pairs`: (query, positive[, negative]) rows — the
    sentence-transformers layout; the corpus is the distinct positives and negatives.
    """

    layout: Literal["corpus", "pairs"]
    corpus: TableRef | None = None
    queries: TableRef | None = None
    qrels: TableRef | None = None
    pairs: TableRef | None = None
    columns: dict[str, str] = Field(default_factory=dict,
                                    description="lorafleet's column name → the data's (e.g. {query: question}).")

    @model_validator(mode="after")
    def _tables_for_layout(self) -> DatasetData:
        need = ("corpus", "queries", "qrels") if self.layout == "corpus" else ("pairs",)
        missing = [t for t in need if getattr(self, t) is None]
        if missing:
            raise ValueError(f"layout {self.layout!r} needs the table(s) {', '.join(missing)}")
        return self


def _data_kind(value: Any) -> str:
    layout = value.get("layout") if isinstance(value, dict) else getattr(value, "layout", None)
    return "dataset" if layout is not None else "statutes"


RetrievalData = Annotated[
    Annotated[DataConfig, Tag("statutes")] | Annotated[DatasetData, Tag("dataset")], Discriminator(_data_kind)
]


class LoraSettings(StrictModel):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["query", "key", "value", "dense"],
        min_length=1,
        description="Module names (peft matches suffixes); BERT: query, key, value, dense.",
    )


class TrainConfig(StrictModel):
    base_model: str = Field(PACKAGED_MINILM, description="Packaged MiniLM, hub id or local path.")
    data: RetrievalData = Field(default_factory=DataConfig, description="The statutes (default), or your own "
                                "data with `layout: corpus | pairs` (docs/data.md).")
    lora: LoraSettings = Field(default_factory=LoraSettings)
    learning_rate: float = Field(5e-4, gt=0, lt=1)
    epochs: int = Field(2, ge=1, le=100)
    batch_size: int = Field(32, ge=2, description="In-batch negatives: bigger batches give harder contrast.")
    mini_batch_size: int = Field(8, ge=1, description="cached_mnrl only: sub-batch size of the gradient cache.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_seq_length: int = Field(128, ge=16, le=512, description="Token budget of one corpus chunk and of training.")
    loss: Literal["mnrl", "cached_mnrl"] = "mnrl"
    scale: float = Field(20.0, gt=0, description="MNRL similarity scale (inverse temperature).")
    seed: int = 42
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:0', …")
    precision: TrainPrecision = Field("fp32", description=PRECISION_HELP)
    dropout_masks: DropoutMasks = Field("fast", description=DROPOUT_MASKS_HELP)
    eval_batch_size: int = Field(32, ge=1)
    price_per_hour_usd: float = Field(0.10, ge=0, description="Machine price, for the run's estimated cost.")


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read the `train:` section of `path`; `overrides` are `key=value` relative to it (`lora.r=16`)."""
    path = Path(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict) or "train" not in raw:
        raise ConfigError(f"{path} has no top-level 'train:' section")
    section = raw["train"] or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: 'train:' must be a mapping")
    section = apply_overrides(section, list(overrides or []))
    return validate_model(TrainConfig, section, source=f"{path} [train]")
