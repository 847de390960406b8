"""lorafleet.tune.kinds.rerank: a cross-encoder LoRA's score profile under /v1/rerank load, pairs/s.

May import tune's shared modules and the ground floor; never another kind's room.
"""
