"""`inference.scoring.score_pairs` on every model type (tiny, trained a few steps so that scores are far from
uniform): the token-weighted mean score is the model's plain cross-entropy, an empty target scores its `</s>` alone,
batches (sentences or tokens, any size) change nothing and the order is restored, the score of a decoded hypothesis
is its n-best `log_prob`, and ONNX Runtime fp32 scores equal torch's."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import LANGUAGES, read_sentences
from trained_tiny import trained_baseline

import hf_variants
from hf_variants.inference import DecodeOptions, TranslationRequest, Translator
from hf_variants.inference.scoring import PairScore, score_pairs, summarize, target_ids

N = 10
SOURCES = read_sentences("en", "val", n=N)
TARGETS = {lang: read_sentences(lang, "val", n=N) for lang in ("de", "fr")}
for _targets in TARGETS.values():
    _targets[3] = ""  # an empty target: its </s> alone


def _flat_parse(sentence: str) -> str:
    """A parse (S, pairs of words as NP, NN leaves) of a whitespace-tokenized sentence."""
    words = sentence.split()
    pairs = [" ".join(f"(NN {w})" for w in words[i : i + 2]) for i in range(0, len(words), 2)]
    return "(ROOT (S " + " ".join(f"(NP {pair})" for pair in pairs) + "))"


# case -> (model type, config overrides, target language per pair or None, variant inputs per source)
CASES = {
    "transformer_nmt": ("transformer_nmt", {}, None, None),
    "transformer_nmt_tags": (
        "transformer_nmt",
        dict(languages=list(LANGUAGES), target_language_tags=True),
        "mix",
        None,
    ),
    "mute_nmt": ("mute_nmt", {}, None, None),
    "hysan_nmt": ("hysan_nmt", dict(local_k=2), None, None),
    "mgsa_nmt": ("mgsa_nmt", dict(phrase_type="ngram"), None, None),
    "mgsa_nmt_syntactic": ("mgsa_nmt", dict(phrase_type="syntactic"), None, "parses"),
    "mimo_nmt": ("mimo_nmt", dict(languages=list(LANGUAGES), num_transformations=2), "mix", None),
    "tied_nmt": ("tied_nmt", dict(languages=list(LANGUAGES)), "mix", None),
}
_TRAINED: dict = {}


def _langs(case: str, n: int) -> list[str] | None:
    return ["de" if i % 2 == 0 else "fr" for i in range(n)] if CASES[case][2] == "mix" else None


def _targets(case: str, sources_n: int = N, targets=TARGETS) -> list[str]:
    langs = _langs(case, sources_n)
    return [targets[langs[i] if langs else "de"][i] for i in range(sources_n)]


def _annotations(case: str, sources) -> dict:
    return {"parses": [_flat_parse(s) for s in sources]} if CASES[case][3] == "parses" else {}


def trained(case: str, tokenizer, steps: int = 30):
    """A tiny model of `case` after `steps` Adam steps on 64 real pairs (en->de, and en->fr for the multilingual
    cases), trained once per test session."""
    if case not in _TRAINED:
        model_type, overrides, _, _ = CASES[case]
        if case == "transformer_nmt":
            _TRAINED[case] = trained_baseline(tokenizer, steps=150)
            return _TRAINED[case]
        torch.manual_seed(0)
        config_class, _, model_class = hf_variants.MODEL_CLASSES[model_type]
        config = config_class.from_preset(
            "tiny", vocab_size=len(tokenizer), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **overrides
        )
        model = model_class(config)
        sources = read_sentences("en", n=64)
        train_targets = {lang: read_sentences(lang, n=64) for lang in ("de", "fr")}
        batches = []
        for start in range(0, 64, 16):
            src = sources[start : start + 16]
            langs = _langs(case, 16)
            tgt = [train_targets[langs[i] if langs else "de"][start + i] for i in range(16)]
            kwargs = {"tgt_lang": langs} if langs else {}
            batches.append(
                model.prepare_translation_inputs(
                    tokenizer, src, text_target=tgt, max_length=24, **kwargs, **_annotations(case, src)
                )
            )
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a tiny model gains nothing from a second thread, and loses a lot on a busy CPU
        try:
            for step in range(steps):
                model(**batches[step % len(batches)]).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        finally:
            torch.set_num_threads(threads)
        _TRAINED[case] = model.eval()
    return _TRAINED[case]


def _score(case, model, tokenizer, **kwargs) -> list[PairScore]:
    return score_pairs(
        model,
        SOURCES,
        _targets(case),
        tokenizer=tokenizer,
        tgt_lang=_langs(case, N),
        annotations=_annotations(case, SOURCES),
        **kwargs,
    )


def _plain_cross_entropy(model, tokenizer, case) -> tuple[float, int]:
    """The model's own loss (no smoothing, auxiliary losses removed) over the pairs, token-weighted over the
    target languages (one forward per language: the Tied Transformer sums per-direction means), and the number of
    target tokens."""
    langs = _langs(case, N)
    total, tokens = 0.0, 0
    for lang in sorted(set(langs)) if langs else [None]:
        idx = [i for i in range(N) if langs is None or langs[i] == lang]
        kwargs = {"tgt_lang": lang} if lang else {}
        sources = [SOURCES[i] for i in idx]
        inputs = model.prepare_translation_inputs(
            tokenizer, sources, text_target=[_targets(case)[i] for i in idx], **kwargs, **_annotations(case, sources)
        )
        with torch.no_grad():
            out = model(**inputs)
        loss = out.loss - sum((out.aux_losses or {}).values(), torch.tensor(0.0))
        n = int((inputs["labels"] != -100).sum())
        total, tokens = total + float(loss) * n, tokens + n
    return total / tokens, tokens


@pytest.mark.parametrize("case", list(CASES))
def test_mean_score_is_the_cross_entropy(case, tokenizer):
    model = trained(case, tokenizer)
    scores = _score(case, model, tokenizer, batch_size=4)
    summary = summarize(scores)
    cross_entropy, tokens = _plain_cross_entropy(model, tokenizer, case)
    assert summary.tokens == tokens and summary.scored == N
    assert -summary.mean_log_prob == pytest.approx(cross_entropy, abs=1e-5)
    assert summary.ppl == pytest.approx(math.exp(cross_entropy), rel=1e-4)
    # trained: far below a uniform model's log(vocabulary), and the pairs differ
    assert cross_entropy < math.log(len(tokenizer)) - 0.5
    per_token = [s.log_prob / s.tokens for s in scores]
    assert max(per_token) - min(per_token) > 0.3
    # the empty target: </s> alone, the log-softmax of the first position's logits at </s>
    empty = scores[3]
    assert empty.tokens == 1 and empty.ppl == pytest.approx(math.exp(-empty.log_prob))
    kwargs = {"tgt_lang": _langs(case, N)[3]} if _langs(case, N) else {}
    inputs = model.prepare_translation_inputs(tokenizer, [SOURCES[3]], **kwargs, **_annotations(case, [SOURCES[3]]))
    start = torch.full((1, 1), model.config.decoder_start_token_id)
    with torch.no_grad():
        logits = model(**inputs, decoder_input_ids=start).logits[0, 0]
    assert empty.log_prob == pytest.approx(float(torch.log_softmax(logits, -1)[model.config.eos_token_id]), abs=1e-5)


@pytest.mark.parametrize("case", ["transformer_nmt", "mimo_nmt"])
def test_batches_change_nothing_and_the_order_is_restored(case, tokenizer):
    """Every pair scored alone is the reference; length-sorted batches of 3 pairs, token batches and one batch of
    all pairs give the same scores at the same positions, and each token's score sums to the pair's."""
    model = trained(case, tokenizer)
    alone = [
        score_pairs(
            model,
            [SOURCES[i]],
            [_targets(case)[i]],
            tokenizer=tokenizer,
            tgt_lang=_langs(case, N)[i] if _langs(case, N) else None,
        )[0]
        for i in range(N)
    ]
    assert len({s.tokens for s in alone}) > 3  # different lengths: the sorted batches reorder them
    for kwargs in (dict(batch_size=3), dict(batch_size=None, max_tokens=60), dict(batch_size=N)):
        batched = _score(case, model, tokenizer, token_scores=True, **kwargs)
        for a, b in zip(alone, batched):
            assert b.tokens == a.tokens and b.log_prob == pytest.approx(a.log_prob, abs=1e-4), kwargs
            assert math.fsum(b.token_log_probs) == pytest.approx(b.log_prob) and len(b.token_log_probs) == b.tokens


def test_too_long_pairs_are_not_scored(tokenizer):
    """A source or a target longer than the model's positions: `log_prob` None, `too_long`, counted apart in the
    summary; the other pairs are scored as without them."""
    torch.manual_seed(0)
    config = hf_variants.TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), max_position_embeddings=40, position_embedding_type="learned"
    )
    model = hf_variants.TransformerNmtForConditionalGeneration(config).eval()
    long = " ".join(read_sentences("en", "val", n=4, start=20))
    sources = [SOURCES[0], long, SOURCES[1], SOURCES[2]]
    targets = [TARGETS["de"][0], TARGETS["de"][1], long, TARGETS["de"][2]]
    scores = score_pairs(model, sources, targets, tokenizer=tokenizer, batch_size=2)
    assert [s.too_long for s in scores] == [False, True, True, False]
    assert scores[1].log_prob is None and scores[1].to_dict() == {
        "log_prob": None,
        "tokens": scores[1].tokens,
        "ppl": None,
    }
    kept = score_pairs(model, [SOURCES[0], SOURCES[2]], [TARGETS["de"][0], TARGETS["de"][2]], tokenizer=tokenizer)
    assert [scores[0].log_prob, scores[3].log_prob] == pytest.approx([s.log_prob for s in kept], abs=1e-5)
    summary = summarize(scores)
    assert (summary.scored, summary.too_long_lines, summary.tokens) == (2, [2, 3], kept[0].tokens + kept[1].tokens)


@pytest.mark.parametrize("case", ["transformer_nmt", "tied_nmt"])
def test_score_of_a_hypothesis_is_its_nbest_log_prob(case, tokenizer):
    """Beam search with 4 hypotheses a sentence (and greedy search): scoring each hypothesis' text gives the
    `log_prob` the n-best output reported (fp32, 1e-4), wherever the text tokenizes back to the generated tokens
    (most hypotheses; every hypothesis when scored from its token ids)."""
    model = trained(case, tokenizer)
    translator = Translator(model, tokenizer)
    langs = _langs(case, N)
    requests = [TranslationRequest(s, tgt_lang=langs[i] if langs else None) for i, s in enumerate(SOURCES)]
    for options in (
        DecodeOptions(num_beams=4, nbest=4, scores=True),
        DecodeOptions(num_beams=1, scores=True),
    ):
        results = translator.translate(requests[:6], options)
        pairs = [(i, hyp) for i, result in enumerate(results) for hyp in result.hypotheses]
        scores = score_pairs(
            translator,
            [SOURCES[i] for i, _ in pairs],
            [hyp.text for _, hyp in pairs],
            tgt_lang=[langs[i] for i, _ in pairs] if langs else None,
            batch_size=7,
        )
        ids = target_ids(tokenizer, [hyp.text for _, hyp in pairs])
        same = [k for k, (_, hyp) in enumerate(pairs) if ids[k] == list(hyp.token_ids)]
        assert len(same) >= 0.7 * len(pairs)
        for k in same:
            assert scores[k].log_prob == pytest.approx(pairs[k][1].log_prob, abs=1e-4)
            assert scores[k].tokens == len(pairs[k][1].token_ids)
        # from the generated token ids themselves: every hypothesis
        values = translator.engine.token_log_probs([requests[i] for i, _ in pairs], [h.token_ids for _, h in pairs])
        for (_, hyp), per_token in zip(pairs, values):
            assert math.fsum(per_token) == pytest.approx(hyp.log_prob, abs=1e-4)


@pytest.fixture(scope="module")
def onnx_export(tokenizer, tmp_path_factory):
    """The trained tiny Tied Transformer (the target language an input of every graph) exported with its fp32 and
    int8 graphs, the scoring graph included (the shared-cache step graph left out: `test_onnx` covers it)."""
    from hf_variants.onnx.export import export

    folder = tmp_path_factory.mktemp("scoring") / "onnx"
    export(
        trained("tied_nmt", tokenizer), tokenizer, folder, int8=True, progress=False, shared_cache=False, scoring=True
    )
    return folder


@pytest.mark.parametrize("graph", ["scoring", "step"])
def test_onnx_scores_equal_torch(onnx_export, tokenizer, graph, monkeypatch):
    """ONNX Runtime fp32 scores every pair (into two target languages, in one batch) as torch does (1e-4), in order,
    with sentence and token batches: on the scoring graph (the whole target in one run) and on the step graph (one
    position at a time); int8 scores are close (its weights are rounded) and rank the pairs alike."""
    from hf_variants.onnx.modeling import OrtModelForSeq2SeqLM

    calls = []
    if graph == "step":
        monkeypatch.setattr(OrtModelForSeq2SeqLM, "has_scoring_graph", property(lambda self: False))
    else:
        original = OrtModelForSeq2SeqLM.token_log_probs
        monkeypatch.setattr(
            OrtModelForSeq2SeqLM, "token_log_probs", lambda *a, **k: calls.append(1) or original(*a, **k)
        )
    model = trained("tied_nmt", tokenizer)
    expected = _score("tied_nmt", model, tokenizer)
    fp32 = Translator.from_pretrained(str(onnx_export), engine="onnx", num_threads=1)
    for kwargs in (dict(batch_size=3), dict(batch_size=None, max_tokens=50)):
        got = _score("tied_nmt", fp32, None, **kwargs)
        assert [s.tokens for s in got] == [s.tokens for s in expected]
        assert [s.log_prob for s in got] == pytest.approx([s.log_prob for s in expected], abs=1e-4)
    assert bool(calls) == (graph == "scoring")
    int8 = _score("tied_nmt", Translator.from_pretrained(str(onnx_export), engine="onnx", precision="int8"), None)
    assert summarize(int8).ppl == pytest.approx(summarize(expected).ppl, rel=0.05)
    ranks = sorted(range(N), key=lambda i: expected[i].log_prob / expected[i].tokens)
    int8_ranks = sorted(range(N), key=lambda i: int8[i].log_prob / int8[i].tokens)
    assert sum(a == b for a, b in zip(ranks, int8_ranks)) >= N // 2


def test_onnx_scoring_graph_manifest_and_command(onnx_export, tokenizer, tmp_path):
    """The manifest names the scoring graph and its inputs (the target language last); `hf-variants-score --onnx`
    scores pairs into French as torch does."""
    import json

    from hf_variants.commands import score

    manifest = json.loads((onnx_export / "onnx_manifest.json").read_text())
    assert manifest["scoring"]["graphs"] == {"fp32": "scoring_model.onnx", "int8": "scoring_model_int8.onnx"}
    names = [v["name"] for v in manifest["scoring"]["io"]["inputs"]]
    assert names == ["input_ids", "attention_mask", "decoder_input_ids", "labels", "tgt_lang_ids"]
    expected = _score("tied_nmt", trained("tied_nmt", tokenizer), tokenizer)
    idx = [i for i in range(N) if _langs("tied_nmt", N)[i] == "fr"]
    (tmp_path / "s").write_text("".join(SOURCES[i] + "\n" for i in idx))
    (tmp_path / "t").write_text("".join(TARGETS["fr"][i] + "\n" for i in idx))
    args = ["--onnx", str(onnx_export), "--source", str(tmp_path / "s"), "--target", str(tmp_path / "t")]
    score.main([*args, "--tgt_lang", "fr", "--output", str(tmp_path / "o.jsonl"), "--no_progress"])
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["log_prob"] for r in rows] == pytest.approx([expected[i].log_prob for i in idx], abs=1e-4)
