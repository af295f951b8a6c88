"""`hf-variants-serve` on its other engines, one real server process each: ONNX Runtime (fp32 graphs of a default
export: greedy and beam search run bound on its shared-cache graph; two workers decoding in parallel) and CTranslate2
(the baseline, int8). Concurrent clients get their own translations, in order, equal to the translation core's
`Translator.translate` on the same engine and sentences; n-best with scores equal the core's; a cancelled batch
stops inside each engine (the bound search's step, CTranslate2's greedy callback); the server logs no line per
batch.

(ONNX Runtime int8 quantizes activations per row, so a sentence's int8 translation does not depend on the sentences
that share its batch: test_onnx.py checks 1,000 sentences at batch sizes 1, 7 and 64, which is what a server's
batches are; CTranslate2's int8 quantizes per row too and is compared here under concurrency.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import read_sentences
from serve_helpers import ServerProcess, metric_values
from trained_tiny import en_de_baseline

from hf_variants.inference import DecodeOptions, Translator
from hf_variants.inference.requests import DecodingCancelled

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf-variants[serve]'")

ENGINES = {
    "onnx": ("fp32", ["--workers", "2"]),
    "ctranslate2": ("int8", []),
}


@pytest.fixture(scope="module")
def trained(tokenizer):
    model = en_de_baseline(tokenizer)
    return model


@pytest.fixture(scope="module", params=list(ENGINES))
def served(request, trained, tokenizer, tmp_path_factory):
    """(engine, precision, server process, the core's translator of the same folder, the folder)."""
    engine = request.param
    precision, extra = ENGINES[engine]
    folder = tmp_path_factory.mktemp(f"serve-{engine}") / "export"
    if engine == "onnx":
        pytest.importorskip("onnxruntime")
        from hf_variants.onnx.export import export

        export(trained, tokenizer, folder, progress=False)
    else:
        pytest.importorskip("ctranslate2")
        from hf_variants.deploy.ctranslate2 import export

        export(trained, tokenizer, folder)
    args = ["--model", str(folder), "--engine", engine, "--precision", precision, "--num_threads", "1"]
    with ServerProcess(args + ["--max_wait_ms", "50", *extra]) as process:
        process.health = process.wait_ready()
        reference = Translator.from_pretrained(str(folder), engine=engine, precision=precision, num_threads=1)
        yield engine, precision, process, reference, folder


def test_concurrent_clients_get_the_core_translations_of_the_engine(served):
    engine, precision, server, reference, _ = served
    assert server.health["engine"] == engine and server.health["precision"] == precision
    sentences = read_sentences("en", "val", n=40, start=100)
    jobs = [sentences[i : i + 1 + i % 3] for i in range(0, 40, 4)]
    expected = {r.source: r.text for r in reference.translate(sentences)}

    def client_thread(my_jobs):
        with server.client() as client:
            return [(job, client.post("/translate", json={"text": job}).json()) for job in my_jobs]

    with ThreadPoolExecutor(5) as pool:
        per_client = list(pool.map(client_thread, [jobs[i::5] for i in range(5)]))
    for answers in per_client:
        for job, answer in answers:
            assert answer == {"translations": [expected[s] for s in job], "truncated": []}
    assert len(set(expected.values())) > 25
    with server.client() as client:
        metrics = metric_values(client.get("/metrics").text)
    assert metrics["hf_variants_serve_sentences_total"] == sum(map(len, jobs))
    assert f'engine="{engine}"' in client_info(server)
    assert "generate():" not in server.log()  # no INFO line per batch (ONNX Runtime's decoding path is DEBUG)


def client_info(server) -> str:
    with server.client() as client:
        return next(
            line
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("hf_variants_serve_model_info")
        )


def test_nbest_with_scores_equals_the_core(served):
    _, _, server, reference, _ = served
    sentences = read_sentences("en", "val", n=2, start=150)
    with server.client() as client:
        answer = client.post("/translate", json={"text": sentences, "num_beams": 3, "nbest": 3}).json()
    core = reference.translate(sentences, DecodeOptions(num_beams=3, nbest=3, scores=True))
    for item, result in zip(answer["translations"], core):
        assert [h["tokens"] for h in item["hypotheses"]] == [h.tokens for h in result.hypotheses]
        assert [h["log_prob"] for h in item["hypotheses"]] == pytest.approx(
            [h.log_prob for h in result.hypotheses], abs=1e-4
        )
        assert len(item["hypotheses"]) == 3


def rule_with_some_cut(translator: Translator, sentences: list[str]) -> tuple[DecodeOptions, int]:
    """A length rule (greedy) under which some of `sentences` reach their own limit and the others end before it,
    with limits that differ between sentences: chosen from the model's unlimited greedy outputs (a greedy output
    under a limit is the unlimited one cut there, `</s>` forced as the limit-th token), so the situation is made,
    whatever the fixture model's outputs are. Returns the options and how many sentences reach their limit."""
    unlimited = translator.translate(sentences, DecodeOptions(num_beams=1, max_new_tokens=64))
    natural = [len(r.hypotheses[0].tokens) for r in unlimited]  # `</s>` included; 64: at least that
    lengths = translator.count_tokens(sentences)
    for a in (1.0, 0.5, 1.5, 2.0):
        for b in range(16):
            options = translator.resolve(DecodeOptions(num_beams=1, max_len_a=a, max_len_b=b, scores=True))
            limits = translator.engine.length_limits(lengths, options)
            reach = sum(n >= limit for n, limit in zip(natural, limits))
            if 0 < reach < len(sentences) and len(set(limits)) > 1 and max(limits) < 64:
                return options, reach
    raise AssertionError(f"no length rule cuts some of these outputs and not others: lengths {natural}")


def test_the_engine_decodes_greedy_like_torch(served, trained, tokenizer):
    """The engine behind the server (fp32) against the torch model: the same greedy tokens under a length rule
    (sentences of many lengths in one batch, some reaching their own limit, chosen so that some do) and under
    max_new_tokens, and the same log-probabilities."""
    engine, _, _, _, folder = served
    fp32 = Translator.from_pretrained(str(folder), engine=engine, precision="fp32", num_threads=1)
    torch_translator = Translator(trained.eval(), tokenizer)
    sentences = read_sentences("en", "val", n=40, start=200)
    rule, reach = rule_with_some_cut(torch_translator, sentences)
    for options in (rule, DecodeOptions(num_beams=1, max_new_tokens=6, scores=True)):
        ours, theirs = torch_translator.translate(sentences, options), fp32.translate(sentences, options)
        assert [r.hypotheses[0].tokens for r in theirs] == [r.hypotheses[0].tokens for r in ours]
        assert [r.hypotheses[0].log_prob for r in theirs] == pytest.approx(
            [r.hypotheses[0].log_prob for r in ours], abs=1e-4
        )
        if options is rule:  # outputs cut by their own sentence's limit were compared
            limits = torch_translator.engine.length_limits(torch_translator.count_tokens(sentences), rule)
            reached = sum(len(r.hypotheses[0].tokens) == limit for r, limit in zip(ours, limits))
            assert reached == reach and 0 < reached < len(sentences)


def test_the_commands_on_the_export_answer_like_the_server(served, tokenizer, tmp_path, capsys):
    """hf-variants-translate and hf-variants-score take the export folder as --model (the engine follows from it, or
    is named): their n-best hypotheses are the server's on the same engine (texts; scores and log-probabilities
    within 1e-4), and the scorer's log-probability of a hypothesis is the one translate reported."""
    import json

    from hf_variants.commands import score, translate

    engine, precision, server, _, folder = served
    sentences = read_sentences("en", "val", n=12, start=300)
    src = tmp_path / "src.en"
    src.write_text("\n".join(sentences) + "\n")
    common = ["--model", str(folder), "--precision", precision, "--num_threads", "1"]
    for named in ([], ["--engine", engine]):
        out = tmp_path / f"nbest{len(named)}.jsonl"
        args = [*common, *named, "--input", str(src), "--output", str(out), "--nbest", "2", "--num_beams", "2"]
        assert translate.main([*args, "--no_progress"])["engine"] == engine
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_text() == (tmp_path / "nbest0.jsonl").read_text()
    with server.client() as client:
        answer = client.post("/translate", json={"text": sentences, "nbest": 2, "num_beams": 2}).json()
    for line, served_line in zip(lines, answer["translations"], strict=True):
        assert [h["text"] for h in line["hypotheses"]] == [h["text"] for h in served_line["hypotheses"]]
        for ours, theirs in zip(line["hypotheses"], served_line["hypotheses"]):
            assert ours["score"] == pytest.approx(theirs["score"], abs=1e-4)
            assert ours["log_prob"] == pytest.approx(theirs["log_prob"], abs=1e-4)
    best = [line["hypotheses"][0] for line in lines]
    tgt = tmp_path / "best.de"
    tgt.write_text("\n".join(h["text"] for h in best) + "\n")
    scored = tmp_path / "scores.jsonl"
    score.main([*common, "--source", str(src), "--target", str(tgt), "--output", str(scored), "--no_progress"])
    capsys.readouterr()
    compared = 0
    for hypothesis, row in zip(best, map(json.loads, scored.read_text().splitlines()), strict=True):
        ids = tokenizer(hypothesis["text"])["input_ids"]
        if tokenizer.convert_ids_to_tokens(ids) == hypothesis["tokens"]:  # the text re-tokenizes to the hypothesis
            assert row["log_prob"] == pytest.approx(hypothesis["log_prob"], abs=1e-4)
            compared += 1
    assert compared >= len(best) // 2
    if engine == "onnx":  # an export without int8 graphs: refused before anything loads
        with pytest.raises(SystemExit):
            score.main(["--model", str(folder), "--precision", "int8", "--source", str(src), "--target", str(tgt)])
        assert "graphs (export with --int8 for int8)" in capsys.readouterr().err


def test_a_cancelled_batch_stops_inside_the_engine(served):
    """`decode_batch(cancelled=...)`, the server's call: a flag that turns true at its second ask stops greedy and
    beam search inside ONNX Runtime's bound search (asked before every step: 2 asks, then the check after it) and
    CTranslate2's greedy search (its callback, asked for each sentence's token: every sentence stopped at its first
    token), then `DecodingCancelled`; CTranslate2's beam search cannot be stopped inside its call and is asked before
    and after it. A flag that stays false changes nothing."""
    engine, _, _, reference, _ = served
    sentences = read_sentences("en", "val", n=4, start=400)
    encoded = reference.encode(sentences)
    for beams in (1, 3):
        resolved = reference.resolve(DecodeOptions(num_beams=beams))
        asks = []

        def cancelled():
            asks.append(1)
            return len(asks) >= 2

        with pytest.raises(DecodingCancelled):
            reference.decode_batch(encoded, resolved, cancelled=cancelled)
        expected = {"onnx": 3, "ctranslate2": 2 + len(sentences) if beams == 1 else 2}[engine]
        assert len(asks) == expected, (engine, beams, len(asks))
        if engine == "onnx":
            assert reference.model.last_decoding["path"] == ("bound_greedy" if beams == 1 else "bound_beam")
        kept = reference.decode_batch(encoded, resolved, cancelled=lambda: False)
        assert [r.text for r in kept] == [r.text for r in reference.translate(sentences, resolved)]
