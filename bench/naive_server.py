"""The naive contender: a tiny uvicorn app that encodes each request alone, on arrival.

No batching, no queue: the handler calls `model.encode` right in the event loop, so requests are
served one after another in the main thread (where torch gets the cores; MEASURED.md). Same
MessagePack body as lorafleet's `/v1/encode/{model}` route, so the load generator sends the same bytes.

    python -m lorafleet.bench.naive_server --model DIR --port P
"""

from __future__ import annotations

import argparse
import os
import sys

import msgpack
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def create_app(model_dir: str) -> Starlette:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    model.encode(["warm up"], show_progress_bar=False)

    async def encode(request: Request) -> Response:
        try:
            inputs = msgpack.unpackb(await request.body())["inputs"]
        except Exception as exc:
            return JSONResponse({"error": {"code": "bad_request", "message": f"body: {exc}"}}, status_code=400)
        # Blocking on purpose: one request at a time, each encoded alone as it arrives.
        vecs = np.ascontiguousarray(model.encode(inputs, show_progress_bar=False), dtype="<f4")
        body = msgpack.packb({"model": "naive", "dim": int(vecs.shape[1]), "vectors": [v.tobytes() for v in vecs],
                              "prompt_tokens": 0})
        return Response(body, media_type="application/msgpack")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/encode", encode, methods=["POST"]), Route("/healthz", healthz)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.naive_server",
                                description="Naive embedding server for bench/serve.py: encodes each request on "
                                            "arrival.")
    p.add_argument("--model", required=True, help="sentence-transformers model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import uvicorn

    uvicorn.run(create_app(args.model), host=args.host, port=args.port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
