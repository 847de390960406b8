"""Helpers for tests and benchmarks: a tiny random BERT built on the fly, offline.

Public so that users writing tests against lorafleet get the same fast model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

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

    from lorafleet.models import resolve_model_source

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
