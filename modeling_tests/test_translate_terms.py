"""hf-variants-translate's terminology flags (`--constraints FILE`, `--glossary FILE`, commands/translate_terms.py)
end to end on a tiny trained baseline: the text output is the translation core's for the same requests (each line's
own constraints, then its glossary terms'), lines without constraints are a plain run's, the JSON Lines records
carry each line's constraints, the unmet ones and the glossary's terms, the summary counts the sentences with
constraints and those with some unmet (a constraint that cannot be placed is reported, never dropped) and gives
term accuracy equal to `evaluation.term_accuracy` of the output, beside BLEU / chrF; every refusal names the flag,
file and line, before the model loads; a sharded run is byte-identical to one process, and a changed glossary is
refused on resume naming it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import read_sentences
from trained_tiny import one_torch_thread, save_en_de_baseline

from hf_variants.commands import translate
from hf_variants.commands.common import refusals
from hf_variants.inference import DecodeOptions, Glossary, TranslationRequest, Translator, parse_constraints
from hf_variants.training import evaluation

LINES = 24
ONE = ["--no_progress", "--num_threads", "1", "--buffer_size", "6"]
GLOSSARY = "man\tMann|Kerl\ndog\tHund\nwoman\tFrau\nstreet\tStraße|Strasse\nshirt\tHemd\nwater\tWasser\n"
# per input line (1-based): its constraints file line; the others are empty
CONSTRAINT_LINES = {1: "Hund", 3: "Kasse|Kassenbereich\tWarenkorb", 5: "rote Mütze", 10: "Ball\tWasser|Strand"}


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def files(tokenizer, tmp_path_factory):
    """The model folder, the input (24 validation sentences, line 8 empty), its references, a constraints file and
    a glossary."""
    root = tmp_path_factory.mktemp("terms")
    save_en_de_baseline(tokenizer, root / "model")
    sources = read_sentences("en", "val", n=LINES)
    sources[7] = ""
    constraints = [CONSTRAINT_LINES.get(i + 1, "") for i in range(LINES)]
    return {
        "model": root / "model",
        "root": root,
        "sources": sources,
        "input": write(root / "src.en", sources),
        "refs": write(root / "ref.de", read_sentences("de", "val", n=LINES)),
        "constraints": write(root / "constraints.tsv", constraints),
        "glossary": write(root / "glossary.tsv", GLOSSARY.splitlines()),
    }


def args_of(files, output: Path, *extra) -> list[str]:
    return ["--model", str(files["model"]), "--input", str(files["input"]), "--output", str(output), *ONE, *extra]


def terms_flags(files) -> list[str]:
    return ["--constraints", str(files["constraints"]), "--glossary", str(files["glossary"]), "--glossary_ignore_case"]


def expected_requests(files) -> tuple[list[TranslationRequest], Glossary]:
    """The requests the command should make: each line's constraints, then its glossary terms'."""
    glossary = Glossary.load(files["glossary"], ignore_case=True)
    lines = files["constraints"].read_text(encoding="utf-8").splitlines()
    requests = [
        glossary.apply(TranslationRequest(source, tgt_lang="de", constraints=parse_constraints(line)))
        for source, line in zip(files["sources"], lines)
    ]
    return requests, glossary


def test_constraints_and_a_glossary_give_the_cores_translations_records_and_term_accuracy(files, tmp_path):
    requests, glossary = expected_requests(files)
    assert sum(bool(r.constraints) for r in requests) >= 8  # lines with their own constraints, with terms, both
    core = Translator.from_pretrained(str(files["model"]), num_threads=1).translate(requests, DecodeOptions())
    flags = [*terms_flags(files), "--references", str(files["refs"])]
    summary = translate.main(args_of(files, tmp_path / "out.de", *flags, "--results_json", str(tmp_path / "r.json")))
    text = (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
    assert text == [result.text for result in core]  # the text output: one translation a line, as always
    plain = translate.main(args_of(files, tmp_path / "plain.de"))
    plain_text = (tmp_path / "plain.de").read_text(encoding="utf-8").splitlines()
    for request, line, without in zip(requests, text, plain_text):
        if not request.constraints:
            assert line == without  # lines without constraints: the plain search's translation
    assert text != plain_text

    translate.main(args_of(files, tmp_path / "out.jsonl", *terms_flags(files), "--output_format", "jsonl"))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    for request, result, record in zip(requests, core, records):
        assert [h["text"] for h in record["hypotheses"]] == [h.text for h in result.hypotheses]
        if request.constraints and request.source:
            assert record["constraints"] == [list(forms) for forms in request.constraints]
            met = [h.constraints_met for h in result.hypotheses]
            assert [h["constraints_met"] for h in record["hypotheses"]] == met
            assert record.get("unmet_constraints", []) == [list(forms) for forms in result.unmet_constraints]
        else:
            assert "constraints" not in record and "unmet_constraints" not in record
        checks = glossary.check(request.source, result.text)
        assert record["glossary"] == [check.to_dict() for check in checks]
    assert any(record["glossary"] for record in records)

    constrained = [r for r, q in zip(core, requests) if q.constraints and q.source]
    met = sum(bool(r.constraints_met) for r in constrained)
    accuracy = evaluation.term_accuracy(files["sources"], text, glossary)
    assert summary["constrained_sentences"] == len(constrained) and summary["constraints_met_sentences"] == met
    assert summary["unmet_constraints_sentences"] == len(constrained) - met == len(summary["unmet_constraints_lines"])
    assert summary["constrained_num_beams"] == sorted({max(4, len(r.constraints) + 1) for r in constrained})
    assert summary["num_beams"] == plain["num_beams"] == 1  # greedy asked for; the constrained lines' beam said above
    for key in ("term_accuracy", "terms", "terms_found", "sentences_with_terms"):
        assert summary[key] == accuracy[key], key
    assert summary["terms"] > 0 and {"bleu", "chrf"} <= set(summary)
    assert summary["glossary"] == str(files["glossary"]) and summary["glossary_terms"] == 6
    assert summary["glossary_ignore_case"] is True and summary["glossary_whole_word"] is True
    assert json.loads((tmp_path / "r.json").read_text())["term_accuracy"] == summary["term_accuracy"]
    assert "term_accuracy" not in plain and "constrained_sentences" not in plain


def test_a_constraint_that_cannot_be_placed_is_counted_and_listed(files, tmp_path, tokenizer, caplog):
    """A prefix that fills the output limit but for 3 tokens leaves "Kasse" (3 tokens) no room before </s>: the
    line is translated, its record lists the unmet constraint, the summary counts it and names the line."""
    prefix = "Ein Mann mit einem roten Hemd"
    n = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    source = write(tmp_path / "two.en", files["sources"][:2])
    prefixes = write(tmp_path / "prefix.de", ["", prefix])
    constraints = write(tmp_path / "c.tsv", ["Hund", "Kasse\tMann"])
    args = ["--model", str(files["model"]), "--input", str(source), "--output", str(tmp_path / "o.jsonl"), *ONE]
    args += ["--prefix", str(prefixes), "--constraints", str(constraints), "--output_format", "jsonl"]
    with caplog.at_level(logging.WARNING, logger="hf_variants.translate"):
        summary = translate.main([*args, "--num_beams", "4", "--max_len_a", "0", "--max_len_b", str(n + 3)])
    records = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text(encoding="utf-8").splitlines()]
    assert records[1]["unmet_constraints"] == [["Kasse"]] and records[1]["hypotheses"][0]["constraints_met"] == [
        False,
        True,
    ]
    assert "unmet_constraints" not in records[0] and records[0]["hypotheses"][0]["constraints_met"] == [True]
    assert summary["constrained_sentences"] == 2 and summary["constraints_met_sentences"] == 1
    assert summary["unmet_constraints_sentences"] == 1 and summary["unmet_constraints_lines"] == [2]
    assert summary["constrained_num_beams"] == [4]
    assert "line 2: 1 of 2 constraints not met within the sentence's length limit: 'Kasse'" in caplog.text


def test_refusals_name_the_flag_file_and_line_before_the_model_loads(files, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(translate, "load_translator", no_loading)
    out = tmp_path / "o.de"
    lines = files["constraints"].read_text(encoding="utf-8").splitlines()
    bad = write(tmp_path / "bad.tsv", [*lines[:4], "Kasse|", *lines[5:]])
    short = write(tmp_path / "short.tsv", lines[:-1])
    glossary = write(tmp_path / "g.tsv", ["dog\tHund", "cat", "dog\tKatze"])
    cases = [
        (["--constraints", str(bad)], rf"--constraints {bad}:5: constraints\[0\]\[1\]: an empty phrase"),
        (["--constraints", str(short)], rf"has 24 lines but --constraints {short} has 23; line 24 has no counterpart"),
        (["--constraints", "-"], r"--constraints cannot be stdin"),
        (["--glossary", str(glossary)], rf"--glossary {glossary}:2: expected 2 tab-separated fields"),
        (["--glossary_substring"], r"--glossary_substring sets how --glossary matches: pass --glossary FILE"),
        (
            ["--glossary", str(files["glossary"]), "--do_sample"],
            r"--glossary: constrained beam search does not implement --do_sample",
        ),
        (
            ["--constraints", str(files["constraints"]), "--no_repeat_ngram_size", "3"],
            r"--constraints: constrained beam search does not implement --no_repeat_ngram_size 3",
        ),
    ]
    for flags, message in cases:
        with pytest.raises(refusals(), match=message):
            translate.main(args_of(files, out, *flags))
    with pytest.raises(refusals(), match=r"--output '.*glossary.tsv' is --glossary .*would overwrite its own input"):
        translate.main(args_of(files, files["glossary"], "--glossary", str(files["glossary"])))
    assert not out.exists()


def test_constraints_that_cannot_fit_name_the_input_line_and_file(files, tmp_path):
    lines = [""] * LINES
    lines[5] = "ein sehr langer Satz\tmit vielen Wörtern\tder nicht passt"
    constraints = write(tmp_path / "long.tsv", lines)
    with pytest.raises(refusals()) as error:
        translate.main(args_of(files, tmp_path / "o.de", "--constraints", str(constraints), "--max_new_tokens", "8"))
    message = str(error.value)
    assert (
        message.startswith(f"{files['input']}:6: constraints: ") and f"(from --constraints {constraints}:6)" in message
    )
    assert "raise --max_len_b or --max_new_tokens" in message
    assert not (tmp_path / "o.de").exists()


def test_ctranslate2_is_refused_naming_the_flag_before_loading(files, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    from transformers import AutoTokenizer

    from hf_variants.deploy.ctranslate2 import export
    from hf_variants.modeling_transformer_nmt import TransformerNmtForConditionalGeneration

    folder = tmp_path / "ct2"
    model = TransformerNmtForConditionalGeneration.from_pretrained(files["model"])
    export(model, AutoTokenizer.from_pretrained(files["model"]), folder)
    monkeypatch.setattr(translate, "load_translator", lambda *a, **k: pytest.fail("the model loaded"))
    for flags, flag in (
        (["--constraints", str(files["constraints"])], "--constraints"),
        (["--glossary", str(files["glossary"])], "--glossary"),
    ):
        args = ["--model", str(folder), "--input", str(files["input"]), "--output", str(tmp_path / "o"), *ONE, *flags]
        with pytest.raises(
            refusals(), match=rf"^{flag}: the ctranslate2 engine has no lexically constrained decoding"
        ):
            translate.main(args)


def test_sharded_output_is_byte_identical_and_a_changed_glossary_is_refused(files, tmp_path):
    flags = [*terms_flags(files), "--output_format", "jsonl", "--references", str(files["refs"])]
    plain = translate.main(args_of(files, tmp_path / "plain.jsonl", *flags))
    glossary = write(tmp_path / "glossary.tsv", GLOSSARY.splitlines())
    flags[3] = str(glossary)  # its own copy, changed below
    units = ["--unit_lines", "6", "--num_shards", "2"]
    assert translate.main(args_of(files, tmp_path / "sharded.jsonl", *flags, *units, "--shard_index", "0")) is None
    glossary.write_text(GLOSSARY + "boy\tJunge\n", encoding="utf-8")
    with pytest.raises(refusals()) as error:
        translate.main(args_of(files, tmp_path / "sharded.jsonl", *flags, *units, "--shard_index", "1"))
    assert f"--glossary {glossary.resolve()} (sha256): sha256 " in str(error.value)
    glossary.write_text(GLOSSARY, encoding="utf-8")
    translate.main(args_of(files, tmp_path / "sharded.jsonl", *flags, *units, "--shard_index", "1"))
    merged = translate.main(args_of(files, tmp_path / "sharded.jsonl", *flags, *units, "--merge"))
    assert (tmp_path / "sharded.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
    keys = ("constrained_sentences", "constraints_met_sentences", "unmet_constraints_lines", "constrained_num_beams")
    for key in (*keys, "term_accuracy", "terms", "terms_found", "sentences_with_terms", "bleu", "chrf"):
        assert merged[key] == plain[key], key
    manifest_flags = ["--constraints", str(files["constraints"]), "--output_format", "jsonl", "--keep_work_dir"]
    translate.main(args_of(files, tmp_path / "kept.jsonl", *manifest_flags, "--unit_lines", "6"))
    manifest = json.loads((tmp_path / "kept.jsonl.work" / "manifest.json").read_text())
    assert (
        set(manifest["inputs"]) == {"--input", "--constraints"} and "glossary_ignore_case" not in manifest["settings"]
    )
    assert (tmp_path / "kept.jsonl").read_bytes().count(b"\n") == LINES
