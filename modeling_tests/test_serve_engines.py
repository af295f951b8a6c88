"""`hf-variants-serve` on its other engines, one real server process each: ONNX Runtime (fp32 graphs, two workers
decoding in parallel) and CTranslate2 (the baseline, int8). Concurrent clients get their own translations, in
order, equal to the translation core's `Translator.translate` on the same engine and sentences; n-best with scores
equal the core's.

(ONNX Runtime int8 is not compared under concurrency: it quantizes activations per tensor, so a sentence's int8
translation depends on the sentences that share its batch; CTranslate2's int8 quantizes per row and does not.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import read_sentences
from serve_helpers import ServerProcess, metric_values
from trained_tiny import trained_baseline

from hf_variants.inference import DecodeOptions, Translator

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf-variants[serve]'")

ENGINES = {
    "onnx": ("fp32", ["--workers", "2"]),
    "ctranslate2": ("int8", []),
}


@pytest.fixture(scope="module")
def trained(tokenizer):
    model = trained_baseline(tokenizer)
    model.config.languages, model.config.target_languages = ["en", "de"], ["de"]
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

        export(trained, tokenizer, folder, shared_cache=False, progress=False)
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
