"""The user's path end to end, with nothing faked, through the pipeline module the CLI uses: a research run
on a small budget → its winner tuned and registered as `candidate` in a real MLflow store → `promote` onto
a real local cluster (nats-server, gateway, worker, packaged all-MiniLM-L6-v2) → the promoted name serves
the adapter's embeddings → a second version promoted and rolled back live while a client sends steady
traffic, none of which fails."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.core import settings
from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.testing import wait_until

pytestmark = pytest.mark.integration

BASE = "all-MiniLM-L6-v2"
NAME = "legal"
SENTENCES = [
    "Der Arbeitgeber darf den Beschäftigten nicht wegen seines Alters benachteiligen.",
    "Die Kündigung des Arbeitsverhältnisses ist sozial ungerechtfertigt.",
    "Wer eine Benachteiligung geltend machen will, muss dies innerhalb von zwei Monaten tun.",
    "Der Betriebsrat ist vor jeder Kündigung zu hören.",
]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def research_config(minilm: Path) -> dict:
    """Small but real: one short trial of MiniLM on two laws, no reseed (a couple of minutes on 2 CPUs)."""
    return {
        "train": {
            "base_model": str(minilm),
            "data": {"laws": ["agg", "kschg"], "max_train_queries": 64, "max_eval_queries": 24,
                     "hard_negatives": False},
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"]},
            "epochs": 1, "batch_size": 16, "max_seq_length": 64, "device": "cpu", "learning_rate": 2e-3,
        },
        "research": {
            "study": NAME, "n_trials": 1, "budget_minutes": 8, "trial_timeout_minutes": 5,
            "sampler": {"kind": "random", "seed": 0}, "pruner": {"kind": "none"}, "reseed": False,
            "min_margin": 0.0, "space": {"learning_rate": {"type": "float", "low": 2e-3, "high": 2e-3}},
        },
    }


def embed(url: str, model: str, texts: list[str]) -> np.ndarray:
    r = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "float"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


def wait_serving(url: str, ref: np.ndarray, timeout: float = 90.0) -> None:
    """Until NAME answers with `ref` (the watchers of the fleet state are asynchronous)."""
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": SENTENCES, "encoding_format": "float"},
                       timeout=60)
        if r.status_code == 200:
            got = np.array([d["embedding"] for d in r.json()["data"]])
            if cosine(got, ref).min() > 0.9999:
                return
        time.sleep(0.3)
    raise AssertionError(f"{NAME} did not switch within {timeout}s (last cosine "
                         f"{None if got is None else cosine(got, ref).min()})")


class SteadyClient:
    """Sends one request to NAME every ~20 ms in a thread and keeps every answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, int, np.ndarray | None, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not self._stop.is_set():
                k = i % len(SENTENCES)
                r = client.post(f"{self.url}/v1/embeddings",
                                json={"model": NAME, "input": SENTENCES[k], "encoding_format": "float"})
                vec = np.array(r.json()["data"][0]["embedding"]) if r.status_code == 200 else None
                self.answers.append((r.status_code, k, vec, r.text[:200] if vec is None else ""))
                i += 1
                time.sleep(0.02)

    def wait_answers(self, n: int, timeout: float = 120.0) -> None:
        """Until `n` more answers than now have come back."""
        want = len(self.answers) + n
        wait_until(lambda: len(self.answers) >= want, timeout, f"{n} more answers of the steady client")

    def __enter__(self) -> SteadyClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def test_research_ship_promote_rollback(tmp_path: Path, minilm_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from lorafleet import pipeline
    from lorafleet.cli import app
    from lorafleet.nats.server import free_port
    from lorafleet.ops.cluster import LocalCluster
    from lorafleet.registry import store
    from lorafleet.registry.bundle import read_spec
    from lorafleet.research.config import load_config
    from lorafleet.testing import make_random_adapter

    # 1. The pipeline: research on a small budget, then the ship step (quick tune + register as 'candidate').
    cfg_path = tmp_path / "research.yaml"
    cfg_path.write_text(yaml.safe_dump(research_config(minilm_path)))
    seen: list[object] = []
    out = pipeline.run(load_config(cfg_path), progress_live=False, tune_quick=True, on_researched=seen.append)
    result = out.research
    assert seen == [result] and result.winner_adapter_dir and result.finalized and result.task == "retrieval"
    # One short trial on 64 queries may or may not beat the base model. The pipeline ships only a candidate;
    # the serving path is what is tested here, so a non-candidate winner is shipped by hand, as a user can.
    if result.candidate:
        assert out.shipped is not None and out.shipped.ref == (result.study, "1")
        assert store.get_version(result.study, "candidate").tags["lorafleet.task"] == "retrieval"
    else:
        assert out.shipped is None
    shipped = pipeline.ship(result, name=NAME, tune_quick=True, require_candidate=False)
    assert shipped is not None and shipped.ref == (NAME, "1") and shipped.profile_source == "tuned"
    v1 = store.get_version(NAME, "candidate")
    assert v1.version == "1" and v1.run_id == result.parent_run_id
    assert v1.metric("test_ndcg@10") == pytest.approx(result.winner_metrics["test_ndcg@10"], abs=1e-5)
    assert v1.metric("base_test_ndcg@10") == pytest.approx(result.baseline["base_test_ndcg@10"], abs=1e-5)
    spec = read_spec(store.download_bundle(NAME, "1", tmp_path / "v1"))
    assert spec.base.name == BASE and spec.profile == shipped.profile and spec.profile_source == "tuned"
    assert "report/results.json" in spec.files and "report/report.md" in spec.files

    # Shipping the same winner again (a resumed run finalizing twice) registers nothing new.
    again = pipeline.ship(result, name=NAME, tune_quick=True, require_candidate=False)
    assert again is not None and again.ref == (NAME, "1") and again.profile == shipped.profile
    assert [i.version for i in store.versions(NAME)] == ["1"]

    # A second version (a random adapter, no metrics) to promote and roll back later.
    other = make_random_adapter(minilm_path, tmp_path / "other", seed=7)
    v2 = store.register_bundle(NAME, other, base_source=BASE, alias="candidate")
    assert v2 == (NAME, "2")

    # Direct references: base + adapter loaded in-process.
    refs = {}
    for version, adapter in (("1", Path(result.winner_adapter_dir)), ("2", other)):
        m = SentenceTransformer(str(minilm_path), device="cpu")
        m.load_adapter(str(adapter))
        refs[version] = m.encode(SENTENCES)
    base_ref = SentenceTransformer(str(minilm_path), device="cpu").encode(SENTENCES)
    assert cosine(refs["2"], base_ref).min() < 0.999 and cosine(refs["2"], refs["1"]).min() < 0.999

    # 2. A cluster in this LORAFLEET_HOME (promote finds it through cluster.json); nothing about NAME in it.
    fleet = FleetConfig(bases=[BaseModelSpec(name=BASE)])
    with LocalCluster(fleet, workers=1, port=0, home=settings.home(), nats_port=free_port()) as cluster:
        url = cluster.gateway_url
        r = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": "x"}, timeout=30)
        assert r.status_code == 404

        runner = CliRunner()
        cli = runner.invoke(app, ["promote", NAME, "--version", "1", *([] if result.candidate else ["--force"])])
        assert cli.exit_code == 0, cli.output
        assert store.alias_version(NAME, "champion") == "1"
        wait_serving(url, refs["1"])
        assert cosine(embed(url, NAME, SENTENCES), refs["1"]).min() > 0.9999
        assert NAME in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}

        # The gate refuses v2 (no test metrics) and says why; nothing changes.
        cli = runner.invoke(app, ["promote", NAME, "--version", "2"])
        assert cli.exit_code == 1 and "fails the quality gate" in cli.output and "no test_ndcg@10" in cli.output
        assert store.alias_version(NAME, "champion") == "1"

        # 3. Live switch and rollback under steady traffic: no request fails.
        with SteadyClient(url) as client:
            client.wait_answers(3)  # traffic before, between and after the switches
            pipeline.promote(NAME, "2", force=True)
            wait_serving(url, refs["2"])
            client.wait_answers(3)
            assert pipeline.rollback(NAME).version == "1"
            wait_serving(url, refs["1"])
            client.wait_answers(3)
        failed = [(s, t) for s, _, _, t in client.answers if s != 200]
        assert not failed, failed[:3]
        assert len(client.answers) >= 9  # traffic ran across both switches (waited for above)
        seen = set()
        for _, k, vec, _ in client.answers:
            match = [v for v, ref in refs.items() if cosine(vec, ref[k]) > 0.9999]
            assert match, "an answer matched neither version's embeddings"
            seen.add(match[0])
        assert seen == {"1", "2"}, "the steady client should have seen both versions"
        assert store.alias_version(NAME, "champion") == "1"

        listing = runner.invoke(app, ["registry", "list"])
        assert listing.exit_code == 0 and "champion" in listing.output and "candidate" in listing.output
