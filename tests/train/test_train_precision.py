"""Training precision: bf16 autocast over float32 weights for both kinds, `auto`'s resolution, the config error.

The bf16 trainings run on tiny random models; they need a CPU with native bf16 (this project's machines have
avx512_bf16 / amx_bf16) and are skipped elsewhere, where the setting is refused (tested below with a faked CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_testkit import GEN_LAWS, GEN_SYSTEM, tiny_generation_cfg

from lorafleet.core.config import ConfigError
from lorafleet.models.precision import native_cpu_precisions, read_cpuinfo
from lorafleet.train import DataConfig, LoraSettings, TrainConfig, build_dataset, train_adapter
from lorafleet.train.precision import resolve_training_precision
from lorafleet.train.statutes import parse_law

WITH_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
WITHOUT_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
LAWS = ["kschg", "prodhaftg"]
native_bf16 = pytest.mark.skipif("bf16" not in native_cpu_precisions(read_cpuinfo()),
                                 reason="this CPU has no native bf16 (training at bf16 is refused here)")


# ---------------------------------------------------------------- resolution and the config error (pure)


@pytest.mark.parametrize(("cpuinfo", "auto"), [(WITH_BF16, "bf16"), (ARM_BF16, "bf16"), (WITHOUT_BF16, "fp32")])
def test_auto_resolves_by_the_cpu_flags(cpuinfo: str, auto: str) -> None:
    assert resolve_training_precision("auto", "cpu", cpuinfo=cpuinfo) == auto
    assert resolve_training_precision("fp32", "cpu", cpuinfo=cpuinfo) == "fp32"


def test_auto_follows_the_host_capability_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import lorafleet.models.precision as precision

    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITH_BF16)
    assert resolve_training_precision("auto", "cpu") == "bf16"
    assert resolve_training_precision("bf16", "cpu") == "bf16"
    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITHOUT_BF16)
    assert resolve_training_precision("auto", "cpu") == "fp32"


@pytest.mark.parametrize("bf16_gpu", [True, False])
def test_auto_on_cuda_follows_the_gpu(monkeypatch: pytest.MonkeyPatch, bf16_gpu: bool) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_gpu)
    assert resolve_training_precision("auto", "cuda") == ("bf16" if bf16_gpu else "fp32")
    if not bf16_gpu:
        with pytest.raises(ConfigError, match=r"is_bf16_supported.*supported on cuda: fp32"):
            resolve_training_precision("bf16", "cuda")


def test_bf16_without_native_support_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_training_precision("bf16", "cpu", cpuinfo=WITHOUT_BF16)
    text = str(err.value)
    assert "train.precision is 'bf16'" in text and "avx512_bf16" in text and "supported on cpu: fp32" in text


def test_configs_take_the_setting_and_default_to_fp32() -> None:
    from pydantic import ValidationError

    from lorafleet.train.kinds.generation.config import GenerationTrainConfig

    assert TrainConfig().precision == "fp32" and GenerationTrainConfig().precision == "fp32"
    assert TrainConfig(precision="auto").precision == "auto"
    assert GenerationTrainConfig(precision="bf16", dtype="float32").dtype == "float32"
    with pytest.raises(ValidationError):
        TrainConfig(precision="fp16")


def test_generation_dtype_keeps_working(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dtype` loads the weights; bfloat16 weights train in bf16 whatever `precision` says (CUDA's 'auto')."""
    import lorafleet.models.precision as precision
    from lorafleet.train.kinds.generation.config import GenerationTrainConfig
    from lorafleet.train.kinds.generation.trainer import training_precision

    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITH_BF16)
    assert training_precision(GenerationTrainConfig(), "cpu") == "fp32"  # dtype auto on CPU: float32 weights
    assert training_precision(GenerationTrainConfig(precision="auto"), "cpu") == "bf16"
    assert training_precision(GenerationTrainConfig(dtype="bfloat16"), "cpu") == "bf16"
    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITHOUT_BF16)
    assert training_precision(GenerationTrainConfig(precision="auto"), "cpu") == "fp32"
    with pytest.raises(ConfigError, match="supported on cpu: fp32"):
        training_precision(GenerationTrainConfig(precision="bf16"), "cpu")


# ---------------------------------------------------------------- hooks: what the Linear layers computed in


class LinearDtypes:
    """Forward hooks on every nn.Linear of a model: the output dtypes seen in training and in eval mode."""

    def __init__(self) -> None:
        self.train: set[Any] = set()
        self.eval: set[Any] = set()

    def attach(self, model: Any) -> Any:
        import torch

        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._hook)
        return model

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        (self.train if module.training else self.eval).add(output.dtype)


# ---------------------------------------------------------------- retrieval: a tiny BERT


@pytest.fixture(scope="module")
def statute_model(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_model

    corpus = [s.title + ". " + s.text for law in LAWS for s in parse_law(data_dir, law).sections]
    return build_tiny_model(tmp_path_factory.mktemp("tiny-statutes") / "bert", corpus=corpus, vocab_size=3000,
                            max_seq_length=64, hidden=64, heads=4)


def _retrieval_cfg(model: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        base_model=str(model), data=DataConfig(laws=LAWS, hard_negatives=False), lora=LoraSettings(r=8, alpha=16),
        learning_rate=1e-2, epochs=4, batch_size=8, max_seq_length=64, warmup_ratio=0.0, device="cpu",
    )
    base.update(kw)
    return TrainConfig(**base)


@native_bf16
def test_retrieval_bf16_autocasts_over_float32_weights(statute_model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import load_file

    import lorafleet.train.kinds.retrieval.trainer as trainer_mod
    from lorafleet.train.kinds.retrieval.trainer import load_base_model, pairs_loss

    # lr 1e-2 for 8 epochs: the fp32 test's setting (25–33 % lower loss there; 4 epochs give too little).
    cfg = _retrieval_cfg(statute_model, precision="bf16", epochs=8)
    dataset = build_dataset(cfg)
    seen = LinearDtypes()
    loader = trainer_mod.load_base_model
    monkeypatch.setattr(trainer_mod, "load_base_model", lambda *a, **k: seen.attach(loader(*a, **k)))
    result = train_adapter(cfg, dataset, tmp_path / "run", keep_model=True, evaluate_test=True)

    assert seen.train == {torch.bfloat16}  # every training forward ran under autocast
    assert seen.eval == {torch.float32}  # dev (each epoch) and test scored at float32
    assert result.extras["training_precision"] == "bf16"
    model = result.extras["model"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights, adapter included
    assert {t.dtype for t in load_file(result.adapter_dir / "adapter_model.safetensors").values()} == {torch.float32}
    assert "_original_forward" not in model.__dict__  # handed on without accelerate's autocast wrapper

    pairs = dataset.train_pairs()
    before = pairs_loss(load_base_model(cfg.base_model, "cpu", 64), pairs, 16)
    after = pairs_loss(model, pairs, 16)
    assert after < before * 0.9, (before, after)


def test_retrieval_bf16_refused_before_any_work(statute_model: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import lorafleet.models.precision as precision
    import lorafleet.train.kinds.retrieval.trainer as trainer_mod

    cfg = _retrieval_cfg(statute_model, precision="bf16")
    dataset = build_dataset(cfg)
    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITHOUT_BF16)
    monkeypatch.setattr(trainer_mod, "load_base_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ConfigError, match="supported on cpu: fp32"):
        train_adapter(cfg, dataset, tmp_path / "run")


# ---------------------------------------------------------------- generation: a tiny Llama

SYSTEM = GEN_SYSTEM


@pytest.fixture(scope="module")
def tiny_llama(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_llama

    corpus = [s.title + ". " + s.text for law in GEN_LAWS for s in parse_law(data_dir, law).sections]
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "llama", corpus=[SYSTEM, *corpus],
                            vocab_size=1500)


def _generation_cfg(model: Path, **kw: Any) -> Any:
    return tiny_generation_cfg(model, **kw)


@pytest.fixture(scope="module")
def headings(tiny_llama: Path, data_dir: Path) -> Any:
    from lorafleet.train.kinds.generation.causal_lm import load_causal_base
    from lorafleet.train.kinds.generation.headings import build_headings

    cfg = _generation_cfg(tiny_llama)
    _, tok = load_causal_base(cfg.base_model)
    return build_headings(cfg.data, tok, data_root=data_dir)


@native_bf16
def test_generation_bf16_autocasts_over_float32_weights(tiny_llama: Path, headings: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import load_file

    import lorafleet.train.kinds.generation.trainer as generation
    from lorafleet.train.kinds.generation.causal_lm import load_causal_base

    cfg = _generation_cfg(tiny_llama, precision="bf16")
    conversations = [row["messages"] for row in headings.data["train"]]
    base, tok = load_causal_base(cfg.base_model)
    before = generation.assistant_loss(base, tok, conversations)

    seen = LinearDtypes()
    loader = generation.load_causal_base

    def load_hooked(*a: Any, **k: Any) -> Any:
        model, tokenizer = loader(*a, **k)
        return seen.attach(model), tokenizer

    monkeypatch.setattr(generation, "load_causal_base", load_hooked)
    result = generation.train_generation(cfg, headings, tmp_path / "run", keep_model=True, evaluate_test=True)

    assert seen.train == {torch.bfloat16}  # every training forward ran under autocast
    assert seen.eval == {torch.float32}  # dev (each epoch) and test generated at float32
    assert result.extras["training_precision"] == "bf16"
    model = result.extras["model"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {t.dtype for t in load_file(result.adapter_dir / "adapter_model.safetensors").values()} == {torch.float32}
    after = generation.assistant_loss(model, tok, conversations)
    assert after < before * 0.8, (before, after)


def test_generation_bf16_refused_before_any_work(tiny_llama: Path, headings: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import lorafleet.models.precision as precision
    import lorafleet.train.kinds.generation.trainer as generation

    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITHOUT_BF16)
    monkeypatch.setattr(generation, "load_causal_base", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ConfigError, match="supported on cpu: fp32"):
        generation.train_generation(_generation_cfg(tiny_llama, precision="bf16"), headings, tmp_path / "run")


# ---------------------------------------------------------------- where the precision used is recorded


@pytest.mark.integration  # a real (sqlite) MLflow store
def test_mlflow_run_records_the_training_precision(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from lorafleet.core import settings
    from lorafleet.core.tasks import TrainResult
    from lorafleet.train import tracking

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with tracking.train_run("bf16-run") as run:
        tracking.log_config(TrainConfig(precision="auto"), "retrieval")
        result = TrainResult(adapter_dir=tmp_path / "adapter", dataset_digest="d" * 64,
                             metrics={"dev_ndcg@10": 0.5, "test_ndcg@10": 0.5},
                             epochs=[{"epoch": 1.0, "train_loss": 1.0, "dev_ndcg@10": 0.5}],
                             cost={"wall_s": 1.0, "cpu_s": 1.0, "peak_rss_mb": 1.0, "usd": 0.0},
                             extras={"training_precision": "bf16"})
        tracking.log_result(run, result, tmp_path, live_epochs=True, task="retrieval")
    params = MlflowClient(tracking_uri=settings.mlflow_tracking_uri()).get_run(run.info.run_id).data.params
    assert params["precision"] == "auto" and params["training_precision"] == "bf16"  # asked for, and used


def test_bundle_details_record_the_training_precision(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lorafleet.models.precision as precision
    from lorafleet.train.kinds.generation.kind import GenerationKind
    from lorafleet.train.kinds.retrieval.kind import RetrievalKind

    monkeypatch.setattr(precision, "read_cpuinfo", lambda: WITH_BF16)
    assert RetrievalKind().bundle_details(TrainConfig(precision="auto", device="cpu"))["training_precision"] == "bf16"
    assert RetrievalKind().bundle_details(TrainConfig(device="cpu"))["training_precision"] == "fp32"
    gen = GenerationKind().bundle_details(_generation_cfg(tiny_llama, precision="auto"))
    assert gen["training_precision"] == "bf16"
