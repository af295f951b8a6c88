"""M2M100 and NLLB-200 as sources: conversion into the baseline, their tokenizers and language codes everywhere a
language is named, vocabulary pruning, warm starts of every variant and fine-tuning from the result.

Tiny random `M2M100Config` models built here, with tokenizers built here from a SentencePiece model trained on a few
hundred lines of the bundled Multi30k: an NLLB tokenizer (`NllbTokenizer`, tokens `eng_Latn`, ...) and an M2M100
tokenizer (`M2M100Tokenizer`, codes `en`, tokens `__en__`). Every check compares two paths that must agree:

- conversion: the logits of the original and the converted model (fp32, right- and left-padded batches, two language
  pairs per family: max abs diff <= 1e-5), and `generate()` greedy and beam, transformers' `forced_bos_token_id`
  against the package's `tgt_lang=` (one code, one per sentence); the saved folder through the command;
- languages: the pipeline, the translator (hypotheses without the forced language token; the scoring of a
  hypothesis equals its `log_prob`) and the checks naming the argument;
- pruning: the tokens of the text split identically, the pruned model's greedy translations of that text equal the
  full model's, beam search's differing lines counted the same way by the report and here; a sentence with tokens
  outside the kept set translates (unknown pieces as `<unk>`);
- every variant warm-started from the pruned folder keeps the languages and the language tokens, starts exact where
  the warm start is exact (MUTE, MIMO), and its loss falls over a few steps; `hf-variants-train --model_name_or_path`
  fine-tunes the pruned folder on files named with the model's codes.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import read_sentences
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    M2M100Config,
    M2M100ForConditionalGeneration,
    M2M100Tokenizer,
    NllbTokenizer,
    pipeline,
)

import hf_variants  # noqa: F401  (registers the models and the translation task)
from hf_variants.commands import convert_m2m100 as convert_command
from hf_variants.commands import prune_vocabulary as prune_command
from hf_variants.convert.m2m100 import convert_m2m100, tokenizer_languages
from hf_variants.convert.prune import prune_vocabulary, translate_ids
from hf_variants.convert.warm_start import warm_start
from hf_variants.inference import Translator
from hf_variants.inference.requests import DecodeOptions, TranslationRequest
from hf_variants.inference.scoring import score_pairs

sentencepiece = pytest.importorskip("sentencepiece")

NLLB_CODES = ["eng_Latn", "fra_Latn", "deu_Latn", "ces_Latn"]
# (family, source language, target language): two pairs per family, each in the tokenizer's own codes
PAIRS = {"nllb": [("eng_Latn", "fra_Latn"), ("deu_Latn", "eng_Latn")], "m2m100": [("en", "fr"), ("de", "en")]}
CORPUS = {"en": "eng_Latn", "fr": "fra_Latn", "de": "deu_Latn"}
MAX_NEW = 8


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory):
    """A SentencePiece BPE model (300 pieces; <s>=0, <pad>=1, </s>=2, <unk>=3, fairseq's ids) trained on 150 lines a
    language, and the M2M100 vocab.json over it."""
    folder = tmp_path_factory.mktemp("spm")
    lines = [s for lang in ("en", "fr", "de") for s in read_sentences(lang, n=150)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    (folder / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    return folder


@pytest.fixture(scope="module")
def tokenizers(spm_folder):
    nllb = NllbTokenizer.from_pretrained(spm_folder, additional_special_tokens=NLLB_CODES, model_max_length=128)
    m2m = M2M100Tokenizer(spm_folder / "vocab.json", spm_folder / "sentencepiece.bpe.model", model_max_length=128)
    return {"nllb": nllb, "m2m100": m2m}


def m2m100_model(vocab_size: int, seed: int = 0, **overrides) -> M2M100ForConditionalGeneration:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        dropout=0.1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        init_std=0.1,  # outputs that vary from token to token
    )
    fields.update(overrides)
    return M2M100ForConditionalGeneration(M2M100Config(**fields)).eval()


@pytest.fixture(scope="module")
def models(tokenizers):
    """family -> (original, converted). NLLB: tied embeddings; M2M100: untied, and LayerDrop 0.05 as M2M100-418M
    (converted with ignore_layerdrop)."""
    nllb = m2m100_model(len(tokenizers["nllb"]))
    m2m = m2m100_model(408, seed=1, tie_word_embeddings=False, encoder_layerdrop=0.05, decoder_layerdrop=0.05)
    return {
        "nllb": (nllb, convert_m2m100(nllb, tokenizers["nllb"])),
        "m2m100": (m2m, convert_m2m100(m2m, tokenizers["m2m100"], ignore_layerdrop=True)),
    }


def source_batch(tokenizer, texts, src_lang, padding_side="right"):
    """What transformers' users feed the original: the tokenizer's `src_lang` set, a padded batch."""
    tokenizer.src_lang, tokenizer.padding_side = src_lang, padding_side
    try:
        return tokenizer(texts, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = "right"


def lang_token(tokenizer, code: str) -> int:
    return tokenizer.get_lang_id(code) if hasattr(tokenizer, "get_lang_id") else tokenizer.convert_tokens_to_ids(code)


SOURCES = {"en": read_sentences("en", "val", n=3), "de": read_sentences("de", "val", n=3, start=3)}


def sources_of(code: str) -> list[str]:
    return SOURCES[code[:2]]


# -------------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_config_carries_what_m2m100_does(family, models, tokenizers):
    original, converted = models[family]
    config = converted.config
    codes, ids = tokenizer_languages(tokenizers[family])
    assert (config.normalize_before, config.position_embedding_type) == (True, "fairseq_sinusoidal")
    assert config.scale_embedding and config.share_encoder_decoder_embeddings and config.target_language_token
    assert config.tie_word_embeddings == (family == "nllb")
    assert config.decoder_start_token_id == original.config.decoder_start_token_id == 2
    assert config.languages == config.source_languages == config.target_languages == codes
    assert config.language_token_ids == ids
    assert ids[codes.index(PAIRS[family][0][1])] == lang_token(tokenizers[family], PAIRS[family][0][1])
    assert len(codes) == (4 if family == "nllb" else 100)


@pytest.mark.parametrize("family", ["nllb", "m2m100"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_logits_equal(family, padding_side, models, tokenizers):
    original, converted = models[family]
    tokenizer = tokenizers[family]
    for src, tgt in PAIRS[family]:
        inputs = source_batch(tokenizer, sources_of(src), src, padding_side)
        decoder = torch.tensor(
            [[2, lang_token(tokenizer, tgt), 40, 41, 42, 1, 1], [2, lang_token(tokenizer, tgt), 7, 8, 9, 10, 11]]
        )
        decoder = decoder.repeat(2, 1)[: inputs["input_ids"].shape[0]]  # rows with and without padding
        with torch.no_grad():
            expected = original(**inputs, decoder_input_ids=decoder).logits
            got = converted(**inputs, decoder_input_ids=decoder).logits
        assert (expected - got).abs().max().item() <= 1e-5, (src, tgt)
    # inputs_embeds: M2M100 takes them scaled, the baseline scales them (an unpadded row: sequential positions)
    ids = source_batch(tokenizer, sources_of(PAIRS[family][0][0])[:1], PAIRS[family][0][0])["input_ids"]
    embeds = converted.get_input_embeddings()(ids)
    with torch.no_grad():
        a = converted(inputs_embeds=embeds, decoder_input_ids=decoder[:1]).logits
        b = original(inputs_embeds=embeds * converted.config.embed_scale, decoder_input_ids=decoder[:1]).logits
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_generate_equal_greedy_and_beam(family, models, tokenizers):
    original, converted = models[family]
    tokenizer = tokenizers[family]
    for src, tgt in PAIRS[family]:
        inputs = source_batch(tokenizer, sources_of(src), src)
        forced = lang_token(tokenizer, tgt)
        for beams in (1, 3):
            kwargs = dict(num_beams=beams, max_new_tokens=MAX_NEW, num_return_sequences=min(beams, 2))
            expected = original.generate(**inputs, forced_bos_token_id=forced, **kwargs)
            assert torch.equal(converted.generate(**inputs, forced_bos_token_id=forced, **kwargs), expected)
            assert torch.equal(converted.generate(**inputs, tgt_lang=tgt, **kwargs), expected), (src, tgt, beams)
            assert expected[:, 1].eq(forced).all()
    # one target language per sentence, through prepare_translation_inputs (the pipeline's and the trainer's way)
    (src, first), (second, _) = PAIRS[family][0], PAIRS[family][1]
    texts = sources_of(src)[:2]
    mixed = converted.prepare_translation_inputs(tokenizer, texts, src_lang=src, tgt_lang=[first, second])
    got = converted.generate(**mixed, max_new_tokens=MAX_NEW)
    for row, (text, tgt) in enumerate(zip(texts, [first, second])):
        alone = original.generate(
            **source_batch(tokenizer, [text], src),
            forced_bos_token_id=lang_token(tokenizer, tgt),
            max_new_tokens=MAX_NEW,
        )
        assert got[row, : alone.shape[1]].tolist() == alone[0].tolist()


@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_training_batches_start_labels_with_the_target_language(family, models, tokenizers):
    """prepare_translation_inputs with `text_target` (the trainer's batches): each source starts with its source
    language's token, each label row with its target language's (M2M100's tokenizer, saved with no `tgt_lang`,
    left untouched), and the loss is transformers' M2M100 loss on the same labels."""
    original, converted = models[family]
    tokenizer = tokenizers[family]
    (src, first), (second, _) = PAIRS[family][0], PAIRS[family][1]
    texts, targets = sources_of(src)[:2], read_sentences("fr", "val", n=2)
    before = getattr(tokenizer, "tgt_lang", None)
    batch = converted.prepare_translation_inputs(
        tokenizer, texts, src_lang=[src, second], tgt_lang=[first, src], text_target=targets
    )
    assert getattr(tokenizer, "tgt_lang", None) == before
    assert batch["input_ids"][:, 0].tolist() == [lang_token(tokenizer, src), lang_token(tokenizer, second)]
    assert batch["labels"][:, 0].tolist() == [lang_token(tokenizer, first), lang_token(tokenizer, src)]
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        assert converted(**batch).loss.item() == pytest.approx(original(**inputs).loss.item(), abs=1e-5)


def test_ctranslate2_export_refuses_the_forced_language_token(models):
    from hf_variants.deploy.ctranslate2 import check_exportable

    with pytest.raises(ValueError, match="target_language_token=True"):
        check_exportable(models["nllb"][1].config)


def test_generate_needs_a_target_language(models, tokenizers):
    _, converted = models["nllb"]
    inputs = source_batch(tokenizers["nllb"], sources_of("en"), "eng_Latn")
    with pytest.raises(ValueError, match="pass `tgt_lang`"):
        converted.generate(**inputs, max_new_tokens=2)
    with pytest.raises(ValueError, match="tgt_lang='xx_Latn' is an unknown language"):
        converted.generate(**inputs, tgt_lang="xx_Latn", max_new_tokens=2)
    with pytest.raises(ValueError, match="forces it already"):
        converted.generate(**inputs, tgt_lang="fra_Latn", forced_bos_token_id=5, max_new_tokens=2)


def test_command_writes_the_folder_and_refuses_what_it_cannot_carry(models, tokenizers, tmp_path, capsys):
    original, converted = models["m2m100"]
    source = tmp_path / "m2m100_418M"
    original.save_pretrained(source)
    tokenizers["m2m100"].save_pretrained(source)
    with pytest.raises(SystemExit) as stop:
        convert_command.main(["--m2m100", str(source), "--output_dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "encoder_layerdrop=0.05: LayerDrop" in capsys.readouterr().err and not (tmp_path / "out").exists()
    convert_command.main(["--m2m100", str(source), "--output_dir", str(tmp_path / "out"), "--ignore_layerdrop"])
    assert "note: encoder_layerdrop=0.05 left out" in capsys.readouterr().out
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert type(tokenizer).__name__ == "M2M100Tokenizer" and loaded.config.languages == converted.config.languages
    for name, tensor in converted.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    moe = tmp_path / "moe"
    from transformers import NllbMoeConfig

    NllbMoeConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, num_experts=4).save_pretrained(moe)
    with pytest.raises(SystemExit):
        convert_command.main(["--nllb", str(moe), "--output_dir", str(tmp_path / "out2")])
    assert "model_type='nllb-moe' (NLLB-MoE, num_experts=4): its mixture-of-experts" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- languages
@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_pipeline_and_translator_take_the_model_codes(family, models, tokenizers, tmp_path):
    original, converted = models[family]
    tokenizer = tokenizers[family]
    converted.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (src, tgt), texts = PAIRS[family][0], sources_of(PAIRS[family][0][0])
    expected = original.generate(
        **source_batch(tokenizer, texts, src), forced_bos_token_id=lang_token(tokenizer, tgt), max_new_tokens=MAX_NEW
    )
    decoded = tokenizer.batch_decode(expected, skip_special_tokens=True)
    translator = pipeline("translation", model=str(tmp_path))
    got = translator(texts, src_lang=src, tgt_lang=tgt, max_new_tokens=MAX_NEW, num_beams=1)
    assert [r["translation_text"] for r in got] == decoded
    with pytest.raises(ValueError, match="pass `src_lang`"):
        translator(texts, tgt_lang=tgt)
    core = Translator.from_pretrained(str(tmp_path))
    assert core.languages == {"source": converted.config.languages, "target": converted.config.languages}
    requests = [TranslationRequest(text, src_lang=src, tgt_lang=tgt) for text in texts]
    results = core.translate(requests, DecodeOptions(num_beams=1, max_new_tokens=MAX_NEW, scores=True))
    for result, row in zip(results, expected.tolist()):
        (hypothesis,) = result.hypotheses
        assert [2, lang_token(tokenizer, tgt)] + hypothesis.token_ids == row[: 2 + len(hypothesis.token_ids)]
    # a hypothesis scored later gets its decoding log_prob (the language token is the prompt, not scored)
    rescored = core.engine.token_log_probs(requests, [r.hypotheses[0].token_ids for r in results])
    assert [sum(v) for v in rescored] == pytest.approx([r.hypotheses[0].log_prob for r in results], abs=1e-4)
    targets = read_sentences("fr" if tgt[:2] == "fr" else "en", "val", n=len(texts))
    scored = score_pairs(core, texts, targets, src_lang=src, tgt_lang=tgt)
    lengths = [len(ids) + 1 for ids in tokenizer(targets, add_special_tokens=False)["input_ids"]]  # + </s>
    assert [s.tokens for s in scored] == lengths and all(s.log_prob < 0 for s in scored)
    with pytest.raises(ValueError, match="src_lang: this model marks the source language with a token"):
        core.translate([TranslationRequest(texts[0], tgt_lang=tgt)])
    with pytest.raises(ValueError, match="src_lang: this model marks the source language with a token"):
        score_pairs(core, texts, targets, tgt_lang=tgt)
    with pytest.raises(ValueError, match="is an unknown language"):
        core.translate([TranslationRequest(texts[0], src_lang="xx", tgt_lang=tgt)])


# ----------------------------------------------------------------------------------------------------- pruning
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Files named as the training data (PREFIX.LANG), in the NLLB codes and the M2M100 ones."""
    folder = tmp_path_factory.mktemp("corpus")
    for code, nllb in CORPUS.items():
        lines = read_sentences(code, "test_2016_flickr", n=6)
        (folder / f"text.{nllb}").write_text("\n".join(lines) + "\n")
        (folder / f"text.{code}").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def pruned_nllb(models, tokenizers, corpus):
    _, converted = models["nllb"]
    files = [corpus / "text.eng_Latn", corpus / "text.fra_Latn"]
    kwargs = dict(with_translations=True, generate_kwargs={"num_beams": 1, "max_new_tokens": MAX_NEW})
    return prune_vocabulary(converted, tokenizers["nllb"], ["eng_Latn", "fra_Latn"], files, **kwargs)


def test_pruning_keeps_the_text_and_its_greedy_translations(pruned_nllb, models, tokenizers, corpus):
    pruned, pruned_tokenizer, report = pruned_nllb
    _, full = models["nllb"]
    assert pruned.config.languages == ["eng_Latn", "fra_Latn"] == pruned.config.target_languages
    assert pruned.config.vocab_size == report.vocab_size_after == len(pruned_tokenizer) < full.config.vocab_size
    assert pruned.config.language_token_ids == pruned_tokenizer.convert_tokens_to_ids(["eng_Latn", "fra_Latn"])
    assert pruned_tokenizer.convert_tokens_to_ids("deu_Latn") == pruned_tokenizer.unk_token_id  # not kept
    assert report.tokenization_mismatches == 0 and report.lines == 12
    assert [r["differing"] for r in report.translations.values()] == [0, 0]  # greedy: the full model's, by design
    assert sum(r["lines"] for r in report.translations.values()) == 12
    # beam search: the lines whose translation differs, counted here as the report counts them
    kept = [pruned_tokenizer.convert_ids_to_tokens(i) for i in range(pruned.config.vocab_size)]
    back = tokenizers["nllb"].convert_tokens_to_ids(kept)
    lines = (corpus / "text.eng_Latn").read_text().splitlines()
    beam = {"num_beams": 3, "max_new_tokens": MAX_NEW}
    full_ids = translate_ids(full, tokenizers["nllb"], lines, "eng_Latn", "fra_Latn", 8, **beam)
    pruned_ids = translate_ids(pruned, pruned_tokenizer, lines, "eng_Latn", "fra_Latn", 8, **beam)
    differing = sum([back[i] for i in b] != a for a, b in zip(full_ids, pruned_ids))
    from hf_variants.convert.prune import compare_translations

    reference = {(str(corpus / "text.eng_Latn"), "eng_Latn", "fra_Latn"): (lines, full_ids)}
    counted = compare_translations(full, pruned, pruned_tokenizer, back, reference, 8, **beam)
    assert [r["differing"] for r in counted.values()] == [differing]


@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_a_sentence_outside_the_kept_tokens_translates(family, pruned_nllb, models, tokenizers, corpus):
    if family == "nllb":
        pruned, tokenizer, _ = pruned_nllb
        src, tgt = "eng_Latn", "fra_Latn"
    else:
        files = [corpus / "text.en", corpus / "text.fr"]
        pruned, tokenizer, report = prune_vocabulary(models["m2m100"][1], tokenizers["m2m100"], ["en", "fr"], files)
        assert report.tokenization_mismatches == 0 and report.language_tokens == 100  # M2M100 keeps its 100
        assert pruned.config.languages == ["en", "fr"] and pruned.config.vocab_size == len(tokenizer) + 100
        src, tgt = "en", "fr"
    text = "Zyxw quokka Ω jumps."  # words and a character the text never had
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id in ids and max(ids) < pruned.config.vocab_size
    out = pipeline("translation", model=pruned, tokenizer=tokenizer)(
        text, src_lang=src, tgt_lang=tgt, max_new_tokens=4
    )
    assert isinstance(out[0]["translation_text"], str)


def test_prune_command(models, tokenizers, corpus, tmp_path, capsys):
    _, converted = models["nllb"]
    converted.save_pretrained(tmp_path / "full")
    tokenizers["nllb"].save_pretrained(tmp_path / "full")
    prune_command.main(
        [
            "--model",
            str(tmp_path / "full"),
            "--output_dir",
            str(tmp_path / "pruned"),
            "--keep_languages",
            "eng_Latn,deu_Latn",
            "--keep_tokens_from",
            str(corpus / "text.eng_Latn"),
            str(corpus / "text.deu_Latn"),
        ]
    )
    assert "lines of the text tokenized differently after pruning: 0" in capsys.readouterr().out
    report = json.loads((tmp_path / "pruned" / "prune.json").read_text())
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "pruned")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "pruned")
    assert model.config.languages == report["languages"] == ["eng_Latn", "deu_Latn"]
    assert model.config.vocab_size == report["vocab_size_after"] == len(tokenizer)
    with pytest.raises(SystemExit):
        prune_command.main(
            ["--model", str(tmp_path / "full"), "--output_dir", str(tmp_path / "p2"), "--keep_languages", "spa_Latn"]
            + ["--keep_tokens_from", str(corpus / "text.eng_Latn")]
        )
    assert "--keep_languages: ['spa_Latn'] are not languages of this model" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- warm start, training
@pytest.fixture(scope="module")
def pruned_folder(pruned_nllb, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pruned")
    pruned, tokenizer, _ = pruned_nllb
    pruned.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def fine_tune_losses(model, batch, steps=4) -> list[float]:
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model_type", ["mute_nmt", "hysan_nmt", "mgsa_nmt", "mimo_nmt", "tied_nmt"])
def test_every_variant_warm_starts_from_the_pruned_folder(model_type, pruned_folder, pruned_nllb, tmp_path):
    base, tokenizer, _ = pruned_nllb
    variant = warm_start(pruned_folder, model_type, output_dir=tmp_path / model_type)
    config = variant.config
    assert config.languages == base.config.languages and config.language_token_ids == base.config.language_token_ids
    assert config.target_language_token and not config.target_language_tags
    assert (tmp_path / model_type / "tokenizer.json").is_file()
    texts = read_sentences("en", "val", n=3, start=6)
    batch = base.prepare_translation_inputs(
        tokenizer,
        texts,
        src_lang=["eng_Latn", "fra_Latn", "eng_Latn"],
        tgt_lang=["fra_Latn", "eng_Latn", "fra_Latn"],
        text_target=read_sentences("fr", "val", n=3, start=6),
    )
    if model_type in ("mute_nmt", "mimo_nmt"):  # exact warm starts (MIMO: pre-norm units, one task row a language)
        with torch.no_grad():
            assert (variant(**batch).logits - base(**batch).logits).abs().max().item() <= 1e-5
    if model_type == "mimo_nmt":
        assert config.normalize_before and variant.model.encoder.layers[1].self_attn_mix.task_logits.shape[0] == 2
    generated = variant.eval().generate(**batch, max_new_tokens=3)
    assert generated[:, 1].tolist() == [
        tokenizer.convert_tokens_to_ids(t) for t in ("fra_Latn", "eng_Latn", "fra_Latn")
    ]
    losses = fine_tune_losses(variant, batch)
    assert losses[-1] < losses[0], losses


def test_train_command_fine_tunes_the_pruned_folder(pruned_folder, tmp_path):
    """hf-variants-train --model_name_or_path: data files named with the model's codes (train.eng_Latn, ...) flow
    into the run's languages, the batches' language tokens and the saved model's recorded directions."""
    from hf_variants.training import train

    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 24), ("val", 4), ("test_2016_flickr", 4)):
        for code, nllb in (("en", "eng_Latn"), ("fr", "fra_Latn")):
            (data / f"{split}.{nllb}").write_text("\n".join(read_sentences(code, "val", n=n)) + "\n")
    argv = ["--model_name_or_path", str(pruned_folder), "--data_dir", str(data), "--output_dir", str(tmp_path / "run")]
    argv += ["--languages", "eng_Latn", "fra_Latn", "--max_steps", "2", "--warmup_steps", "1", "--max_tokens", "512"]
    argv += ["--eval_bleu_pairs", "2", "--num_beams", "1", "--max_len_b", "4", "--num_examples", "1"]
    train.main(argv)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "model")
    assert model.config.target_language_token and model.config.languages == ["eng_Latn", "fra_Latn"]
    assert sorted(model.config.source_languages) == ["eng_Latn", "fra_Latn"] == sorted(model.config.target_languages)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 2


def test_calibrated_int8_export_takes_the_calibration_language(models, tokenizers, tmp_path):
    """ONNX Runtime int8 with calibrated scales (`--int8_activations calibrated`) for a converted NLLB-200: its
    calibration sentences are in the language `calibration_src_lang` names (the model marks the source language with
    a token and translates from several), translated into each other language in turn; the int8 graphs then translate
    a sentence the same alone and batched. Without that language, or with one the model does not translate from, the
    export refuses before it writes anything, naming the argument."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_variants.onnx.export import export
    from hf_variants.onnx.modeling import OrtModelForSeq2SeqLM

    _, converted = models["nllb"]
    tokenizer = tokenizers["nllb"]
    kwargs = dict(int8=True, int8_activations="calibrated", calibration_sources=read_sentences("en", n=8))
    for lang, message in (
        (None, "calibration_src_lang .*several languages"),
        ("xx", "calibration_src_lang .*'xx' is an unknown language"),
    ):
        with pytest.raises(ValueError, match=message):
            export(converted, tokenizer, tmp_path / "refused", calibration_src_lang=lang, progress=False, **kwargs)
        assert not (tmp_path / "refused").exists()
    folder = export(converted, tokenizer, tmp_path / "onnx", calibration_src_lang="eng_Latn", progress=False, **kwargs)
    assert json.loads((folder / "onnx_manifest.json").read_text())["int8"]["calibration"]["src_lang"] == "eng_Latn"
    ort8 = OrtModelForSeq2SeqLM.from_pretrained(folder, precision="int8", num_threads=1)
    texts, langs = read_sentences("en", "val", n=4), ["fra_Latn", "deu_Latn", "ces_Latn", "fra_Latn"]

    def translate(picked):
        inputs = ort8.prepare_translation_inputs(
            tokenizer, [texts[i] for i in picked], src_lang="eng_Latn", tgt_lang=[langs[i] for i in picked]
        )
        rows = ort8.generate(**inputs, max_new_tokens=MAX_NEW, num_beams=1).tolist()
        return [[t for t in row if t != converted.config.pad_token_id] for row in rows]

    assert [translate([i])[0] for i in range(4)] == translate(range(4))
