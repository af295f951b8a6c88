"""The translation core (`hf_variants.inference`) on every model type, tiny models trained a few steps so that
scores are not uniform: n-best lists (their 1-best is the plain translation, their scores are generate()'s
`sequences_scores`, their log-probabilities the model's own cross-entropy), prefixes honoured token by token,
sampling reproducible from its seed, alignments from the right hypothesis, token batches equal to sentence batches,
a translation independent of its batch, the input order restored, streaming that reads its input lazily, and the
checks that name the option or field at fault."""

import itertools
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import LANGUAGES, read_sentences  # noqa: E402
from trained_tiny import one_torch_thread, trained_baseline, trained_tiny  # noqa: E402

from hf_variants import (  # noqa: E402
    HysanConfig,
    HysanForConditionalGeneration,
    MgsaConfig,
    MgsaForConditionalGeneration,
    MimoConfig,
    MimoForConditionalGeneration,
    MuteConfig,
    MuteForConditionalGeneration,
    TiedTransformerConfig,
    TiedTransformerForConditionalGeneration,
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
)
from hf_variants.inference import (  # noqa: E402
    DecodeOptions,
    OptionError,
    TranslationRequest,
    Translator,
    buffered,
    length_sorted_batches,
)
from hf_variants.inference.batching import LineReader  # noqa: E402
from hf_variants.inference.decode import hard_alignment, word_indices  # noqa: E402
from hf_variants.inference.requests import DecodingCancelled  # noqa: E402

# model type -> (class, config class, config overrides, target language of its requests)
TYPES = {
    "transformer_nmt": (TransformerNmtForConditionalGeneration, TransformerNmtConfig, {}, None),
    "mute_nmt": (MuteForConditionalGeneration, MuteConfig, {}, None),
    "hysan_nmt": (HysanForConditionalGeneration, HysanConfig, {}, None),
    "mgsa_nmt": (MgsaForConditionalGeneration, MgsaConfig, {"phrase_type": "ngram"}, None),
    "mimo_nmt": (
        MimoForConditionalGeneration,
        MimoConfig,
        {"num_transformations": 3, "languages": list(LANGUAGES), "mixing_init_std": 0.5},
        "de",
    ),
    "tied_nmt": (TiedTransformerForConditionalGeneration, TiedTransformerConfig, {"languages": list(LANGUAGES)}, "de"),
}
SOURCES = read_sentences("en", "val", n=12)
# short outputs keep the tests fast; the rule still differs per sentence (a = 0.5)
RULE = {"max_len_a": 0.5, "max_len_b": 4}


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(scope="module", params=list(TYPES))
def typed(request, tokenizer):
    """(translator, target language) of a tiny model of each type trained for 30 steps."""
    model_class, config_class, overrides, tgt_lang = TYPES[request.param]
    model = trained_tiny(model_class, config_class, tokenizer, steps=30, tgt_lang=tgt_lang, **overrides)
    return Translator(model, tokenizer), tgt_lang


@pytest.fixture(scope="module")
def baseline(tokenizer):
    return Translator(trained_baseline(tokenizer), tokenizer)


def requests_of(texts, tgt_lang, **fields):
    return [TranslationRequest(text, tgt_lang=tgt_lang, **fields) for text in texts]


def texts_of(results):
    return [r.text for r in results]


# ------------------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "options, names, message",
    [
        (DecodeOptions(num_beams=4, nbest=5), ("nbest", "num_beams"), "nbest=5 > num_beams=4"),
        (DecodeOptions(top_k=5), ("top_k", "do_sample"), "top_k=5 needs do_sample"),
        (DecodeOptions(do_sample=True, num_beams=4), ("do_sample", "num_beams"), "num_beams=4 must be 1"),
        (DecodeOptions(max_length=20, max_len_b=3), ("max_length", "max_len_b"), "pass one of them"),
        (DecodeOptions(max_length=20, max_new_tokens=3), ("max_length", "max_new_tokens"), "pass one"),
        (DecodeOptions(top_p=1.5, do_sample=True), ("top_p",), r"top_p=1.5: expected a number in \(0, 1\]"),
        (DecodeOptions(nbest=0), ("nbest",), "nbest=0: expected an integer >= 1"),
        (DecodeOptions(temperature=0.0, do_sample=True), ("temperature",), "expected a number > 0"),
        (DecodeOptions(max_len_a=0, max_len_b=0), ("max_len_a", "max_len_b"), "leaves no tokens"),
    ],
)
def test_options_are_checked_naming_the_option(options, names, message):
    with pytest.raises(OptionError, match=message) as caught:
        options.check()
    assert caught.value.names == names
    with pytest.raises(OptionError, match="--" + names[0]):  # the command's wording
        options.check(flags=True)


def test_options_resolve_to_the_saved_generation_config(baseline):
    saved = baseline.generation_config
    saved_rule = saved.length_rule
    resolved = baseline.resolve(DecodeOptions())
    assert resolved.num_beams == (saved.num_beams or 1) and resolved.length_penalty == (saved.length_penalty or 1.0)
    assert (resolved.max_len_a, resolved.max_len_b) == (saved_rule["max_len_a"], saved_rule["max_len_b"])
    assert baseline.resolve(DecodeOptions(do_sample=True, nbest=3)).num_beams == 1
    baseline.generation_config.num_beams = 4
    try:
        with pytest.raises(OptionError, match=r"nbest=5 > num_beams=4 \(the model's saved num_beams\)"):
            baseline.resolve(DecodeOptions(nbest=5))
    finally:
        baseline.generation_config.num_beams = saved.num_beams
    with pytest.raises(OptionError, match="max_new_tokens=999: more target positions"):
        baseline.resolve(DecodeOptions(max_new_tokens=999))
    with pytest.raises(OptionError, match="unknown decoding option"):
        DecodeOptions.from_dict({"beam": 4})


# ----------------------------------------------------------------------------------------------------- batching
def test_token_batches_hold_their_budget_and_every_index_once():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12, 8, 40]
    for batch_size, max_tokens in ((3, None), (None, 40), (4, 36), (None, 10)):
        batches = length_sorted_batches(lengths, batch_size=batch_size, max_tokens=max_tokens)
        assert sorted(itertools.chain(*batches)) == list(range(len(lengths)))
        for batch in batches:
            assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
            if batch_size:
                assert len(batch) <= batch_size
            if max_tokens and len(batch) > 1:  # a longer sentence alone is a batch of its own
                assert len(batch) * max(lengths[i] for i in batch) <= max_tokens
    assert length_sorted_batches(lengths, max_tokens=10)[0] == [9]  # 40 tokens alone
    with pytest.raises(ValueError, match="max_tokens=0"):
        length_sorted_batches(lengths, max_tokens=0)


def test_buffers_are_cut_short_when_the_next_item_would_be_waited_for():
    assert list(buffered(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    available = iter([True, False, True, True, True])
    assert list(buffered(range(6), 4, ready=lambda: next(available, True))) == [[0, 1], [2, 3, 4, 5]]


def test_line_reader_tells_whether_a_line_is_ready(tmp_path):
    import os

    read_end, write_end = os.pipe()
    with open(read_end, "rb", buffering=0) as stream:
        reader = LineReader(stream)
        assert not reader.ready()
        os.write(write_end, "\ufeffA dog runs.\r\nTwo".encode())
        lines = iter(reader)
        assert next(lines) == "A dog runs."  # the BOM and the terminator dropped
        os.write(write_end, b" men.\n")
        os.close(write_end)
        assert reader.ready() and list(lines) == ["Two men."]


# ------------------------------------------------------------------------------------------------- every type
def test_nbest_one_best_is_the_plain_translation_and_scores_are_generates(typed, tokenizer):
    translator, tgt_lang = typed
    requests = requests_of(SOURCES[:4], tgt_lang)
    plain = translator.translate(requests, DecodeOptions(num_beams=3, **RULE))
    nbest = translator.translate(requests, DecodeOptions(num_beams=3, nbest=3, scores=True, **RULE))
    assert texts_of(nbest) == texts_of(plain)
    engine = translator.engine
    options = translator.resolve(DecodeOptions(num_beams=3, nbest=3, **RULE))
    inputs = engine.encode(requests)
    kwargs = engine.generate_kwargs(inputs, requests, options)
    direct = translator.model.generate(**inputs, **kwargs, output_scores=True, return_dict_in_generate=True)
    expected = direct.sequences_scores.view(4, 3)
    for result, row in zip(nbest, expected):
        scores = [h.score for h in result.hypotheses]
        assert scores == sorted(scores, reverse=True) and len(set(scores)) > 1  # ranked, not uniform
        assert scores == pytest.approx(row.tolist(), abs=1e-4)
    # log_prob: the model's own cross-entropy of the hypothesis (labels = its tokens, </s> included)
    hypothesis = nbest[1].hypotheses[2]
    labels = torch.tensor([hypothesis.token_ids])
    with torch.no_grad():
        loss = translator.model(**engine.encode(requests[1:2]), labels=labels).loss
    assert hypothesis.log_prob == pytest.approx(-float(loss) * len(hypothesis.token_ids), abs=1e-4)
    assert hypothesis.tokens == tokenizer.convert_ids_to_tokens(hypothesis.token_ids)


def test_prefixes_are_honoured_token_by_token(typed, tokenizer):
    translator, tgt_lang = typed
    prefixes = ["Ein Hund", "", "Zwei Männer sitzen", "Die"]
    requests = [TranslationRequest(s, tgt_lang=tgt_lang, prefix=p) for s, p in zip(SOURCES[:4], prefixes)]
    for beams in (1, 3):
        results = translator.translate(requests, DecodeOptions(num_beams=beams, max_len_a=0.5, max_len_b=8))
        for prefix, result in zip(prefixes, results):
            forced = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
            assert result.hypotheses[0].token_ids[: len(forced)] == forced
        plain = translator.translate(requests[1:2], DecodeOptions(num_beams=beams, max_len_a=0.5, max_len_b=8))
        assert results[1].text == plain[0].text  # an empty prefix is no prefix
        # one at a time: the same (prefixes of other lengths in the batch change nothing)
        alone = [
            translator.translate([r], DecodeOptions(num_beams=beams, max_len_a=0.5, max_len_b=8))[0] for r in requests
        ]
        assert texts_of(alone) == texts_of(results)


def test_sampling_is_reproducible_from_its_seed(typed):
    translator, tgt_lang = typed
    requests = requests_of(SOURCES[:6], tgt_lang)
    options = DecodeOptions(do_sample=True, nbest=2, top_k=20, temperature=1.2, seed=7, **RULE)
    first = translator.translate(requests, options)
    assert [[h.text for h in r.hypotheses] for r in translator.translate(requests, options)] == [
        [h.text for h in r.hypotheses] for r in first
    ]
    other = translator.translate(requests, options.replace(seed=8))
    assert [[h.text for h in r.hypotheses] for r in other] != [[h.text for h in r.hypotheses] for r in first]
    assert all(len(r.hypotheses) == 2 for r in first)


def test_alignments_are_well_formed_and_from_each_hypothesis(typed, tokenizer):
    translator, tgt_lang = typed
    requests = requests_of(SOURCES[:3], tgt_lang)
    results = translator.translate(requests, DecodeOptions(num_beams=3, nbest=3, alignments=True, **RULE))
    compared = 0
    for request, result in zip(requests, results):
        source_words = len(request.source.split())
        for hypothesis in result.hypotheses:
            target_words = len(hypothesis.text.split())
            assert hypothesis.alignment, hypothesis
            assert all(0 <= i < source_words and 0 <= j < target_words for i, j in hypothesis.alignment)
            assert hypothesis.alignment == sorted(set(hypothesis.alignment))
            # from this hypothesis' own cross-attention: the same pairs from a forward over it alone
            engine = translator.engine
            inputs = engine.encode([request])
            _, (attention,) = engine._teacher_forced(inputs, [hypothesis.token_ids], 1, attentions=True)
            source = inputs["input_ids"][0].tolist()
            assert hypothesis.alignment == hard_alignment(
                attention, word_indices(tokenizer, source), word_indices(tokenizer, hypothesis.token_ids)
            )
            compared += 1
    assert compared == 9


def test_token_batches_equal_sentence_batches_and_batches_change_nothing(typed):
    translator, tgt_lang = typed
    requests = requests_of(SOURCES, tgt_lang)
    options = DecodeOptions(num_beams=1, **RULE)
    one = texts_of(translator.translate(requests, options, batch_size=1))
    assert texts_of(translator.translate(requests, options, batch_size=5)) == one
    assert texts_of(translator.translate(requests, options, max_tokens=60)) == one
    reversed_order = texts_of(translator.translate(requests[::-1], options, batch_size=7))
    assert reversed_order[::-1] == one  # the input order restored


def test_no_repeat_ngram_size_and_repetition_penalty_reach_generate(typed):
    translator, tgt_lang = typed
    requests = requests_of(SOURCES[:6], tgt_lang)
    results = translator.translate(requests, DecodeOptions(num_beams=1, no_repeat_ngram_size=1, max_new_tokens=20))
    for result in results:
        ids = result.hypotheses[0].token_ids
        assert len(ids) == len(set(ids)), ids  # no token twice
    # under a repetition penalty the scores are what the beam ranked by: generate()'s own sequences_scores
    options = translator.resolve(DecodeOptions(num_beams=2, nbest=2, repetition_penalty=1.5, scores=True, **RULE))
    penalized = translator.translate(requests[:2], options)
    inputs = translator.engine.encode(requests[:2])
    kwargs = translator.engine.generate_kwargs(inputs, requests[:2], options)
    assert kwargs["repetition_penalty"] == 1.5
    direct = translator.model.generate(**inputs, **kwargs)
    assert [h.score for r in penalized for h in r.hypotheses] == pytest.approx(direct.sequences_scores.tolist())
    unpenalized = translator.translate(requests[:2], options.replace(repetition_penalty=None))
    assert [r.hypotheses[0].token_ids for r in penalized] != [r.hypotheses[0].token_ids for r in unpenalized] or all(
        len(set(h.token_ids)) == len(h.token_ids) for r in penalized for h in r.hypotheses
    )


# ---------------------------------------------------------------------------------------------- the baseline
def test_a_sentence_does_not_depend_on_its_batch(baseline):
    """Greedy search: identical outputs at batch sizes 1, 7 and 64 (the length rule per sentence: a long neighbour
    in the batch no longer raises a short sentence's limit). 200 validation sentences (40 at batch size 1, which
    costs most); the CLI, the pipeline and ONNX Runtime are compared on more in test_onnx."""
    sources = read_sentences("en", "val", n=200)
    options = DecodeOptions(num_beams=1, max_len_a=0.8, max_len_b=2)  # a limit that binds on many sentences
    at_64 = texts_of(baseline.translate(sources, options, batch_size=64))
    assert texts_of(baseline.translate(sources, options, batch_size=7)) == at_64
    assert texts_of(baseline.translate(sources[:40], options, batch_size=1)) == at_64[:40]
    assert texts_of(baseline.translate(sources, options, max_tokens=500)) == at_64
    assert len(set(at_64)) > 150  # real, varied translations


def test_the_length_rule_is_per_sentence(baseline, tokenizer):
    """With the rule a = 0, b = 3, every hypothesis ends with </s> as its 3rd token at the latest, whatever the batch;
    with a = 1, b = 0, a sentence of n source tokens gets at most n."""
    results = baseline.translate(SOURCES, DecodeOptions(num_beams=2, max_len_a=0.0, max_len_b=3))
    assert all(len(r.hypotheses[0].token_ids) <= 3 and r.hypotheses[0].token_ids[-1] == 2 for r in results)
    lengths = baseline.count_tokens(SOURCES)
    results = baseline.translate(SOURCES, DecodeOptions(num_beams=2, max_len_a=1.0, max_len_b=0))
    assert all(len(r.hypotheses[0].token_ids) <= n for r, n in zip(results, lengths))


def test_empty_too_long_and_truncated_sources(baseline):
    long = " ".join(read_sentences("en", "val", n=40))
    results = baseline.translate(["", SOURCES[0], "   ", long], DecodeOptions(num_beams=1, **RULE))
    assert [r.skipped for r in results] == ["empty", None, "empty", "too long"]
    assert results[3].source_tokens > baseline.max_source_tokens and results[3].hypotheses == []
    assert [r.index for r in results] == [0, 1, 2, 3] and results[1].text
    cut = baseline.translate([long, SOURCES[0]], DecodeOptions(num_beams=1, max_source_length=30, **RULE))
    assert cut[0].truncated and not cut[1].truncated and cut[0].text
    assert cut[0].source_tokens == baseline.count_tokens([long])[0]


class CountingEngine:
    """The baseline's engine, recording every source it tokenizes (`encode_sources`, `encode`) and the requests of
    every batch it decodes."""

    def __init__(self, engine):
        self.engine, self.tokenized, self.batches = engine, [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def encode_sources(self, requests, max_source_length=None):
        self.tokenized += [r.source for r in requests]
        return self.engine.encode_sources(requests, max_source_length)

    def encode(self, requests, max_source_length=None):
        self.tokenized += [r.source for r in requests]
        return self.engine.encode(requests, max_source_length)

    def batch_inputs(self, requests, max_source_length=None):  # the engine's own, its tokenizer calls recorded
        return type(self.engine).batch_inputs(self, requests, max_source_length)

    def translate_batch(self, requests, options, cancelled=None):
        self.batches.append(list(requests))
        return type(self.engine).translate_batch(self, requests, options, cancelled)


def test_each_sentence_is_tokenized_once_and_decoded_from_its_ids(baseline, tokenizer):
    """`translate` tokenizes every source once (its count and its token ids travel into the engine); decoding from
    the ids gives what decoding from the text gives, for greedy and beam search, with truncation."""
    counting = CountingEngine(baseline.engine)
    translator = Translator(engine=counting)
    for options in (DecodeOptions(num_beams=1, **RULE), DecodeOptions(num_beams=3, nbest=2, scores=True)):
        counting.tokenized.clear()
        results = translator.translate(SOURCES, options, batch_size=5)
        assert sorted(counting.tokenized) == sorted(SOURCES)  # once each
        assert all(r.source_ids is not None for batch in counting.batches for r in batch)
        from_text = baseline.engine.translate_batch(requests_of(SOURCES, None), baseline.resolve(options))
        assert [[h.token_ids for h in r.hypotheses] for r in results] == [[h.token_ids for h in s] for s in from_text]
    cut = DecodeOptions(num_beams=1, max_source_length=6, **RULE)
    encoded = baseline.encode(SOURCES[:4])
    by_ids = baseline.engine.translate_batch(encoded, baseline.resolve(cut))
    by_text = baseline.engine.translate_batch(requests_of(SOURCES[:4], None), baseline.resolve(cut))
    assert [h[0].token_ids for h in by_ids] == [h[0].token_ids for h in by_text]
    assert [len(r.source_ids) for r in encoded] == baseline.count_tokens(SOURCES[:4])
    assert encoded[0].source_ids == tuple(tokenizer(SOURCES[0])["input_ids"])


def test_decode_batch_decodes_one_batch_as_given_and_stops_when_cancelled(baseline):
    """`decode_batch` (the server's call: encoded requests, resolved options, one batch) equals `translate`; a
    cancel flag that turns true at the second decoding step stops greedy and beam search there (no result), and
    one that stays false changes nothing."""
    counting = CountingEngine(baseline.engine)
    translator = Translator(engine=counting)
    encoded = translator.encode(["", *SOURCES[:6]])
    counting.tokenized.clear()
    for options in (DecodeOptions(num_beams=1, **RULE), DecodeOptions(num_beams=2, **RULE)):
        resolved = translator.resolve(options)
        counting.batches.clear()
        results = translator.decode_batch(encoded, resolved, cancelled=lambda: False)
        assert len(counting.batches) == 1 and counting.tokenized == []  # one batch, nothing tokenized again
        assert results[0].skipped == "empty"
        assert texts_of(results[1:]) == texts_of(baseline.translate(SOURCES[:6], options))
        asks = []

        def cancelled():
            asks.append(1)
            return len(asks) >= 2

        with pytest.raises(DecodingCancelled):
            translator.decode_batch(encoded, resolved, cancelled=cancelled)
        assert len(asks) == 3  # two steps, then the check after generate()


def test_streaming_reads_lazily_and_keeps_the_order(baseline):
    pulled = []

    def sources():
        for i, text in enumerate(SOURCES):
            pulled.append(i)
            yield text

    stream = baseline.translate_stream(sources(), DecodeOptions(num_beams=1, **RULE), buffer_size=4, batch_size=3)
    first = next(stream)
    assert first.index == 0 and len(pulled) == 4  # one buffer read, not the whole input
    rest = list(stream)
    assert [r.index for r in rest] == list(range(1, len(SOURCES)))
    assert [first.text] + texts_of(rest) == texts_of(baseline.translate(SOURCES, DecodeOptions(num_beams=1, **RULE)))


def test_word_indices_and_hard_alignment(tokenizer):
    ids = tokenizer("A dog runs.", add_special_tokens=True)["input_ids"]
    words = word_indices(tokenizer, ids)
    assert words[-1] is None and words[0] == 0 and max(w for w in words if w is not None) == 2
    attention = torch.zeros(2, len(ids))
    attention[0, 1] = 1.0
    attention[1, len(ids) - 1], attention[1, len(ids) - 2] = 0.9, 0.1  # mostly at </s>, which aligns to no word
    assert hard_alignment(attention, words, [0, 1]) == [(words[1], 0), (words[len(ids) - 2], 1)]


# ------------------------------------------------------------------------------------------------ languages
def test_languages_are_checked_against_the_model(tokenizer):
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), languages=["en", "fr"], target_languages=["fr"]
    )
    translator = Translator(TransformerNmtForConditionalGeneration(config).eval(), tokenizer)
    assert translator.languages == {"source": ["en"], "target": ["fr"]}
    with pytest.raises(
        ValueError, match=r"requests\[0\]: tgt_lang='en' is not a target language of this model: .* into \['fr'\]"
    ):
        translator.translate([TranslationRequest("A dog.", tgt_lang="en")])
    with pytest.raises(ValueError, match=r"src_lang='fr'"):
        translator.translate([TranslationRequest("Un chien.", src_lang="fr")])
    assert translator.translate([TranslationRequest("A dog.", src_lang="en")], DecodeOptions(max_new_tokens=3))
    tied = Translator(
        TiedTransformerForConditionalGeneration(
            TiedTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), languages=list(LANGUAGES))
        ).eval(),
        tokenizer,
    )
    with pytest.raises(ValueError, match="tgt_lang: this model translates into several languages"):
        tied.check_request(TranslationRequest("A dog."))
    tied.check_request(TranslationRequest("A dog.", tgt_lang="de"))


def test_a_plain_transformers_model_gets_the_same_rule_per_sentence(tokenizer):
    """A seq2seq model without the package's generate (transformers' MarianMTModel, trainable with
    `--model_type marian`): the core applies the length rule per sentence with the model code's processor; greedy
    outputs do not depend on the batch, and every hypothesis stays within its own sentence's limit."""
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=1,
        forced_eos_token_id=None,
    )
    model = MarianMTModel(config).eval()
    with torch.no_grad():  # never `</s>` of its own: every output runs to its sentence's limit (the rule binds)
        model.final_logits_bias[0, config.eos_token_id] = -1e4
    translator = Translator(model, tokenizer)
    assert not translator.engine._length_rule_kwarg
    options = DecodeOptions(num_beams=1, max_len_a=0.5, max_len_b=2)
    one = translator.translate(SOURCES, options, batch_size=1)
    assert texts_of(translator.translate(SOURCES, options, batch_size=12)) == texts_of(one)
    lengths = translator.count_tokens(SOURCES)
    assert len(set(lengths)) > 1  # limits of several lengths in one batch
    assert [len(r.hypotheses[0].token_ids) for r in one] == [int(0.5 * n + 2) for n in lengths]
