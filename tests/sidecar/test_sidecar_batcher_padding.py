"""Forward passes cut where lengths jump (issue 27): a pulled window of arrivals padded to its longest row wastes
what the length-sorted ceiling never computes. The cut is pure logic; the runtime's cut passes must give the same
vectors, in the caller's order, as one pass."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from lorafleet.core.config import BaseModelSpec
from lorafleet.sidecar.batcher import padded_cost, padding_cuts


def passes_cost(lengths: list[int], cuts: list[int], overhead: float) -> float:
    start, total = 0, 0.0
    for end in cuts:
        total += padded_cost(lengths[start:end]) + overhead
        start = end
    return total


def test_short_and_long_rows_go_in_separate_passes() -> None:
    lengths = [10] * 8 + [40] * 8
    # One pass: 16 × 40 = 640; two: 8 × 10 + 8 × 40 = 400, plus one more pass's overhead.
    assert padding_cuts(lengths, overhead_tokens=24) == [8, 16]
    assert padding_cuts(lengths, overhead_tokens=500) == [16]  # a pass costs more than the padding it saves


def test_equal_lengths_stay_in_one_pass() -> None:
    assert padding_cuts([12] * 32, overhead_tokens=1) == [32]
    assert padding_cuts([], overhead_tokens=24) == []
    assert padding_cuts([7], overhead_tokens=24) == [1]


def test_cuts_are_optimal_against_every_split() -> None:
    rng = random.Random(7)
    for _ in range(30):
        lengths = sorted(rng.randint(8, 48) for _ in range(rng.randint(2, 9)))
        overhead = rng.choice([0.5, 8.0, 24.0, 100.0])
        cuts = padding_cuts(lengths, overhead)
        assert cuts[-1] == len(lengths) and cuts == sorted(set(cuts))
        n = len(lengths)
        best = min(passes_cost(lengths, [e for k, e in enumerate(range(1, n)) if mask >> k & 1] + [n], overhead)
                   for mask in range(1 << (n - 1)))
        assert passes_cost(lengths, cuts, overhead) == pytest.approx(best)


def test_arrival_window_of_sentences_costs_less_cut_than_whole() -> None:
    # 16 arrivals of 10–45 tokens (German sentences of 5–20 words): the cut passes compute far fewer padded tokens.
    rng = random.Random(0)
    lengths = sorted(rng.randint(10, 45) for _ in range(16))
    cuts = padding_cuts(lengths, overhead_tokens=24)
    assert len(cuts) > 1
    assert passes_cost(lengths, cuts, 24) < 0.9 * (padded_cost(lengths) + 24)  # 596 against 696 here


def test_runtime_cut_passes_match_one_pass_in_caller_order(tiny_model_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from lorafleet.sidecar.st_runtime import SentenceTransformerRuntime

    rng = random.Random(3)
    words = ["der", "die", "das", "Käufer", "Verkäufer", "Kaufpreis", "Sache", "Vertrag", "Frist", "Kündigung",
             "Miete", "Schaden"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 3, 25, 30, 40]))) for _ in range(24)]
    rt = SentenceTransformerRuntime(BaseModelSpec(name="tiny", source=str(tiny_model_dir), precision="fp32"),
                                    device="cpu")
    lengths = rt._token_lengths(texts)
    assert len(padding_cuts(sorted(lengths), rt._pass_overhead())) > 1  # the inputs do get cut
    got = rt.encode(texts, None)
    want = SentenceTransformer(str(tiny_model_dir), device="cpu").encode(texts, batch_size=len(texts))
    assert got.shape == want.shape and got.dtype == np.float32
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert float(cos.min()) > 0.99999
    assert rt._pass_time.coefficients() is not None  # each pass was timed: the fit of the fixed cost has data


class _Meta:
    def __init__(self, pending: int, seq: int) -> None:
        self.num_pending = pending
        self.num_delivered = 1
        self.sequence = type("Seq", (), {"stream": seq})()


class _Msg:
    def __init__(self, task: object, pending: int, seq: int) -> None:
        self.data = task.to_wire()  # type: ignore[attr-defined]
        self.metadata = _Meta(pending, seq)


class _BacklogSub:
    """A consumer with a backlog of `n` tasks in queue order; fetch answers at once with what it is asked for."""

    def __init__(self, tokens: list[int]) -> None:
        import time

        from lorafleet.core.wire import Task

        now = time.time()
        n = len(tokens)
        self.msgs = [_Msg(Task(id=f"t{i}", request_id="r", index=i, model="m", base="m", text="x", tokens=t,
                               deadline=now + 60, reply="_INBOX.g.r", adapter=None, enqueued=now), n - 1 - i, i + 1)
                     for i, t in enumerate(tokens)]
        self.fetched: list[int] = []

    async def fetch(self, n: int, timeout: float) -> list[_Msg]:
        got, self.msgs = self.msgs[:n], self.msgs[n:]
        self.fetched.append(len(got))
        return got


async def test_a_backlog_wider_than_one_batch_is_sorted_before_batches_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 arrivals alternating short and long, batches of 16: one pull takes both batches' worth and the first
    batch holds the 16 shortest (before: the first 16 arrivals, half of them long, padded to the longest)."""
    import asyncio

    from lorafleet.core.config import FleetConfig, ServingProfile, WorkerConfig
    from lorafleet.sidecar import scheduler
    from lorafleet.sidecar.batcher import Batch
    from lorafleet.sidecar.scheduler import PullScheduler

    monkeypatch.setattr(scheduler, "SORT_WINDOW_BATCHES", 2)  # LORAFLEET_SORT_WINDOW=2 (off by default)
    from lorafleet.sidecar.settle import HeldTable

    tokens = [10 if i % 2 == 0 else 40 for i in range(32)]
    sub = _BacklogSub(tokens)
    prof = ServingProfile(max_batch_items=16, max_wait_ms=0)
    fleet = FleetConfig(bases=[{"name": "m"}], worker=WorkerConfig(profile=prof))  # type: ignore[list-item]
    handed: list[Batch] = []

    class NoSettler:
        async def settle_many(self, settlements: list[object]) -> None:
            raise AssertionError(f"nothing should be refused: {settlements}")

    sched = PullScheduler(fleet, {"m": sub}, HeldTable(), NoSettler(), handed.append,  # type: ignore[arg-type]
                          lambda base, adapter: prof, asyncio.Semaphore(4), lambda: bool(handed))
    await asyncio.wait_for(sched.run(), 10)
    assert [len(b) for b in handed] == [16, 16]
    assert [p.task.tokens for p in handed[0].items] == [10] * 16
    assert sum(b.cost for b in handed) == 16 * 10 + 16 * 40  # against 2 × 16 × 40 in queue order


async def test_tasks_fetched_before_a_failing_fetch_are_batched_not_dropped() -> None:
    """A pull whose later fetch fails (a reconnect) keeps what its earlier fetches brought: they are held and
    batched now (before, only the first message was, and the rest waited out ack_wait for a redelivery)."""
    import asyncio

    from lorafleet.core.config import FleetConfig, ServingProfile, WorkerConfig
    from lorafleet.sidecar.batcher import Batch
    from lorafleet.sidecar.scheduler import PullScheduler
    from lorafleet.sidecar.settle import HeldTable

    class FailsThirdFetch(_BacklogSub):
        async def fetch(self, n: int, timeout: float) -> list[_Msg]:
            if len(self.fetched) == 2:
                self.fetched.append(0)
                raise ConnectionError("nats: connection closed")
            # Each fetch brings at most 5, so the pull needs several and the third one fails.
            return await super().fetch(min(n, 5), timeout)

    sub = FailsThirdFetch([20] * 16)
    prof = ServingProfile(max_batch_items=16, max_wait_ms=0)
    fleet = FleetConfig(bases=[{"name": "m"}], worker=WorkerConfig(profile=prof))  # type: ignore[list-item]
    handed: list[Batch] = []
    errors: list[BaseException] = []

    class NoSettler:
        async def settle_many(self, settlements: list[object]) -> None:
            raise AssertionError(f"nothing should be refused: {settlements}")

    sched = PullScheduler(fleet, {"m": sub}, HeldTable(), NoSettler(), handed.append,  # type: ignore[arg-type]
                          lambda base, adapter: prof, asyncio.Semaphore(4), lambda: bool(handed),
                          on_pull_error=lambda base, exc: errors.append(exc))
    await asyncio.wait_for(sched.run(), 10)
    assert len(errors) == 1
    assert [len(b) for b in handed] == [6]  # the waiter's 1 and the second fetch's 5
