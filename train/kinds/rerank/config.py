"""The `train:` section of the rerank kind: the retrieval data, the first stage, the cross-encoder LoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lorafleet.core.config import PACKAGED_MINILM, StrictModel
from lorafleet.core.refs import MODELS_SCHEME, parse_models_uri
from lorafleet.train.dropout import DROPOUT_MASKS_HELP, DropoutMasks
from lorafleet.train.kinds.rerank.fusion import RRF_K
from lorafleet.train.kinds.retrieval.config import DataConfig, LoraSettings, RetrievalData, TrainConfig

FirstStageKind = Literal["bm25", "dense", "hybrid"]
# A cross-encoder base is served under its base name plus this (configs/fleet.yaml: all-MiniLM-L6-v2-ce), beside the
# same checkpoint as an embedder: two runtimes of one source need two names.
CE_BASE_SUFFIX = "-ce"


class FirstStageSettings(StrictModel):
    """What finds the candidates the cross-encoder reorders (and mines its hard negatives)."""

    kind: FirstStageKind = Field("bm25", description="bm25; dense (the `embedder`); hybrid: RRF of both.")
    embedder: str = Field(PACKAGED_MINILM, description="dense/hybrid: a sentence-transformers model (packaged "
                          "MiniLM, hub id or folder), or a registered embedding specialist `models:/NAME/N` "
                          "(`models:/NAME@champion`): its base with its LoRA, from the MLflow registry.")
    depth: int = Field(20, ge=2, le=100, description="Rerank depth k: the first stage's top k sections are "
                       "reordered, the rest keep the first stage's order.")
    rrf_k: int = Field(RRF_K, ge=0, description="hybrid: the RRF constant.")

    @field_validator("embedder")
    @classmethod
    def _registry_uri(cls, embedder: str) -> str:
        if embedder.startswith(MODELS_SCHEME):
            parse_models_uri(embedder)  # ValueError naming models:/NAME/VERSION and models:/NAME@ALIAS
        return embedder


class RerankConfig(StrictModel):
    base_model: str = Field(PACKAGED_MINILM, description="A cross-encoder or any BERT-like checkpoint (a missing "
                            "classification head is drawn from a fixed seed, as the serving runtime does).")
    data: RetrievalData = Field(default_factory=DataConfig, description="The retrieval kind's data: the statutes "
                                "(default) or your own with `layout: corpus | pairs`. `num_negatives` hard "
                                "negatives per query are mined from the first stage's ranking (`hard_negatives: "
                                "false`: random training sections instead); `negative_margin` is not used.")
    served_base: str | None = Field(None, description="The fleet base (runtime `cross-encoder`) the bundle runs on "
                                    f"once promoted; default the base model's name plus `{CE_BASE_SUFFIX}`, as the "
                                    "default fleet serves the packaged MiniLM (`all-MiniLM-L6-v2-ce`).")
    first_stage: FirstStageSettings = Field(default_factory=FirstStageSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    loss: Literal["mnrl", "bce", "lambda"] = Field(
        "mnrl", description="mnrl: softmax over the positive, its mined negatives and in-batch ones (listwise, the "
        "default: one relevant section per query); bce: pointwise labelled pairs; lambda: LambdaLoss (nDCG).")
    scale: float = Field(10.0, gt=0, description="mnrl: logit scale.")
    in_batch_negatives: int = Field(4, ge=0, description="mnrl: other queries' documents added as negatives per "
                                    "query, drawn from the batch: 0 none, N that many (all when the batch holds "
                                    "fewer); null is refused (sentence-transformers would read it as all).")
    learning_rate: float = Field(5e-4, gt=0, lt=1)
    epochs: int = Field(1, ge=1, le=100)
    batch_size: int = Field(16, ge=1, description="Queries per step (each with its positive and negatives).")
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_seq_length: int = Field(128, ge=16, le=512, description="Token budget of one corpus chunk (as retrieval).")
    max_pair_length: int = Field(192, ge=16, le=512, description="Token budget of one (query, chunk) pair; what "
                                 "the served cross-encoder truncates to.")
    seed: int = 42
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', …")
    dropout_masks: DropoutMasks = Field("fast", description=DROPOUT_MASKS_HELP)
    eval_batch_size: int = Field(64, ge=1, description="Pairs per forward pass when scoring.")
    price_per_hour_usd: float = Field(0.10, ge=0)

    @model_validator(mode="after")
    def _pairs_fit(self) -> RerankConfig:
        if self.max_pair_length < self.max_seq_length:
            raise ValueError("max_pair_length must hold a whole chunk: at least max_seq_length")
        return self

    def retrieval_config(self) -> TrainConfig:
        """The retrieval kind's config for the same data: what the dataset builders and the dense first stage read
        (the corpus is chunked with the cross-encoder's tokenizer, as it reads the chunks)."""
        return TrainConfig(base_model=self.base_model, data=self.data, max_seq_length=self.max_seq_length,
                           device=self.device, seed=self.seed, eval_batch_size=self.eval_batch_size)
