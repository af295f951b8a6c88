"""Decoding inside ONNX Runtime's `com.microsoft::BeamSearch` op (`hf_variants.onnx_generation`): the exported
graphs wrapped as the op's subgraphs decode greedy and early-stopping beam search token for token like torch fp32
(length penalty, returned sequences, max/min length, no_repeat_ngram_size, the model's token suppression), on the
trained tiny baseline and on every model type of test_onnx.py (MUTE, HySAN, MG-SA, and MIMO and Tied with one
target language per sentence; a graph reading another input, the syntactic MG-SA's `phrase_index`, is refused);
the loop is taken where the op cannot reproduce transformers (sampling, scores, custom processors,
early_stopping=False unless forced), and the op's model written to a file runs on plain onnxruntime.

The exports are test_onnx.py's (`_export_once`: one per model type and test session)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import read_sentences, run_without_package
from transformers import LogitsProcessor, LogitsProcessorList

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed: pip install 'hf-variants[onnx]'")
pytest.importorskip("onnx", reason="onnx is not installed: pip install 'hf-variants[onnx]'")
pytest.importorskip("onnxscript", reason="onnxscript is not installed: pip install 'hf-variants[onnx]'")

from test_onnx import BUILDERS, _export_once, _inputs  # noqa: E402

from hf_variants import OrtModelForSeq2SeqLM  # noqa: E402
from hf_variants.onnx import generation as onnx_generation  # noqa: E402

SENTENCES = read_sentences("en", "val", n=8)


def _ort(model_type, tokenizer, tmp_path_factory, precision="fp32", **options):
    model, folder = _export_once(model_type, tokenizer, tmp_path_factory)
    return model, folder, OrtModelForSeq2SeqLM.from_pretrained(folder, precision=precision, num_threads=1, **options)


def _both(model, ort, inputs, use_search_op=None, **settings):
    with torch.no_grad():
        expected = model.generate(**inputs, **settings)
    return ort.generate(**inputs, use_search_op=use_search_op, **settings), expected


@pytest.fixture(scope="module")
def baseline(tokenizer, tmp_path_factory):
    """The baseline loaded without its shared-cache graph (`shared_cache=False`), so that the default policy takes the
    op where it fits: with that graph, greedy and beam search run bound on it (`onnx_bound`; test_onnx.py)."""
    model, folder, ort = _ort("transformer_nmt", tokenizer, tmp_path_factory, shared_cache=False)
    return model, folder, ort, model.prepare_translation_inputs(tokenizer, SENTENCES)


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=1, max_new_tokens=16),
        dict(num_beams=1, max_new_tokens=16, min_new_tokens=14),
        dict(num_beams=4, length_penalty=0.6, early_stopping=True, max_new_tokens=60),
        dict(num_beams=4, length_penalty=1.3, early_stopping=True, num_return_sequences=2, max_new_tokens=60),
        dict(num_beams=4, early_stopping=True, no_repeat_ngram_size=2, max_new_tokens=60),
    ],
)
def test_search_op_decodes_like_torch(baseline, settings):
    """The op alone (no sentence decoded again) gives torch fp32's sequences, padding and width included."""
    model, _, ort, inputs = baseline
    got, expected = _both(model, ort, inputs, **settings)
    assert ort.last_decoding["path"] == "search_op" and "redecoded" not in ort.last_decoding, ort.last_decoding
    assert torch.equal(got, expected), settings
    assert expected.shape[1] > 8  # decoded past a few steps
    if settings.get("min_new_tokens"):
        assert (expected[:, 1:15] != model.config.eos_token_id).all()  # the minimum length was in force


def test_sentences_reaching_max_length_are_decoded_again(baseline):
    """With a length limit most sentences reach, ORT and transformers score max-length hypotheses differently;
    those sentences are decoded again in the loop, and the result is still torch's."""
    model, _, ort, inputs = baseline
    for settings in (
        dict(num_beams=4, length_penalty=0.6, early_stopping=True, max_new_tokens=8),
        dict(num_beams=3, length_penalty=1.3, early_stopping=True, num_return_sequences=2, max_length=7),
    ):
        got, expected = _both(model, ort, inputs, **settings)
        assert ort.last_decoding["path"] == "search_op" and ort.last_decoding["redecoded"], ort.last_decoding
        assert torch.equal(got, expected), settings


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=4, length_penalty=0.6),  # early_stopping=False: the loop unless the length is fixed
        dict(num_beams=3, length_penalty=-0.5, early_stopping=True, num_return_sequences=2),
    ],
)
def test_fixed_length_beam_search_in_the_op(baseline, settings):
    """Where eos is suppressed up to max_length (min_new_tokens == max_new_tokens, the benchmarks' decoding), every
    hypothesis has that length: the op's beam search is transformers' for any early_stopping and length_penalty, so
    it runs there, decodes no sentence again, and gives torch's sequences; one token shorter a minimum is not fixed
    length, and the same settings take the loop."""
    model, _, ort, inputs = baseline
    got, expected = _both(model, ort, inputs, max_new_tokens=12, min_new_tokens=12, **settings)
    assert ort.last_decoding["path"] == "search_op" and "redecoded" not in ort.last_decoding, ort.last_decoding
    assert torch.equal(got, expected) and expected.shape[1] == 13, settings
    got, expected = _both(model, ort, inputs, max_new_tokens=12, min_new_tokens=11, **settings)
    assert ort.last_decoding["path"] == "python_loop", ort.last_decoding
    assert torch.equal(got, expected), settings


class _Ban(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, torch.tensor([5]), -float("inf"))


def test_loop_where_the_op_cannot_reproduce_transformers(baseline):
    """Each decoding the op cannot express runs in transformers' loop, says why, and still decodes like torch;
    use_search_op=False forces the loop, use_search_op=True forces the op for early_stopping=False."""
    model, _, ort, inputs = baseline
    cases = [
        (dict(do_sample=True, top_k=20), "sampling"),
        (dict(num_beams=4, length_penalty=0.6), "early_stopping=False"),  # the saved paper decoding's
        (dict(num_beams=3, length_penalty=0.0, early_stopping="never"), "early_stopping='never'"),
        (dict(num_beams=2, do_sample=True), "beam sampling"),
        (dict(num_beams=1, use_search_op=False), "use_search_op=False"),
        (dict(num_beams=1, use_cache=False), "use_cache=False"),
        (dict(num_beams=1, logits_processor=LogitsProcessorList([_Ban()])), "_Ban"),
    ]
    for settings, reason in cases:
        torch.manual_seed(1)
        with torch.no_grad():
            expected = model.generate(
                **inputs, max_new_tokens=12, **{k: v for k, v in settings.items() if k != "use_search_op"}
            )
        torch.manual_seed(1)
        got = ort.generate(**inputs, max_new_tokens=12, **settings)
        assert ort.last_decoding["path"] == "python_loop" and reason in ort.last_decoding["reason"], ort.last_decoding
        assert torch.equal(got, expected), settings
    out = ort.generate(**inputs, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    assert ort.last_decoding["path"] == "python_loop" and len(out.scores) == out.sequences.shape[1] - 1
    forced = ort.generate(**inputs, num_beams=4, length_penalty=0.6, max_new_tokens=60, use_search_op=True)
    assert ort.last_decoding["path"] == "search_op" and forced.shape[0] == len(SENTENCES)
    assert (forced[:, 0] == model.config.decoder_start_token_id).all()


@pytest.mark.parametrize("model_type", [t for t in BUILDERS if t != "transformer_nmt"])
def test_every_model_type(model_type, tokenizer, tmp_path_factory):
    """The op decodes every type like torch; MIMO's and Tied's target language (a different one per sentence here)
    reaches the op's subgraphs, repeated per beam. Random weights: beam hypotheses run to the length limit and
    are decoded again in the loop, greedy search is the op's alone."""
    model, _, ort = _ort(model_type, tokenizer, tmp_path_factory)
    langs = BUILDERS[model_type][1]
    inputs = _inputs(model, tokenizer, SENTENCES[:4], langs)
    for settings in (dict(num_beams=1), dict(num_beams=4, length_penalty=0.6, early_stopping=True)):
        got, expected = _both(model, ort, inputs, max_new_tokens=10, use_search_op=True, **settings)
        assert ort.last_decoding["path"] == "search_op", ort.last_decoding
        assert torch.equal(got, expected), (model_type, settings)
    # by default: bound on the shared-cache graph where the type has one (every decoder attention fused), else
    # the op; the same sequences either way
    bound = ort.shared_cache_graph is not None
    for settings in (dict(num_beams=1), dict(num_beams=4, length_penalty=0.6, early_stopping=True)):
        mode = "greedy" if settings["num_beams"] == 1 else "beam"
        default, expected = _both(model, ort, inputs, max_new_tokens=10, **settings)
        assert ort.last_decoding["path"] == (f"shared_cache_{mode}" if bound else "search_op"), ort.last_decoding
        assert torch.equal(default, expected), (model_type, settings)
    if langs:  # the language is read: another one changes the output
        other = _inputs(model, tokenizer, SENTENCES[:4], langs[::-1])
        assert not torch.equal(ort.generate(**other, num_beams=1, max_new_tokens=10), got)


def test_int8_through_the_op(tokenizer, tmp_path_factory):
    """int8 graphs run in the op too: greedy agrees with the int8 loop on most sentences (activation scales are
    computed per call, so a different first step or batch layout can move a near tie)."""
    model, _, ort8 = _ort("transformer_nmt", tokenizer, tmp_path_factory, precision="int8")
    inputs = model.prepare_translation_inputs(tokenizer, read_sentences("en", "val", n=16))
    op = ort8.generate(**inputs, num_beams=1, max_new_tokens=16, use_search_op=True)
    assert ort8.last_decoding["path"] == "search_op"
    loop = ort8.generate(**inputs, num_beams=1, max_new_tokens=16, use_search_op=False)
    width = min(op.shape[1], loop.shape[1])
    assert (op[:, :width] == loop[:, :width]).all(1).float().mean() >= 0.5
    assert torch.equal(op[:, :2], loop[:, :2])  # the first token: one step, the same graphs


def test_search_model_file_runs_without_hf_variants(baseline, tmp_path):
    """`python -m hf_variants.onnx_generation` writes the op's model; plain onnxruntime decodes the greedy
    sequences of generate() with it (ids int32, [batch, returned, max_length], padded with pad_token_id)."""
    model, folder, ort, inputs = baseline
    path = onnx_generation.main(
        ["--model", str(folder), "--output", str(tmp_path / "search.onnx"), "--early_stopping"]
    )
    expected = ort.generate(**inputs, num_beams=1, max_new_tokens=16)
    suppressed = model.generation_config.suppress_tokens
    code = f"""
    import numpy as np, onnxruntime
    session = onnxruntime.InferenceSession({str(path)!r}, providers=["CPUExecutionProvider"])
    mask = np.ones({model.config.vocab_size}, np.int32)
    mask[{suppressed!r}] = 0
    feeds = dict(input_ids=np.array({inputs["input_ids"].tolist()!r}, np.int32),
                 attention_mask=np.array({inputs["attention_mask"].tolist()!r}, np.int32),
                 max_length=np.array([17], np.int32), min_length=np.array([0], np.int32),
                 num_beams=np.array([1], np.int32), num_return_sequences=np.array([1], np.int32),
                 length_penalty=np.array([1.0], np.float32), repetition_penalty=np.array([1.0], np.float32),
                 vocab_mask=mask)
    print(session.run(None, feeds)[0][:, 0].tolist())
    """
    sequences = eval(run_without_package(code).strip().splitlines()[-1])
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    for row, want in zip(sequences, expected.tolist()):
        tokens = [t for t in want if t not in (eos, pad)]
        assert row[: len(tokens)] == tokens and set(row[len(tokens) :]) <= {pad}


def test_refusal_names_the_reason(baseline, tmp_path):
    """A folder whose graphs read an input the op cannot pass (the syntactic MG-SA's `phrase_index`, here written
    into a copy of the baseline's manifest) is refused by name: by the builder and the CLI, and by generate(),
    which decodes in the loop."""
    _, folder, _, inputs = baseline
    copy = tmp_path / "onnx"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "onnx_manifest.json").read_text())
    manifest["step_inputs"] = ["phrase_index"]
    (copy / "onnx_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"reads \['phrase_index'\] besides the source"):
        onnx_generation.build_search_model(copy)
    with pytest.raises(SystemExit, match="phrase_index"):
        onnx_generation.main(["--model", str(copy), "--output", str(tmp_path / "x.onnx")])
    assert "phrase_index" in OrtModelForSeq2SeqLM.from_pretrained(copy, precision="fp32").search_op_refusal


def test_generate_leaves_the_source_graph_to_the_op(baseline, monkeypatch):
    """On the op path generate() does not run the source graph (the op's subgraph does); where the loop runs after
    all (sampling is decided before; a re-decoded sentence after), the source graph runs once, and decodes right."""
    model, _, ort, inputs = baseline
    calls = []
    run = ort.source_graph.run
    monkeypatch.setattr(ort.source_graph, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    ort.generate(**inputs, num_beams=4, early_stopping=True, max_new_tokens=60)
    assert ort.last_decoding["path"] == "search_op" and not calls
    got, expected = _both(model, ort, inputs, num_beams=4, early_stopping=True, max_new_tokens=8)
    assert ort.last_decoding["redecoded"] and len(calls) == 1 and torch.equal(got, expected)
    got, expected = _both(model, ort, inputs, num_beams=4, length_penalty=0.6, max_new_tokens=8)
    assert ort.last_decoding["path"] == "python_loop" and len(calls) == 2 and torch.equal(got, expected)
