"""lorafleet: ship small LoRA specialists and serve a fleet of them from one pull-based queue.

This package is the ground floor, in rooms that import only downwards:
- `lorafleet.core`: the contracts every stage meets through (wire, tasks, fleet state, config, settings, refs,
  deadlines, metrics, plugins, progress, heartbeats, agreement, adapter sources, URLs);
- `lorafleet.nats` (client, auth, TLS, embedded server and cluster, stream layout) and `lorafleet.models`
  (causal-LM sources, precision, device, checkpoints), each on the core;
- `lorafleet.ops` (the local cluster, supervisor, processes, threads, layout keeper), on those;
- `lorafleet.testing`, helpers for tests and benchmarks.
Above it: the stages (lorafleet.train, .research, .tune, .registry, .serve, .sidecar), then the pipeline
(lorafleet.pipeline) and the command (lorafleet.cli). docs/architecture.md draws the layers and the contracts.
"""

__version__ = "0.1.0"
