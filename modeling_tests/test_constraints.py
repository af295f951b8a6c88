"""Lexically constrained decoding and glossaries in the translation core (`hf_variants.inference.constraints`,
`constrained`, `glossary`), on tiny models trained a few steps: every constraint appears in every hypothesis when
the beam can place it (disjunctive ones by one of their forms), a constraint that cannot fit the sentence's length
limit is reported instead of dropped, requests without constraints keep generate()'s tokens, a sentence's
translation does not depend on its batch or on the other requests of the call, the search's scores are the
teacher-forced log-probabilities of what it returns (so its cached steps, beam reordering and language inputs are
the model's own) on every model type, ONNX Runtime fp32 gives torch's hypotheses and scores, and the errors name
the field or option. Glossaries: matching (case, whole words, longest terms), file errors with file and line, and
term accuracy on handmade cases."""

from __future__ import annotations

import copy
import logging
import re
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
    Glossary,
    GlossaryError,
    OptionError,
    TranslationRequest,
    Translator,
    normalize_constraints,
    parse_constraints,
)
from hf_variants.inference.constrained import DecoderSteps, _row_top, word_continuations  # noqa: E402
from hf_variants.inference.constraints import ConstraintTracker  # noqa: E402
from hf_variants.training.evaluation import term_accuracy  # noqa: E402

SOURCES = read_sentences("en", "val", n=12)
RULE = {"max_len_a": 1.0, "max_len_b": 6}
# per source: constraints in the request's form (a phrase, or a tuple of alternative forms)
CONSTRAINTS = [
    ("Hund",),
    (("Straße", "Strasse"),),
    ("Kasse", "Hund"),
    ("rote Mütze",),
    ("Ball", ("Wasser", "Strand")),
    ("Gitarre",),
    ("Fahrrad", "Kinder", "Hund"),
    (("blauen Himmel", "Himmel"),),
]


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def baseline(tokenizer):
    return Translator(trained_baseline(tokenizer), tokenizer)


def constrained_requests(count=len(CONSTRAINTS), **fields):
    return [TranslationRequest(SOURCES[i], constraints=CONSTRAINTS[i], **fields) for i in range(count)]


def contains(ids, forms_ids) -> bool:
    """Whether `ids` holds one of `forms_ids` as a contiguous run."""
    return any(ids[i : i + len(f)] == f for f in forms_ids for i in range(len(ids) - len(f) + 1))


def form_ids(tokenizer, constraint):
    forms = (constraint,) if isinstance(constraint, str) else constraint
    return [tokenizer(form, add_special_tokens=False)["input_ids"] for form in forms]


def assert_scores_are_teacher_forced(translator, requests, results, length_penalty):
    """Each hypothesis' log_prob is the model's own cross-entropy of it (teacher forcing), and its score, which
    the constrained search summed over its cached steps, that log_prob over length ** length_penalty."""
    for request, result in zip(requests, results):
        inputs = translator.engine.encode([request])
        for hypothesis in result.hypotheses:
            n = len(hypothesis.token_ids)
            assert hypothesis.score == pytest.approx(hypothesis.log_prob / n**length_penalty, abs=1e-4)
            if translator.model is not None and not hasattr(translator.model, "manifest"):
                labels = torch.tensor([hypothesis.token_ids])
                with torch.no_grad():
                    loss = translator.model(**inputs, labels=labels).loss
                assert hypothesis.log_prob == pytest.approx(-float(loss) * n, abs=1e-4)


# ---------------------------------------------------------------------------------------------------- phrases
def test_constraints_are_normalized_and_bad_ones_named():
    assert normalize_constraints(None) == normalize_constraints([]) == ()
    assert normalize_constraints(["Kasse ", ("Warenkorb", "Einkaufswagen", "Warenkorb")]) == (
        ("Kasse",),
        ("Warenkorb", "Einkaufswagen"),
    )
    for value, message in (
        ("Kasse", r"constraints: expected a list of phrases, got a string"),
        (42, "constraints: expected a list of phrases, got int"),
        (["Kasse", "  "], r"constraints\[1\]: an empty phrase"),
        ([()], r"constraints\[0\]: a constraint without any form"),
        ([("Kasse", 3)], r"constraints\[0\]\[1\]: expected a string, got int"),
        (["zwei\nZeilen"], r"constraints\[0\]: one line expected"),
        ([{"Kasse"}], r"constraints\[0\]: expected a phrase or a tuple of alternative forms, got set"),
    ):
        with pytest.raises(ValueError, match=message):
            normalize_constraints(value)
    assert parse_constraints("Kasse|Kassenbereich\tWarenkorb\r\n") == (("Kasse", "Kassenbereich"), ("Warenkorb",))
    assert parse_constraints("   \n") == ()
    with pytest.raises(ValueError, match=r"file.txt:3: constraints\[1\]\[0\]: an empty phrase"):
        parse_constraints("Kasse\t\tWarenkorb", where="file.txt:3")


def test_tracker_matches_forms_wherever_they_appear():
    tracker = ConstraintTracker([[[1, 1, 2]], [[9], [3, 4]]])
    assert tracker.total == 3 + 1 and tracker.next_tokens(tracker.start) == [1, 3, 9]
    state = tracker.state_of([1, 1, 1])  # a repeated first token keeps the longest partial match (KMP)
    assert tracker.bank(state) == 2 and tracker.next_tokens(state) == [1, 2, 3, 9]
    state = tracker.advance(state, 2)
    assert tracker.met(state) == [True, False] and tracker.bank(state) == 3
    broken = tracker.state_of([1, 1, 7])  # a broken match loses its tokens from the bank
    assert tracker.bank(broken) == 0 and tracker.met(broken) == [False, False]
    state = tracker.state_of([5, 3, 4])  # the second constraint by its second form
    assert tracker.met(state) == [False, True] and not tracker.all_met(state) and tracker.bank(state) == 1
    assert tracker.all_met(tracker.advance(tracker.state_of([1, 1, 2, 8]), 9))
    overlapping = ConstraintTracker([[[1, 2]], [[2, 3]]])  # one token can end one form and begin the next
    assert overlapping.all_met(overlapping.state_of([1, 2, 3]))
    with pytest.raises(ValueError, match=r"constraints\[0\]: a form without tokens"):
        ConstraintTracker([[[]]])


def test_word_continuations_are_read_from_the_vocabulary(tokenizer):
    """The tokens that may not follow a completed constraint (it must end a word): Metaspace pieces without "▁"
    that begin with a letter or digit."""
    continuing = set(word_continuations(tokenizer))
    ids = {piece: tokenizer.convert_tokens_to_ids(piece) for piece in ("▁Hund", "ass", "e", ".", ",", "</s>")}
    assert {ids["ass"], ids["e"]} <= continuing
    assert not {ids["▁Hund"], ids["."], ids[","], ids["</s>"]} & continuing
    assert 0.2 < len(continuing) / len(tokenizer) < 0.9


# ---------------------------------------------------------------------------------------------- the baseline
def test_every_constraint_appears_in_every_hypothesis(baseline, tokenizer):
    """Beam 12: more beams than banks (up to 10 here: 9 constraint tokens), so the 2-best both meet every
    constraint; at beam 4 the 1-best does."""
    requests = constrained_requests()
    options = DecodeOptions(num_beams=12, nbest=2, scores=True, **RULE)
    results = baseline.translate(requests, options)
    assert all(r.constraints_met for r in baseline.translate(requests, DecodeOptions(num_beams=4, **RULE)))
    plain = baseline.translate([r.source for r in requests], DecodeOptions(num_beams=4, **RULE))
    absent = 0
    for request, result, alone in zip(requests, results, plain):
        assert result.constraints == normalize_constraints(request.constraints)
        assert result.constraints_met is True and result.unmet_constraints == []
        for constraint in request.constraints:
            forms = form_ids(tokenizer, constraint)
            absent += not contains(alone.hypotheses[0].token_ids, forms)
            for hypothesis in result.hypotheses:
                assert contains(hypothesis.token_ids, forms), (constraint, hypothesis.tokens)
                words = (constraint,) if isinstance(constraint, str) else constraint  # whole words in the text
                assert any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", hypothesis.text) for w in words), hypothesis.text
        for hypothesis in result.hypotheses:
            assert hypothesis.constraints_met == [True] * len(request.constraints)
            assert hypothesis.token_ids[-1] == tokenizer.eos_token_id
        assert result.hypotheses[0].score >= result.hypotheses[1].score
    assert absent >= 8  # most constraints are not what the model says unconstrained: the search placed them
    assert_scores_are_teacher_forced(baseline, requests, results, baseline.resolve(options).length_penalty)
    assert results[0].hypotheses[0].to_dict()["constraints_met"] == [True]
    assert "constraints_met" not in plain[0].hypotheses[0].to_dict()


def test_outputs_without_constraints_keep_generates_tokens_and_mixed_batches_change_nothing(baseline):
    options = DecodeOptions(num_beams=4, nbest=2, scores=True, **RULE)
    resolved = baseline.resolve(options)
    plain = [TranslationRequest(s) for s in SOURCES]
    engine = baseline.engine
    inputs = engine.encode(plain)
    generated = baseline.model.generate(**inputs, **engine.generate_kwargs(inputs, plain, resolved))
    today = [engine._hypothesis_ids(row) for row in generated.tolist()]
    alone = baseline.translate(plain, options)
    assert [h.token_ids for r in alone for h in r.hypotheses] == today
    assert all(h.constraints_met is None for r in alone for h in r.hypotheses)
    # half of the call constrained, interleaved: each request gets what it gets alone
    constrained = constrained_requests(6)
    mixed = [constrained[i // 2] if i % 2 else plain[i] for i in range(12)]
    together = baseline.translate(mixed, options, batch_size=5)
    singly = [baseline.translate([r], options)[0] for r in constrained]
    for i, result in enumerate(together):
        expected = singly[i // 2] if i % 2 else alone[i]
        assert [h.token_ids for h in result.hypotheses] == [h.token_ids for h in expected.hypotheses]
        assert [h.score for h in result.hypotheses] == pytest.approx([h.score for h in expected.hypotheses], abs=1e-5)
    # constrained batches of 1, 3 and all: the same hypotheses
    for batch_size in (3, None):
        batched = baseline.translate(constrained, options, batch_size=batch_size)
        assert [[h.token_ids for h in r.hypotheses] for r in batched] == [
            [h.token_ids for h in r.hypotheses] for r in singly
        ]


def test_greedy_search_becomes_beam_search_for_constrained_sentences(baseline, caplog):
    requests = [
        TranslationRequest(SOURCES[0], constraints=("Hund",)),
        TranslationRequest(SOURCES[1], constraints=("Hund", "Ball", "Kasse", "Kinder")),
        TranslationRequest(SOURCES[2]),
    ]
    with caplog.at_level(logging.WARNING, logger="hf_variants.inference.translator"):
        greedy = baseline.translate(requests, DecodeOptions(num_beams=1, **RULE))
        baseline.translate(requests, DecodeOptions(num_beams=1, **RULE))
    said = [r.message for r in caplog.records if "constraints need beam search" in r.message]
    assert len(said) <= 1 and (said or baseline._promotion_said)  # once per translator
    assert baseline.translate(requests[:1], DecodeOptions(num_beams=4, **RULE))[0].text == greedy[0].text
    assert baseline.translate(requests[1:2], DecodeOptions(num_beams=5, **RULE))[0].text == greedy[1].text
    assert baseline.translate(requests[2:], DecodeOptions(num_beams=1, **RULE))[0].text == greedy[2].text
    assert greedy[0].constraints_met and greedy[1].constraints_met


def test_prefix_and_constraints_together(baseline, tokenizer):
    requests = [
        TranslationRequest(SOURCES[0], prefix="Ein Mann", constraints=("Hund",)),
        TranslationRequest(SOURCES[3], prefix="Zwei", constraints=(("Straße", "Strasse"), "Ball")),
    ]
    results = baseline.translate(requests, DecodeOptions(num_beams=4, nbest=2, **RULE))
    for request, result in zip(requests, results):
        forced = tokenizer(request.prefix, add_special_tokens=False)["input_ids"]
        for hypothesis in result.hypotheses:
            assert hypothesis.token_ids[: len(forced)] == forced
            assert all(contains(hypothesis.token_ids, form_ids(tokenizer, c)) for c in request.constraints)


def test_a_constraint_that_cannot_fit_is_reported_not_dropped(baseline, tokenizer):
    """The prefix fills the limit but for 3 tokens: "Kasse" (3 tokens) fits the check (3 < limit) but not with
    </s> after the prefix. The best hypothesis comes back, ending at the limit, and says what it misses."""
    prefix = "Ein Mann mit einem roten Hemd"
    n = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    request = TranslationRequest(SOURCES[0], prefix=prefix, constraints=("Kasse", "Mann"))
    options = DecodeOptions(num_beams=4, nbest=2, scores=True, max_len_a=0.0, max_len_b=n + 3)
    (result,) = baseline.translate([request], options)
    assert result.constraints_met is False and result.unmet_constraints == [("Kasse",)]
    best = result.hypotheses[0]
    assert best.constraints_met == [False, True] and best.token_ids[-1] == tokenizer.eos_token_id
    assert len(best.token_ids) <= n + 3 and best.log_prob is not None
    # a fixed limit without a forced </s>: the hypothesis is cut there, still reported
    cut = baseline.translate(
        [TranslationRequest(SOURCES[0], constraints=("Kasse", "Hund", "Ball"))],
        DecodeOptions(num_beams=2, max_new_tokens=8),
    )[0]
    assert len(cut.hypotheses[0].token_ids) <= 8
    assert cut.constraints_met == all(cut.hypotheses[0].constraints_met)


def test_request_and_option_errors_name_the_field(baseline, tokenizer):
    options = DecodeOptions(num_beams=4, **RULE)
    for constraints, message in (
        (("Hund", ""), r"requests\[1\]: constraints\[1\]: an empty phrase"),
        ("Hund", r"requests\[1\]: constraints: expected a list of phrases, got a string"),
        ((("Hund", "\U0001f600"),), r"requests\[1\]: constraints\[0\]\[1\]: '😀' tokenizes to the special token"),
    ):
        requests = [SOURCES[0], TranslationRequest(SOURCES[1], constraints=constraints)]
        with pytest.raises(ValueError, match=message):
            baseline.translate(requests, options)
    long = TranslationRequest(SOURCES[0], constraints=("rote Mütze", "Fahrrad"))  # 6 + 5 tokens
    with pytest.raises(ValueError, match=r"requests\[0\]: constraints: 11 tokens .* limited to 8 tokens"):
        baseline.translate([long], DecodeOptions(num_beams=4, max_len_a=0.0, max_len_b=8))
    for bad, names in (
        (DecodeOptions(do_sample=True, **RULE), ("constraints", "do_sample")),
        (DecodeOptions(num_beams=4, no_repeat_ngram_size=2, **RULE), ("constraints", "no_repeat_ngram_size")),
        (DecodeOptions(num_beams=4, repetition_penalty=1.3, **RULE), ("constraints", "repetition_penalty")),
    ):
        with pytest.raises(OptionError, match="constraints: constrained beam search does not implement") as caught:
            baseline.translate([TranslationRequest(SOURCES[0], constraints=("Hund",))], bad)
        assert caught.value.names == names
    # a form that tokenizes to nothing: a real tokenizer whose normalizer deletes a character
    from tokenizers import normalizers

    deleting = copy.deepcopy(tokenizer)
    deleting.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace("\u2063", "")]
    )
    translator = Translator(baseline.model, deleting)
    with pytest.raises(ValueError, match=r"requests\[0\]: constraints\[0\]: '\\u2063' tokenizes to no tokens"):
        translator.translate([TranslationRequest(SOURCES[0], constraints=("\u2063",))], options)


def test_ctranslate2_refuses_constraints_naming_the_field(baseline, tokenizer, tmp_path):
    pytest.importorskip("ctranslate2")
    from hf_variants.deploy.ctranslate2 import export

    export(baseline.model, tokenizer, tmp_path / "ct2")
    translator = Translator.from_pretrained(str(tmp_path / "ct2"), engine="ctranslate2", num_threads=1)
    with pytest.raises(OptionError, match="constraints: the ctranslate2 engine has no lexically") as caught:
        translator.translate([SOURCES[0], TranslationRequest(SOURCES[1], constraints=("Hund",))])
    assert caught.value.names == ("constraints",)
    assert translator.translate([SOURCES[0]])[0].text  # without constraints it translates


# ----------------------------------------------------------------------------------------------- every type
TYPES = {
    "transformer_nmt": (TransformerNmtForConditionalGeneration, TransformerNmtConfig, {}, None),
    "mute_nmt": (MuteForConditionalGeneration, MuteConfig, {}, None),
    "hysan_nmt": (HysanForConditionalGeneration, HysanConfig, {}, None),
    "mgsa_nmt": (MgsaForConditionalGeneration, MgsaConfig, {"phrase_type": "ngram"}, None),
    "mimo_nmt": (
        MimoForConditionalGeneration,
        MimoConfig,
        {"num_transformations": 3, "languages": list(LANGUAGES), "mixing_init_std": 0.5},
        ["de", "fr"],
    ),
    "tied_nmt": (
        TiedTransformerForConditionalGeneration,
        TiedTransformerConfig,
        {"languages": list(LANGUAGES)},
        ["de", "fr"],
    ),
}


def typed_model(model_type, tokenizer):
    model_class, config_class, overrides, langs = TYPES[model_type]
    tgt_lang = langs[0] if langs else None
    return trained_tiny(model_class, config_class, tokenizer, steps=30, tgt_lang=tgt_lang, **overrides), langs


def typed_requests(langs, count=6):
    return [
        TranslationRequest(
            SOURCES[i],
            tgt_lang=langs[i % len(langs)] if langs else None,
            constraints=CONSTRAINTS[i],
            prefix="Ein" if i == 2 else None,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("model_type", list(TYPES))
def test_every_model_type(model_type, tokenizer):
    """Constraints met, scores that are the teacher-forced log-probabilities (the search's cached steps, beam
    reordering and per-sentence target languages are the model's own), and a batch that changes nothing."""
    model, langs = typed_model(model_type, tokenizer)
    translator = Translator(model, tokenizer)
    requests = typed_requests(langs)
    options = DecodeOptions(num_beams=3, nbest=2, scores=True, **RULE)
    results = translator.translate(requests, options)
    for request, result in zip(requests, results):
        assert result.constraints_met, (model_type, result.hypotheses[0].text)
        for hypothesis in result.hypotheses:  # the 2nd-best may miss one at beam 3 (fewer beams than banks)
            assert hypothesis.constraints_met == [
                contains(hypothesis.token_ids, form_ids(tokenizer, c)) for c in request.constraints
            ]
    assert_scores_are_teacher_forced(translator, requests, results, translator.resolve(options).length_penalty)
    singly = [translator.translate([r], options)[0] for r in requests[:3]]
    assert [r.text for r in singly] == [r.text for r in results[:3]]


def test_a_plain_transformers_model(tokenizer):
    """A seq2seq model without the package's generation code (transformers' MarianMTModel): its own cache
    reordering, the same search."""
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
    translator = Translator(MarianMTModel(config).eval(), tokenizer)
    requests = constrained_requests(4)
    options = DecodeOptions(num_beams=3, nbest=2, scores=True, **RULE)
    results = translator.translate(requests, options)
    assert all(r.constraints_met for r in results)
    assert_scores_are_teacher_forced(translator, requests, results, translator.resolve(options).length_penalty)


# ---------------------------------------------------------------------------------------------- ONNX Runtime
ONNX_TYPES = ("transformer_nmt", "mute_nmt", "mimo_nmt")


@pytest.fixture(scope="module", params=ONNX_TYPES)
def onnx_pair(request, tokenizer, tmp_path_factory):
    """(torch translator, ONNX Runtime fp32 translator of its export, target languages): the baseline and MIMO on
    the shared-cache step graph, MUTE on the concatenated cache of its step graph."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    if request.param == "transformer_nmt":
        model, langs = trained_baseline(tokenizer), None
    else:
        model, langs = typed_model(request.param, tokenizer)
    folder = tmp_path_factory.mktemp(request.param) / "onnx"
    export(model, tokenizer, folder, progress=False)
    ort = OrtModelForSeq2SeqLM.from_pretrained(folder, num_threads=1)
    assert (ort.shared_cache_graph is not None) == (request.param != "mute_nmt")
    return Translator(model, tokenizer), Translator(ort, tokenizer), langs


def test_onnx_runtime_fp32_equals_torch_with_constraints(onnx_pair):
    torch_translator, ort_translator, langs = onnx_pair
    requests = typed_requests(langs, count=8)
    requests[5] = TranslationRequest(SOURCES[5], tgt_lang=requests[5].tgt_lang)  # one without constraints
    options = DecodeOptions(num_beams=4, nbest=2, scores=True, **RULE)
    expected = torch_translator.translate(requests, options, batch_size=3)
    got = ort_translator.translate(requests, options, batch_size=3)
    for a, b in zip(expected, got):
        assert [h.text for h in b.hypotheses] == [h.text for h in a.hypotheses]
        assert [h.token_ids for h in b.hypotheses] == [h.token_ids for h in a.hypotheses]
        assert [h.constraints_met for h in b.hypotheses] == [h.constraints_met for h in a.hypotheses]
        assert [h.score for h in b.hypotheses] == pytest.approx([h.score for h in a.hypotheses], abs=1e-4)
        assert [h.log_prob for h in b.hypotheses] == pytest.approx([h.log_prob for h in a.hypotheses], abs=1e-4)
    assert sum(bool(r.constraints_met) for r in got) == 7


class CountingSteps(DecoderSteps):
    """An engine's step interface that records the rows of every decoding step."""

    def __init__(self, inner: DecoderSteps):
        self.inner, self.rows = inner, []

    def start(self, inputs, beams, max_new_tokens):
        self.inner.start(inputs, beams, max_new_tokens)

    def logits(self, sequences):
        self.rows.append(sequences.shape[0])
        return self.inner.logits(sequences)

    def reorder(self, rows):
        self.inner.reorder(rows)

    def keep(self, sentences):
        self.inner.keep(sentences)

    def scope(self):
        return self.inner.scope()


def test_done_sentences_leave_the_rows_and_change_no_hypothesis(onnx_pair, monkeypatch):
    """On torch and ONNX Runtime (the shared-cache buffers of the baseline and MIMO, MUTE's concatenated cache): a
    sentence that is done is not decoded further (the batch's rows shrink as its sentences finish), and each
    sentence's hypotheses and scores are those it gets alone."""
    requests = typed_requests(onnx_pair[2], count=8)
    options = DecodeOptions(num_beams=4, nbest=2, scores=True, **RULE)
    for translator in onnx_pair[:2]:
        searches: list[CountingSteps] = []

        def counting(original=translator.engine.decoder_steps, searches=searches):
            searches.append(CountingSteps(original()))
            return searches[-1]

        monkeypatch.setattr(translator.engine, "decoder_steps", counting)
        together = translator.translate(requests, options, batch_size=8)
        rows = searches[0].rows
        assert len(searches) == 1 and rows[0] == 8 * 4, rows
        assert rows == sorted(rows, reverse=True) and rows[-1] < rows[0], rows
        for request, result in zip(requests, together):
            alone = translator.translate([request], options)[0]
            assert [h.token_ids for h in result.hypotheses] == [h.token_ids for h in alone.hypotheses]
            assert [h.score for h in result.hypotheses] == pytest.approx([h.score for h in alone.hypotheses], abs=1e-5)


# -------------------------------------------------------------------------------------------------- glossaries
def write(path: Path, content: bytes | str) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def test_glossary_files_load_and_bad_lines_are_named(tmp_path):
    good = write(tmp_path / "good.tsv", "\ufeffcheckout\tKasse|Kassenbereich\r\n\ncredit  card\tKreditkarte\r\n")
    glossary = Glossary.load(good)
    assert [(t.source, t.targets, t.line) for t in glossary] == [
        ("checkout", ("Kasse", "Kassenbereich"), 1),
        ("credit card", ("Kreditkarte",), 3),
    ]
    for name, content, message in (
        ("tab.tsv", "checkout Kasse\n", r"tab.tsv:1: expected 2 tab-separated fields .*, got 1"),
        ("extra.tsv", "a\tb\n\nc\td\te\n", r"extra.tsv:3: expected 2 tab-separated fields .*, got 3"),
        ("source.tsv", "a\tb\n \tKasse\n", r"source.tsv:2: an empty source term"),
        ("target.tsv", "checkout\t  \n", r"target.tsv:1: an empty target term"),
        ("form.tsv", "checkout\tKasse||Kassenbereich\n", r"form.tsv:1: form 2 of the target term"),
        ("bytes.tsv", b"a\tb\ncaf\xe9\tCafe\n", r"bytes.tsv:2: not UTF-8 \(byte 4 of the line\)"),
        ("empty.tsv", "\n\n", r"empty.tsv: no terms"),
        ("twice.tsv", "checkout\tKasse\ncart\tWarenkorb\ncheckout\tKassa\n", r"twice.tsv:3: the source term .*line 1"),
    ):
        with pytest.raises(GlossaryError, match=message):
            Glossary.load(write(tmp_path / name, content))
    same = write(tmp_path / "same.tsv", "checkout\tKasse\ncheckout\tKasse\n")
    assert len(Glossary.load(same)) == 1  # the same entry twice is one term
    cased = write(tmp_path / "cased.tsv", "Checkout\tKasse\ncheckout\tKassa\n")
    assert len(Glossary.load(cased)) == 2  # two terms when case matters
    with pytest.raises(GlossaryError, match=r"cased.tsv:2: the source term 'checkout' is given twice"):
        Glossary.load(cased, ignore_case=True)
    with pytest.raises(GlossaryError, match=r"terms\[1\]: an empty source term"):
        Glossary([("cart", "Warenkorb"), ("", "x")])


def test_glossary_matching_case_words_and_longest_terms():
    terms = [("cat", "Katze"), ("credit card", "Kreditkarte"), ("card", "Karte"), ("Checkout", ("Kasse", "Kassa"))]
    exact = Glossary(terms)
    assert exact.constraints_for("The cat paid by credit  card at the checkout.") == (("Katze",), ("Kreditkarte",))
    assert exact.constraints_for("A category of cards, a card.") == (("Karte",),)  # whole words only
    loose = Glossary(terms, ignore_case=True, whole_word=False)
    assert loose.constraints_for("A Category at CHECKOUT, one card.") == (("Katze",), ("Kasse", "Kassa"), ("Karte",))
    assert [t.source for t in loose.find("cat cat CAT")] == ["cat"]  # once per sentence
    request = loose.apply(TranslationRequest("checkout with a card", constraints=("Karte", "bitte")))
    assert request.constraints == (("Karte",), ("bitte",), ("Kasse", "Kassa"))
    assert exact.apply("No term here.").constraints == ()
    checks = Glossary(terms, ignore_case=True).check("The cat at the checkout.", "Die KATZE an der Kassa-Theke.")
    assert [(c.source, c.found, c.form) for c in checks] == [("cat", True, "Katze"), ("Checkout", True, "Kassa")]
    assert [c.to_dict() for c in exact.check("A cat.", "Eine Katzenklappe.")] == [
        {"source": "cat", "target": ["Katze"], "found": False}  # whole word: not inside "Katzenklappe"
    ]


def test_a_glossary_over_another_overrides_its_terms_and_matches_the_longest_of_both():
    base = Glossary([("card", "Karte"), ("credit card", "Kreditkarte"), ("dog", "Hund")], ignore_case=True)
    over = base.with_terms([("DOG", "Köter"), ("gift card", "Geschenkkarte"), ("credit", "Kredit")])
    assert (over.ignore_case, over.whole_word) == (True, True)
    # its own terms first, then the base's it does not give again; the base itself is unchanged
    assert [(t.source, t.targets) for t in over] == [
        ("DOG", ("Köter",)),
        ("gift card", ("Geschenkkarte",)),
        ("credit", ("Kredit",)),
        ("card", ("Karte",)),
        ("credit card", ("Kreditkarte",)),
    ]
    assert base.constraints_for("A dog with a gift card.") == (("Hund",), ("Karte",))
    # leftmost-longest over both: "gift card" (own) over "card" (base), "credit card" (base) over "credit" (own)
    assert over.constraints_for("A dog with a gift card and a credit card.") == (
        ("Köter",),
        ("Geschenkkarte",),
        ("Kreditkarte",),
    )
    assert over.constraints_for("Credit, then a card.") == (("Kredit",), ("Karte",))
    with pytest.raises(GlossaryError, match=r"glossary\[1\]: the source term 'Dog' is given twice"):
        base.with_terms([("dog", "Köter"), ("Dog", "Hündchen")])


def test_term_accuracy_numbers():
    glossary = Glossary([("dog", "Hund"), ("street", "Straße|Strasse"), ("ball", "Ball")], ignore_case=True)
    sources = ["A dog on the street.", "The dog and the ball.", "Nothing here.", "A Ball."]
    hypotheses = ["Ein Hund auf der Strasse.", "Der Hund und die Kugel.", "Nichts.", "Ein Ball."]
    # applied: dog, street | dog, ball | - | ball  -> 5 terms; found: Hund, Strasse | Hund | - | Ball -> 4
    assert term_accuracy(sources, hypotheses, glossary) == {
        "term_accuracy": 0.8,
        "terms": 5,
        "terms_found": 4,
        "sentences_with_terms": 3,
    }
    assert term_accuracy(["Nothing."], ["Nichts."], glossary)["term_accuracy"] is None
    with pytest.raises(ValueError, match="1 hypotheses for 2 sources"):
        term_accuracy(sources[:2], hypotheses[:1], glossary)


def test_a_glossary_through_the_translator_raises_term_accuracy(baseline):
    glossary = Glossary([("dog", "Hund"), ("man", "Kerl"), ("street", "Straße|Strasse"), ("shirt", "Kasse")])
    sources = [s for s in read_sentences("en", "val", n=60) if glossary.find(s)][:8]
    assert len(sources) >= 5
    options = DecodeOptions(num_beams=4, **RULE)
    without = [r.text for r in baseline.translate(sources, options)]
    results = baseline.translate([glossary.apply(s) for s in sources], options)
    with_glossary = [r.text for r in results]
    assert term_accuracy(sources, with_glossary, glossary)["term_accuracy"] == 1.0
    assert term_accuracy(sources, without, glossary)["term_accuracy"] < 1.0
    assert all(r.constraints_met for r in results)


@pytest.mark.parametrize("vocab", [8000, 997, 40])
def test_the_two_level_row_top_k_is_each_rows_top_k(vocab):
    """The search's per-row top-k (two-level over blocks where the vocabulary splits) gives each row's k best values
    and their columns, best first, as a top-k over the row does: rows with excluded tokens (-inf), a forced row (one
    finite value), a row with every value excluded."""
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(24, vocab, generator=generator)
    scores[1, : vocab // 2] = float("-inf")
    scores[2, torch.randperm(vocab, generator=generator)[: vocab - 3]] = float("-inf")
    scores[3] = float("-inf")
    scores[3, 7] = 0.5
    scores[4] = float("-inf")
    for k in (1, 8, 16):
        values, columns = _row_top(scores, k)
        expected_values, expected_columns = scores.topk(k, dim=1)
        assert torch.equal(values, expected_values)
        finite = expected_values > float("-inf")
        assert torch.equal(columns[finite], expected_columns[finite])
        assert torch.equal(scores.gather(1, columns), values)  # every column holds its value
