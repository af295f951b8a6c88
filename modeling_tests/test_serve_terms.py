"""Terminology in `hf-variants-serve` (serve/terms.py): a real server process with a glossary of its own
(`--glossary`, case-insensitive) on a tiny trained baseline, spoken to over HTTP.

- A request's `constraints` (per sentence) and `glossary` (over the server's: its target wins for a term both
  give) give the translation core's translations of the same requests; each item is an object with its hypotheses'
  `constraints_met`, its `constraints`, `unmet_constraints` and `glossary` terms, and the answer lists the items
  with an unmet constraint; the server's glossary applies to plain requests, split paragraphs and the
  LibreTranslate mount too.
- Concurrent constrained and plain requests share the server's batches and each gets the translation it gets alone;
  in-process, `decode_batch` of a mixed batch equals each sentence alone, and a constrained request has a batch key
  of its own.
- Every bad field is a 422 naming it (`constraints[1][0]`, `glossary[0].target`, ...), the size limits name theirs
  (`max_constraints`, `max_constraint_chars`, `max_glossary_terms`), what the core refuses (a phrase the vocabulary
  cannot spell, constraints that cannot fit, sampling) is a 422 before anything is queued, and the server keeps
  serving; the OpenAPI schema describes both fields; the flags are refused before anything loads.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import read_sentences
from test_serve import refused
from trained_tiny import save_en_de_baseline

from hf_variants.inference import DecodeOptions, Glossary, TranslationRequest, Translator

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf-variants[serve]'")

from serve_helpers import ServerProcess  # noqa: E402

SERVER_GLOSSARY = [("dog", "Hund"), ("street", "Straße|Strasse")]
LIMITS = ["--max_constraints", "3", "--max_constraint_chars", "24", "--max_glossary_terms", "3", "--max_beams", "4"]
VAL = read_sentences("en", "val", n=60)
DOG, MAN, STREET = VAL[6], VAL[1], VAL[19]  # sentences holding "dog", "man", "street"


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-terms")
    save_en_de_baseline(tokenizer, root / "model")
    glossary = root / "glossary.tsv"
    glossary.write_text("".join(f"{s}\t{t}\n" for s, t in SERVER_GLOSSARY), encoding="utf-8")
    return {"model": root / "model", "glossary": glossary, "root": root}


@pytest.fixture(scope="module")
def reference(folders):
    return Translator.from_pretrained(str(folders["model"]), num_threads=1)


@pytest.fixture(scope="module")
def server(folders):
    args = ["--model", str(folders["model"]), "--num_threads", "1", "--max_wait_ms", "50", *LIMITS]
    args += ["--glossary", str(folders["glossary"]), "--glossary_ignore_case"]
    with ServerProcess(args) as process:
        process.wait_ready()
        yield process


def server_glossary() -> Glossary:
    return Glossary(SERVER_GLOSSARY, ignore_case=True)


def translate(client, body: dict):
    return client.post("/translate", json=body)


def test_constraints_and_a_glossary_answer_the_cores_translations(server, reference):
    sentences = [DOG, MAN, STREET, VAL[0]]
    own = [["Ball"], [], [["Kasse", "Kassenbereich"]], None]
    request_terms = [{"source": "man", "target": "Mann|Kerl"}, {"source": "DOG", "target": ["Hund", "Köter"]}]
    body = {"text": sentences, "constraints": own, "glossary": request_terms, "num_beams": 4}
    with server.client() as client:
        response = translate(client, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    # the request's terms, then the server's it does not give again ("dog": the request's "DOG" wins, as spelt)
    glossary = Glossary(
        [("man", "Mann|Kerl"), ("DOG", ("Hund", "Köter")), ("street", "Straße|Strasse")], ignore_case=True
    )
    requests = [glossary.apply(TranslationRequest(s, constraints=tuple(c or ()))) for s, c in zip(sentences, own)]
    assert [len(r.constraints) for r in requests] == [2, 1, 2, 0]
    core = reference.translate(requests, DecodeOptions(num_beams=4))
    for item, request, result in zip(answer["translations"], requests, core):
        assert item["source"] == result.source
        assert [h["text"] for h in item["hypotheses"]] == [h.text for h in result.hypotheses]
        assert [h.get("constraints_met") for h in item["hypotheses"]] == [h.constraints_met for h in result.hypotheses]
        assert "score" not in item["hypotheses"][0]  # scores were not asked for
        if request.constraints:
            assert item["constraints"] == [list(forms) for forms in request.constraints]
            assert item["unmet_constraints"] == [list(forms) for forms in result.unmet_constraints]
        else:
            assert "constraints" not in item
        assert item["glossary"] == [check.to_dict() for check in glossary.check(result.source, result.text)]
    assert answer["unmet_constraints"] == [i for i, r in enumerate(core) if r.unmet_constraints]
    assert answer["translations"][0]["glossary"] == [
        {"source": "DOG", "target": ["Hund", "Köter"], "found": core[0].constraints_met}
    ]


def test_the_server_glossary_applies_to_plain_requests_paragraphs_and_libretranslate(server, reference):
    glossary = server_glossary()
    plain = [glossary.apply(s) for s in (DOG, STREET)]
    core = {r.source: r.text for r in reference.translate(plain, DecodeOptions())}
    paragraph = [glossary.apply(s) for s in ("A dog runs.", "A man walks on the street.")]
    split = reference.translate(paragraph, DecodeOptions())
    with server.client() as client:
        answer = translate(client, {"text": [DOG, STREET]}).json()
        nbest = translate(client, {"text": DOG, "nbest": 2, "num_beams": 2}).json()
        document = translate(
            client, {"text": "A dog runs. A man walks on the street.", "split_sentences": True}
        ).json()
        libre = client.post("/libretranslate/translate", json={"q": DOG, "source": "en", "target": "de"}).json()
    assert answer["translations"] == [core[DOG], core[STREET]]  # strings, as a plain request gets
    assert answer["unmet_constraints"] == [i for i, s in enumerate([DOG, STREET]) if not all_met(reference, s)]
    (two,) = reference.translate([glossary.apply(DOG)], DecodeOptions(num_beams=2, nbest=2, scores=True))
    assert [h["text"] for h in nbest["translations"][0]["hypotheses"]] == [h.text for h in two.hypotheses]
    assert nbest["translations"][0]["glossary"] == [c.to_dict() for c in glossary.check(DOG, two.text)]
    assert document["translations"] == [f"{split[0].text} {split[1].text}"]
    assert libre == {"translatedText": core[DOG]}


def all_met(reference, sentence: str) -> bool:
    (result,) = reference.translate([server_glossary().apply(sentence)], DecodeOptions())
    return bool(result.constraints_met)


def test_concurrent_constrained_and_plain_requests_get_what_each_gets_alone(server, reference):
    sentences = VAL[20:32]
    bodies = []
    for i, sentence in enumerate(sentences):
        if i % 3 == 0:
            bodies.append({"text": sentence, "constraints": ["Ball"]})
        elif i % 3 == 1:
            bodies.append({"text": [sentence], "glossary": {"man": "Mann"}})
        else:
            bodies.append({"text": sentence})
    expected = []
    for body, sentence in zip(bodies, sentences):
        request = TranslationRequest(sentence, constraints=tuple(body.get("constraints", ())))
        glossary = server_glossary().with_terms([("man", "Mann")]) if "glossary" in body else server_glossary()
        (alone,) = reference.translate([glossary.apply(request)], DecodeOptions())
        expected.append(alone.text)

    def send(body):
        with server.client() as client:
            response = translate(client, body)
            assert response.status_code == 200, response.text
            item = response.json()["translations"][0]
            return item if isinstance(item, str) else item["hypotheses"][0]["text"]

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(send, bodies)) == expected


def test_a_mixed_batch_decodes_each_sentence_as_alone_and_constrained_requests_batch_apart(reference):
    from hf_variants.serve.limits import ServeLimits
    from hf_variants.serve.prepare import prepare_body
    from hf_variants.serve.terms import ServerTerms

    requests = [
        TranslationRequest(VAL[40], constraints=("Ball",)),
        TranslationRequest(VAL[41]),
        TranslationRequest(VAL[42], constraints=(("Wasser", "Strand"), "Hund")),
        TranslationRequest(VAL[43]),
    ]
    options = reference.resolve(DecodeOptions(num_beams=2))
    batch = reference.decode_batch(reference.encode(requests), options)
    for request, result in zip(requests, batch):
        (alone,) = reference.translate([request], DecodeOptions(num_beams=2))
        assert [h.token_ids for h in result.hypotheses] == [h.token_ids for h in alone.hypotheses]
        assert result.constraints_met == alone.constraints_met
    limits, terms = ServeLimits(), ServerTerms()

    def prepared(body):
        return prepare_body(reference, json.dumps(body).encode(), limits, None, None, terms)

    plain = prepared({"text": [VAL[40], VAL[41]], "num_beams": 2})
    constrained = prepared({"text": [VAL[40], VAL[41]], "num_beams": 2, "constraints": [["Ball"], []]})
    glossary = prepared({"text": [VAL[40], VAL[41]], "num_beams": 2, "glossary": [{"source": "xyz", "target": "Q"}]})
    assert plain.key != constrained.key and plain.key == glossary.key  # no term applied: no constraints
    assert [r.constraints for r in constrained.requests] == [(("Ball",),), ()]
    assert constrained.constrained and not glossary.constrained and glossary.glossary is not None


BAD = [
    ({"text": "A dog.", "constraints": "Ball"}, 422, "constraints", None),
    ({"text": ["A.", "B."], "constraints": [["Ball"]]}, 422, "constraints", None),
    ({"text": ["A.", "B."], "constraints": [["Ball"], ["", "x"]]}, 422, "constraints[1][0]", None),
    ({"text": ["A.", "B."], "constraints": [[], [["Kasse", 3]]]}, 422, "constraints[1][0][1]", None),
    ({"text": "A.", "constraints": ["a", "b", "c", "d"]}, 422, "constraints", "max_constraints"),
    ({"text": "A.", "constraints": ["x" * 25]}, 422, "constraints[0]", "max_constraint_chars"),
    ({"text": "A.", "constraints": [["Kasse", "y" * 25]]}, 422, "constraints[0][1]", "max_constraint_chars"),
    ({"text": "A. B.", "split_sentences": True, "constraints": ["Ball"]}, 422, "constraints", None),
    ({"text": "A.", "glossary": "dog"}, 422, "glossary", None),
    ({"text": "A.", "glossary": [{"source": "dog"}]}, 422, "glossary[0]", None),
    ({"text": "A.", "glossary": [{"source": "dog", "target": ""}]}, 422, "glossary[0].target", None),
    ({"text": "A.", "glossary": {"dog": ["Hund", 3]}}, 422, 'glossary["dog"][1]', None),
    ({"text": "A.", "glossary": {"a": "b", "c": "d", "e": "f", "g": "h"}}, 413, "glossary", "max_glossary_terms"),
    (
        {"text": "A.", "glossary": [{"source": "cat", "target": "Katze"}, {"source": "Cat", "target": "Kater"}]},
        422,
        "glossary[1]",
        None,
    ),
    ({"text": "A.", "constraints": ["€€€"]}, 422, "constraints[0]", None),
    ({"text": ["A.", "B."], "constraints": [[], ["Ball", "Hund"]], "max_new_tokens": 3}, 422, "constraints[1]", None),
    ({"text": "A.", "constraints": ["Ball"], "do_sample": True}, 422, "do_sample", None),
    ({"text": "A dog runs.", "do_sample": True}, 422, "do_sample", None),
    (
        {"text": "A man, a cat and a dog on the street.", "glossary": {"man": "Mann", "cat": "Katze"}},
        422,
        "glossary",
        "max_constraints",
    ),
]


def test_bad_fields_get_422s_naming_them_and_the_server_keeps_serving(server):
    messages = []
    with server.client() as client:
        for body, status, field, limit in BAD:
            response = translate(client, body)
            messages.append(response.json()["error"]["message"])
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["field"] == field, (body, error)
            assert error.get("limit") == limit, (body, error)
            if limit:
                assert error["type"] == limit and f"--{limit}" in error["message"]
            else:
                assert error["type"] == "invalid_request"
        good = translate(client, {"text": "A dog.", "constraints": ["Ball"]})
    assert good.status_code == 200 and good.json()["translations"][0]["constraints"] == [["Ball"], ["Hund"]]
    assert "<unk>" in messages[14] and "output is limited to 3 tokens" in messages[15]
    assert "does not implement do_sample" in messages[16] and "the server's glossary" in messages[17]


def test_the_openapi_schema_describes_constraints_and_glossary(server):
    with server.client() as client:
        schema = client.get("/openapi.json").json()
    body = schema["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    constraints, glossary = body["properties"]["constraints"], body["properties"]["glossary"]
    assert {"array", "null"} == {branch["type"] for branch in constraints["anyOf"]}
    assert "--max_constraints" in constraints["description"]
    kinds = [branch["type"] for branch in glossary["anyOf"]]
    assert kinds == ["array", "object", "null"] and "--max_glossary_terms" in glossary["description"]
    assert glossary["anyOf"][0]["items"]["required"] == ["source", "target"]
    responses = json.dumps(schema["components"]["schemas"])
    assert all(name in responses for name in ('"constraints_met"', '"unmet_constraints"', '"found"'))


def test_terminology_flags_are_refused_before_anything_loads(folders, tmp_path, capsys):
    model = str(folders["model"])
    bad = tmp_path / "bad.tsv"
    bad.write_text("dog\tHund\nstreet\n", encoding="utf-8")
    message = refused(capsys, "--model", model, "--glossary", str(bad))
    assert re.search(rf"--glossary {re.escape(str(bad))}:2: expected 2 tab-separated fields", message)
    assert "--max_constraints" in refused(capsys, "--model", model, "--max_constraints", "0")
    assert "--max_glossary_terms" in refused(capsys, "--model", model, "--max_glossary_terms", "-1")
    pytest.importorskip("ctranslate2")
    from transformers import AutoTokenizer

    from hf_variants.deploy.ctranslate2 import export
    from hf_variants.modeling_transformer_nmt import TransformerNmtForConditionalGeneration

    ct2 = tmp_path / "ct2"
    export(TransformerNmtForConditionalGeneration.from_pretrained(model), AutoTokenizer.from_pretrained(model), ct2)
    message = refused(capsys, "--model", str(ct2), "--glossary", str(folders["glossary"]))
    assert "--glossary: the ctranslate2 engine has no lexically constrained decoding" in message
