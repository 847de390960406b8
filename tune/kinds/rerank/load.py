"""The rerank load: `/v1/rerank` requests of one query and the first stage's top k passages of the statutes."""

from __future__ import annotations

import json
import random
import re

from lorafleet.tune.config import TuneError
from lorafleet.tune.loadgen import Target
from lorafleet.tune.probe import SERVED_NAME

BODIES = 16  # distinct requests the load cycles through


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
