"""What the registry tests against a real nats-server and MLflow share: a registered bundle of the tiny BERT,
the fleet entries as the bucket holds them, and a fleet file with a short heartbeat."""

from __future__ import annotations

from pathlib import Path

from lorafleet.core.config import BaseModelSpec, FleetConfig, WorkerConfig
from lorafleet.core.fleet_state import FleetEntry, ensure_fleet_bucket, read_entries
from lorafleet.registry import store


def register(adapter: Path, base_source: Path, score: float, *, name: str = "legal", kind: str | None = None
             ) -> str:
    """A bundle of `adapter` on the tiny base, its test score `score` against a base at 0.30; its version."""
    extra = {} if kind is None else {"kind": kind}
    return store.register_bundle(name, adapter, base_source=str(base_source), base_name="tiny",
                                 metrics={"test_ndcg@10": score, "base_test_ndcg@10": 0.30}, **extra).version


async def entries(url: str, create: bool = False) -> dict[str, FleetEntry]:
    """Every fleet entry; `create` makes the bucket first (as `lorafleet up` would)."""
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await ensure_fleet_bucket(js) if create else await js.key_value("lorafleet_fleet")
        return await read_entries(kv)
    finally:
        await nc.close()


def write_fleet_file(path: Path) -> Path:
    """A fleet file of one tiny base; a short heartbeat, as each promote listens ~1.5 heartbeats for workers."""
    path.write_text(FleetConfig(bases=[BaseModelSpec(name="tiny", source="x")],
                                worker=WorkerConfig(heartbeat_s=0.2)).model_dump_json())
    return path
