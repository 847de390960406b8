"""The ground floor's lowest room: the contracts every stage meets through.

Wire types (subjects, MessagePack bodies), the task-kind contract, the desired fleet state, config models,
settings, model and registry references, deadlines, metric names, plugins, progress, heartbeats, shadow
agreement and the adapter-source contract. It imports nothing else of lorafleet: the other ground-floor rooms
(`lorafleet.nats`, `lorafleet.core.model_source`, `lorafleet.ops`) and every stage build on it.
"""
