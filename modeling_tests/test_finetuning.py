"""Fine-tuning with transformers' `Seq2SeqTrainer` (docs/user-guide.md section 5) on the inputs the model trains and
translates with, and the one validation measure of every model type.

- `hf_variants.finetuning.translation_features` gives a multilingual MIMO model, through `datasets.map`,
  `DataCollatorForSeq2Seq` and `Seq2SeqTrainer`, exactly the rows `prepare_translation_inputs` builds in training
  and translation: each source starts with its `<2xx>` tag and carries its `tgt_lang_ids` (the forward of every
  training step is checked), where `tokenizer(..., text_target=...)` would leave both out;
- a `Seq2SeqTrainer`'s `eval_loss` with `label_smoothing_factor` is the label-smoothed cross-entropy, not the plain
  one, and `finetuning.cross_entropy` gives both, as the guide says;
- the validation loss of training is the cross-entropy per target token for every model type: a bidirectional Tied
  run's equals the token mean over both directions (its training loss sums one mean per direction), a MUTE run's
  leaves out the auxiliary losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from conftest import read_sentences
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_variants import (
    MimoConfig,
    MimoForConditionalGeneration,
    MuteConfig,
    MuteForConditionalGeneration,
    TiedTransformerConfig,
    TiedTransformerForConditionalGeneration,
)
from hf_variants.finetuning import cross_entropy, translation_features
from hf_variants.training.corpus import Pair
from hf_variants.training.trainer import make_batch, validation_loss

N = 8
EN, DE, FR = (read_sentences(lang, n=N) for lang in ("en", "de", "fr"))


def tiny(config_class, model_class, tokenizer, **fields):
    torch.manual_seed(0)
    config = config_class.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        **fields,
    )
    return model_class(config)


def multilingual_mimo(tokenizer) -> MimoForConditionalGeneration:
    """en→de and en→fr: two target languages, so the sources carry `<2xx>` tags and the rows `tgt_lang_ids`."""
    return tiny(
        MimoConfig,
        MimoForConditionalGeneration,
        tokenizer,
        languages=["en", "de", "fr"],
        target_languages=["de", "fr"],
        target_language_tags=True,
    )


def rows() -> Dataset:
    """Half the rows en→fr, half en→de (a column names each row's target language)."""
    return Dataset.from_dict(
        {
            "en": EN,
            "target": [FR[i] if i % 2 else DE[i] for i in range(N)],
            "tgt_lang": ["fr" if i % 2 else "de" for i in range(N)],
        }
    )


def test_mimo_fine_tunes_through_seq2seq_trainer_on_its_training_inputs(tokenizer, tmp_path):
    model = multilingual_mimo(tokenizer)
    raw = rows()
    tokenized = raw.map(
        lambda batch: translation_features(
            model, tokenizer, batch["en"], batch["target"], tgt_lang=batch["tgt_lang"], max_length=64
        ),
        batched=True,
        batch_size=3,  # rows padded in their own map batches come out unpadded, whatever the batch
        remove_columns=raw.column_names,
    )
    assert tokenized.column_names == ["input_ids", "attention_mask", "labels", "tgt_lang_ids"]
    # each row is what prepare_translation_inputs gives that pair in training and translation, padding aside
    for i, row in enumerate(tokenized):
        one = model.prepare_translation_inputs(
            tokenizer, [EN[i]], tgt_lang=raw[i]["tgt_lang"], text_target=[raw[i]["target"]], max_length=64
        )
        assert row["input_ids"] == one["input_ids"][0].tolist()
        assert row["labels"] == one["labels"][0].tolist()
        assert row["tgt_lang_ids"] == int(one["tgt_lang_ids"][0]) == model.config.language_id(raw[i]["tgt_lang"])
    tag = {lang: tokenizer.convert_tokens_to_ids(f"<2{lang}>") for lang in ("de", "fr")}
    assert [row["input_ids"][0] for row in tokenized] == [tag[lang] for lang in list(raw["tgt_lang"])]
    # what tokenizer(..., text_target=...) alone gives (the guide before): no tag, no language ids
    plain = tokenizer(EN, text_target=list(raw["target"]))
    assert all(ids[0] not in tag.values() for ids in plain["input_ids"]) and "tgt_lang_ids" not in plain

    seen = []  # every training forward's inputs

    def record(module, args, kwargs):
        if module.training:
            # (the label smoother takes the labels out; the collator made decoder inputs from them)
            seen.append({k: kwargs[k].clone() for k in ("input_ids", "tgt_lang_ids", "decoder_input_ids")})

    model.register_forward_pre_hook(record, with_kwargs=True)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=N,
        max_steps=2,
        learning_rate=1e-3,
        label_smoothing_factor=0.1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        eval_dataset=tokenized,
        data_collator=collator,
        processing_class=tokenizer,
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    assert len(seen) == 2 and any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    language_tag = {model.config.language_id(lang): tag[lang] for lang in tag}
    for batch in seen:  # the tags and the language ids reached every training batch, row by row
        assert batch["input_ids"][:, 0].tolist() == [language_tag[int(i)] for i in batch["tgt_lang_ids"]]
        assert not torch.isin(batch["decoder_input_ids"], torch.tensor(list(tag.values()))).any()  # nor targets
    assert sorted({int(i) for b in seen for i in b["tgt_lang_ids"]}) == sorted(language_tag)

    # eval_loss: with label_smoothing_factor, transformers' LabelSmoother (one evaluation batch: the token mean)
    smoothed = cross_entropy(model, tokenized, collator, label_smoothing=0.1)
    plain = cross_entropy(model, tokenized, collator)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(smoothed["loss"], rel=1e-5)
    assert plain["loss"] < smoothed["loss"] and plain["perplexity"] == pytest.approx(torch.tensor(plain["loss"]).exp())
    # the plain measure by hand: every labelled token of the set, one mean
    batch = collator(list(tokenized))
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    assert plain["loss"] == pytest.approx(F.cross_entropy(logits.transpose(1, 2), batch["labels"]).item(), rel=1e-5)
    assert plain["tokens"] == int((batch["labels"] != -100).sum())


def test_a_model_input_the_collator_cannot_pad_is_refused(tokenizer):
    """The syntactic MG-SA's phrase inputs are neither per token nor per row: named, not silently dropped."""
    from hf_variants import MgsaConfig, MgsaForConditionalGeneration

    model = tiny(MgsaConfig, MgsaForConditionalGeneration, tokenizer)
    with pytest.raises(ValueError, match="translation_features: the model's input 'phrase_"):
        translation_features(
            model, tokenizer, ["A dog runs ."], ["Un chien court ."], parses=["(S (NP A dog) (VP runs .))"]
        )


def by_hand(model, batch) -> float:
    """The token-mean cross-entropy of every labelled token of `batch` (label smoothing 0.1)."""
    logits = model(**batch).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=-100, label_smoothing=0.1).item()


@torch.no_grad()
def test_validation_loss_is_the_token_mean_for_every_model_type(tokenizer):
    accelerator = Accelerator(cpu=True)
    # different lengths per direction: a sum of per-direction means differs from the token mean
    pairs = [Pair("en", "de", EN[i], DE[i] + " " + DE[(i + 1) % N], f"row {i}") for i in range(N)]
    batches = [list(range(N))]
    tied = tiny(
        TiedTransformerConfig,
        TiedTransformerForConditionalGeneration,
        tokenizer,
        languages=["en", "de"],
        target_languages=["en", "de"],
        direction_loss="sum",
    ).eval()
    batch = make_batch(tied, tokenizer, pairs, True, 128)
    assert sorted(set(batch["tgt_lang_ids"].tolist())) == [0, 1]  # both directions in the batch
    expected = by_hand(tied, batch)
    assert tied(**batch, smoothing=0.1).loss.item() > 1.5 * expected  # its training loss: a sum of two means
    measured = validation_loss(accelerator, tied, tokenizer, pairs, batches, True, 128, 0.1)
    assert measured == pytest.approx(expected, rel=1e-5)

    mute = tiny(MuteConfig, MuteForConditionalGeneration, tokenizer, merge="seq", shuffle_penalty_weight=1.0)
    one_way = make_batch(mute, tokenizer, pairs, False, 128)
    measured = validation_loss(accelerator, mute, tokenizer, pairs, batches, False, 128, 0.1)
    assert measured == pytest.approx(by_hand(mute.eval(), one_way), rel=1e-5)
