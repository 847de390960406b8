"""lorafleet.tune.kinds: one room per tune kind, named as train's kinds (retrieval, rerank, generation).

Each room holds only its kind's parts of the sweep (kind.py's KindSweep: probe, guard, grid, finish) and is
registered as an entry point of `lorafleet.tune_kinds`; the one driver (tune/sweep.py) finds it there. A room may
import tune's shared modules (kind, analysis, batching, config, loadgen, streamload, probe, precision,
generation_guard, report, source) and the ground floor, never another kind's room.
"""
