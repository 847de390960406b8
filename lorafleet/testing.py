"""Helpers for tests and benchmarks: a tiny random BERT and a tiny random Llama, built on the fly, offline,
a wait for the CLI processes a test starts, bounded waits on a condition (tests wait on the state they expect,
never sleep and then assert), and a NATS flush that covers a subscription just made.

Public so that users writing tests against lorafleet get the same fast model.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_CORPUS = [
    "Der Verkäufer einer Sache ist verpflichtet, dem Käufer die Sache zu übergeben.",
    "Der Käufer ist verpflichtet, dem Verkäufer den vereinbarten Kaufpreis zu zahlen.",
    "Die Kündigung des Arbeitsverhältnisses bedarf der Schriftform.",
    "Der Arbeitgeber hat dem Arbeitnehmer Urlaub zu gewähren.",
    "Wer vorsätzlich das Eigentum eines anderen verletzt, ist zum Schadensersatz verpflichtet.",
    "The quick brown fox jumps over the lazy dog.",
    "A small model for fast unit tests of the serving cluster.",
]


def build_tiny_model(out_dir: str | Path, *, hidden: int = 32, layers: int = 2, heads: int = 2,
                     vocab_size: int = 400, max_seq_length: int = 64, seed: int = 0,
                     corpus: list[str] | None = None) -> Path:
    """Write a random, tiny sentence-transformers BERT (mean pooling, normalised) to `out_dir`.

    The WordPiece tokenizer is trained on `corpus` on the fly, so nothing is downloaded.
    """
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from tokenizers.trainers import WordPieceTrainer
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus or _CORPUS, WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_seq_length,
    )
    raw_dir = out / "_hf"
    config = BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=hidden * 2, max_position_embeddings=max_seq_length + 2,
    )
    BertModel(config).save_pretrained(raw_dir)
    hf_tok.save_pretrained(raw_dir)

    transformer = models.Transformer(str(raw_dir), max_seq_length=max_seq_length)
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    model.save(str(out))
    shutil.rmtree(raw_dir, ignore_errors=True)
    return out


def make_random_adapter(base_model: str | Path, out_dir: str | Path, *, seed: int = 0, r: int = 4,
                        scale: float = 0.5) -> Path:
    """Save a LoRA adapter with random (non-identity) weights for `base_model`, in peft format.

    peft initialises B to zero, which would make the adapter a no-op; `init_lora_weights=False`
    gives random A and B so that each adapter visibly changes the embeddings.
    """
    import torch
    from peft import LoraConfig
    from sentence_transformers import SentenceTransformer

    from lorafleet.core.model_source import resolve_model_source

    torch.manual_seed(seed)
    model = SentenceTransformer(resolve_model_source(str(base_model)), device="cpu")
    model.add_adapter(LoraConfig(r=r, lora_alpha=r, target_modules=["query", "value"], init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Only the adapter, in plain peft format (adapter_config.json + adapter_model.safetensors).
    model[0].auto_model.save_pretrained(str(out))
    return out


def add_random_ce_adapter(model: Any, name: str, *, r: int = 4, seed: int = 0, scale: float = 0.2) -> Any:
    """Add a LoRA adapter `name` with random weights (and its own random head) to a cross-encoder `model`.

    peft initialises B to zero and copies the head, which would make the adapter score like its base; random B
    and head weights from a seeded generator make each adapter visibly its own. Returns `model`.
    """
    import torch
    from peft import LoraConfig, TaskType

    model.add_adapter(LoraConfig(task_type=TaskType.SEQ_CLS, r=r, target_modules=["query", "value"],
                                 modules_to_save=["classifier"]), adapter_name=name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.model.named_parameters():
            if "lora_B" in param_name or "modules_to_save" in param_name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llama(out_dir: str | Path, *, hidden: int = 128, heads: int = 2, layers: int = 2,
                     vocab_size: int = 512, max_positions: int = 512, seed: int = 0,
                     corpus: list[str] | None = None, chat_template: str | None = CHATML_TEMPLATE,
                     mute_special_tokens: bool = False) -> Path:
    """Write a random, tiny Llama causal LM with its tokenizer to `out_dir` as a normal HF folder.

    head_dim is hidden / heads (64 by default): vLLM's CPU attention rejects head_dim 16. The BPE
    tokenizer (newlines split off, then Metaspace, so every token decodes to valid text and chat turns
    tokenise as prefixes of each other) is trained on `corpus` on the fly, eos is
    `<|im_end|>`, and `chat_template` (ChatML by default; None: no template) renders system, user and
    assistant turns. `mute_special_tokens` zeroes the special tokens' output rows, so greedy decoding never
    stops early (useful for serving tests that compare token streams).
    """
    import torch
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden % heads or hidden // heads < 32:
        raise ValueError(f"hidden={hidden} / heads={heads} must give a whole head_dim of at least 32")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok = Tokenizer(BPE(unk_token="<unk>"))
    # ChatML puts "\n" right after the role and before the content: split it off so that it never merges
    # with a word, and the prompt's tokens are a prefix of the whole conversation's.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.Metaspace(prepend_scheme="first")])
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    texts = (corpus or _CORPUS) + ["system user assistant"]  # the role names the template renders
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=["\n"], show_progress=False)
    tok.train_from_iterator(texts * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", model_max_length=max_positions)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=hidden // heads, max_position_embeddings=max_positions,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=False, initializer_range=0.2)
    model = LlamaForCausalLM(config)
    if mute_special_tokens:
        with torch.no_grad():
            model.lm_head.weight[: len(special)] = 0
    model.save_pretrained(out)
    return out


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """Every process's exit code, each waited for up to `timeout` s; any still running after that is killed."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *, poll_s: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy, and return that; AssertionError naming `what` (and the
    last value seen) once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s (last: {value!r})")
        time.sleep(poll_s)
    return value


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float, what: str, *,
                           poll_s: float = 0.05) -> T:
    """`wait_until` on an event loop: `predicate` may be a plain function or return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s (last: {value!r})")
        await asyncio.sleep(poll_s)


async def flush_nats(nc: Any) -> None:
    """Return once the server has every command `nc` (a nats-py client) sent before, a subscription just made
    included.

    nats-py 2.16's `flush()` writes its PING to the socket at once, ahead of commands that its flusher task has
    not written yet: its PONG can come back before the server has seen a SUB made just before, and a message
    another connection publishes then finds no subscriber. The first flush lets the flusher write what was
    pending; the second PING follows it on the wire.
    """
    await nc.flush()
    await nc.flush()
