"""lorafleet.serve: the HTTP gateway (OpenAI-compatible embeddings and chat/completions, MessagePack encode)
in front of the queue.

A gateway validates a request, resolves the served name to (base model, adapter) from the fleet
file and the live fleet state, counts tokens, publishes one MessagePack task per input to the
JetStream work queue and awaits the workers' results on its own inbox; a generative request is one
task whose text may come back streamed. Modules: routes.py (HTTP side), gateway.py (request core and
NATS lifecycle), parsing, completions (the OpenAI generative bodies and SSE), generation (prompt,
parameters, the handle of one generate task), textstream (streamed text across redeliveries),
prompts (a causal base's tokenizer and template), errors, auth, resolver, routekeys (which route key
split a canary), pending, workers (liveness from heartbeats), tokens, bases, metrics.

Public API:
    create_app(fleet, nats_url=None, gateway_id=None) -> Starlette     (app.state.gateway: the Gateway)
    run_gateway(fleet, nats_url=None, host=None, port=None, …)          (blocking: `python -m lorafleet.serve`)
    Gateway                                                             (the request core)
"""

from __future__ import annotations

from typing import Any

__all__ = ["Gateway", "create_app", "run_gateway"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "run_gateway"):
        from lorafleet.serve import routes

        return getattr(routes, name)
    if name == "Gateway":
        from lorafleet.serve.gateway import Gateway

        return Gateway
    raise AttributeError(name)
