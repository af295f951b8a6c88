"""Sampling in the translation core (`hf_variants.inference.sampling`): each sentence draws from a generator seeded by
(seed, its index), so its samples are the same at batch sizes 1, 7 and 64, in pieces of a corpus translated
separately, in any buffers, through a real pipe whose buffers depend on when lines arrive, and on ONNX Runtime as
on torch; the sampler draws from the softmax of the processed scores (transformers' multinomial sampling); a sampled
n-best list comes sorted by score; CTranslate2 refuses a seed."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO_ROOT, read_sentences
from trained_tiny import one_torch_thread, save_en_de_baseline

from hf_variants.commands import translate
from hf_variants.inference import DecodeOptions, TranslationRequest, Translator
from hf_variants.inference.sampling import SentenceSampler, sentence_seed, sentence_seeds

SAMPLE = DecodeOptions(do_sample=True, nbest=3, top_k=20, seed=11, max_len_a=1.0, max_len_b=5)
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampling_model")
    save_en_de_baseline(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def translator(model_dir):
    return Translator.from_pretrained(str(model_dir))


def samples(results) -> list[list[tuple]]:
    return [[(h.text, tuple(h.token_ids)) for h in r.hypotheses] for r in results]


def test_the_seed_rule_is_the_documented_hash():
    digest = hashlib.sha256(b"hf_variants.sample:11:41").digest()
    assert sentence_seed(11, 41) == int.from_bytes(digest[:8], "big") >> 1
    assert sentence_seeds(11, [41, None, 3]) == [sentence_seed(11, 41), sentence_seed(11, 1), sentence_seed(11, 3)]
    assert len({sentence_seed(s, i) for s in range(3) for i in range(100)}) == 300
    torch.manual_seed(0)
    first = sentence_seeds(None, [0, 1])
    torch.manual_seed(0)
    assert sentence_seeds(None, [0, 1]) == first and first[0] != first[1]


def test_the_sampler_draws_from_the_softmax_of_its_rows():
    """20,000 draws of one sentence's rows: the frequencies are softmax(scores) within 4 standard errors, tokens
    masked by top-k (-inf) never come, and every row keeps only its sample's score finite."""
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 20_000
    scores = logits.expand(rows, -1).clone()
    out = SentenceSampler([5], rows)(torch.zeros(rows, 1, dtype=torch.long), scores)
    assert torch.isfinite(out).sum(-1).eq(1).all()
    chosen = out.argmax(-1)
    assert torch.equal(out[torch.arange(rows), chosen], scores[torch.arange(rows), chosen])
    frequencies = torch.bincount(chosen, minlength=6).double() / rows
    probs = torch.softmax(logits.double(), -1)
    assert torch.all((frequencies - probs).abs() <= 4 * (probs * (1 - probs) / rows).sqrt() + 1e-4), frequencies
    kept = TopKLogitsWarper(top_k=3)(None, scores.clone())
    chosen = SentenceSampler([6], rows)(None, kept).argmax(-1)
    frequencies = torch.bincount(chosen, minlength=6).double() / rows
    probs = torch.softmax(logits[:3].double(), -1)
    assert frequencies[3:].sum() == 0
    assert torch.all((frequencies[:3] - probs).abs() <= 4 * (probs * (1 - probs) / rows).sqrt()), frequencies
    again = SentenceSampler([6], rows)(None, kept).argmax(-1)
    assert torch.equal(chosen, again)  # the same seed, the same draws


def test_samples_do_not_depend_on_the_batch_the_call_or_the_buffers(translator):
    sources = read_sentences("en", "val", n=40)
    sources[5] = ""
    at = {size: samples(translator.translate(sources, SAMPLE, batch_size=size)) for size in (1, 7, 64)}
    assert at[1] == at[7] == at[64]
    assert sum(len({text for text, _ in row}) for row in at[1]) > 60  # samples, not one repeated translation
    pieces = []
    for start, stop in ((0, 13), (13, 14), (14, 40)):  # a corpus in pieces: each sentence with its own index
        requests = [TranslationRequest(s, index=i) for i, s in enumerate(sources[start:stop], start)]
        pieces += samples(translator.translate(requests, SAMPLE, batch_size=5))
    assert pieces == at[64]
    streamed = samples(translator.translate_stream(iter(sources), SAMPLE, buffer_size=6, batch_size=4))
    assert streamed == at[64]
    other = samples(translator.translate(sources, SAMPLE.replace(seed=12)))
    assert other != at[64]


def test_onnx_runtime_draws_the_samples_of_torch(translator, model_dir, tokenizer, tmp_path):
    """The ONNX engine runs the same sampler in transformers' loop over its step graph."""
    pytest.importorskip("onnxruntime")
    from hf_variants.onnx.export import export

    folder = tmp_path / "onnx"
    export(translator.model, tokenizer, folder, shared_cache=False, progress=False)
    on_ort = Translator.from_pretrained(str(folder), engine="onnx", num_threads=1)
    sources = read_sentences("en", "val", n=24)
    want = samples(translator.translate(sources, SAMPLE, batch_size=64))
    for size in (1, 7):
        got = on_ort.translate(sources, SAMPLE, batch_size=size)
        assert samples(got) == want
    assert on_ort.model.last_decoding["path"] == "loop"


def test_a_sampled_nbest_list_is_sorted_by_score(translator):
    """The engine draws in draw order; the core returns the same samples best first (score: log_prob / length **
    length_penalty), ties in draw order."""
    sources = read_sentences("en", "val", n=30)
    results = translator.translate(sources, SAMPLE)
    options = translator.resolve(SAMPLE)
    requests = [translator._prepared(TranslationRequest(s), i) for i, s in enumerate(sources)]
    drawn = [translator.engine.translate_batch([r], options)[0] for r in requests]
    reordered = 0
    for result, raw in zip(results, drawn):
        scores = [h.score for h in result.hypotheses]
        assert scores == sorted(scores, reverse=True)
        for h in result.hypotheses:
            assert h.score == pytest.approx(h.log_prob / len(h.token_ids) ** options.length_penalty)
        assert sorted((h.text for h in raw), key=[h.text for h in raw].index) == [h.text for h in raw]
        assert sorted(h.text for h in raw) == sorted(h.text for h in result.hypotheses)
        reordered += [h.text for h in raw] != [h.text for h in result.hypotheses]
    assert reordered > 0  # the draw order was not already the score order


def test_ctranslate2_refuses_a_seed():
    from hf_variants.inference.decode import engine_class

    pytest.importorskip("ctranslate2")
    why = engine_class("ctranslate2").unsupported(DecodeOptions(do_sample=True, seed=1))
    assert why.startswith("seed: CTranslate2 samples in its own threads") and "torch or onnx engine" in why
    assert engine_class("ctranslate2").unsupported(DecodeOptions(do_sample=True)) is None


# ------------------------------------------------------------------------------------------------- the command
FLAGS = ["--do_sample", "--top_k", "20", "--seed", "3", "--nbest", "2", "--max_len_a", "1", "--max_len_b", "5"]


def test_the_command_samples_alike_at_batch_sizes_1_7_64_and_through_a_pipe(model_dir, tmp_path):
    sources = read_sentences("en", "val", n=30)
    source = tmp_path / "src.en"
    source.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    lines = {}
    for size in (1, 7, 64):
        out = tmp_path / f"b{size}.jsonl"
        translate.main(
            ["--model", str(model_dir), "--input", str(source), "--output", str(out), "--no_progress"]
            + FLAGS
            + ["--batch_size", str(size)]
        )
        lines[size] = out.read_text(encoding="utf-8").splitlines()
    drawn = {size: drawn_samples(rows) for size, rows in lines.items()}  # the scores' last digits follow the batch
    assert drawn[1] == drawn[7] == drawn[64] and len(drawn[1]) == 30
    for row in map(json.loads, lines[1]):
        scores = [h["score"] for h in row["hypotheses"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    piped = pipe_in_bursts(model_dir, sources, bursts=(1, 4, 25))
    assert drawn_samples(piped) == drawn[64]


def drawn_samples(lines: list[str]) -> list[list[tuple]]:
    """Each line's samples: (text, tokens) in the order given."""
    return [[(h["text"], tuple(h["tokens"])) for h in json.loads(line)["hypotheses"]] for line in lines]


def pipe_in_bursts(model_dir, sources: list[str], bursts) -> list[str]:
    """A real process reading stdin, fed `bursts` lines at a time, each burst only after the previous one's answers
    came back: its buffers are cut where the pipe ran dry (1, 4, 25 lines), not where a file's would be."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_variants.commands.translate", "--model", str(model_dir), "--input", "-"]
        + ["--output", "-", "--no_progress", *FLAGS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=ENV,
    )
    received = b""  # read from the pipe itself (a buffered reader would hide lines from select)
    try:
        start = 0
        for size in bursts:
            proc.stdin.write("".join(s + "\n" for s in sources[start : start + size]).encode("utf-8"))
            proc.stdin.flush()
            start += size
            deadline = time.time() + 300
            while received.count(b"\n") < start:
                ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.time(), 0.1))
                assert ready and time.time() < deadline, f"{len(received.splitlines())} answers of {start}"
                received += os.read(proc.stdout.fileno(), 1 << 16)
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-3000:]
        assert proc.stdout.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
    return received.decode("utf-8").splitlines()
