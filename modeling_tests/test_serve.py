"""`hf-variants-serve` as a client sees it: a real server process on a port the OS picked, spoken to over HTTP.

- One server on the torch engine (a tiny baseline trained for a few seconds, so translations are real token
  sequences): concurrent clients get their own translations, in order, equal to the translation core's
  `Translator.translate` on the same sentences; n-best with scores equal the core's; every bad input gets its status
  and a JSON error naming the field or the limit, and the next good request succeeds; `/metrics` counts what was
  sent; OpenAPI (`/health`'s languages an object) and the Swagger page with its assets served locally (no CDN);
  paragraphs split into sentences and joined with their whitespace, equal to the core's sentence by sentence; the
  LibreTranslate mount with the request shapes LibreTranslate's tests and docs send (form, query, multipart, JSON
  text or list, alternatives, source auto) and its refusals; CORS; the page at `/` loads and its script translates
  (run by Node.js against the server where `node` is installed; by a headless Chromium where `chromium` is; else
  its HTML and fetch call are read).
- One server whose engine is wrapped to be slow or to fail on purpose (`serve_helpers.FAULTS_PRELUDE`): /health
  503 while loading then 200, API keys (401 / 401 / 200, /health open), truncation, the full queue (503 +
  Retry-After), the request timeout (504), an engine crash (500 naming it, the server goes on), and SIGTERM with a
  request in flight (it completes; exit status 0).
- The command's flags refused before anything loads (exit status 2 naming the flag).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import REPO_ROOT, read_sentences
from serve_helpers import ServerProcess, metric_values
from trained_tiny import save_en_de_baseline

from hf_variants.commands.serve import main as serve_main
from hf_variants.inference import DecodeOptions, Translator

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf-variants[serve]'")

KEY = "test-key-0123456789abcdef"
ALLOWED_ORIGIN = "http://app.example.com"


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "model"
    save_en_de_baseline(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    return Translator.from_pretrained(str(model_dir), num_threads=1)


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--model", str(model_dir), "--num_threads", "1", "--max_wait_ms", "50", "--max_sentences", "16"]
    args += ["--max_body_bytes", "8192", "--max_sentence_tokens", "40", "--max_beams", "4"]
    args += ["--cors_origins", ALLOWED_ORIGIN]
    with ServerProcess(args) as process:
        process.health = process.wait_ready()
        yield process


def translate(client, body: dict, **kwargs) -> httpx.Response:
    return client.post("/translate", json=body, **kwargs)


def metrics_of(client, **kwargs) -> dict:
    return metric_values(client.get("/metrics", **kwargs).text)


def wait_for_metric(client, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metrics_of(client).get(name) != value:
        assert time.monotonic() < deadline, f"{name} did not reach {value} in {timeout} s"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------- the torch server
def test_health_names_the_model_and_openapi_describes_the_api(server):
    assert server.health == {
        "status": "ready",
        "model_type": "transformer_nmt",
        "engine": "torch",
        "precision": "fp32",
        "languages": {"source": ["en"], "target": ["de"]},
        "max_sentence_tokens": 40,
    }
    with server.client() as client:
        schema = client.get("/openapi.json").json()
        body = schema["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        # every decoding option but max_source_length (the server's --truncate decides it), generated from
        # DecodeOptions (test_front_end.py checks types, ranges and help against it)
        options = set(DecodeOptions.__dataclass_fields__) - {"max_source_length"}
        fields = {"text", "src_lang", "tgt_lang", "split_sentences", "constraints", "glossary"}
        assert set(body["properties"]) == {*fields, *options}
        assert body["additionalProperties"] is False and body["required"] == ["text"]
        assert {"413", "422", "503", "504"} <= set(schema["paths"]["/translate"]["post"]["responses"])
        assert client.get("/docs").status_code == 200


def test_concurrent_clients_get_their_own_translations_in_order(server, reference):
    sentences = read_sentences("en", "val", n=48)
    jobs = [sentences[i : i + 1] if i % 3 else sentences[i : i + 3] for i in range(0, 48, 2)]  # 1 or 3 a request
    expected = {r.source: r.text for r in reference.translate(sentences, DecodeOptions())}
    with server.client() as client:
        before = metrics_of(client)

    def client_thread(my_jobs):
        with server.client() as client:
            answers = []
            for job in my_jobs:
                body = {"text": job[0]} if len(job) == 1 else {"text": job}
                response = translate(client, body)
                assert response.status_code == 200, response.text
                answers.append((job, response.json()))
            return answers

    with ThreadPoolExecutor(8) as pool:
        per_client = list(pool.map(client_thread, [jobs[i::8] for i in range(8)]))
    for answers in per_client:
        for job, answer in answers:
            assert answer == {"translations": [expected[s] for s in job], "truncated": []}
    assert len({expected[s] for s in sentences}) > 30  # real, varied translations were compared

    with server.client() as client:
        after = metrics_of(client)
    sent = sum(len(job) for job in jobs)
    assert after["hf_variants_serve_sentences_total"] - before["hf_variants_serve_sentences_total"] == sent
    key = 'hf_variants_serve_requests_total{endpoint="/translate",status="200"}'
    assert after[key] - before.get(key, 0) == len(jobs)
    batches = after["hf_variants_serve_batch_sentences_count"] - before["hf_variants_serve_batch_sentences_count"]
    assert batches < len(jobs)  # sentences of concurrent requests shared batches
    assert after["hf_variants_serve_queue_sentences"] == 0


def test_nbest_and_scores_equal_the_translation_core(server, reference):
    sentences = read_sentences("en", "val", n=3, start=60)
    with server.client() as client:
        answer = translate(client, {"text": sentences, "num_beams": 4, "nbest": 2}).json()
        scored = translate(client, {"text": sentences[0], "scores": True}).json()
        short = translate(client, {"text": sentences[:1], "max_new_tokens": 3}).json()
    core = reference.translate(sentences, DecodeOptions(num_beams=4, nbest=2, scores=True))
    for item, result in zip(answer["translations"], core):
        assert item["source"] == result.source
        assert [h["text"] for h in item["hypotheses"]] == [h.text for h in result.hypotheses]
        assert [h["tokens"] for h in item["hypotheses"]] == [h.tokens for h in result.hypotheses]
        assert [h["score"] for h in item["hypotheses"]] == pytest.approx(
            [h.score for h in result.hypotheses], abs=1e-5
        )
        assert [h["log_prob"] for h in item["hypotheses"]] == pytest.approx(
            [h.log_prob for h in result.hypotheses], abs=1e-5
        )
    (one,) = reference.translate(sentences[:1], DecodeOptions(scores=True))
    assert scored["translations"][0]["hypotheses"][0]["log_prob"] == pytest.approx(
        one.hypotheses[0].log_prob, abs=1e-5
    )
    (cut,) = reference.translate(sentences[:1], DecodeOptions(max_new_tokens=3))
    assert short["translations"] == [cut.text] and len(cut.hypotheses[0].tokens) == 3


def test_answers_equal_the_translate_command(server, reference, model_dir, tmp_path):
    """The server and `hf-variants-translate --nbest` (JSON Lines) print the same hypotheses for the same lines."""
    from hf_variants.commands import translate as translate_command

    candidates = read_sentences("en", "val", n=20, start=80)
    sentences = [s for s, n in zip(candidates, reference.count_tokens(candidates)) if n <= 40][:4]
    (tmp_path / "in.en").write_text("\n".join(sentences) + "\n")
    out = tmp_path / "out.jsonl"
    translate_command.main(
        ["--model", str(model_dir), "--input", str(tmp_path / "in.en"), "--output", str(out), "--num_beams", "2"]
        + ["--nbest", "2", "--no_progress"]
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    with server.client() as client:
        answer = translate(client, {"text": sentences, "num_beams": 2, "nbest": 2}).json()
    assert [item["source"] for item in answer["translations"]] == [line["source"] for line in lines]
    for item, line in zip(answer["translations"], lines):
        assert [h["tokens"] for h in item["hypotheses"]] == [h["tokens"] for h in line["hypotheses"]]
        assert [h["text"] for h in item["hypotheses"]] == [h["text"] for h in line["hypotheses"]]
        assert [h["log_prob"] for h in item["hypotheses"]] == pytest.approx(
            [h["log_prob"] for h in line["hypotheses"]], abs=1e-5
        )


def test_the_openapi_schema_and_the_docs_page_are_served_without_a_cdn(server):
    """Defect 10: /health's `languages` is described as the object it is; /docs loads Swagger's assets from the
    server itself (no CDN: the page works offline), and the probes and /languages are in the schema."""
    with server.client() as client:
        schema = client.get("/openapi.json").json()
        page = client.get("/docs")
        script = client.get("/docs/assets/swagger-ui-bundle.js")
        style = client.get("/docs/assets/swagger-ui.css")
        unknown = client.get("/docs/assets/../../etc/passwd")
    components = schema["components"]["schemas"]
    languages = components["Health"]["properties"]["languages"]["anyOf"][0]["$ref"].rsplit("/", 1)[1]
    assert set(components[languages]["properties"]) == {"source", "target"}
    assert {"/health/live", "/health/ready", "/languages", "/libretranslate/translate"} <= set(schema["paths"])
    assert page.status_code == 200 and "http" not in page.text and "cdn" not in page.text
    assert 'src="docs/assets/swagger-ui-bundle.js"' in page.text and "self'" in page.headers["content-security-policy"]
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text[:200000]
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    assert unknown.status_code == 404


def test_paragraphs_are_split_into_sentences_and_joined_with_their_whitespace(server, reference):
    """`split_sentences`: each item a paragraph or a document; its sentences (sentencex) translated in the same
    batches as everything else, equal to the core's translation of each sentence, joined with the item's own
    whitespace (line breaks and blank lines kept)."""
    first, second, third = read_sentences("en", "val", n=3, start=30)
    document = f"  {first} {second}\n\n{third}\n"
    with server.client() as client:
        answer = translate(client, {"text": [document, "", third], "split_sentences": True}).json()
        refused = translate(client, {"text": ["A.\nB."], "split_sentences": True, "nbest": 2})
        line_break = translate(client, {"text": "One.\nTwo."})
    core = {r.source: r.text for r in reference.translate([first, second, third])}
    assert answer == {
        "translations": [f"  {core[first]} {core[second]}\n\n{core[third]}\n", "", core[third]],
        "truncated": [],
    }
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "nbest"
    assert line_break.status_code == 422 and "split_sentences" in line_break.json()["error"]["message"]


# LibreTranslate's own tests and docs send these shapes: a form (data=), JSON with one text or a list, alternatives,
# source "auto"; its errors are {"error": "message"} with 400 (403 for a key)
def libre(client, **kwargs) -> httpx.Response:
    return client.post("/libretranslate/translate", **kwargs)


def test_the_libretranslate_mount_translates_the_shapes_its_clients_send(server, reference):
    sentences = ["A man rides a bike.", "Two dogs play in the snow. They run."]
    core = {
        r.source: r.text
        for r in reference.translate(["A man rides a bike.", "Two dogs play in the snow.", "They run."])
    }
    joined = f"{core['Two dogs play in the snow.']} {core['They run.']}"
    with server.client() as client:
        form = libre(client, data={"q": sentences[0], "source": "en", "target": "de", "format": "text"}).json()
        query = libre(client, params={"q": sentences[0], "source": "en", "target": "de"}).json()
        multipart = libre(client, files={"q": (None, sentences[0]), "source": (None, "en"), "target": (None, "de")})
        batch = libre(client, json={"q": sentences, "source": "en", "target": "de", "format": "text"}).json()
        auto = libre(client, json={"q": sentences[1], "source": "auto", "target": "de"}).json()
        alternatives = libre(client, json={"q": sentences, "source": "en", "target": "de", "alternatives": 2}).json()
        languages = client.get("/libretranslate/languages").json()
        settings = client.get("/libretranslate/frontend/settings").json()
    assert form == query == multipart.json() == {"translatedText": core[sentences[0]]}
    assert batch == {"translatedText": [core[sentences[0]], joined]}
    assert auto == {"translatedText": joined, "detectedLanguage": {"confidence": 100.0, "language": "en"}}
    # alternatives: the n-best list of a beam search of alternatives + 1 beams (at least the saved beam size)
    beams = max(3, reference.resolve(DecodeOptions()).num_beams)
    nbest = reference.translate(
        ["A man rides a bike.", "Two dogs play in the snow.", "They run."], DecodeOptions(num_beams=beams, nbest=3)
    )
    best = [nbest[0].text, f"{nbest[1].text} {nbest[2].text}"]
    assert alternatives["translatedText"] == best
    expected = [h.text for h in nbest[0].hypotheses[1:] if h.text != best[0]]
    assert alternatives["alternatives"][0] == list(dict.fromkeys(expected))
    second = [f"{nbest[1].hypotheses[k].text} {nbest[2].hypotheses[k].text}" for k in (1, 2)]
    assert alternatives["alternatives"][1] == list(dict.fromkeys(t for t in second if t != best[1]))
    assert languages == [{"code": "en", "name": "en", "targets": ["de"]}, {"code": "de", "name": "de", "targets": []}]
    assert settings["keyRequired"] is False and settings["language"]["target"]["code"] == "de"


LIBRE_REFUSALS = [
    ({"data": {"source": "en", "target": "de"}}, 400, "Invalid request: missing q parameter"),
    ({"json": {"q": [], "source": "en", "target": "de"}}, 400, "Invalid request: missing q parameter"),
    ({"data": {"q": "Hello", "target": "de"}}, 400, "Invalid request: missing source parameter"),
    ({"data": {"q": "Hello", "source": "en"}}, 400, "Invalid request: missing target parameter"),
    ({"data": {"q": "Hello", "source": "en", "target": "zz"}}, 400, "zz is not supported"),
    ({"data": {"q": "Hello", "source": "zz", "target": "de"}}, 400, "zz is not supported"),
    ({"data": {"q": "Hello", "source": "en", "target": "de", "format": "xml"}}, 400, "xml format is not supported"),
    ({"data": {"q": "Hello", "source": "en", "target": "de", "format": "html"}}, 400, "html format is not supported"),
    (
        {"data": {"q": "Hello", "source": "en", "target": "de", "alternatives": "abc"}},
        400,
        "Invalid request: alternatives parameter is not a number",
    ),
    ({"json": ["not", "a", "dict"]}, 400, "Invalid JSON format"),
]


@pytest.mark.parametrize("kwargs,status,message", LIBRE_REFUSALS, ids=[m for _, _, m in LIBRE_REFUSALS])
def test_the_libretranslate_mount_refuses_as_libretranslate_does(server, kwargs, status, message):
    with server.client() as client:
        response = libre(client, **kwargs)
    assert response.status_code == status and response.json() == {"error": message}


LONG = "A man in a blue shirt is riding a red bicycle down a very long road near the big old house. " * 3
BAD_REQUESTS = [
    # (what, request kwargs, status, error type, field or limit)
    (
        "invalid JSON",
        {"content": b'{"text": ', "headers": {"Content-Type": "application/json"}},
        400,
        "invalid_json",
        None,
    ),
    (
        "invalid UTF-8",
        {"content": b'{"text": "\xff\xfe"}', "headers": {"Content-Type": "application/json"}},
        400,
        "invalid_json",
        None,
    ),
    (
        "NaN",
        {"content": b'{"text": "a", "num_beams": NaN}', "headers": {"Content-Type": "application/json"}},
        400,
        "invalid_json",
        None,
    ),
    ("no content type", {"content": b'{"text": "a"}'}, 415, "unsupported_media_type", "Content-Type"),
    ("a form", {"data": {"text": "a"}}, 415, "unsupported_media_type", "Content-Type"),
    ("a list body", {"json": ["a"]}, 422, "invalid_request", "body"),
    ("text a number", {"json": {"text": 5}}, 422, "invalid_request", "text"),
    ("text null", {"json": {"text": None}}, 422, "invalid_request", "text"),
    ("an item a number", {"json": {"text": ["a", 1]}}, 422, "invalid_request", "text[1]"),
    ("num_beams a string", {"json": {"text": "a", "num_beams": "4"}}, 422, "invalid_request", "num_beams"),
    ("num_beams a float", {"json": {"text": "a", "num_beams": 2.5}}, 422, "invalid_request", "num_beams"),
    ("num_beams 0", {"json": {"text": "a", "num_beams": 0}}, 422, "invalid_request", "num_beams"),
    ("scores a string", {"json": {"text": "a", "scores": "yes"}}, 422, "invalid_request", "scores"),
    ("an empty list", {"json": {"text": []}}, 422, "invalid_request", "text"),
    ("no text", {"json": {"num_beams": 2}}, 422, "invalid_request", "text"),
    ("a field naming a path", {"json": {"text": "a", "model": "/etc/passwd"}}, 422, "invalid_request", "model"),
    ("an engine field", {"json": {"text": "a", "engine": "onnx"}}, 422, "invalid_request", "engine"),
    ("a NUL", {"json": {"text": ["ok", "a\u0000b"]}}, 422, "invalid_request", "text[1]"),
    ("a line break", {"json": {"text": "one\ntwo"}}, 422, "invalid_request", "text"),
    ("a C1 control", {"json": {"text": ["ok", "ok", "x\u0085"]}}, 422, "invalid_request", "text[2]"),
    (
        "an unpaired surrogate",
        {"content": b'{"text": "\\ud800"}', "headers": {"Content-Type": "application/json"}},
        422,
        "invalid_request",
        "text",
    ),
    ("17 sentences", {"json": {"text": ["a"] * 17}}, 413, "max_sentences", "max_sentences"),
    ("a body over the limit", {"json": {"text": ["a" * 1000] * 9}}, 413, "max_body_bytes", "max_body_bytes"),
    (
        "a chunked body over the limit",
        {"content": iter([b'{"text": "', b"a" * 9000, b'"}']), "headers": {"Content-Type": "application/json"}},
        413,
        "max_body_bytes",
        "max_body_bytes",
    ),
    (
        "a sentence over the token limit",
        {"json": {"text": ["ok", LONG]}},
        413,
        "max_sentence_tokens",
        "max_sentence_tokens",
    ),
    ("num_beams over max_beams", {"json": {"text": "a", "num_beams": 5}}, 422, "max_beams", "max_beams"),
    ("nbest over num_beams", {"json": {"text": "a", "num_beams": 2, "nbest": 3}}, 422, "invalid_request", "nbest"),
    (
        "max_new_tokens over the positions",
        {"json": {"text": "a", "max_new_tokens": 10_000}},
        422,
        "invalid_request",
        "max_new_tokens",
    ),
    (
        "a target language the model lacks",
        {"json": {"text": "a", "tgt_lang": "fr"}},
        422,
        "invalid_request",
        "tgt_lang",
    ),
    (
        "a source language the model lacks",
        {"json": {"text": "a", "src_lang": "de"}},
        422,
        "invalid_request",
        "src_lang",
    ),
    ("not a language code", {"json": {"text": "a", "tgt_lang": "../x"}}, 422, "invalid_request", "tgt_lang"),
]


@pytest.mark.parametrize("what,kwargs,status,kind,name", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_gets_its_status_and_the_server_keeps_serving(
    server, reference, what, kwargs, status, kind, name
):
    with server.client() as client:
        response = client.post("/translate", **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == kind and error["message"]
        assert name in (error.get("field"), error.get("limit")), error
        if "limit" in error:
            assert error["message"].count("--" + error["limit"]) == 1  # the flag to change is named
        good = translate(client, {"text": "A dog runs."})
        assert good.status_code == 200 and good.json()["translations"] == [
            reference.translate(["A dog runs."])[0].text
        ]


def test_other_routes_methods_hosts_and_origins_get_json_errors(server):
    with server.client() as client:
        before = metrics_of(client)
        cases = [
            (client.get("/translate"), 405, "method_not_allowed"),
            (client.get("/no/such/route"), 404, "not_found"),
            (client.get("/health", headers={"Host": "evil.example"}), 400, "host_not_allowed"),
            (translate(client, {"text": "a"}, headers={"Origin": "http://evil.example"}), 403, "cors_origins"),
        ]
        for response, status, kind in cases:
            assert response.status_code == status and response.json()["error"]["type"] == kind, response.text
        after = metrics_of(client)
    for _, _, kind in cases:
        key = f'hf_variants_serve_errors_total{{kind="{kind}"}}'
        assert after[key] - before.get(key, 0) == 1


def test_cors_answers_a_listed_origin_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with server.client() as client:
        listed = client.options("/translate", headers={"Origin": ALLOWED_ORIGIN, **preflight})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        response = translate(client, {"text": "A dog runs."}, headers={"Origin": ALLOWED_ORIGIN})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        other = client.options("/translate", headers={"Origin": "http://evil.example", **preflight})
        assert other.status_code in (400, 403) and "access-control-allow-origin" not in other.headers
        same_origin = translate(client, {"text": "A dog runs."}, headers={"Origin": server.url})
        assert same_origin.status_code == 200 and "access-control-allow-origin" not in same_origin.headers


# The page's own script, run by Node.js against the live server: a minimal DOM (the elements the page reads and
# writes by id), `location` with ?text=..., and the real `fetch` (recorded). It prints what the page shows.
NODE_PAGE_RUNNER = r"""
const [base, query] = process.argv.slice(1);
const requests = [];
const realFetch = globalThis.fetch;
async function main() {
  const html = await (await realFetch(base + "/")).text();
  const script = html.match(/<script>([\s\S]*?)<\/script>/)[1];
  const elements = {};
  const element = (id) => elements[id] || (elements[id] = {
    id, value: "", textContent: "", disabled: false, children: [], listeners: {},
    addEventListener(type, f) { this.listeners[type] = f; }, appendChild(c) { this.children.push(c); },
  });
  for (const id of ["source", "src_lang", "tgt_lang", "num_beams", "api_key", "translate", "output", "error",
                    "model", "timing"]) element(id);
  const document = { baseURI: base + "/", getElementById: element, createElement: () => ({}) };
  const location = { search: query };
  const fetch = (url, init) => { requests.push({ url: String(url), init: init || {} }); return realFetch(url, init); };
  const run = new Function("document", "location", "fetch", script + "\n;return start;");
  run(document, location, fetch);
  for (let i = 0; i < 600 && !elements.output.textContent && !elements.error.textContent; i++) {
    await new Promise((r) => setTimeout(r, 100));
  }
  console.log(JSON.stringify({
    output: elements.output.textContent, error: elements.error.textContent, model: elements.model.textContent,
    targets: elements.tgt_lang.children.map((c) => c.value), requests,
  }));
}
main().catch((e) => { console.error(e); process.exit(1); });
"""


def test_the_page_loads_and_its_script_translates(server, reference, tmp_path):
    sentences = ["A man rides a bike.", "Two dogs play in the snow."]
    expected = "\n".join(r.text for r in reference.translate(sentences))
    query = "?" + httpx.QueryParams({"text": "\n".join(sentences), "tgt_lang": "de"}).__str__()
    with server.client() as client:
        page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    # what a browser runs: a JSON POST to the relative route, its answer's translations shown as text (no HTML)
    assert 'fetch(new URL("translate", document.baseURI)' in script and 'method: "POST"' in script
    assert '"Content-Type": "application/json"' in script and "JSON.stringify(body)" in script
    assert 'data.translations.join("\\n")' in script and "innerHTML" not in script
    for element in ("source", "tgt_lang", "num_beams", "api_key", "translate", "output", "error"):
        assert f'id="{element}"' in html
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    node = shutil.which("node")
    if chromium:  # a real browser: the page translates ?text= on load; the DOM after its script ran
        dom = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--virtual-time-budget=60000",
                "--dump-dom",
                server.url + "/" + query,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        ).stdout
        shown = re.search(r'<pre id="output"[^>]*>(.*?)</pre>', dom, re.S).group(1)
        assert shown == expected.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    elif node:
        run = subprocess.run(
            [node, "-e", NODE_PAGE_RUNNER, server.url, query], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        shown = json.loads(run.stdout)
        assert shown["error"] == "" and shown["output"] == expected
        assert shown["model"] == "transformer_nmt on torch (fp32)" and shown["targets"] == ["de"]
        posted = [r for r in shown["requests"] if r["init"].get("method") == "POST"]
        assert [r["url"] for r in posted] == [server.url + "/translate"]
        assert json.loads(posted[0]["init"]["body"]) == {"text": sentences, "tgt_lang": "de"}
    else:
        pytest.skip("neither chromium nor node is installed: the page's HTML and fetch call were checked")


# ------------------------------------------------------------------------------------------ the fault-injected server
@pytest.fixture(scope="module")
def faulty(model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# serving keys\n{KEY}\n\nanother-key-abcdefghijklmnop\n")
    args = [
        "--model",
        str(model_dir),
        "--num_threads",
        "1",
        "--api_key_file",
        str(keys),
        "--max_queue",
        "4",
        "--max_sentences",
        "4",
    ]
    args += ["--request_timeout_s", "4", "--max_wait_ms", "0", "--truncate", "--max_sentence_tokens", "12"]
    env = {"FAULT_DELAY": "3", "FAULT_LOAD_DELAY": "4"}
    with ServerProcess(args, faults=True, env=env) as process:
        process.early = [
            httpx.get(f"{process.url}/health", timeout=10),
            httpx.post(f"{process.url}/translate", json={"text": "a"}, headers=auth(), timeout=10),
        ]
        process.health = process.wait_ready()
        yield process


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_health_is_503_until_the_model_is_loaded_and_warmed_up(faulty):
    health, early = faulty.early
    assert health.status_code == 503 and health.json() == {"status": "loading"} and health.headers["retry-after"]
    assert early.status_code == 503 and early.json()["error"]["type"] == "loading"
    assert faulty.health["status"] == "ready"
    log = faulty.log()
    assert log.index("listening on") < log.index("Ready:")


def test_api_keys_guard_every_route_but_health(faulty):
    with faulty.client() as client:
        missing = translate(client, {"text": "A dog runs."})
        wrong = translate(client, {"text": "A dog runs."}, headers=auth("test-key-0123456789abcdeX"))
        right = translate(client, {"text": "A dog runs."}, headers=auth())
        second = translate(client, {"text": "A dog runs."}, headers=auth("another-key-abcdefghijklmnop"))
        assert (missing.status_code, wrong.status_code, right.status_code, second.status_code) == (401, 401, 200, 200)
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert missing.json()["error"]["type"] == wrong.json()["error"]["type"] == "unauthorized"
        assert client.get("/health").status_code == 200 and client.get("/").status_code == 200
        assert client.get("/metrics").status_code == 401 and client.get("/metrics", headers=auth()).status_code == 200


def test_truncate_cuts_long_sentences_and_says_which(faulty, reference):
    sentences = ["A dog runs.", LONG]
    with faulty.client(headers=auth()) as client:
        answer = translate(client, {"text": sentences}).json()
    core = reference.translate(sentences, DecodeOptions(max_source_length=12))
    assert answer == {"translations": [r.text for r in core], "truncated": [1]} and core[1].truncated


def test_a_full_queue_gets_503_with_retry_after_and_a_slow_request_504(faulty, reference):
    with ThreadPoolExecutor(2) as pool, faulty.client(headers=auth()) as client:
        slow = pool.submit(translate, client, {"text": "SLOW A dog runs."})  # its batch takes 3 s
        wait_for_metric(client, "hf_variants_serve_requests_in_flight", 2)  # it, and this scrape
        # fills the queue (4), then decodes for 3 s more than its 4 s allow
        waiting = pool.submit(translate, client, {"text": [f"SLOW Dog {i}." for i in range(4)]})
        wait_for_metric(client, "hf_variants_serve_queue_sentences", 4)
        full = translate(client, {"text": "One more."})
        timed_out = waiting.result()
        done = slow.result()
        after = translate(client, {"text": "A dog runs."})
        metrics = metrics_of(client)
    assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1, full.text
    assert full.json()["error"]["limit"] == "max_queue" and full.json()["error"]["value"] == 4
    assert timed_out.status_code == 504 and timed_out.json()["error"]["limit"] == "request_timeout_s"
    assert done.status_code == 200 and done.json()["translations"] == [
        reference.translate(["SLOW A dog runs."])[0].text
    ]
    assert after.status_code == 200
    assert metrics['hf_variants_serve_errors_total{kind="max_queue"}'] == 1
    assert metrics['hf_variants_serve_errors_total{kind="request_timeout_s"}'] == 1
    assert metrics["hf_variants_serve_queue_sentences"] == 0  # the timed-out sentences left the queue


def test_an_engine_crash_fails_its_batch_with_500_and_the_server_goes_on(faulty):
    with faulty.client(headers=auth()) as client:
        crash = translate(client, {"text": ["A dog runs.", "CRASH now"]})
        after = translate(client, {"text": "A dog runs."})
    assert crash.status_code == 500
    error = crash.json()["error"]
    assert error["type"] == "engine_error" and "RuntimeError: injected engine fault" in error["message"]
    assert after.status_code == 200 and faulty.process.poll() is None


def test_a_request_refused_before_its_body_closes_the_connection(faulty):
    """A refusal answered before the body was read (no API key) says `Connection: close`: a keep-alive client must
    not send its next request on a connection whose unread body the server drops (httpx reported "Server
    disconnected without sending a response" for the request after a 401). The body is held back here, so the
    refusal always comes before it."""
    host, port = faulty.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 25\r\nConnection: keep-alive\r\n\r\n"
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += conn.recv(4096)
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 401") and "connection: close" in head, head


def test_sigterm_finishes_the_request_in_flight_and_exits_0(faulty, reference):
    """(The last test of the fault-injected server: it stops it.)"""
    with ThreadPoolExecutor(1) as pool, faulty.client(headers=auth()) as client:
        in_flight = pool.submit(translate, client, {"text": ["SLOW Two dogs play.", "A man rides a bike."]})
        wait_for_metric(client, "hf_variants_serve_requests_in_flight", 2)
        time.sleep(0.3)  # in its batch
        status = faulty.terminate()
        response = in_flight.result()
    assert status == 0, faulty.log()[-3000:]
    assert response.status_code == 200
    sources = ["SLOW Two dogs play.", "A man rides a bike."]
    assert response.json()["translations"] == [r.text for r in reference.translate(sources)]
    assert "Stopping (SIGTERM)" in faulty.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{faulty.url}/health", timeout=5)


# ------------------------------------------------------------------------------------------------------ the flags
def refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as stop:
        serve_main(list(args))
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_flags_are_refused_before_anything_loads(model_dir, tmp_path, capsys):
    assert "--model" in refused(capsys, "--model", str(tmp_path / "missing"))
    assert "no config.json" in refused(capsys, "--model", str(tmp_path))
    assert "onnx_manifest.json" in refused(capsys, "--model", str(model_dir), "--engine", "onnx")
    assert "model.bin" in refused(capsys, "--model", str(model_dir), "--engine", "ctranslate2")
    short = tmp_path / "short.txt"
    short.write_text("tooshort\n")
    assert "too easy to guess" in refused(capsys, "--model", str(model_dir), "--api_key_file", str(short))
    empty = tmp_path / "empty.txt"
    empty.write_text("# no key\n\n")
    assert "holds no key" in refused(capsys, "--model", str(model_dir), "--api_key_file", str(empty))
    assert "--cors_origins" in refused(capsys, "--model", str(model_dir), "--cors_origins", "app.example.com/x")
    assert "--max_sentences" in refused(capsys, "--model", str(model_dir), "--max_sentences", "9", "--max_queue", "8")
    assert "--max_sentence_tokens 999" in refused(capsys, "--model", str(model_dir), "--max_sentence_tokens", "999")
    assert "--workers" in refused(capsys, "--model", str(model_dir), "--workers", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert f"--port {port}" in refused(capsys, "--model", str(model_dir), "--port", port)


def test_a_parser_or_event_loop_not_installed_is_refused_by_its_flag(model_dir, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("httptools", "uvloop") else find_spec(name, *a)
    )
    message = refused(capsys, "--model", str(model_dir), "--http", "httptools")
    assert "--http httptools: httptools is not installed" in message
    assert "--loop uvloop: uvloop is not installed" in refused(capsys, "--model", str(model_dir), "--loop", "uvloop")
    assert "invalid choice" in refused(capsys, "--model", str(model_dir), "--http", "gunicorn")


def test_the_command_and_its_extra_are_declared():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
        import tomli as tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["hf-variants-serve"] == "hf_variants.commands.serve:cli"
    extra = project["optional-dependencies"]["serve"]
    assert {re.split(r"[<>=]", r)[0] for r in extra} == {
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "sentencex",
        "python-multipart",
        "swagger-ui-bundle",
        "httptools",
        "uvloop",
    }
    assert all(">=" in r for r in extra) and set(extra) <= set(project["optional-dependencies"]["dev"])
