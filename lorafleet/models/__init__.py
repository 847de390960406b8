"""Where model weights come from and how they compute: causal-LM sources, precision, the torch device, and
whether a checkpoint ships its own score head.

Imports `lorafleet.core` only; torch and transformers load inside the functions that use them.
"""
