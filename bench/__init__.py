"""lorafleet.bench: benchmarks that run their contenders side by side in one run and print ratios.

    python -m lorafleet.bench.serve      the cluster against raw encode and peer servers
    python -m lorafleet.bench.routing    pull against push routers on the same trace
    python -m lorafleet.bench.adapters   many adapters on one base: mixed batches, one adapter per batch, none
    python -m lorafleet.bench.train      LoRA against full fine-tuning
    python -m lorafleet.bench.research   research with and without pruning
    python -m lorafleet.bench.report     docs/benchmarks.md tables from bench/results/*.json

Each writes JSON under bench/results/ and takes --quick (the CI smoke tests). The benchmarks sit
at the top layer beside the CLI: they may use every stage.
"""
