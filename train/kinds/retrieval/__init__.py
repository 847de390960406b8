"""The retrieval kind: a LoRA on a sentence-transformers model (MNRL loss, mined hard negatives), judged by nDCG@10.

Holds its config (`config`), dataset of statute sections or your own tables (`dataset`, `byo`), dense and
BM25 evaluation (`evaluate`), its parts of training (`trainer`), its report (`report`) and `RetrievalKind`
(`kind`). May import lorafleet's ground floor and lorafleet.train's shared modules; no other kind.
"""
