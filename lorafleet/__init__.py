"""lorafleet: ship small LoRA specialists and serve a fleet of them from one pull-based queue."""

__version__ = "0.1.0"
