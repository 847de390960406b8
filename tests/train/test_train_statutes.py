"""The statute parser on the real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.core.settings import DataDirError
from lorafleet.train.statutes import available_laws, parse_law, parse_law_text

# What this parser yields for bgb.md (bundestag/gesetze @ 77abca2c): every `§ N` heading that is not
# repealed. A structural change in the parser or the file shows up here first.
BGB_SECTIONS = 2446


@pytest.fixture(scope="module")
def bgb(data_dir: Path):
    return parse_law(data_dir, "bgb")


def test_bgb_section_count(bgb) -> None:
    assert len(bgb.sections) == BGB_SECTIONS
    # Sanity: the BGB has ~2,400 live sections (numbers reach § 2385 plus lettered ones, minus repealed).
    assert 2300 <= len(bgb.sections) <= 2600
    assert len({s.id for s in bgb.sections}) == len(bgb.sections)
    assert bgb.abbreviation == "BGB"


def test_bgb_433(bgb) -> None:
    s = next(s for s in bgb.sections if s.number == "433")
    assert s.id == "bgb:§433"
    assert s.title == "Vertragstypische Pflichten beim Kaufvertrag"
    assert s.text.startswith("(1) Durch den Kaufvertrag wird der Verkäufer einer Sache verpflichtet,")
    assert s.text.endswith("die gekaufte Sache abzunehmen.")
    assert s.path == (
        "Buch 2 Recht der Schuldverhältnisse", "Abschnitt 8 Einzelne Schuldverhältnisse",
        "Titel 1 Kauf, Tausch", "Untertitel 1 Allgemeine Vorschriften",
    )
    assert "  " not in s.text and "\n" not in s.text


def test_repealed_and_grouped_sections_skipped(bgb) -> None:
    numbers = {s.number for s in bgb.sections}
    assert "10" not in numbers  # "§ 10 (weggefallen)"
    assert not numbers & {"3", "4", "5", "6"}  # "(XXXX) §§ 3 bis 6 (weggefallen)"
    assert {"1", "2", "7", "11"} <= numbers
    assert not any("weggefallen" in s.title or s.text == "(weggefallen)" for s in bgb.sections)


def test_footnotes_removed(bgb) -> None:
    s14 = next(s for s in bgb.sections if s.number == "14")
    assert s14.text.startswith("(1) Unternehmer ist eine natürliche oder juristische Person")
    assert "[^" not in s14.text and "Amtlicher Hinweis" not in s14.text


def test_articles(data_dir: Path) -> None:
    gg = parse_law(data_dir, "gg")
    art1 = next(s for s in gg.sections if s.number == "1")
    assert art1.kind == "Art." and art1.id == "gg:Art.1"
    assert art1.text.startswith("(1) Die Würde des Menschen ist unantastbar.")
    assert art1.path[-1] == "I. Die Grundrechte"


def test_heading_depth_does_not_matter() -> None:
    raw = "---\nTitle: Testgesetz\njurabk: TG\n---\n# Testgesetz\n## Teil 1 - Allgemeines\n" \
          "## § 1 Zweck\nDieses Gesetz\n  regelt   etwas.\n\n#### § 2 (weggefallen)\n\n" \
          "### § 3\n(weggefallen)\n###### § 4 Ende\nSchluss.\n"
    law = parse_law_text("tg", raw)
    assert [(s.number, s.title, s.text) for s in law.sections] == [
        ("1", "Zweck", "Dieses Gesetz regelt etwas."), ("4", "Ende", "Schluss.")
    ]
    assert law.sections[1].path == ("Teil 1 Allgemeines",)


def test_unknown_law_lists_available(data_dir: Path) -> None:
    with pytest.raises(DataDirError, match=r"unknown law 'nope'.*bgb.*zpo"):
        parse_law(data_dir, "nope")
    assert {"bgb", "kschg", "prodhaftg"} <= set(available_laws(data_dir))


def test_missing_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataDirError, match="gesetze"):
        parse_law(tmp_path, "bgb")
