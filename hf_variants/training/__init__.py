"""Training, translation and evaluation for hf_variants models (not shipped with saved models).

- `train`: the training command (`accelerate launch training/train.py` from a clone, `hf-variants-train` or
  `accelerate launch -m hf_variants.training.train` when installed), its options in `options`;
- `translate`: batch translation with BLEU/chrF (`hf-variants-translate`);
- the stages they share: data (`corpus`, `data_pipeline` and its parts), `trainer`, `checkpointing`, `run_lock`,
  `settings`, `evaluation`, `external` (transformers' own models trained through the same loop, for comparisons).
"""
