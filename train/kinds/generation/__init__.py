"""The generation kind: LoRA SFT of a small causal LM (trl), judged by ROUGE-L against the best baseline.

Holds its config (`config`), the statute-headings data and your own `messages` tables (`headings`, `byo`),
causal-LM loading (`causal_lm`), generation and text metrics (`evaluate`), the baselines (`baselines`), its
parts of training (`trainer`), the standalone run's pieces (`run`) and `GenerationKind` (`kind`). May import
lorafleet's ground floor and lorafleet.train's shared modules; no other kind.
"""
