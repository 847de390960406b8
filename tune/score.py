"""`lorafleet tune` for a reranker: sweep the score profile of a cross-encoder's LoRA under rerank requests.

A reranker's unit of work is a (query, document) pair, and its typical request is one query with the
first stage's top k documents: the load here is `/v1/rerank` with 1 query × `rerank_documents` (50)
passages of the statutes, and every profile reports pairs/s (requests/s × documents) beside the
request p99 (all of a request's pairs scored) at the same offered rates.

The knobs are the embedding sweep's, in the order that matters for pairs: the token budget first
(`max_batch_tokens`: padded pair tokens of one forward pass, so it sets pairs per call, and of one
batch), then batch items (tasks, each a chunk of `gateway.rerank_chunk` documents, one batch may
join), then the wait window. Same staged, coordinate-wise grid and early stop as sweep.py (why not a
sampler: see there); each profile restarts only the worker. The cross-encoder runtime serves fp32
only, so the precision guard has nothing to judge: fp32 is the reference and the only candidate.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import sys
import time
from pathlib import Path

import httpx

from lorafleet.core import settings
from lorafleet.core.config import BaseModelSpec, FleetConfig, GatewayConfig, ServedModel, ServingProfile, WorkerConfig
from lorafleet.tune.analysis import ProfileResult, pareto_front, plateaued, recommend, score
from lorafleet.tune.config import TuneConfig, TuneError
from lorafleet.tune.loadgen import Target
from lorafleet.tune.precision import PrecisionQuality
from lorafleet.tune.probe import SERVED_NAME
from lorafleet.tune.report import write_outputs
from lorafleet.tune.source import TuneSource
from lorafleet.tune.sweep import Say, Sweeper, TuneResult, _terminate_as_interrupt

SCORE_TASK_TYPE = "SEQ_CLS"  # peft's task type of a cross-encoder LoRA (what the rerank kind trains)
RUNTIME = "cross-encoder"
BODIES = 16  # distinct requests the load cycles through


def is_score(source: TuneSource) -> bool:
    """Whether an adapter belongs to a cross-encoder (peft task type SEQ_CLS), so the score sweep applies."""
    try:
        config = json.loads((source.adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("task_type") == SCORE_TASK_TYPE


def rerank_bodies(texts: list[str], documents: int, n: int = BODIES, seed: int = 0,
                  model: str = SERVED_NAME) -> list[bytes]:
    """`n` JSON bodies of /v1/rerank, each one query (a sentence's first words) and `documents` passages (two
    sentences each, ~60 tokens: a chunk of a statute section)."""
    if len(texts) < 3:
        raise TuneError("too few texts to build rerank requests")
    rng = random.Random(seed)
    bodies = []
    for _ in range(n):
        query = " ".join(rng.choice(texts).split()[:8])
        docs = [f"{rng.choice(texts)} {rng.choice(texts)}" for _ in range(documents)]
        bodies.append(json.dumps({"model": model, "query": query, "documents": docs}).encode())
    return bodies


def rerank_target(gateway_url: str, bodies: list[bytes]) -> Target:
    m = re.match(r"^http://([^:/]+):(\d+)", gateway_url)
    if not m:
        raise TuneError(f"unsupported gateway URL {gateway_url}")
    return Target(m.group(1), int(m.group(2)), "/v1/rerank", lambda i: bodies[i % len(bodies)],
                  content_type="application/json")


class ScoreSweeper(Sweeper):
    """The embedding sweeper with a cross-encoder base and rerank requests as the load."""

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: Say) -> None:
        # Closed-loop points at the rerank concurrencies; the rest of the machinery reads cfg.concurrencies.
        super().__init__(source, cfg.model_copy(update={"concurrencies": cfg.rerank_concurrencies}), work_dir, say)
        self.bodies = rerank_bodies(self.texts, cfg.rerank_documents, seed=cfg.seed)

    def fleet(self, profile: ServingProfile) -> FleetConfig:
        return FleetConfig(
            bases=[BaseModelSpec(name=self.source.base_name, source=self.source.base_source,
                                 revision=self.source.base_revision, runtime=RUNTIME, precision="fp32")],
            models=[ServedModel(name=SERVED_NAME, base=self.source.base_name, adapter=str(self.source.adapter_dir),
                                adapter_id=f"{SERVED_NAME}-adapter", profile=profile)],
            gateway=GatewayConfig(port=0, default_deadline_s=60.0,
                                  max_rerank_documents=max(self.cfg.rerank_documents, 1000)),
            worker=WorkerConfig(profile=profile, device=self.cfg.device),
        )

    def target(self) -> Target:
        assert self.cluster is not None
        return rerank_target(self.cluster.gateway_url, self.bodies)

    def _wait_serving(self, timeout: float) -> None:
        """Until a rerank request to the adapter succeeds: the (new) worker loaded base, adapter and head."""
        assert self.cluster is not None
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, code in self.cluster.exited():
                raise TuneError(f"the {name} exited with code {code}; see {self.cluster.log_path(name)}")
            try:
                r = httpx.post(f"{self.cluster.gateway_url}/v1/rerank", content=self.bodies[0],
                               headers={"Content-Type": "application/json"}, timeout=60)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise TuneError(f"the tuning worker did not serve the reranker within {timeout:.0f}s ({last})")

    def measure(self, profile: ServingProfile, phase: str, restart_s: float) -> ProfileResult:
        r = super().measure(profile, phase, restart_s)
        r.pairs_per_request = self.cfg.rerank_documents
        return r

    def calibrate(self, target: Target, measured: float) -> None:
        super().calibrate(target, measured)
        # A 50-pair request takes a CPU worker a good part of a second: the embedding sweep's floor of 1 req/s
        # could offer more than the capacity. Rates here follow the measured capacity down to 0.1 req/s.
        self.open_rates = [round(max(f * self.baseline_rps, 0.1), 2) for f in self.cfg.open_fractions]


def run_score_tune(source: TuneSource, cfg: TuneConfig | None = None, out_dir: Path | None = None,
                   say: Say | None = None) -> TuneResult:
    """Sweep a reranker's score profile; outputs as sweep.py's (profile.yaml, results.csv with pairs_per_s, …)."""
    cfg = cfg or TuneConfig()
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    slo = cfg.slo_rerank_p99_ms
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(out_dir) if out_dir else settings.home() / "tune" / f"{source.label}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / ".work"
    t0 = time.monotonic()
    memory_mb = cfg.memory_gb * 1024 if cfg.memory_gb else None
    default = ServingProfile(precision="fp32")
    sweeper = ScoreSweeper(source, cfg, work, say)
    results: list[ProfileResult] = []
    n = cfg.rerank_documents
    say(f"tune (reranker): {source.label} on {source.base_name}; 1 query × {n} documents per request; "
        f"request p99 ≤ {slo:g} ms" + (f", memory ≤ {cfg.memory_gb:g} GiB" if cfg.memory_gb else "")
        + f"; budget {cfg.budget_s:.0f}s")

    def run_one(profile: ServingProfile, phase: str, first: bool = False) -> ProfileResult | None:
        key = (profile.max_batch_items, profile.max_batch_tokens, profile.max_wait_ms, profile.batches_in_flight,
               "fp32")
        done = next((r for r in results if r.key() == key), None)
        if done is not None:
            return done
        if not first and (len(results) >= cfg.max_profiles or time.monotonic() - t0 > cfg.budget_s):
            return None
        restart = 0.0 if first else sweeper.apply(profile)
        r = sweeper.measure(profile, phase, restart)
        results.append(r)
        p99 = f"{r.p99_ms:.0f}" if r.p99_ms is not None else "-"
        say(f"  [{len(results):>2}] items {profile.max_batch_items:>3} tokens {profile.max_batch_tokens:>5} wait "
            f"{profile.max_wait_ms:>4g} ms: {r.pairs_per_s or 0:7.1f} pairs/s ({r.throughput_rps:.2f} req/s), "
            f"request p99 {p99} ms @ {sweeper.open_rates[-1]:g} req/s, RSS {r.peak_rss_mb:.0f} MB"
            + (f", {r.errors} errors" if r.errors else "") + f"  ({time.monotonic() - t0:.0f}s)")
        return r

    def centre() -> ServingProfile:
        return max(results, key=lambda r: score(r, slo, memory_mb)).profile

    ok = False
    restore = _terminate_as_interrupt()
    try:
        say("  starting a private cluster (nats-server, gateway, one cross-encoder worker)…")
        sweeper.start(default)
        run_one(default, "baseline", first=True)
        # The token budget first: it decides pairs per forward pass, the knob that matters most for pairs/s.
        history: list[float] = []
        for tokens in cfg.rerank_tokens_grid:
            r = run_one(centre().model_copy(update={"max_batch_tokens": tokens}), "tokens")
            if r is None:
                break
            history.append(r.throughput_rps)
            if plateaued(history, cfg.plateau_gain, cfg.plateau_patience):
                break
        for items in cfg.rerank_items_grid:
            run_one(centre().model_copy(update={"max_batch_items": items}), "items")
        for wait in cfg.wait_grid:
            run_one(centre().model_copy(update={"max_wait_ms": wait}), "wait")
        ok = True
    finally:
        restore()
        sweeper.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    for r in pareto_front(results):
        r.on_front = True
    rec = recommend(results, slo, memory_mb)
    if rec is None:
        raise TuneError(f"no profile could be measured without errors; see the worker log under {work / 'cluster'}")
    rec.result.recommended = True
    quality = [PrecisionQuality("fp32", True, "the reference (the cross-encoder runtime serves fp32 only)")]
    result = TuneResult(out_dir, rec.result.profile, rec, results, [r for r in results if r.on_front],
                        sweeper.baseline_rps, time.monotonic() - t0, quality=quality)
    result.files = write_outputs(result, cfg.model_copy(update={"slo_p99_ms": slo}), source)
    with contextlib.suppress(Exception):
        say(f"recommended: {rec.result.profile.model_dump()} — {rec.reason}: {rec.result.pairs_per_s:.1f} pairs/s "
            f"({rec.result.throughput_rps:.2f} req/s of {n} documents), request p99 {rec.result.p99_ms:.0f} ms; "
            f"outputs in {out_dir} ({result.wall_s:.0f}s)")
    return result
