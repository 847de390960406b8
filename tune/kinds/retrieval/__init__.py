"""lorafleet.tune.kinds.retrieval: the embedding adapter's batching sweep, precision an axis judged by nDCG@10.

May import tune's shared modules and the ground floor; never another kind's room.
"""
