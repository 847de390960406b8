"""lorafleet.train.kinds: one room per task kind; each supplies only its parts to the one loop in lorafleet.train.

A kind's room holds its config, dataset builder, model/adapter construction, loss, evaluator, baselines,
report and its `TaskKind` (registered as an entry point in group `lorafleet.tasks`). What every kind does
alike (seeds, the trainer's callbacks, progress, per-epoch dev evaluation, the one look at test, MLflow,
the standalone run) lives in lorafleet.train (`loop`, `run`, `tracking`) and is reached through
`lorafleet.train.loop.KindTrainer`. A room may import lorafleet's ground floor and lorafleet.train's
shared modules, never another stage; a kind imports another kind only where its docstring says so.
A new kind is a new folder (here or in any package) plus its entry point: nothing here lists the kinds.
"""
