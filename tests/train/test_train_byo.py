"""Bring-your-own retrieval data through `datasets`: each layout of configs/examples trains a tiny model end to end,
and each kind of bad data is refused with the table, row and column named."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.train.statutes import parse_law

REPO = Path(__file__).resolve().parents[2]


def statute_docs(data_dir: Path, n: int = 40) -> list[tuple[str, str, str]]:
    """(id, heading, text) of sections with a heading: material for the test's own files."""
    law = parse_law(data_dir, "betrvg")
    return [(f"d{i}", s.title, s.text) for i, s in enumerate(s for s in law.sections if s.title)][:n]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)


def corpus_files(root: Path, docs: list[tuple[str, str, str]]) -> None:
    root.mkdir(exist_ok=True)
    write_jsonl(root / "corpus.jsonl", [{"_id": i, "title": "", "text": t} for i, _, t in docs])
    write_jsonl(root / "queries.jsonl", [{"_id": f"q{i}", "text": h} for i, h, _ in docs])
    write_csv(root / "qrels.csv", ["query-id", "corpus-id", "score"], [[f"q{i}", i, 1] for i, _, _ in docs])


def pairs_file(root: Path, docs: list[tuple[str, str, str]]) -> None:
    root.mkdir(exist_ok=True)
    write_csv(root / "pairs.csv", ["question", "answer", "wrong_answer"],
              [[h, t, docs[(k + 7) % len(docs)][2]] for k, (_, h, t) in enumerate(docs)])


def run_example(name: str, tiny_model_dir: Path, tmp_path: Path, *extra: str) -> Any:
    cfg = yaml.safe_load((REPO / "configs" / "examples" / name).read_text())
    cfg["train"].update(base_model=str(tiny_model_dir), epochs=1, batch_size=8, max_seq_length=64, device="cpu",
                        eval_batch_size=64)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return CliRunner().invoke(app, ["train", str(path), "--no-mlflow", "--out", str(tmp_path / "run"), *extra])


@pytest.mark.parametrize("layout", ["retrieval-corpus.yaml", "retrieval-pairs.yaml"])
def test_each_layout_trains_end_to_end(layout: str, tiny_model_dir: Path, data_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the example configs name my-data/… relative to where the command runs
    docs = statute_docs(data_dir)
    (corpus_files if "corpus" in layout else pairs_file)(tmp_path / "my-data", docs)
    out = run_example(layout, tiny_model_dir, tmp_path)
    assert out.exit_code == 0, out.output
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    m = saved["metrics"]
    assert 0 <= m["test_ndcg@10"] <= 1 and "base_test_ndcg@10" in m and "bm25_test_ndcg@10" in m
    assert saved["dataset"]["sections"] == len(docs) and saved["dataset"]["test_queries"] > 0
    assert "your data, layout" in (tmp_path / "run" / "report.md").read_text()


def test_a_datasets_folder_saved_to_disk(tiny_model_dir: Path, data_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from lorafleet.train import TrainConfig, build_dataset

    docs = statute_docs(data_dir)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({
        "question": [h for _, h, _ in docs], "answer": [t for _, _, t in docs]})}).save_to_disk(str(tmp_path / "ds"))
    cfg = TrainConfig(base_model=str(tiny_model_dir), max_seq_length=64, data={
        "layout": "pairs", "pairs": str(tmp_path / "ds"), "columns": {"query": "question", "positive": "answer"},
        "hard_negatives": False})
    ds = build_dataset(cfg)
    again = build_dataset(cfg)
    assert ds.digest == again.digest and len(ds.sections) == len(docs)
    assert sum(len(q) for q in ds.queries.values()) == len(docs)
    changed = build_dataset(cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": 99})}))
    assert changed.digest != ds.digest


@pytest.mark.parametrize(("damage", "message"), [
    ("missing_column", r"queries my-data/queries.jsonl: no column '_id' \(columns: qid, text\)"),
    ("empty_text", r"corpus my-data/corpus.jsonl row 3: column 'text' is empty"),
    ("unknown_doc", r"qrels my-data/qrels.csv row 5: document 'nope' is not in the corpus"),
    ("duplicate_id", r"corpus my-data/corpus.jsonl rows 0 and 2: duplicate _id 'd0'"),
])
def test_bad_data_is_refused_naming_file_row_and_column(damage: str, message: str, tiny_model_dir: Path,
                                                        data_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    docs = statute_docs(data_dir, 12)
    root = tmp_path / "my-data"
    corpus_files(root, docs)
    if damage == "missing_column":
        write_jsonl(root / "queries.jsonl", [{"qid": f"q{i}", "text": h} for i, h, _ in docs])
    elif damage == "empty_text":
        write_jsonl(root / "corpus.jsonl", [{"_id": i, "text": "" if k == 3 else t}
                                            for k, (i, _, t) in enumerate(docs)])
    elif damage == "unknown_doc":
        write_csv(root / "qrels.csv", ["query-id", "corpus-id", "score"],
                  [[f"q{i}", "nope" if k == 5 else i, 1] for k, (i, _, _) in enumerate(docs)])
    else:
        write_jsonl(root / "corpus.jsonl", [{"_id": "d0" if k == 2 else i, "text": t}
                                            for k, (i, _, t) in enumerate(docs)])
    out = run_example("retrieval-corpus.yaml", tiny_model_dir, tmp_path)
    assert out.exit_code == 2
    assert __import__("re").search(message, out.output), out.output
    assert not (tmp_path / "run" / "adapter").exists()  # nothing was trained on it


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama")


@pytest.mark.parametrize("layout", ["generation-messages.yaml", "generation-prompt-completion.yaml"])
def test_each_generation_layout_trains_end_to_end(layout: str, tiny_llama: Path, data_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    docs = statute_docs(data_dir, 30)
    root = tmp_path / "my-data"
    root.mkdir()
    if "messages" in layout:
        write_jsonl(root / "chats.jsonl", [{"messages": [{"role": "user", "content": t[:300]},
                                                         {"role": "assistant", "content": h}]} for _, h, t in docs])
    else:
        write_csv(root / "pairs.csv", ["text", "title"], [[t[:300], h] for _, h, t in docs])
    cfg = yaml.safe_load((REPO / "configs" / "examples" / layout).read_text())
    cfg["train"].update(base_model=str(tiny_llama), batch_size=4, max_new_tokens=6, device="cpu",
                        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    cfg["train"]["data"].update(dev_fraction=0.2, test_fraction=0.2, input_max_tokens=48)
    path = tmp_path / layout
    path.write_text(yaml.safe_dump(cfg))
    out = CliRunner().invoke(app, ["train", str(path), "--no-mlflow", "--out", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert {"test_chrf", "base_test_chrf", "lead_test_chrf"} <= set(m)
    assert "your data, layout" in (tmp_path / "run" / "report.md").read_text()


def test_bad_generation_rows_are_refused(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "my-data"
    root.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"Text {i}"}, {"role": "assistant", "content": f"Titel {i}"}]}
            for i in range(12)]
    rows[4] = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    write_jsonl(root / "chats.jsonl", rows)
    cfg = yaml.safe_load((REPO / "configs" / "examples" / "generation-messages.yaml").read_text())
    cfg["train"].update(base_model=str(tiny_llama), device="cpu")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = CliRunner().invoke(app, ["train", str(path), "--no-mlflow", "--out", str(tmp_path / "run")])
    assert out.exit_code == 2
    assert "rows my-data/chats.jsonl row 4: needs exactly one user and then one assistant message" in out.output
