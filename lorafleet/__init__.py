"""lorafleet: ship small LoRA specialists and serve a fleet of them from one pull-based queue.

This package is the core layer (contracts every stage builds on: config, wire, queue, plugins,
tasks, adapters, fleet_state, cluster, heartbeats, metrics, refs, device, models, settings,
nats_server, nats_auth), plus the pipeline (lorafleet.pipeline) and the command (lorafleet.cli) in
their own layers. The stages are lorafleet.train, .research, .tune, .registry, .serve, .sidecar;
docs/architecture.md draws the layers and the contracts.
"""

__version__ = "0.1.0"
