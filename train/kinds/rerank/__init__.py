"""The rerank kind: a LoRA (with its classification head) on a cross-encoder, judged as a first stage + reranker.

Holds its config (`config`), first stages and pipeline scoring (`evaluate`, `fusion`), its parts of training
(`trainer`) and `RerankKind` (`kind`). Its data and ranking metrics are the retrieval kind's, so it may import
lorafleet.train.kinds.retrieval (the one kind it builds on), lorafleet's ground floor and lorafleet.train's
shared modules.
"""
