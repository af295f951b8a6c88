"""Fine-tuning a saved model with transformers' `Seq2SeqTrainer` on the inputs the model trains and translates with.

- `translation_features(model, tokenizer, sources, targets, tgt_lang=...)`: the `datasets.Dataset.map(batched=True)`
  function of a fine-tune. It calls the model's own `prepare_translation_inputs` (what `hf-variants-train`, the
  translate command and the pipeline call), so a multilingual model gets the `<2xx>` target tag on its sources and
  its `tgt_lang_ids` exactly as in training and translation, and returns one unpadded row per pair for
  `DataCollatorForSeq2Seq` (which pads the labels with -100). `tokenizer(sources, text_target=targets)` alone
  leaves the tag and the language ids out: a multilingual model would be fine-tuned on other inputs than it
  translates.
- `cross_entropy(model, dataset, data_collator)`: the validation measure of `hf-variants-train` (the cross-entropy
  per target token over the whole dataset, every model type alike, no auxiliary loss; label-smoothed on request)
  and its perplexity. A `Seq2SeqTrainer`'s `eval_loss` is the label-smoothed loss of transformers' `LabelSmoother`
  when the arguments set `label_smoothing_factor`, and otherwise the model's own loss (auxiliary losses and a
  variant's token weights included), averaged per batch.

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from .loss_transformer_nmt import smoothed_cross_entropy

ROW_KEYS = ("input_ids", "attention_mask")  # per source token: cut to each row's own length


def translation_features(
    model,
    tokenizer,
    sources: Sequence[str],
    targets: Sequence[str] | None = None,
    *,
    src_lang: str | None = None,
    tgt_lang: str | Sequence[str] | None = None,
    max_length: int | None = None,
    **variant_inputs,
) -> dict[str, list]:
    """The model's training inputs of a batch of pairs, one unpadded row each: `input_ids` and `attention_mask`
    (the source with its `<2xx>` tag where the model uses tags), `labels` (the target; with `targets`) and
    `tgt_lang_ids` (where the model conditions on the target language: MIMO, Tied), built by
    `model.prepare_translation_inputs(tokenizer, sources, tgt_lang=..., text_target=targets, ...)`.

    `tgt_lang`: one code or one per pair (a model with one target language needs none); `max_length` truncates
    sources and targets to that many tokens. A model input that is no per-token or per-row value (the syntactic
    MG-SA's phrase inputs) raises a `ValueError`: `DataCollatorForSeq2Seq` cannot pad it."""
    inputs = model.prepare_translation_inputs(
        tokenizer,
        list(sources),
        src_lang=src_lang,
        tgt_lang=tgt_lang if isinstance(tgt_lang, (str, type(None))) else list(tgt_lang),
        text_target=None if targets is None else list(targets),
        max_length=max_length,
        **variant_inputs,
    )
    inputs = {key: value.cpu() for key, value in inputs.items()}
    keep = inputs["attention_mask"].bool()
    rows = len(keep)
    features: dict[str, list] = {}
    for key, value in inputs.items():
        if key in ROW_KEYS:
            features[key] = [row[mask].tolist() for row, mask in zip(value, keep)]
        elif key == "labels":
            features[key] = [row[row != -100].tolist() for row in value]
        elif value.dim() == 1 and len(value) == rows:
            features[key] = value.tolist()
        else:
            raise ValueError(
                f"translation_features: the model's input {key!r} (shape {tuple(value.shape)}) is neither per token "
                "nor per row: DataCollatorForSeq2Seq cannot pad it; batch such a model with "
                "model.prepare_translation_inputs in a collator of your own."
            )
    return features


@torch.no_grad()
def cross_entropy(
    model, dataset: Iterable[dict], data_collator, batch_size: int = 32, label_smoothing: float = 0.0
) -> dict[str, float]:
    """`{"loss", "perplexity", "tokens"}`: the cross-entropy of every labelled target token of `dataset` (rows as
    `translation_features` makes them), one mean over all of them, from the model's logits, so it is the same measure
    for every model type (a variant's own loss may add auxiliary losses or weight tokens differently);
    `label_smoothing` > 0 gives the label-smoothed one (`hf-variants-train`'s validation loss at that value). The
    perplexity is exp(loss) of the plain cross-entropy (None when smoothed)."""
    was_training = model.training
    model.eval()
    rows = list(dataset)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for start in range(0, len(rows), batch_size):
        batch = data_collator(rows[start : start + batch_size])
        batch = {key: value.to(model.device) for key, value in batch.items() if torch.is_tensor(value)}
        labels = batch["labels"]
        tokens = int((labels != -100).sum())
        loss = smoothed_cross_entropy(model(**batch).logits, labels, label_smoothing)
        total += loss.double().cpu() * tokens
        count += tokens
    model.train(was_training)
    loss = float(total / max(count, 1))
    return {"loss": loss, "perplexity": math.exp(loss) if label_smoothing == 0 else None, "tokens": count}


__all__ = ["translation_features", "cross_entropy"]
