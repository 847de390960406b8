"""The generation baselines' cache key outlives nothing that computed them: an edit to the code that prompts, decodes
or scores, another version of a metric library, or another converted folder (a GGUF converted by another converter)
each change it. Pure logic on stand-ins for the config and the dataset; the key's use by a run is tested in
test_train_gemma.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import lorafleet.models.causal as causal
import lorafleet.train.kinds.generation.baselines as gb


def _cfg(base: Path) -> Any:
    return SimpleNamespace(base_model=str(base), chat_template=None, baselines=SimpleNamespace(kshot=2),
                           max_new_tokens=24, eval_batch_size=8, device="cpu", dtype="float32")


DATASET = SimpleNamespace(digest="d" * 64)


@pytest.fixture
def gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in GGUF file (only its bytes are hashed) in a LORAFLEET_HOME of its own."""
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    path = tmp_path / "base.gguf"
    path.write_bytes(b"GGUF not really")
    return path


def _key(base: Path) -> dict[str, Any]:
    key = gb.baselines_cache_key(_cfg(base), DATASET, None, ("dev", "test"))  # type: ignore[arg-type]
    assert key is not None
    return key


def test_the_key_names_the_scoring_code_and_the_metric_libraries(gguf: Path) -> None:
    from importlib.metadata import version

    names = {p.name for p in gb.BASELINES_CODE}
    assert {"evaluate.py", "baselines.py", "run.py", "causal.py"} <= names
    assert all(p.is_file() for p in gb.BASELINES_CODE)
    key = _key(gguf)
    assert key["code"] == gb.code_digest(gb.BASELINES_CODE)
    assert key["metric_libraries"] == {"rouge-score": version("rouge-score"), "sacrebleu": version("sacrebleu")}


def test_an_edit_to_a_scoring_module_changes_the_key(gguf: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "generation_eval.py"
    module.write_text("def normalise(text): return text.casefold()\n")
    monkeypatch.setattr(gb, "BASELINES_CODE", (module,))
    before = _key(gguf)
    assert _key(gguf) == before  # the same bytes: the same key
    module.write_text("def normalise(text): return text.lower()\n")
    assert _key(gguf) != before
    assert gb.baselines_cache_path(_key(gguf)) != gb.baselines_cache_path(before)


@pytest.mark.parametrize("library", ["sacrebleu", "rouge-score"])
def test_another_metric_library_version_changes_the_key(gguf: Path, library: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    before = _key(gguf)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0" if name == library else real(name))
    after = _key(gguf)
    assert after != before and after["metric_libraries"][library] == "99.0"


def test_another_converter_changes_the_key_and_the_converted_folder(gguf: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder converted before the Gemma template fill (another template, another converter) is neither the
    folder a run loads nor the identity its baselines were stored under."""
    before, folder, identity = _key(gguf), causal.gguf_cache_dir(gguf), causal.base_identity(gguf)
    assert identity == f"gguf:{causal.file_sha256(gguf)}+converter:{causal.converter_identity()}"
    assert folder.name == f"base-{causal.file_sha256(gguf)[:12]}-c{causal.converter_identity()[:8]}"
    monkeypatch.setattr(causal, "GEMMA_CHAT_TEMPLATE", causal.GEMMA_CHAT_TEMPLATE + "{# another fill #}")
    assert causal.base_identity(gguf) != identity
    assert causal.gguf_cache_dir(gguf) != folder
    assert _key(gguf) != before
    monkeypatch.undo()
    assert _key(gguf) == before


def test_a_converter_dependency_version_changes_the_folder(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    folder = causal.gguf_cache_dir(gguf)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "transformers" else real(name))
    assert causal.gguf_cache_dir(gguf) != folder
