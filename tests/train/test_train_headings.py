"""Headings dataset on the real statutes: sizes, one known section, no leakage, digest, system prompt budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.train.chunks import DatasetError
from lorafleet.train.kinds.generation.headings import (
    SPLITS,
    HeadingsDataConfig,
    build_headings,
    check_no_leakage,
    is_repealed,
)
from lorafleet.train.statutes import Section, parse_law

LAWS = ["bgb", "kschg", "prodhaftg"]
SMALL = ["kschg", "prodhaftg", "tzbfg", "agg", "milog"]  # 127 sections: for the tests that build many times


@pytest.fixture(scope="module")
def tokenizer(data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tokenizer of a tiny Llama trained on the three laws: fast to build, realistic German token counts."""
    from transformers import AutoTokenizer

    from lorafleet.testing import build_tiny_llama

    corpus = [s.title + ". " + s.text for law in LAWS for s in parse_law(data_dir, law).sections]
    folder = build_tiny_llama(tmp_path_factory.mktemp("tok") / "llama", corpus=corpus, vocab_size=2000)
    return AutoTokenizer.from_pretrained(folder)


def _cfg(**kw) -> HeadingsDataConfig:
    return HeadingsDataConfig(**{"laws": LAWS, "input_max_tokens": 64, "max_train_examples": None,
                                 "max_eval_examples": None, **kw})


@pytest.fixture(scope="module")
def dataset(tokenizer, data_dir: Path):
    return build_headings(_cfg(), tokenizer, data_root=data_dir)


def test_sizes_and_format(dataset, data_dir: Path) -> None:
    n_sections = sum(len(parse_law(data_dir, law).sections) for law in LAWS)
    s = dataset.summary()
    total = s["train_examples"] + s["dev_examples"] + s["test_examples"]
    assert total + s["skipped_repealed"] + s["skipped_no_heading"] == n_sections
    assert total > 2400  # BGB alone has 2446 sections with headings
    assert abs(s["test_examples"] - 0.1 * total) < 30 and abs(s["dev_examples"] - 0.1 * total) < 30
    assert sorted(dataset.data) == sorted(SPLITS)
    for split in SPLITS:
        assert dataset.data[split].column_names == ["id", "messages"]
        assert len(dataset.data[split]) == len(dataset.examples[split])
    frame = dataset.to_frame()
    assert len(frame) == total and set(frame["split"]) == set(SPLITS)


def test_known_section_messages(dataset, tokenizer) -> None:
    split, ex = next((sp, e) for sp in SPLITS for e in dataset.examples[sp] if e.id == "bgb:§433")
    row = dataset.data[split][[e.id for e in dataset.examples[split]].index("bgb:§433")]
    system, user, assistant = row["messages"]
    assert system == {"role": "system", "content": dataset.system_prompt}
    assert user["role"] == "user" and user["content"].startswith("(1) Durch den Kaufvertrag wird der Verkäufer")
    assert assistant == {"role": "assistant", "content": "Vertragstypische Pflichten beim Kaufvertrag"}
    assert ex.input == user["content"] and ex.label == "§ 433"
    # The input is cut to the token budget (a word may re-tokenise one piece longer at the cut).
    assert len(tokenizer(ex.input, add_special_tokens=False)["input_ids"]) <= 64 + 2
    assert max(e.input_tokens for sp in SPLITS for e in dataset.examples[sp]) <= 64 + 2


def test_no_leakage(dataset) -> None:
    check_no_leakage(dataset)
    ids = [e.id for sp in SPLITS for e in dataset.examples[sp]]
    assert len(ids) == len(set(ids))
    by_split = {sp: {e.input for e in dataset.examples[sp]} for sp in SPLITS}
    assert not by_split["train"] & by_split["dev"] and not by_split["train"] & by_split["test"]
    assert not by_split["dev"] & by_split["test"]

    broken = type(dataset)(examples={**dataset.examples, "test": [*dataset.examples["test"],
                                                                    dataset.examples["train"][0]]},
                           data=dataset.data, settings=dataset.settings)
    with pytest.raises(AssertionError, match="both train and test"):
        check_no_leakage(broken)


def test_repealed_and_headless_sections_are_skipped(dataset) -> None:
    assert is_repealed(Section("x", "§", "1", "(Berlin-Klausel)", "(gegenstandslos)"))
    assert is_repealed(Section("x", "§", "2", "Aufgehobene Vorschriften", "-"))
    assert not is_repealed(Section("x", "§", "3", "Aufhebung des Erbverzichts", "Auf einen Vertrag …"))
    headings = [e.heading for sp in SPLITS for e in dataset.examples[sp]]
    assert all(h and "weggefallen" not in h for h in headings)


def test_digest_stable_and_sensitive(dataset, tokenizer, data_dir: Path) -> None:
    again = build_headings(_cfg(), tokenizer, data_root=data_dir)
    assert again.digest == dataset.digest and len(dataset.digest) == 64
    small = build_headings(_cfg(laws=SMALL), tokenizer, data_root=data_dir)
    for change in ({"seed": 14}, {"input_max_tokens": 48}, {"system_prompt": "Überschrift?"},
                   {"max_eval_examples": 10}, {"laws": SMALL[:-1]}):
        other = build_headings(_cfg(**{"laws": SMALL, **change}), tokenizer, data_root=data_dir)
        assert other.digest != small.digest, change


def test_caps_are_seeded_samples(dataset, tokenizer, data_dir: Path) -> None:
    a = build_headings(_cfg(max_train_examples=100, max_eval_examples=20), tokenizer, data_root=data_dir)
    b = build_headings(_cfg(max_train_examples=100, max_eval_examples=20), tokenizer, data_root=data_dir)
    assert a.digest == b.digest != dataset.digest
    assert [len(a.examples[sp]) for sp in SPLITS] == [100, 20, 20]
    assert [e.id for e in a.examples["train"]] == [e.id for e in b.examples["train"]]
    full = [e.id for e in dataset.examples["train"]]
    assert set(e.id for e in a.examples["train"]) <= set(full)  # the cap samples within the split
    assert [e.id for e in a.examples["train"]] != full[:100]  # a sample across the laws, not the first ids


def test_system_prompt_over_budget_is_refused(tokenizer, data_dir: Path) -> None:
    with pytest.raises(DatasetError, match=r"system prompt has \d+ tokens, over system_prompt_max_tokens=8"):
        build_headings(_cfg(laws=SMALL, system_prompt_max_tokens=8), tokenizer, data_root=data_dir)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="dev_fraction \\+ test_fraction"):
        HeadingsDataConfig(dev_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValueError, match="unique"):
        HeadingsDataConfig(laws=["bgb", "bgb"])
