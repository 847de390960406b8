"""The MLflow UI as a new user meets it, in a real browser (Debian's chromium, driven by Playwright).

For each task kind, a small real research run (2 trials and the winner with a second seed: the tiny
random BERT for retrieval, a tiny random Llama for generation) fills a fresh store, the winner is
registered and given both aliases, and (retrieval) a standalone `lorafleet train` run is added. Then
`lorafleet ui` starts, and the links it prints are opened as a user would, with no click on Columns,
Views or Group by:

- the study's runs view opens on runs (not MLflow 3's GenAI overview), with the kind's headline
  columns (test of the winner, the base model and the baseline side by side, dev, cost), every run
  and its dataset visible;
- the experiment's own page opens on runs too; the chart view starts with the headline charts;
- the registered model shows its aliases and the version's one-sentence result; the version page
  shows the whole sentence;
- the `lorafleet-train` view shows the standalone run with its dataset and headline.

The retrieval case's screenshots go to a temporary folder; with LORAFLEET_UPDATE_SCREENSHOTS=1 they
replace those in docs/img/ (used by docs/mlflow-ui.md), and that case trains the packaged
all-MiniLM-L6-v2 instead of the tiny BERT (a few minutes), so that the pictures show real numbers.
Without chromium the test skips (`apt-get install chromium`, as .ci/run does). The `lorafleet ui`
process, the MLflow server it starts and the browser are stopped at the end, whatever happens.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCS_IMG = REPO / "docs" / "img"
UPDATE = os.environ.get("LORAFLEET_UPDATE_SCREENSHOTS") == "1"
STUDY = {"retrieval": "german-legal", "generation": "german-headings"}
# Kinds whose standalone `run` logs to MLflow through lorafleet.train.tracking (add "generation" once it does).
STANDALONE = {"retrieval", "generation"}
HEADING_LAWS = ["kschg", "prodhaftg", "tzbfg", "agg"]
VIEWPORT = {"width": 1600, "height": 1000}
# The machine's network is closed: no background fetches, no QUIC, no component updates.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# The MLflow assistant panel opens by itself on a browser's first visit; a user closes it once, the pictures
# start without it (MLflow's useLocalStorage key: `<key>_v<version>`).
NO_ASSISTANT = "window.localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _retrieval_config(model_dir: Path) -> dict[str, Any]:
    kit_path = REPO / "tests" / "research" / "research_testkit.py"
    spec = importlib.util.spec_from_file_location("research_testkit", kit_path)
    assert spec is not None and spec.loader is not None
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    # 2 one-epoch trials (sampler seed 2), then the winner with a second seed: about 20 s.
    return kit.tiny_config(model_dir, STUDY["retrieval"], n_trials=2)


def _minilm_config(model_dir: Path) -> dict[str, Any]:
    """Real numbers for the pictures: MiniLM on two laws, 2 short trials and a second seed (minutes on 2 CPUs)."""
    return {
        "train": {
            "base_model": str(model_dir),
            "data": {"laws": ["agg", "kschg"], "max_train_queries": 128, "max_eval_queries": 40,
                     "hard_negatives": False},
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"]},
            "epochs": 1, "batch_size": 16, "max_seq_length": 64, "device": "cpu", "learning_rate": 2e-3,
        },
        "research": {
            "study": STUDY["retrieval"], "n_trials": 2, "budget_minutes": 15, "trial_timeout_minutes": 6,
            "sampler": {"kind": "random", "seed": 0}, "pruner": {"kind": "none"}, "reseed": True, "min_margin": 0.0,
            "space": {"learning_rate": {"type": "float", "low": 4e-3, "high": 1.2e-2, "log": True}},
        },
    }


def _generation_config(model_dir: Path) -> dict[str, Any]:
    """Statute headings on the tiny Llama: 48 training examples, 12 per eval split, 2 trials and a second seed
    (about 40 s)."""
    return {
        "task": "generation",
        "train": {
            "base_model": str(model_dir),
            "data": {"laws": HEADING_LAWS, "input_max_tokens": 32, "system_prompt": "Überschrift des Paragraphen.",
                     "dev_fraction": 0.15, "test_fraction": 0.15, "max_eval_examples": 12, "max_train_examples": 48},
            "lora": {"r": 8, "alpha": 16}, "learning_rate": 5e-3, "epochs": 1, "batch_size": 8, "warmup_ratio": 0.0,
            "max_length": 96, "device": "cpu", "eval_batch_size": 12, "max_new_tokens": 6,
        },
        "research": {
            "study": STUDY["generation"], "n_trials": 2, "budget_minutes": 10, "trial_timeout_minutes": 3,
            "sampler": {"kind": "random", "seed": 2}, "pruner": {"kind": "none"}, "reseed": True, "min_margin": 0.0,
            "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}},
        },
    }


@pytest.fixture(scope="module")
def tiny_llama(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose tokenizer knows the statutes' words."""
    from lorafleet.testing import build_tiny_llama
    from lorafleet.train.statutes import parse_law

    corpus = [s.title + ". " + s.text for law in HEADING_LAWS for s in parse_law(data_dir, law).sections]
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "llama", vocab_size=1500,
                            corpus=["Überschrift des Paragraphen.", *corpus])


def _fill_store(tmp_path: Path, task: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Research → register the winner (`candidate`) → `champion`; plus one standalone training run."""
    from lorafleet import pipeline
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.registry import store
    from lorafleet.research.config import load_config

    path = tmp_path / "research.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = pipeline.run(load_config(path), progress_live=False, ship_winner=False).research
    assert result.finalized and result.winner_trial is not None, result.verdict
    shipped = pipeline.ship(result, tune=False, require_candidate=False)
    assert shipped is not None
    store.set_alias(STUDY[task], "champion", shipped.ref.version)
    standalone = None
    if task in STANDALONE:
        kind = get_task_kind(task)
        standalone = kind.run(kind.parse_config({**cfg["train"], "epochs": 1}), tmp_path / "train-run",
                              run_name="standalone-run")
    return {"result": result, "version": shipped.ref.version, "standalone": standalone,
            "info": store.get_version(STUDY[task], shipped.ref.version)}


class UiProcess:
    """`lorafleet ui` in its own session; its output read by a thread, line by line."""

    def __init__(self, port: int) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli", "ui", "--port", str(port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                                     start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> str:
        """The first line (from now on) matching `pattern`; fails with the output so far if none comes."""
        rx = re.compile(pattern)
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"`lorafleet ui` printed no line matching {pattern!r} in {timeout}s:\n"
                                     + "".join(self.output)) from None
            if rx.search(line):
                return line

    def links(self) -> dict[str, str]:
        """`  what: URL` lines printed before the server starts."""
        out = {}
        for line in self.output:
            m = re.match(r"^  (.+?): (http://\S+)$", line.rstrip("\n"))
            if m:
                out[m.group(1)] = m.group(2)
        return out

    def stop(self) -> None:
        """SIGTERM: `lorafleet ui` stops the server's process group, then exits; whatever is left is killed."""
        import psutil

        try:
            family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:  # only what this test started
            p.kill()
        assert not alive, f"left running after `lorafleet ui` stopped: {[p.pid for p in alive]}"


def row_part(page: Any, link: Any, text: str | re.Pattern[str]) -> Any:
    """The part of the runs-table row holding `link` that shows `text` (the grid renders the pinned run-name
    column and the other columns as separate row elements sharing one row-id)."""
    row_id = page.locator("[role=row]", has=link).first.get_attribute("row-id")
    return page.locator(f'[role=row][row-id="{row_id}"]', has_text=text)


@pytest.fixture
def ui(request: pytest.FixtureRequest) -> Iterator[UiProcess]:
    from lorafleet.nats.server import free_port

    proc = UiProcess(free_port())
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("task", ["retrieval", "generation"])
def test_mlflow_ui_first_look(task: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium installed (Debian: apt-get install chromium)")
    from playwright.sync_api import expect, sync_playwright

    from lorafleet.core.tasks import get_task_kind
    from lorafleet.registry.store import version_description

    if task == "generation":
        cfg = _generation_config(request.getfixturevalue("tiny_llama"))
    elif UPDATE:
        cfg = _minilm_config(request.getfixturevalue("minilm_path"))
    else:
        cfg = _retrieval_config(request.getfixturevalue("tiny_model_dir"))
    study = STUDY[task]
    filled = _fill_store(tmp_path, task, cfg)
    result, version = filled["result"], filled["version"]
    spec = get_task_kind(task).metrics
    mlflow_name = {name: name.replace("@", "_at_") for name in spec.headline_set}
    dataset_name = f"{task}/{'+'.join(cfg['train']['data']['laws'])}"
    shots = tmp_path / "screenshots"
    shots.mkdir()

    ui: UiProcess = request.getfixturevalue("ui")
    ui.wait_for(r"Uvicorn running on|Listening at")
    links = ui.links()
    runs_url = links[f"runs of lorafleet-research/{study}"]
    model_key = next(k for k in links if k.startswith(f"model {study}"))
    assert "candidate=v" in model_key and "champion=v" in model_key
    assert "viewStateShareKey=lorafleet" in runs_url and "workflowType=machine_learning" in runs_url

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=VIEWPORT)
            context.add_init_script(NO_ASSISTANT)
            page = context.new_page()
            page.set_default_timeout(60_000)

            # 1. The study's runs view: runs, not the GenAI overview; headline columns, every run, its dataset.
            page.goto(runs_url)
            parent = page.get_by_role("link", name=f"research-{study}", exact=True)
            expect(parent).to_be_visible()
            assert "/runs" in page.url and "/overview" not in page.url and "/traces" not in page.url
            for absent in ("No data available", "Detect Issues"):  # what MLflow 3's GenAI overview shows
                assert page.get_by_text(absent).count() == 0, f"GenAI overview element {absent!r} shown"
            for name in (spec.headline, spec.base(spec.headline), f"{spec.baseline}_{spec.headline}", spec.objective):
                expect(page.get_by_text(mlflow_name[name], exact=True).first).to_be_in_viewport()
            for run_name in ("trial-000", "trial-001", re.compile(rf"^trial-{result.winner_trial:03d}-seed\d+$")):
                expect(page.get_by_role("link", name=run_name, exact=True)).to_be_in_viewport()
            dataset = page.get_by_text(re.compile("^" + re.escape(dataset_name) + r" \("))
            expect(dataset.first).to_be_in_viewport()
            assert dataset.count() == 4, "every run (parent, 2 trials, second seed) shows its dataset"
            expect(row_part(page, parent, repr(result.winner_metrics[spec.headline])[:5])).to_be_visible()
            expect(row_part(page, parent, repr(result.baseline[spec.base(spec.headline)])[:5])).to_be_visible()
            page.screenshot(path=str(shots / "mlflow-runs.png"))

            # 2. The experiment's own link (no tab, no view) opens on runs too.
            page.goto(runs_url.split("/runs?")[0] + "?workflowType=machine_learning")
            page.wait_for_url(re.compile(r"/experiments/\d+/runs"))
            expect(page.get_by_role("link", name=f"research-{study}", exact=True)).to_be_visible()

            # 3. The chart view leads with the headline: the test numbers of the winner, the base model, the baseline.
            page.goto(runs_url + "&compareRunsMode=CHART")
            expect(page.get_by_text(f"Headline: {spec.label}", exact=False)).to_be_visible()
            boxes = []
            for name in spec.headline_set[:3]:
                title = page.get_by_text(mlflow_name[name], exact=True).last
                expect(title).to_be_in_viewport()
                boxes.append(title.bounding_box())
            assert [b["x"] for b in boxes] == sorted(b["x"] for b in boxes), "headline charts side by side, in order"
            page.screenshot(path=str(shots / "mlflow-charts.png"))

            # 4. The registered model: aliases and the start of each version's one-sentence result.
            page.goto(links[model_key])
            expect(page.get_by_text("candidate", exact=False).first).to_be_visible()
            expect(page.get_by_text("champion", exact=False).first).to_be_visible()
            start = re.compile(rf"^test {re.escape(spec.label)} [\d.]+ vs base")
            expect(page.get_by_text(start).first).to_be_visible()
            page.screenshot(path=str(shots / "mlflow-model.png"))

            # 5. The version page: the whole sentence.
            info = filled["info"]
            sentence = version_description(spec, {**result.baseline, **result.winner_metrics}, info.base or "",
                                           result.dataset_digest)
            page.goto(links[model_key].replace(f"/models/{study}?", f"/models/{study}/versions/{version}?"))
            expect(page.get_by_text(sentence, exact=True)).to_be_visible()
            page.screenshot(path=str(shots / "mlflow-version.png"))

            # 6. A standalone `lorafleet train` run: its dataset and headline in the kind's view.
            if filled["standalone"] is not None:
                page.goto(links["runs of lorafleet-train"])
                run_link = page.get_by_role("link", name="standalone-run", exact=True)
                expect(run_link).to_be_visible()
                expect(row_part(page, run_link, dataset_name)).to_be_visible()
                expect(row_part(page, run_link, repr(filled["standalone"].metrics[spec.headline])[:5])).to_be_visible()
                expect(page.get_by_text(mlflow_name[spec.headline], exact=True).first).to_be_in_viewport()
                page.screenshot(path=str(shots / "mlflow-train.png"))
        finally:
            browser.close()

    if UPDATE and task == "retrieval":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        for shot in sorted(shots.glob("*.png")):
            shutil.copyfile(shot, DOCS_IMG / shot.name)
