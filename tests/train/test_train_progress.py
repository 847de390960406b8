"""Progress of long steps: plain timestamped lines off a terminal, one shared bar display on one.

The retrieval kind's training and corpus encoding say where they are (as the generation kind does), and a
log gets whole lines: no carriage returns, no escape codes, no stray bars from the libraries underneath.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from lorafleet.core import progress as progress_mod
from lorafleet.core.progress import StepProgress, hold_terminal
from lorafleet.train import DataConfig, LoraSettings, TrainConfig, build_dataset, train_adapter
from lorafleet.train.statutes import parse_law

LAWS = ["kschg", "prodhaftg"]
LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<what>[^:]+(?:: encode)?): (?P<done>\d+)/(?P<total>\d+)\b.*\(\d+s.*\)$")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but tab and newline


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_plain_lines_about_every_tenth() -> None:
    out = io.StringIO()
    with StepProgress(200, "encode", stream=out) as bar:
        assert not bar.live
        for _ in range(200):
            bar.advance(1, "loss 0.1")
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and not CONTROL.search(out.getvalue())
    assert all(LINE.match(ln) for ln in lines), lines
    assert lines[-1].startswith(lines[-1][:8] + " encode: 200/200 loss 0.1 (")


def test_nested_bars_share_one_display_and_a_held_terminal_gets_lines() -> None:
    tty = _Tty()
    outer = StepProgress(10, "train", stream=tty)
    inner = StepProgress(5, "dev eval: encode", stream=tty)  # a step inside a step: one more bar, same display
    assert outer.live and inner.live and outer._bar is inner._bar is progress_mod._shared
    inner.close()
    assert progress_mod._shared is outer._bar  # the outer bar keeps drawing
    outer.close()
    assert progress_mod._shared is None
    with hold_terminal():  # another display (research's live panel) redraws the terminal
        held = StepProgress(3, "train", stream=tty)
        assert not held.live
        held.close()


@pytest.fixture(scope="module")
def statute_model(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_model

    corpus = [s.title + ". " + s.text for law in LAWS for s in parse_law(data_dir, law).sections]
    return build_tiny_model(tmp_path_factory.mktemp("tiny-statutes") / "bert", corpus=corpus, vocab_size=3000,
                            max_seq_length=64, hidden=64, heads=4)


def test_retrieval_training_and_corpus_encoding_show_progress_as_plain_lines(
        statute_model: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cfg = TrainConfig(base_model=str(statute_model), data=DataConfig(laws=LAWS, hard_negatives=False),
                      lora=LoraSettings(r=4, alpha=8), epochs=2, batch_size=8, eval_batch_size=4, max_seq_length=64,
                      warmup_ratio=0.0, device="cpu")
    dataset = build_dataset(cfg)
    capfd.readouterr()
    train_adapter(cfg, dataset, tmp_path / "run")
    err = capfd.readouterr().err  # fd 2: what a log file of `lorafleet train` or a research run would hold

    assert "Computing widget examples" not in err and not CONTROL.search(err), err[-2000:]
    seen = [m.groupdict() for ln in err.splitlines() if (m := LINE.match(ln))]
    train = [s for s in seen if s["what"] == "train"]
    assert train and train[-1]["done"] == train[-1]["total"], err[-2000:]  # training steps, to the last one
    encode = [s for s in seen if s["what"].endswith(": encode")]
    chunks = str(len(dataset.corpus))
    for epoch in (1, 2):  # the corpus, encoded for each epoch's dev evaluation
        mine = [s for s in encode if s["what"] == f"dev eval, epoch {epoch}: encode"]
        assert mine and mine[-1]["done"] == mine[-1]["total"] == chunks, err[-2000:]
