"""lorafleet.tune.kinds.generation: a causal LM's LoRA; the engine options of its base swept under streaming load.

May import tune's shared modules and the ground floor; never another kind's room.
"""
