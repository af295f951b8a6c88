"""Two rules every entry point shares through the model code: the length rule applies per sentence (a sentence's
translation never depends on the other sentences of its batch), and a language the model was not trained for is
refused, naming the argument and the model's languages."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import read_sentences
from trained_tiny import trained_baseline
from transformers import pipeline

from hf_variants import MimoConfig, MimoForConditionalGeneration, TransformerNmtConfig

SENTENCES = read_sentences("en", "val", n=64)


def _decode(model, tokenizer, sentences, batch_size, **generate_kwargs) -> list[list[int]]:
    out = []
    for start in range(0, len(sentences), batch_size):
        inputs = model.prepare_translation_inputs(tokenizer, sentences[start : start + batch_size])
        with torch.no_grad():
            ids = model.generate(**inputs, **generate_kwargs)
        eos, pad = model.config.eos_token_id, model.config.pad_token_id
        for row in ids.tolist():
            row = row[1:]
            out.append(row[: row.index(eos) + 1] if eos in row else [t for t in row if t != pad])
    return out


@pytest.fixture(scope="module")
def trained(tokenizer):
    return trained_baseline(tokenizer, steps=150)


def binding_rule(model, tokenizer) -> tuple[dict, list[list[int]]]:
    """A tight rule under which more than 10 of SENTENCES' greedy translations reach their own limit, chosen from
    the model's unlimited greedy translations (returned too: a greedy translation under a limit is the unlimited
    one cut there, `</s>` forced as the limit-th token), so the rule binds whatever the fixture model says."""
    unlimited = _decode(model, tokenizer, SENTENCES, 64, num_beams=1, max_new_tokens=64)
    lengths = [len(x) for x in tokenizer(SENTENCES)["input_ids"]]
    for a, b in ((0.5, 1), (0.5, 0), (0.25, 1), (0.25, 0)):
        limits = [int(a * n + b) for n in lengths]
        if min(limits) >= 1 and sum(len(t) >= limit for t, limit in zip(unlimited, limits)) > 10:
            return {"max_len_a": a, "max_len_b": b}, unlimited
    raise AssertionError(f"no tight rule binds: the unlimited greedy lengths are {[len(t) for t in unlimited]}")


def test_the_length_rule_is_per_sentence_greedy_and_beam(trained, tokenizer):
    """64 sentences at batch sizes 1, 7 and 64 under a tight rule (more than 10 sentences reach their limit, by
    construction): the same tokens, greedy and beam 4; each translation within its own source's limit, ending with
    eos there; a greedy one is the unlimited greedy translation cut at its limit."""
    rule, unlimited = binding_rule(trained, tokenizer)
    runs = {}
    for settings in (dict(num_beams=1), dict(num_beams=4, length_penalty=0.6)):
        runs = {size: _decode(trained, tokenizer, SENTENCES, size, length_rule=rule, **settings) for size in (1, 7)}
        runs[64] = _decode(trained, tokenizer, SENTENCES, 64, length_rule=rule, **settings)
        assert runs[1] == runs[7] == runs[64], settings
        if settings["num_beams"] == 1:
            greedy = runs[1]
    lengths = [len(x) for x in tokenizer(SENTENCES)["input_ids"]]
    limits = [int(rule["max_len_a"] * n + rule["max_len_b"]) for n in lengths]
    eos = trained.config.eos_token_id
    for tokens in runs[1]:
        assert tokens[-1] == eos
    assert all(len(tokens) <= limit for tokens, limit in zip(runs[1], limits))
    cut = [full if len(full) < limit else full[: limit - 1] + [eos] for full, limit in zip(unlimited, limits)]
    assert greedy == cut
    assert sum(len(tokens) == limit for tokens, limit in zip(greedy, limits)) > 10


def test_the_saved_rule_applies_per_sentence_without_arguments(trained, tokenizer):
    """No length from the caller: the saved rule (here a tight one) per sentence, so a batch equals its singletons;
    the pipeline decodes the same."""
    model = copy.deepcopy(trained)
    model.generation_config.length_rule = {"max_len_a": 0.5, "max_len_b": 1, "max_new_tokens": 256}
    batch = _decode(model, tokenizer, SENTENCES[:16], 16)
    assert batch == _decode(model, tokenizer, SENTENCES[:16], 1)
    texts = [t["translation_text"] for t in pipeline("translation", model=model, tokenizer=tokenizer)(SENTENCES[:16])]
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch]


def test_length_rule_argument_overrides_and_errors(trained, tokenizer):
    model = trained
    assert model.length_rule({"max_len_b": 3}) == (2.0, 3, 256)
    assert model.length_rule({"max_len_a": 1, "max_len_b": 0, "max_new_tokens": 5}) == (1.0, 0, 5)
    inputs = model.prepare_translation_inputs(tokenizer, SENTENCES[:2])
    with pytest.raises(ValueError, match="either `length_rule` or `max_new_tokens`"):
        model.generate(**inputs, length_rule={"max_len_b": 3}, max_new_tokens=4)
    for bad in ({"max_len_c": 1}, {"max_len_a": -1}, {"max_len_b": 2.5}, [1, 2]):
        with pytest.raises(ValueError, match="length_rule must be a dict"):
            model.generate(**inputs, length_rule=bad)
    out = model.generate(**inputs, length_rule={"max_len_a": 0, "max_len_b": 2}, num_beams=1)
    assert out.shape[1] <= 3  # the start token and at most two new ones


# ---------------------------------------------------------------------------------------------------- languages
def _one_direction_mimo(tokenizer, **fields):
    torch.manual_seed(0)
    config = MimoConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), languages=["en", "fr"], target_languages=["fr"], **fields
    )
    return MimoForConditionalGeneration(config).eval()


def test_a_one_direction_model_refuses_the_other_direction(tokenizer):
    """An en->fr model asked to translate into English (or from French) is refused everywhere the language is
    given: the config, prepare_translation_inputs, generate and the pipeline, naming the argument and the
    model's languages."""
    model = _one_direction_mimo(tokenizer)
    assert model.config.translation_languages() == (["en"], ["fr"])
    model.config.check_languages(src_lang="en", tgt_lang="fr")
    with pytest.raises(ValueError, match=r"tgt_lang='en' is not a target language.*from \['en'\] into \['fr'\]"):
        model.config.check_languages(tgt_lang="en")
    with pytest.raises(ValueError, match=r"src_lang='fr' is not a source language"):
        model.config.check_languages(src_lang="fr", tgt_lang="fr")
    with pytest.raises(ValueError, match="tgt_lang='en'"):
        model.prepare_translation_inputs(tokenizer, SENTENCES[:2], tgt_lang="en")
    with pytest.raises(ValueError, match="src_lang='fr'"):
        model.prepare_translation_inputs(tokenizer, SENTENCES[:2], src_lang="fr")
    inputs = model.prepare_translation_inputs(tokenizer, SENTENCES[:2])  # its one target
    with pytest.raises(ValueError, match="tgt_lang='en'"):
        model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], tgt_lang="en")
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tgt_lang='en'"):
        translator(SENTENCES[:2], tgt_lang="en")
    assert len(translator(SENTENCES[:2], tgt_lang="fr", max_new_tokens=3)) == 2


def test_recorded_sources_and_unrecorded_languages(tokenizer):
    """Recorded source languages are the sources; a config without them (saved before they were recorded) derives
    them; a model that names no languages has nothing to check; the same code twice is refused."""
    both = TransformerNmtConfig.from_preset(
        "tiny", languages=["en", "de"], source_languages=["en", "de"], target_languages=["en", "de"]
    )
    assert both.translation_languages() == (["en", "de"], ["en", "de"])
    both.check_languages(src_lang="de", tgt_lang="en")
    with pytest.raises(ValueError, match="both 'en'"):
        both.check_languages(src_lang="en", tgt_lang="en")
    old = TransformerNmtConfig.from_preset("tiny", languages=["en", "de", "fr"])
    assert old.translation_languages() == (["en", "de", "fr"], ["en", "de", "fr"])
    with pytest.raises(ValueError, match=r"tgt_lang='cs' is an unknown language: this model translates from"):
        old.check_languages(tgt_lang="cs")
    TransformerNmtConfig.from_preset("tiny").check_languages(src_lang="en", tgt_lang="xx")
    with pytest.raises(ValueError, match="source_languages"):
        TransformerNmtConfig.from_preset("tiny", languages=["en", "de"], source_languages=["fr"])
    reloaded = TransformerNmtConfig.from_dict({**both.to_dict()})
    assert reloaded.source_languages == ["en", "de"]
