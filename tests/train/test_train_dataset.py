"""Dataset: chunks map back to sections, queries of two kinds, leakage-free seeded splits, digest, errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lorafleet.core.config import ConfigError
from lorafleet.core.settings import DataDirError
from lorafleet.train.chunks import DatasetError, chunk_text
from lorafleet.train.kinds.retrieval.config import DataConfig, TrainConfig, load_train_config
from lorafleet.train.kinds.retrieval.dataset import SPLITS, build_dataset, check_no_leakage, citation_queries
from lorafleet.train.statutes import parse_law

LAWS = ["kschg", "prodhaftg", "tzbfg"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lorafleet.core.model_source import resolve_model_source

    return AutoTokenizer.from_pretrained(resolve_model_source("all-MiniLM-L6-v2"))


def _cfg(**data) -> TrainConfig:
    data.setdefault("max_chunks_per_section", None)  # whole sections, so chunk coverage can be checked
    return TrainConfig(data=DataConfig(laws=data.pop("laws", LAWS), **data))


@pytest.fixture(scope="module")
def dataset(data_dir: Path, tokenizer):
    return build_dataset(_cfg(), data_root=data_dir, tokenizer=tokenizer)


def _copy_data(src: Path, dst: Path, laws: list[str]) -> Path:
    (dst / "gesetze").mkdir(parents=True)
    for law in laws:
        shutil.copy(src / "gesetze" / f"{law}.md", dst / "gesetze" / f"{law}.md")
    return dst


def test_chunks_cover_sections_within_budget(dataset, tokenizer) -> None:
    assert set(dataset.sections) == {c.section_id for c in dataset.corpus.values()}
    for sid, section in dataset.sections.items():
        chunks = [c for c in dataset.corpus.values() if c.section_id == sid]
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert [c.id for c in chunks] == [f"{sid}#{k}" for k in range(len(chunks))]
        # Chunks are consecutive pieces of the text: nothing lost but the whitespace between them.
        assert "".join(c.text for c in chunks).replace(" ", "") == section.text.replace(" ", "")
    budget = 128 - 2
    lengths = [len(tokenizer(c.text, add_special_tokens=False)["input_ids"]) for c in dataset.corpus.values()]
    assert max(lengths) <= budget + 2  # re-tokenising at a cut may merge or split one word piece
    assert len(dataset.corpus) > len(dataset.sections)  # long sections really are chunked


def test_chunk_text_prefers_sentence_ends(tokenizer) -> None:
    text = " ".join(f"Satz Nummer {i} regelt die Kündigung des Arbeitsverhältnisses." for i in range(30))
    chunks = chunk_text(text, tokenizer, 40)
    assert len(chunks) > 3
    assert all(c.endswith(".") for c in chunks)
    # Without sentence ends the cut falls between words.
    words = " ".join(["Arbeitsverhältnisses"] * 60)
    assert all(set(c.split()) == {"Arbeitsverhältnisses"} for c in chunk_text(words, tokenizer, 40))


def test_two_query_kinds(dataset) -> None:
    kinds = {q.kind for q in dataset.query_info.values()}
    assert kinds == {"heading", "citation"}
    for q in dataset.query_info.values():
        section = dataset.sections[q.section_id]
        if q.kind == "heading":
            assert q.text == section.title
        else:
            assert q.source_id != q.section_id and q.source_id in dataset.sections
            assert "§" not in q.text
            # The sentence comes from the citing section (modulo the removed citation).
            assert q.text.split()[0] in dataset.sections[q.source_id].text


def test_citation_query_example(data_dir: Path) -> None:
    found = citation_queries(parse_law(data_dir, "kschg"), 5, 48)
    assert len(found) >= 10
    # Citations of other laws ("§ 613a des Bürgerlichen Gesetzbuchs") are not taken for KSchG sections.
    assert all(t.startswith("kschg:§") and s.startswith("kschg:§") and t != s for _, t, s in found)


def test_splits_are_leakage_free(dataset) -> None:
    check_no_leakage(dataset)
    positives = {s: {sid for rel in dataset.qrels[s].values() for sid in rel} for s in SPLITS}
    assert positives["train"].isdisjoint(positives["test"])
    assert positives["train"].isdisjoint(positives["dev"])
    assert positives["dev"].isdisjoint(positives["test"])
    for split in SPLITS:
        assert dataset.queries[split], split
        assert set(dataset.queries[split]) == set(dataset.qrels[split])
        for rel in dataset.qrels[split].values():
            assert all(dataset.split_of_section[sid] == split for sid in rel)
    train_positive_texts = {p for _, p in dataset.train_pairs()}
    held_out_firsts = {dataset.first_chunk(s).text for s in positives["dev"] | positives["test"]}
    assert train_positive_texts.isdisjoint(held_out_firsts)


def test_chunk_cap(data_dir: Path, tokenizer, dataset) -> None:
    capped = build_dataset(_cfg(max_chunks_per_section=1), data_root=data_dir, tokenizer=tokenizer)
    assert set(capped.sections) == set(dataset.sections)
    assert sorted(capped.corpus) == sorted(f"{s}#0" for s in dataset.sections)
    assert capped.queries == dataset.queries and capped.digest != dataset.digest


def test_leak_is_detected(data_dir: Path, tokenizer) -> None:
    ds = build_dataset(_cfg(), data_root=data_dir, tokenizer=tokenizer)
    rel = next(iter(ds.qrels["test"].values()))
    ds.qrels["train"]["leak"] = dict(rel)
    with pytest.raises(AssertionError, match="test sections are training positives"):
        check_no_leakage(ds)


def test_split_is_seeded(data_dir: Path, tokenizer, dataset) -> None:
    again = build_dataset(_cfg(), data_root=data_dir, tokenizer=tokenizer)
    assert again.queries == dataset.queries and again.digest == dataset.digest
    other = build_dataset(_cfg(seed=99), data_root=data_dir, tokenizer=tokenizer)
    assert other.split_of_section != dataset.split_of_section
    assert other.digest != dataset.digest


def test_caps_sample_queries(data_dir: Path, tokenizer) -> None:
    ds = build_dataset(_cfg(max_train_queries=10, max_eval_queries=5), data_root=data_dir, tokenizer=tokenizer)
    assert len(ds.queries["train"]) == 10 and len(ds.queries["dev"]) == 5 and len(ds.queries["test"]) == 5
    check_no_leakage(ds)


def test_digest_tracks_data_only(data_dir: Path, tmp_path: Path, tokenizer, dataset) -> None:
    copy = _copy_data(data_dir, tmp_path / "data", LAWS)
    same = build_dataset(_cfg(), data_root=copy, tokenizer=tokenizer)
    assert same.digest == dataset.digest
    # Settings that do not touch the data leave the digest alone.
    cfg = _cfg(hard_negatives=False, negative_margin=0.2)
    cfg.learning_rate, cfg.epochs, cfg.lora.r = 1e-3, 7, 4
    assert build_dataset(cfg, data_root=copy, tokenizer=tokenizer).digest == dataset.digest
    # One changed word in one statute changes it.
    path = copy / "gesetze" / "prodhaftg.md"
    raw = path.read_text()
    assert raw.count("jemand getötet") == 2
    path.write_text(raw.replace("jemand getötet", "jemand verletzt", 1))
    assert build_dataset(_cfg(), data_root=copy, tokenizer=tokenizer).digest != dataset.digest
    # So do the settings that shape the data.
    assert build_dataset(_cfg(laws=["kschg", "tzbfg"]), data_root=data_dir, tokenizer=tokenizer).digest != \
        dataset.digest
    cfg = _cfg()
    cfg.max_seq_length = 96
    assert build_dataset(cfg, data_root=data_dir, tokenizer=tokenizer).digest != dataset.digest


def test_unknown_law(data_dir: Path, tokenizer) -> None:
    with pytest.raises(DataDirError, match="unknown law 'bgbx'; available: agg, aktg"):
        build_dataset(_cfg(laws=["kschg", "bgbx"]), data_root=data_dir, tokenizer=tokenizer)


def test_empty_corpus(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "gesetze").mkdir()
    (tmp_path / "gesetze" / "leer.md").write_text("# Leeres Gesetz\n\n## Abschnitt 1\n\n### § 1 (weggefallen)\n")
    with pytest.raises(DatasetError, match="no sections"):
        build_dataset(_cfg(laws=["leer"]), data_root=tmp_path, tokenizer=tokenizer)


def test_split_without_test_queries(data_dir: Path, tokenizer) -> None:
    with pytest.raises(DatasetError, match="no test queries"):
        build_dataset(_cfg(laws=["prodhaftg"], test_fraction=0.01), data_root=data_dir, tokenizer=tokenizer)


def test_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 1\n  lora:\n    r: 8\n")
    assert load_train_config(path, ["lora.r=4", "data.laws=[kschg]"]).lora.r == 4
    with pytest.raises(ConfigError, match=r"lora\.r.*greater than 0"):
        load_train_config(path, ["lora.r=0"])
    with pytest.raises(ConfigError, match=r"lora\.rank: unknown key"):
        load_train_config(path, ["lora.rank=4"])
    with pytest.raises(ConfigError, match="dev_fraction \\+ test_fraction"):
        load_train_config(path, ["data.dev_fraction=0.5", "data.test_fraction=0.5"])
    path.write_text("research: {}\n")
    with pytest.raises(ConfigError, match="no top-level 'train:'"):
        load_train_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_train_config(tmp_path / "missing.yaml")


def test_shipped_config_loads() -> None:
    cfg = load_train_config(Path(__file__).resolve().parents[2] / "configs" / "german-legal.yaml")
    assert cfg.base_model == "all-MiniLM-L6-v2" and set(cfg.data.query_kinds) == {"heading", "citation"}
