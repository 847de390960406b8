"""Beyond one machine's disk: a real `mlflow server --serve-artifacts` and a real PostgreSQL, on loopback.

Every "machine" is a process with its own LORAFLEET_HOME; they share only the servers' URLs. A bundle trained
and registered on one is downloaded, verified and loaded on another after the first one's home is deleted;
two research processes drive one study on PostgreSQL and a third process, which trained nothing, takes the
winner's adapter from MLflow and registers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from remote_stores_kit import REPO, cli_env, mlflow_server, pg_bin, pg_user, postgres_server, tiny_config

from lorafleet.testing import make_random_adapter, wait_all

pytestmark = pytest.mark.integration

SENTENCE = "Der Hersteller haftet für Schäden, die durch einen Fehler seines Produkts entstehen."

# The worker side, as its own process: resolve a registry URI (download + verify into its own home), load it.
WORKER = """
import json, sys
from lorafleet.registry.uri import resolve_models_uri
from lorafleet.train.kinds.retrieval.trainer import load_adapter_model
adapter = resolve_models_uri(sys.argv[1])
vec = load_adapter_model(sys.argv[2], adapter, "cpu", 64).encode([sys.argv[3]])[0]
print(json.dumps({"adapter": str(adapter), "vec": [float(x) for x in vec]}))
"""


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def machine(home: Path, tracking_uri: str) -> dict[str, str]:
    """The environment of a process on its own machine: its own LORAFLEET_HOME, the tracking server's URL."""
    env = cli_env()
    env.update({"LORAFLEET_HOME": str(home), "MLFLOW_TRACKING_URI": tracking_uri})
    env.pop("LORAFLEET_OPTUNA_STORAGE", None)
    return env


def test_bundle_travels_through_the_tracking_server(tmp_path: Path, tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    from lorafleet.registry import store
    from lorafleet.train.kinds.retrieval.trainer import load_adapter_model

    server_root = tmp_path / "mlflow-server"
    trainer, worker = tmp_path / "trainer-home", tmp_path / "worker-home"
    with mlflow_server(server_root) as url:
        # 1. `lorafleet train` on the trainer: the run and its adapter go to the server, nothing to its home.
        cfg = tmp_path / "train.yaml"
        cfg.write_text(yaml.safe_dump({"train": tiny_config(tiny_model_dir, "unused")["train"]}))
        done = subprocess.run([sys.executable, "-m", "lorafleet.cli", "train", str(cfg), "--out",
                               str(tmp_path / "run"), "--run-name", "remote"], env=machine(trainer, url), cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        client = MlflowClient(tracking_uri=url)
        exp = client.get_experiment_by_name("lorafleet-train")
        assert exp.artifact_location.startswith("mlflow-artifacts:/"), exp.artifact_location
        (run,) = client.search_runs([exp.experiment_id])
        assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith("mlflow-artifacts:/")
        assert {"adapter", "metrics.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
        assert list((server_root / "artifacts").rglob("adapter_model.safetensors")), "adapter stored by the server"
        assert not (trainer / "mlflow").exists(), "no local MLflow store or artifact root beside a tracking server"

        # 2. Registration on the trainer (a bundle of its own run in `lorafleet-bundles`).
        monkeypatch.setenv("LORAFLEET_HOME", str(trainer))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        adapter = make_random_adapter(tiny_model_dir, tmp_path / "adapter", seed=5)
        ref = store.register_bundle("remote-legal", adapter, base_source=str(tiny_model_dir), base_name="tiny",
                                    metrics={"test_ndcg@10": 0.5, "base_test_ndcg@10": 0.4}, alias="candidate")
        assert ref == ("remote-legal", "1")
        bundles = client.get_experiment_by_name(store.BUNDLE_EXPERIMENT)
        assert bundles.artifact_location.startswith("mlflow-artifacts:/"), bundles.artifact_location
        assert store.get_version("remote-legal", "candidate").source.startswith("mlflow-artifacts:/")
        assert not (trainer / "mlflow").exists()
        expected = load_adapter_model(str(tiny_model_dir), adapter, "cpu", 64).encode([SENTENCE])[0]
        original = digests(adapter)
        shutil.rmtree(trainer, ignore_errors=True)  # the worker's machine shares nothing with the trainer's
        shutil.rmtree(tmp_path / "run")

        # 3. The worker, in its own empty home: download by registry URI, verified, byte-identical, loads.
        got = subprocess.run([sys.executable, "-c", WORKER, "models:/remote-legal@candidate", str(tiny_model_dir),
                              SENTENCE], env=machine(worker, url), cwd=REPO, capture_output=True, text=True,
                             timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        answer = json.loads(got.stdout.strip().splitlines()[-1])
        fetched = Path(answer["adapter"])
        assert fetched.is_relative_to(worker / "bundles" / "remote-legal" / "v1")
        assert digests(fetched) == original
        assert answer["vec"] == pytest.approx([float(x) for x in expected], abs=1e-5)


@pytest.fixture
def pg_dir() -> Path:
    bin_dir = pg_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql: apt-get install postgresql-15")
    if os.geteuid() == 0:
        try:
            pg_user()
        except KeyError:
            pytest.skip("running as root (initdb refuses root) and there is no user 'nobody' to run PostgreSQL as")
        if shutil.which("runuser") is None:
            pytest.skip("running as root (initdb refuses root) and there is no runuser to run PostgreSQL as nobody")
    return bin_dir


def test_two_research_processes_on_postgres(tmp_path: Path, tiny_model_dir: Path, pg_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import optuna
    from mlflow import MlflowClient

    from lorafleet import pipeline
    from lorafleet.registry import store
    from lorafleet.research.config import load_config
    from lorafleet.research.tracking import experiment_name

    study = "pg-study"
    config = tmp_path / "research.yaml"
    config.write_text(yaml.safe_dump(tiny_config(
        tiny_model_dir, study, n_trials=4, reseed=False,
        space={"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}})))
    homes = [tmp_path / "machine-a", tmp_path / "machine-b"]
    with mlflow_server(tmp_path / "mlflow-server") as url, postgres_server(pg_dir) as storage:
        # 1. Two machines run trials of one study (`--worker`: trials only), started together on a fresh database.
        logs = [home.with_suffix(".log") for home in homes]
        procs = []
        for home, log in zip(homes, logs, strict=True):
            with log.open("wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "lorafleet.cli", "research", "run", str(config), "--worker", "--plain",
                     "--no-ship"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                    # The storage URL holds a password: in the environment, not on a command line others can read.
                    env={**machine(home, url), "LORAFLEET_OPTUNA_STORAGE": storage}))
        codes = wait_all(procs, timeout=300)
        assert codes == [0, 0], "\n----\n".join(log.read_text()[-3000:] for log in logs)
        trials = optuna.load_study(study_name=study, storage=storage).get_trials()
        assert 4 <= len(trials) <= 5 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        assert len({t.user_attrs["worker"] for t in trials}) == 2, "both machines ran trials"

        # 2. A third machine, which trained nothing, writes the summary and ships the winner (no tuning).
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        lead = tmp_path / "lead-home"
        monkeypatch.setenv("LORAFLEET_HOME", str(lead))
        result = pipeline.run(load_config(config), storage=storage, progress_live=False, ship_winner=False).research
        assert result.finalized and result.winner_trial is not None
        winner = next(t for t in trials if t.number == result.winner_trial)
        run_id = winner.user_attrs["mlflow_run_id"]
        assert result.winner_adapter_uri == f"runs:/{run_id}/adapter"
        trained_at = Path(winner.user_attrs["adapter_dir"])
        assert any(trained_at.is_relative_to(h) for h in homes)
        local = Path(result.winner_adapter_dir)
        assert local.is_relative_to(lead / "research" / study) and local.is_dir()
        assert digests(local) == digests(trained_at), "the winner's adapter as its trial logged it"

        shipped = pipeline.ship(result, tune=False, require_candidate=False, say=lambda _: None)
        assert shipped is not None and shipped.ref == (study, "1")
        client = MlflowClient(tracking_uri=url)
        parent = client.get_run(result.parent_run_id)
        assert parent.data.tags["lorafleet.winner_adapter_uri"] == result.winner_adapter_uri
        assert client.get_experiment_by_name(experiment_name(study)).artifact_location.startswith("mlflow-artifacts:/")
        bundle = store.download_bundle(study, "candidate", tmp_path / "bundle")
        assert digests(bundle / "adapter") == digests(trained_at)


def _started(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)


def test_remote_worker_and_gateway_serve_a_bundle_from_the_server(tmp_path: Path, tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker and a gateway started as separate commands, each given only a NATS URL and its credential file
    (the fleet file comes from NATS, where the cluster's layout step put it, as `lorafleet up` does), serve a
    promoted bundle that the worker fetched from the tracking server into its own home."""
    import httpx
    import numpy as np

    from lorafleet.core.config import BaseModelSpec, FleetConfig
    from lorafleet.nats.client import ClientSettings
    from lorafleet.nats.server import NatsServer, free_port
    from lorafleet.ops.cluster import apply_layout
    from lorafleet.ops.processes import stop_group
    from lorafleet.registry import store
    from lorafleet.registry.promote import promote
    from lorafleet.train.kinds.retrieval.trainer import load_adapter_model

    config = FleetConfig(bases=[BaseModelSpec(name="tiny", source=str(tiny_model_dir), max_seq_length=64)])
    fleet = tmp_path / "fleet.yaml"  # only the machine that runs `promote` has it
    fleet.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    adapter = make_random_adapter(tiny_model_dir, tmp_path / "adapter", seed=11)
    expected = np.asarray(load_adapter_model(str(tiny_model_dir), adapter, "cpu", 64).encode([SENTENCE])[0])
    worker_home, gateway_home = tmp_path / "worker-home", tmp_path / "gateway-home"
    with mlflow_server(tmp_path / "mlflow-server") as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        assert store.register_bundle("remote-legal", adapter, base_source=str(tiny_model_dir), base_name="tiny",
                                     alias="candidate") == ("remote-legal", "1")
        server = NatsServer(tmp_path / "nats", creds=tmp_path / "creds").start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            admin = ClientSettings.resolve(creds=str(server.creds("admin"))).options()
            asyncio.run(apply_layout(server.url, admin, config))  # what `lorafleet up` does: streams, bucket, file
            port = free_port()
            procs.append(_started([sys.executable, "-m", "lorafleet.cli", "worker",
                                   "--nats-url", server.url, "--creds", str(server.creds("worker")), "--threads", "1"],
                                  machine(worker_home, url), tmp_path / "worker.log"))
            gateway_env = machine(gateway_home, "http://127.0.0.1:9")  # the gateway never needs the registry
            procs.append(_started([sys.executable, "-m", "lorafleet.cli", "gateway",
                                   "--nats-url", server.url, "--creds", str(server.creds("gateway")),
                                   "--host", "127.0.0.1", "--port", str(port)], gateway_env, tmp_path / "gateway.log"))
            gateway = f"http://127.0.0.1:{port}"

            def logs() -> str:
                return "\n----\n".join((tmp_path / f"{part}.log").read_text()[-2000:] for part in ("worker", "gateway"))

            def ready() -> bool:  # /readyz: connected, stream there, a live worker pulling for every base
                assert all(p.poll() is None for p in procs), logs()
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{gateway}/readyz", timeout=5).status_code == 200
                return False

            deadline = time.monotonic() + 120
            while not ready():
                assert time.monotonic() < deadline, f"gateway not ready within 120 s\n{logs()}"
                time.sleep(0.2)
            promote("remote-legal", "1", force=True, nats_url=server.url, fleet_file=fleet,
                    creds=server.creds("control"))
            deadline, got = time.monotonic() + 120, None
            while got is None:
                assert all(p.poll() is None for p in procs), logs()
                assert time.monotonic() < deadline, f"remote-legal not served within 120 s\n{logs()}"
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.post(f"{gateway}/v1/embeddings", json={"model": "remote-legal", "input": [SENTENCE],
                                                                      "encoding_format": "float"}, timeout=30)
                    if r.status_code == 200:
                        got = np.asarray(r.json()["data"][0]["embedding"])
                        break
                time.sleep(0.2)  # polling the gateway's answer: no event tells the test the switch is live
            cosine = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected)))
            assert cosine > 0.9999, cosine
            fetched = worker_home / "bundles" / "remote-legal" / "v1" / "adapter"
            assert digests(fetched) == digests(adapter), "the worker serves the bundle it fetched from the server"
            assert not (gateway_home / "bundles").exists()
        finally:
            for p in procs:
                stop_group(p.pid, 15.0, "remote part")
            server.stop()
