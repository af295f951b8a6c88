"""The translation pipeline's inputs and length rule: empty inputs give "" without generating, a source longer than
the model's positions raises a ValueError naming its length and the limit (or is cut with `truncation=True`), and
generation lengths are the user's: `max_length` is generate()'s `max_length` (as in transformers 4), not a source
truncation; `max_new_tokens` passes through; no pipeline default overrides the model's generation_config."""

import pytest
import torch
from conftest import read_sentences
from transformers import GenerationConfig, pipeline

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration


def build(tokenizer, **overrides):
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset("tiny", **{"vocab_size": len(tokenizer), **overrides})
    return TransformerNmtForConditionalGeneration(config).eval()


def spy_generate(model, monkeypatch, run=True):
    """Record the arguments of every `model.generate` call (the pipeline's only model call); with `run=False`,
    return `<s> </s>` instead of generating (for checks of the arguments alone)."""
    calls = []
    generate = model.generate

    def recording(**kwargs):
        calls.append(kwargs)
        if run:
            return generate(**kwargs)
        config = model.config
        return torch.tensor([[config.decoder_start_token_id, config.eos_token_id]] * len(kwargs["input_ids"]))

    monkeypatch.setattr(model, "generate", recording)
    return calls


def test_empty_inputs_give_empty_translations_without_generating(tokenizer, monkeypatch):
    model = build(tokenizer)
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    calls = spy_generate(model, monkeypatch)
    assert translator("") == [{"translation_text": ""}]
    assert translator("  \t ") == [{"translation_text": ""}]
    assert translator(["", " "], num_beams=2) == [{"translation_text": ""}, {"translation_text": ""}]
    assert calls == []  # nothing was generated
    a, b = read_sentences("en", "val", n=2)
    gen = dict(num_beams=2, max_new_tokens=5)
    mixed = translator(["", a, "   ", b, ""], **gen)
    assert len(calls) == 1 and calls[0]["input_ids"].shape[0] == 2  # one batch of the two real sentences
    assert mixed[0] == mixed[2] == mixed[4] == {"translation_text": ""}
    assert [mixed[1], mixed[3]] == translator([a, b], **gen)
    # several translations per input: the empty input gets as many empty ones
    several = translator([a, ""], num_beams=2, num_return_sequences=2, max_new_tokens=5)
    assert len(several[0]) == 2 and several[1] == [{"translation_text": ""}] * 2
    assert translator("", num_beams=2, num_return_sequences=2) == [{"translation_text": ""}] * 2


def test_per_sentence_inputs_follow_their_sentences_around_empty_ones(tokenizer):
    model = build(tokenizer, languages=["en", "de", "fr", "cs"], target_language_tags=True)
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    a, b = read_sentences("en", "val", n=2)
    gen = dict(num_beams=2, max_new_tokens=5)
    out = translator([a, "", b], tgt_lang=["de", "fr", "cs"], batch_size=1, **gen)
    assert out[1] == {"translation_text": ""}
    assert out[0] == translator(a, tgt_lang="de", **gen)[0]
    assert out[2] == translator(b, tgt_lang="cs", **gen)[0]


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_too_long_sources_raise_naming_the_length_and_the_limit(tokenizer, monkeypatch, positions):
    model = build(tokenizer, max_position_embeddings=16, position_embedding_type=positions)
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    calls = spy_generate(model, monkeypatch)
    short, long = "A dog runs.", " ".join(read_sentences("en", "val", n=3))
    length = len(tokenizer(long)["input_ids"])
    assert length > 16
    with pytest.raises(
        ValueError,
        match=rf"The input is {length} tokens long .*at most 16 "
        r"\(config.max_position_embeddings\).*truncation=True",
    ):
        translator(long, max_new_tokens=4)
    with pytest.raises(ValueError, match=rf"inputs\[2\] is {length} tokens long .*at most 16"):
        translator([short, "", long], max_new_tokens=4)
    assert calls == []  # raised before generate
    # truncation=True cuts the source to the limit (</s> kept), as the tokenizer would
    cut = translator(long, truncation=True, num_beams=2, max_new_tokens=4)
    assert calls[-1]["input_ids"].shape == (1, 16) and calls[-1]["input_ids"][0, -1] == tokenizer.eos_token_id
    inputs = model.prepare_translation_inputs(tokenizer, [long], max_length=16)
    expected = tokenizer.decode(model.generate(**inputs, num_beams=2, max_new_tokens=4)[0], skip_special_tokens=True)
    assert cut == [{"translation_text": expected}]
    # a source of exactly the limit is accepted, one token more is not
    n = len(tokenizer(short)["input_ids"])
    at_limit = pipeline("translation", model=build(tokenizer, max_position_embeddings=n), tokenizer=tokenizer)
    assert len(at_limit(short, num_beams=1, max_new_tokens=2)) == 1
    below = pipeline("translation", model=build(tokenizer, max_position_embeddings=n - 1), tokenizer=tokenizer)
    with pytest.raises(ValueError, match=rf"is {n} tokens long .*at most {n - 1} "):
        below(short, max_new_tokens=2)


def test_max_length_is_the_generation_length_not_a_source_truncation(tokenizer, monkeypatch):
    model = build(tokenizer)
    model.generation_config.update(**model.paper_decoding)  # as in a model saved by training/train.py
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    calls = spy_generate(model, monkeypatch, run=False)
    text = read_sentences("en", "val", n=1)[0]
    source_length = len(tokenizer(text)["input_ids"])
    assert source_length > 6
    translator(text, max_length=6, num_beams=1)
    assert calls[-1]["input_ids"].shape[-1] == source_length  # the source is whole
    assert calls[-1]["max_length"] == 6 and "max_new_tokens" not in calls[-1]
    translator(text, max_new_tokens=3)
    assert calls[-1]["max_new_tokens"] == 3 and "max_length" not in calls[-1]
    # the pipeline adds no generation defaults: the model's generation_config (beam 4, length penalty 0.6) decides
    translator(text)
    added = {key for key in calls[-1] if key not in ("input_ids", "attention_mask", "pad_token_id")}
    assert added == set(), added
    assert (model.generation_config.num_beams, model.generation_config.length_penalty) == (4, 0.6)
    # a user's choice wins over the model's
    translator(text, num_beams=1, length_penalty=1.0, max_new_tokens=2)
    assert (calls[-1]["num_beams"], calls[-1]["length_penalty"]) == (1, 1.0)
    # a user's generation_config is passed on without an added max_new_tokens
    translator(text, generation_config=GenerationConfig(max_length=5, num_beams=2))
    assert calls[-1]["generation_config"].max_new_tokens is None and calls[-1]["generation_config"].max_length == 5
    # set at construction, it applies to every call
    at_init = pipeline("translation", model=model, tokenizer=tokenizer, max_length=7)
    at_init(text, num_beams=1)
    assert calls[-1]["max_length"] == 7


def test_max_length_bounds_the_translation(tokenizer):
    """End to end, on a generation_config without max_new_tokens (the default length rule must yield to the
    user's max_length): pipeline(max_length=N) == generate(max_length=N), at most N tokens."""
    model = build(tokenizer)
    model.generation_config.max_new_tokens = None
    model.generation_config.max_length = 40
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    text = read_sentences("en", "val", n=1)[0]
    inputs = model.prepare_translation_inputs(tokenizer, [text])
    ids = model.generate(**inputs, max_length=6, num_beams=2)
    assert ids.shape[-1] <= 6
    got = translator(text, max_length=6, num_beams=2)
    assert got == [{"translation_text": tokenizer.decode(ids[0], skip_special_tokens=True)}]
    assert len(tokenizer(got[0]["translation_text"], add_special_tokens=False)["input_ids"]) <= 6
