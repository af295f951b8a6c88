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
    """(engine, precision, server process, the core's translator of the same folder)."""
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
        yield engine, precision, process, reference


def test_concurrent_clients_get_the_core_translations_of_the_engine(served):
    engine, precision, server, reference = served
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
    _, _, server, reference = served
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
