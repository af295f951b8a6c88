"""A practitioner's path on the model side: a standard `Seq2SeqTrainer` run keeps the length rule (no silent cap at
transformers' default 20 tokens), single-direction MIMO and Tied models translate without a target language,
`model(**batch).loss` is the plain cross-entropy, and MG-SA without parses gets the flag to pass."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import read_sentences
from transformers import (
    AutoModelForSeq2SeqLM,
    DataCollatorForSeq2Seq,
    GenerationConfig,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

import hf_variants
from hf_variants import (
    MgsaConfig,
    MimoConfig,
    MimoForConditionalGeneration,
    TiedTransformerConfig,
    TiedTransformerForConditionalGeneration,
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
)

EN = read_sentences("en", n=8)
FR = read_sentences("fr", n=8)
# a source whose length rule (2 x source tokens + 10) is well beyond transformers' default 20, short enough to
# decode quickly
LONG = min(EN, key=len)


def tied(tokenizer, **overrides) -> TiedTransformerForConditionalGeneration:
    torch.manual_seed(0)
    config = TiedTransformerConfig.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        **{"languages": ["en", "fr"], "target_languages": ["fr"], **overrides},
    )
    model = TiedTransformerForConditionalGeneration(config).eval()
    with torch.no_grad():  # directions that differ (the table may start at zero)
        model.model.encoder.target_space_embedding.weight.normal_()
    return model


def mimo(tokenizer, **overrides) -> MimoForConditionalGeneration:
    torch.manual_seed(0)
    config = MimoConfig.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        mixing_init_std=1.0,  # task mixtures that differ from the start
        **{"languages": ["en", "fr"], "target_languages": ["fr"], "target_language_tags": False, **overrides},
    )
    return MimoForConditionalGeneration(config).eval()


def endless(model) -> dict:
    """Generation arguments under which the model never ends a sentence: the output is as long as the limit."""
    return {"num_beams": 1, "suppress_tokens": [model.config.eos_token_id, model.config.pad_token_id]}


# ------------------------------------------------------------------------------------------- Seq2SeqTrainer run
def generated_length(prediction) -> dict:
    """run_translation's `gen_len` metric: the mean number of non-padding tokens a prediction has."""
    predictions = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"gen_len": float((predictions > 0).sum(-1).mean())}


def test_seq2seq_trainer_run_keeps_the_length_rule(tokenizer, tmp_path):
    """A run_translation-style fine-tune (no `generation_max_length`, `predict_with_generate`) of a single-direction
    Tied model, on batches without language ids: its evaluation writes transformers' defaults (max_length 20) into
    the generation config it saves; the reloaded model, its pipeline and a copy of the folder still decode a long
    source to the length rule's limit, not to 20 tokens."""
    model = tied(tokenizer).train()
    features = [
        {
            "input_ids": tokenizer(en)["input_ids"],
            "labels": tokenizer(text_target=fr)["input_ids"],
        }
        for en, fr in zip(EN, FR)
    ]
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=1,
        learning_rate=1e-3,
        predict_with_generate=True,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=features,
        eval_dataset=features[:2],
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=generated_length,  # as run_translation's BLEU: evaluation then generates
    )
    trainer.train()  # the collator's batches carry no tgt_lang_ids: the model's one target is used
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and metrics["eval_gen_len"] > 0
    saved = tmp_path / "model"
    trainer.save_model(str(saved))
    written = json.loads((saved / "generation_config.json").read_text())
    assert written["max_length"] == 20  # what transformers writes: the defaults, no choice of ours
    assert written["length_rule"] == {"max_len_a": 2.0, "max_len_b": 10, "max_new_tokens": 256}

    loaded = AutoModelForSeq2SeqLM.from_pretrained(saved).eval()
    assert loaded.generation_config.length_rule == written["length_rule"]
    inputs = tokenizer([LONG], return_tensors="pt")
    source = inputs["input_ids"].shape[1]
    expected = min(2 * source + 10, 256)
    assert expected >= 30
    out = loaded.generate(**inputs, **endless(loaded))
    assert out.shape[1] == 1 + expected  # the start token and the rule's new tokens
    assert loaded.generation_config.max_length == 20  # the saved config is left as it was
    # a length in the call still wins, 20 included
    assert loaded.generate(**inputs, max_length=20, **endless(loaded)).shape[1] == 20
    assert loaded.generate(**inputs, max_new_tokens=7, **endless(loaded)).shape[1] == 8
    # the pipeline decodes like generate (no tgt_lang: the model's one target)
    translator = hf_variants.TranslationPipeline(model=loaded, tokenizer=tokenizer, task="translation")
    text = translator(LONG, **endless(loaded))[0]["translation_text"]
    assert text == tokenizer.decode(out[0], skip_special_tokens=True)
    # a generation config saved without the rule (older versions) but with the Trainer's defaults: the same
    del written["length_rule"]
    (saved / "generation_config.json").write_text(json.dumps(written))
    old = AutoModelForSeq2SeqLM.from_pretrained(saved).eval()
    assert getattr(old.generation_config, "length_rule", None) is None
    assert old.generate(**inputs, **endless(old)).shape[1] == 1 + expected


def test_a_chosen_max_length_is_kept(tokenizer):
    """A max_length the user set (not transformers' default 20, or 20 with max_new_tokens) limits the output."""
    model = tied(tokenizer)
    inputs = tokenizer([LONG], return_tensors="pt")
    model.generation_config.max_length = 30
    assert model.generate(**inputs, **endless(model)).shape[1] == 30
    model.generation_config.max_length = 20
    model.generation_config.max_new_tokens = 12
    assert model.generate(**inputs, **endless(model)).shape[1] == 13
    # a malformed rule is named
    model.generation_config.length_rule = {"max_len_a": 2.0}
    with pytest.raises(ValueError, match="generation_config.length_rule"):
        model.length_rule()


# ---------------------------------------------------------------------------------- single-direction models
def test_single_direction_tied_pipeline_needs_no_tgt_lang(tokenizer, tmp_path):
    model = tied(tokenizer)
    model.save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert model.config.target_languages == ["fr"] and model.config.default_target_language() == "fr"
    translator = hf_variants.TranslationPipeline(model=model, tokenizer=tokenizer, task="translation")
    gen = {"num_beams": 2, "max_new_tokens": 6, "min_new_tokens": 6}
    implicit = translator(EN[:3], **gen)
    explicit = translator(EN[:3], tgt_lang="fr", **gen)
    assert implicit == explicit
    # generate from the tokenizer's output, as the README's snippet does
    inputs = tokenizer(EN[:3], return_tensors="pt", padding=True)
    assert torch.equal(model.generate(**inputs, **gen), model.generate(**inputs, tgt_lang="fr", **gen))
    # the other direction was not trained: refused, naming the model's direction
    with pytest.raises(ValueError, match=r"tgt_lang='en' is not a target language.*into \['fr'\]"):
        model.generate(**inputs, tgt_lang="en", **gen)


def test_models_with_several_targets_still_ask(tokenizer):
    """A two-direction Tied model (both languages targets) or one without recorded targets names `tgt_lang`."""
    both = tied(tokenizer, target_languages=["en", "fr"])
    assert both.config.default_target_language() is None
    translator = hf_variants.TranslationPipeline(model=both, tokenizer=tokenizer, task="translation")
    with pytest.raises(ValueError, match="needs `tgt_lang`.*translates into \\['en', 'fr'\\]"):
        translator(EN[0], max_new_tokens=3)
    unknown = tied(tokenizer, target_languages=None)
    inputs = tokenizer(EN[:2], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="tgt_lang.*config.target_languages = \\['fr'\\]"):
        unknown(**inputs, decoder_input_ids=inputs["input_ids"][:, :2])
    with pytest.raises(ValueError, match="target_languages"):
        TiedTransformerConfig(languages=["en", "fr"], target_languages=["de"])


def test_single_direction_mimo_generates_without_tgt_lang(tokenizer):
    model = mimo(tokenizer)
    inputs = tokenizer(EN[:3], return_tensors="pt", padding=True)
    gen = {"num_beams": 2, "max_new_tokens": 6, "min_new_tokens": 6}
    assert torch.equal(model.generate(**inputs, **gen), model.generate(**inputs, tgt_lang="fr", **gen))
    prepared = model.prepare_translation_inputs(tokenizer, EN[:3])
    assert prepared["tgt_lang_ids"].tolist() == [1, 1, 1]


def test_translate_cli_target_from_the_recorded_targets():
    """translate.py without --tgt_lang: the one recorded target; a two-direction model asks for it."""

    from hf_variants.commands.translate import target_language
    from hf_variants.inference.translator import check_request_languages

    one = TiedTransformerConfig(languages=["en", "fr"], target_languages=["en"])
    assert target_language(None, one) == "en"
    both = TiedTransformerConfig(languages=["en", "fr"], target_languages=["en", "fr"])
    assert target_language(None, both) is None
    with pytest.raises(ValueError, match=r"tgt_lang: this model translates into several languages \(en, fr\)"):
        check_request_languages(both)
    assert target_language("fr", both) == "fr"


@pytest.mark.parametrize("build", [tied, mimo])
def test_trainer_style_forward_without_language_ids(tokenizer, build):
    """`model(**batch)` with plain input_ids / labels (a Seq2SeqTrainer batch) uses the model's one target."""
    model = build(tokenizer)
    batch = tokenizer(EN[:3], text_target=FR[:3], return_tensors="pt", padding=True)
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    with torch.no_grad():
        plain = model(**batch)
        to_fr = model(**batch, tgt_lang_ids=torch.full((3,), 1))
        to_en = model(**batch, tgt_lang_ids=torch.zeros(3, dtype=torch.long))
    assert torch.equal(plain.logits, to_fr.logits) and torch.equal(plain.loss, to_fr.loss)
    assert not torch.allclose(plain.logits, to_en.logits)


# ------------------------------------------------------------------------------------------------------- loss
def test_loss_is_plain_cross_entropy_unless_asked(tokenizer, tmp_path):
    """A config with `label_smoothing: 0.1` (as training runs save them) loads, keeps the value as a record, and
    its `.loss` is the cross-entropy; `smoothing=` in the call gives the smoothed loss, on both loss paths."""
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, label_smoothing=0.1
    )
    torch.manual_seed(0)
    TransformerNmtForConditionalGeneration(config).save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert model.config.label_smoothing == 0.1
    batch = tokenizer(EN[:3], text_target=FR[:3], return_tensors="pt", padding=True)
    labels = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    with torch.no_grad():
        out = model(**batch)
        flat = out.logits.reshape(-1, out.logits.shape[-1])
        plain = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)
        smoothed = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, label_smoothing=0.1)
        assert torch.allclose(out.loss, plain, atol=1e-5)
        assert not torch.allclose(plain, smoothed, atol=1e-3)
        assert torch.allclose(model(**batch, smoothing=0.1).loss, smoothed, atol=1e-5)
        assert torch.allclose(model(**batch, smoothing=0.1, skip_logits=True).loss, smoothed, atol=1e-5)
        assert torch.allclose(model(**batch, skip_logits=True).loss, plain, atol=1e-5)
    with pytest.raises(ValueError, match="`smoothing`"):
        model(**batch, smoothing=1.5)


# ------------------------------------------------------------------------------------------------------ MG-SA
def test_mgsa_without_parses_names_the_flag():
    hint = MgsaConfig.from_preset("tiny").required_source_annotations["parses"]
    assert "--config_overrides phrase_type=ngram" in hint
    assert MgsaConfig.from_preset("tiny", phrase_type="ngram").required_source_annotations == {}


def test_warm_start_mgsa_takes_the_form_without_parses(tokenizer, caplog):
    from hf_variants.convert.warm_start import warm_start

    torch.manual_seed(0)
    base = TransformerNmtForConditionalGeneration(
        TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    )
    model, report = warm_start(base, "mgsa_nmt", return_report=True)
    assert model.config.phrase_type == "ngram" and model.config.required_source_annotations == {}
    assert "phrase_type='ngram'" in report.summary() and "phrase_type=syntactic" in report.summary()
    chosen = warm_start(base, "mgsa_nmt", {"phrase_type": "syntactic"})
    assert chosen.config.phrase_type == "syntactic"


def test_generation_config_of_a_new_model_owns_the_rule():
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=40))
    assert model.generation_config.length_rule == {"max_len_a": 2.0, "max_len_b": 10, "max_new_tokens": 256}
    assert model.length_rule() == (2.0, 10, 256)
    assert (
        GenerationConfig.from_dict(model.generation_config.to_dict()).length_rule
        == model.generation_config.length_rule
    )
