"""One normaliser for every generation metric: exact match, ROUGE-L, chrF and the answer length all score the text
after `normalise_heading`, so a label, a footnote marker or the case costs none of them anything."""

from __future__ import annotations

import doctest

import pytest

import lorafleet.train.kinds.generation.evaluate as ge
from lorafleet.train.kinds.generation.evaluate import chrf, exact_match_reach, normalise_heading, rouge_l, text_metrics


def test_a_leading_label_costs_no_metric() -> None:
    """The issue's example scored exact match 1 and ROUGE-L 0.857 ("346" counted as a word)."""
    m = text_metrics(["§ 346 Rücktritt vom Vertrag."], ["Rücktritt vom Vertrag"], "test")
    assert m["test_exact_match"] == 1.0
    assert m["test_rouge_l"] == pytest.approx(1.0)
    assert m["test_chrf"] == pytest.approx(100.0) and m["test_chrf1"] == pytest.approx(100.0)
    assert m["test_pred_words"] == 3.0
    for label in ("§§ 5", "Art. 3", "Artikel 3a", "§ 21a -"):
        assert normalise_heading(f"{label} Übergangsmandat") == "übergangsmandat"


@pytest.mark.parametrize("reference", ["Zahl der Betriebsratsmitglieder *)", "Zahl der Betriebsratsmitglieder \\*)",
                                       "Zahl der Betriebsratsmitglieder (*)", "Zahl der Betriebsratsmitglieder[^1]"])
def test_a_footnote_marker_in_a_reference_is_reachable(reference: str) -> None:
    """betrvg § 9's heading carries "\\*)" (the statutes' markdown): no answer could match it before."""
    m = text_metrics(["Zahl der Betriebsratsmitglieder"], [reference], "test")
    assert m["test_exact_match"] == 1.0 and m["test_rouge_l"] == pytest.approx(1.0)
    assert m["test_chrf"] == pytest.approx(100.0)
    # In an answer the marker is dropped as well.
    assert text_metrics([reference], ["Zahl der Betriebsratsmitglieder"], "test")["test_exact_match"] == 1.0


def test_case_folding_maps_sharp_s_to_ss_in_every_metric() -> None:
    """Unicode case folding, as documented: ß (and ẞ) fold to "ss"; umlauts stay."""
    assert normalise_heading("Straße") == normalise_heading("STRASSE") == normalise_heading("STRAẞE") == "strasse"
    assert normalise_heading("Anschluß") == normalise_heading("Anschluss")
    assert normalise_heading("Kündigung") != normalise_heading("Kundigung")
    m = text_metrics(["Gewährleistungsausschluß"], ["Gewährleistungsausschluss"], "dev")
    assert (m["dev_exact_match"], m["dev_rouge_l"], m["dev_chrf"]) == (1.0, pytest.approx(1.0), pytest.approx(100.0))
    assert chrf(["KAUFVERTRAG"], ["Kaufvertrag"]) == pytest.approx(100.0)  # chrF is case-insensitive here
    assert rouge_l(["KÜNDIGUNG"], ["Kündigung"]) == [pytest.approx(1.0)]


def test_metrics_agree_on_what_differs() -> None:
    """Where the normalised texts differ, exact match is 0; where they are equal, every score is perfect."""
    pairs = [("„Gefahrübergang“", "Gefahrübergang"), ("Haftung des Herstellers", "Haftung des Verkäufers")]
    for pred, ref in pairs:
        m = text_metrics([pred], [ref], "t")
        same = normalise_heading(pred) == normalise_heading(ref)
        assert m["t_exact_match"] == float(same)
        assert (m["t_rouge_l"] == pytest.approx(1.0)) is same
        assert (m["t_chrf"] == pytest.approx(100.0)) is same


def test_exact_match_reach_uses_the_same_normaliser() -> None:
    reach = exact_match_reach(["Übergangsmandat \\*)"], ["Der Betriebsrat bleibt im Amt."], ["§ 21a Übergangsmandat"])
    assert reach["reach_train"] == 1.0


def test_the_docstring_examples_hold() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(ge.normalise_heading, "normalise_heading", globs={"normalise_heading": normalise_heading}):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted >= 4
    assert runner.summarize(verbose=False).failed == 0
