"""training/translate.py on tiny saved models: too-long sources (a warning naming the line, an empty output line,
the rest translated), empty lines, stdin/stdout, JSONL input (with its references and per-row annotations), the
progress bar, n-best JSON Lines, prefixes, sampling, alignments, token batches, truncation, streaming through a real
pipe, and the errors that end the command (exit 2) before the model loads. The translations are checked against
`evaluation.translate` and the translation core on the same sentences."""

import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import read_sentences  # noqa: E402
from trained_tiny import en_de_baseline, one_torch_thread  # noqa: E402

from hf_variants import (  # noqa: E402
    MgsaConfig,
    MgsaForConditionalGeneration,
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
)
from hf_variants.commands import translate  # noqa: E402
from hf_variants.commands.common import refusals  # noqa: E402
from hf_variants.commands.loading import load_model_and_tokenizer  # noqa: E402
from hf_variants.training import evaluation  # noqa: E402
from hf_variants.training.corpus import DataError  # noqa: E402

SCRIPT = ROOT / "training" / "translate.py"
GEN = ["--num_beams", "2", "--max_len_a", "0", "--max_len_b", "4", "--no_progress"]


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def save_model(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """A tiny en->de baseline with 40 learned positions (a longer source used to crash inside torch)."""
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        max_position_embeddings=40,
        position_embedding_type="learned",
        languages=["en", "de"],
    )
    return save_model(
        TransformerNmtForConditionalGeneration(config).eval(), tokenizer, tmp_path_factory.mktemp("tiny_model")
    )


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model_and_tokenizer(str(model_dir))


def expected(loaded, texts, max_len_b=4):
    model, tok = loaded
    return evaluation.translate(model, tok, texts, "de", num_beams=2, max_len_a=0, max_len_b=max_len_b)


def lines_of(path):
    return Path(path).read_text(encoding="utf-8").split("\n")[:-1]


def write(path, lines):
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_too_long_lines_give_a_warning_and_an_empty_line(model_dir, loaded, tmp_path, caplog):
    _, tok = loaded
    short = read_sentences("en", "val", n=3)
    long = " ".join(read_sentences("en", "val", n=4, start=3))
    n_long = len(tok(long)["input_ids"])
    assert n_long > 40 and all(len(tok(s)["input_ids"]) <= 40 for s in short)
    src = write(tmp_path / "src.en", [short[0], long, "", short[1], "   ", long, short[2]])
    with caplog.at_level(logging.WARNING, logger="hf_variants.translate"):
        result = translate.main(
            ["--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o"), *GEN]
        )
    hyps = lines_of(tmp_path / "o")
    assert len(hyps) == 7 and hyps[1] == hyps[2] == hyps[4] == hyps[5] == ""
    assert [hyps[0], hyps[3], hyps[6]] == expected(loaded, short)
    assert result["too_long_lines"] == [2, 6] and result["too_long_inputs"] == 2 and result["empty_inputs"] == 2
    for line in (2, 6):
        assert f"line {line}: {n_long} tokens" in caplog.text
    assert "more than this model accepts (40, config.max_position_embeddings)" in caplog.text


def test_generation_stays_within_the_models_positions(model_dir, tokenizer, tmp_path):
    """max_len_a/b may ask for more target tokens than the model has positions: capped at the limit - 1 (the
    decoder would index past its learned positions). With </s> suppressed, every hypothesis runs to the cap."""
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        max_position_embeddings=40,
        position_embedding_type="learned",
        languages=["en", "de"],
    )
    model = TransformerNmtForConditionalGeneration(config).eval()
    model.generation_config.suppress_tokens = [0, 1, 2]  # no padding, start or end token: run to the budget
    save_model(model, tokenizer, tmp_path / "m")
    src = write(tmp_path / "src.en", read_sentences("en", "val", n=2))
    translate.main(
        [
            "--model",
            str(tmp_path / "m"),
            "--input",
            str(src),
            "--output",
            str(tmp_path / "o"),
            "--num_beams",
            "1",
            "--max_len_a",
            "2",
            "--max_len_b",
            "10",
            "--no_progress",
        ]
    )
    capped = lines_of(tmp_path / "o")
    model_inputs = model.prepare_translation_inputs(tokenizer, read_sentences("en", "val", n=2))
    assert max(model_inputs["attention_mask"].sum(-1)) * 2 + 10 > 40  # max_len_a/b ask for more than 40
    direct = model.generate(**model_inputs, num_beams=1, max_new_tokens=39)
    assert direct.shape[-1] == 40  # the start token + 39 generated: all 40 positions, no more
    assert capped == [h.strip() for h in tokenizer.decode(direct, skip_special_tokens=True)]


def test_only_empty_lines(model_dir, tmp_path):
    src = write(tmp_path / "src.en", ["", "  ", ""])
    result = translate.main(["--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o")])
    assert lines_of(tmp_path / "o") == ["", "", ""] and result["empty_inputs"] == 3


def test_stdin_to_stdout(model_dir, loaded, tmp_path):
    sentences = read_sentences("en", "val", n=3)
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            str(model_dir),
            "--input",
            "-",
            "--output",
            "-",
            "--num_beams",
            "2",
            "--max_len_a",
            "0",
            "--max_len_b",
            "4",
        ],
        input="\n".join([sentences[0], "", sentences[1], sentences[2]]) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.split("\n")
    assert out[-1] == "" and out[:-1] == [*expected(loaded, sentences[:1]), "", *expected(loaded, sentences[1:])]
    summary = json.loads(proc.stderr[proc.stderr.index("{") :])  # the summary went to stderr, not into the output
    assert summary["input"] == "stdin" and summary["output"] == "stdout" and summary["sentences"] == 4
    assert "translating" not in proc.stderr  # stderr is no terminal: no progress bar


def test_progress_bar_on_a_terminal(model_dir, tmp_path, capsys, monkeypatch):
    src = write(tmp_path / "src.en", read_sentences("en", "val", n=3))
    args = [
        "--model",
        str(model_dir),
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o"),
        "--num_beams",
        "1",
        "--max_len_b",
        "2",
        "--batch_size",
        "2",
    ]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    translate.main(args)
    err = capsys.readouterr().err
    assert "translating" in err and "3/3" in err
    translate.main(args + ["--no_progress"])
    assert "translating" not in capsys.readouterr().err


def test_jsonl_input(model_dir, loaded, tmp_path):
    en = read_sentences("en", "val", n=3)
    de = read_sentences("de", "val", n=3)
    rows = [
        {"translation": {"en": en[0], "de": de[0]}},
        {"translation": {"de": de[1], "en": ""}},
        {"translation": {"en": en[2], "de": de[2]}},
    ]
    src = tmp_path / "test.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    result = translate.main(["--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o"), *GEN])
    hyps = lines_of(tmp_path / "o")
    assert hyps[1] == "" and [hyps[0], hyps[2]] == expected(loaded, [en[0], en[2]])
    # every row has the target side: scored against it
    assert result["references"] == f"{src} (target side)"
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [de]).score)
    # {"text": ...} / {"source": ..., "target": ...} rows, recognised by --input_format on any file name
    flat = write(tmp_path / "rows.txt", [json.dumps({"text": en[0]}), json.dumps({"source": en[2]})])
    translate.main(
        [
            "--model",
            str(model_dir),
            "--input",
            str(flat),
            "--input_format",
            "jsonl",
            "--output",
            str(tmp_path / "o2"),
            *GEN,
        ]
    )
    assert lines_of(tmp_path / "o2") == expected(loaded, [en[0], en[2]])
    # without --input_format, a .txt file is text: the JSON lines are translated as sentences
    result = translate.main(["--model", str(model_dir), "--input", str(flat), "--output", str(tmp_path / "o3"), *GEN])
    assert "references" not in result and len(lines_of(tmp_path / "o3")) == 2


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", r"bad\.jsonl:2: invalid JSON"),
        ("", r"bad\.jsonl:2: empty line"),
        ('["a list"]', r"bad\.jsonl:2: expected a JSON object, got list"),
        ('{"translation": {"fr": "x", "de": "y"}}', r"bad\.jsonl:2: no 'en' side in \"translation\""),
        ('{"text": "x", "source": "y"}', r"bad\.jsonl:2: .*found both \"text\" and \"source\""),
        ('{"sentence": "x"}', r"bad\.jsonl:2: expected .*\"text\".*found the keys \['sentence'\]"),
        ('{"text": 3}', r"bad\.jsonl:2: the source is a int"),
    ],
)
def test_bad_jsonl_rows_name_the_line(model_dir, tmp_path, row, message):
    src = write(tmp_path / "bad.jsonl", [json.dumps({"translation": {"en": "A dog.", "de": "Ein Hund."}}), row])
    with pytest.raises(DataError, match=message):
        translate.main(
            ["--model", str(model_dir), "--input", str(src), "--src_lang", "en", "--output", str(tmp_path / "o"), *GEN]
        )
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_jsonl_source_side_needs_the_languages(model_dir, tmp_path):
    src = write(tmp_path / "three.jsonl", [json.dumps({"translation": {"en": "A.", "fr": "Un.", "de": "Ein."}})])
    with pytest.raises(DataError, match=r"three\.jsonl:1: cannot tell the source side among \['de', 'en', 'fr'\]"):
        translate.main(["--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o"), *GEN])


def _parse(sentence: str) -> str:
    """A two-constituent bracketed parse whose leaves spell `sentence` (enough to drive the syntactic MG-SA)."""
    words = [w.replace("(", "-LRB-").replace(")", "-RRB-") for w in sentence.split()]
    half = max(1, len(words) // 2)
    right = " ".join(f"(VB {w})" for w in words[half:])
    return f"(ROOT (S (NP {' '.join(f'(NN {w})' for w in words[:half])}){f' (VP {right})' if right else ''}))"


def test_jsonl_annotations_per_row_equal_annotation_files(tokenizer, tmp_path):
    torch.manual_seed(0)
    config = MgsaConfig.from_preset("tiny", vocab_size=len(tokenizer), languages=["en", "de"])
    model_dir = save_model(MgsaForConditionalGeneration(config).eval(), tokenizer, tmp_path / "mgsa")
    en = read_sentences("en", "val", n=3)
    write(tmp_path / "src.en", en)
    write(tmp_path / "src.parses", [_parse(s) for s in en])
    translate.main(
        [
            "--model",
            str(model_dir),
            "--input",
            str(tmp_path / "src.en"),
            "--output",
            str(tmp_path / "from_files"),
            "--source_annotation",
            f"parses={tmp_path / 'src.parses'}",
            *GEN,
        ]
    )
    rows = [
        {"translation": {"en": en[0]}, "parses": {"en": _parse(en[0])}},
        {"text": en[1], "parses": _parse(en[1])},
        {"translation": {"en": en[2]}, "parses": {"en": _parse(en[2])}},
    ]
    write(tmp_path / "rows.jsonl", [json.dumps(r) for r in rows])
    translate.main(
        [
            "--model",
            str(model_dir),
            "--input",
            str(tmp_path / "rows.jsonl"),
            "--src_lang",
            "en",
            "--output",
            str(tmp_path / "from_rows"),
            "--source_annotation",
            "parses",
            *GEN,
        ]
    )
    assert lines_of(tmp_path / "from_rows") == lines_of(tmp_path / "from_files")
    assert len(lines_of(tmp_path / "from_rows")) == 3
    write(tmp_path / "missing.jsonl", [json.dumps(rows[0]), json.dumps({"text": en[1]})])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: no 'parses' for the source"):
        translate.main(
            [
                "--model",
                str(model_dir),
                "--input",
                str(tmp_path / "missing.jsonl"),
                "--src_lang",
                "en",
                "--output",
                str(tmp_path / "o"),
                "--source_annotation",
                "parses",
                *GEN,
            ]
        )
    with pytest.raises(DataError, match="NAME=FILE"):  # NAME alone needs JSONL rows
        translate.main(
            [
                "--model",
                str(model_dir),
                "--input",
                str(tmp_path / "src.en"),
                "--output",
                str(tmp_path / "o"),
                "--source_annotation",
                "parses",
                *GEN,
            ]
        )


def test_the_length_rule_stops_at_the_models_target_positions(loaded):
    """A length rule asking for more new tokens than the model has target positions (--max_len_b 200 on a
    40-position model) decodes up to the positions instead of failing in generate() after the model loaded; below
    the positions the rule is kept."""
    model, tok = loaded
    assert evaluation.new_token_limit(10, 1.2, 200, positions=40) == 40
    assert evaluation.new_token_limit(10, 1.2, 5, positions=40) == 17
    assert evaluation.new_token_limit(10, 1.2, 200) == 212
    with pytest.raises(ValueError, match="max_position_embeddings=40"):  # what the rule used to ask of generate()
        model.generate(**tok(["A dog."], return_tensors="pt"), max_new_tokens=212, num_beams=1)
    (hyp,) = evaluation.translate(model, tok, ["A dog runs."], "de", num_beams=2, max_len_a=1.2, max_len_b=200)
    assert isinstance(hyp, str) and hyp  # decoded up to the 40 positions (an untrained model never stops earlier)


# ------------------------------------------------------------------------------------ the translation core's options
@pytest.fixture(scope="module")
def trained_dir(tokenizer, tmp_path_factory):
    """The tiny baseline trained a few seconds, saved as train.py saves a model: beam 4, length penalty 0.6 and the
    run's length rule in its generation config, its languages in its config."""
    model = en_de_baseline(tokenizer)
    model.generation_config.num_beams, model.generation_config.length_penalty = 4, 0.6
    model.generation_config.length_rule = {"max_len_a": 1.2, "max_len_b": 10, "max_new_tokens": 256}
    return save_model(model, tokenizer, tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="module")
def core(trained_dir):
    from hf_variants.inference import Translator

    return Translator.from_pretrained(str(trained_dir))


def run(model_dir, tmp_path, sources, *extra, name="o"):
    src = write(tmp_path / f"{name}.src", sources)
    result = translate.main(
        ["--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / name), "--no_progress", *extra]
    )
    return result, lines_of(tmp_path / name)


def test_nbest_jsonl_one_best_is_the_plain_translation(trained_dir, core, tmp_path):
    from hf_variants.inference import DecodeOptions

    sources = read_sentences("en", "val", n=6)
    sources[2] = ""
    result, plain = run(trained_dir, tmp_path, sources, name="plain")
    assert result["output_format"] == "text" and result["num_beams"] == 4 and result["length_penalty"] == 0.6
    assert result["length_rule"] == {"max_len_a": 1.2, "max_len_b": 10}  # the saved rule
    result, rows = run(trained_dir, tmp_path, sources, "--nbest", "3", name="nbest")
    assert result["output_format"] == "jsonl" and len(rows) == 6
    rows = [json.loads(row) for row in rows]
    assert [r["hypotheses"][0]["text"] if r["hypotheses"] else "" for r in rows] == plain
    assert rows[2] == {"source": "", "hypotheses": [], "skipped": "empty"}
    expected = core.translate(sources, DecodeOptions(nbest=3, scores=True))
    for row, want in zip(rows, expected):
        assert row["source"] == want.source
        assert [h["text"] for h in row["hypotheses"]] == [h.text for h in want.hypotheses]
        assert [h["score"] for h in row["hypotheses"]] == pytest.approx([h.score for h in want.hypotheses])
        assert [h["log_prob"] for h in row["hypotheses"]] == pytest.approx([h.log_prob for h in want.hypotheses])
        assert [h["tokens"] for h in row["hypotheses"]] == [h.tokens for h in want.hypotheses]
    _, scored = run(trained_dir, tmp_path, sources, "--scores", name="scored")
    first = json.loads(scored[0])["hypotheses"]
    assert len(first) == 1 and first[0]["score"] == pytest.approx(rows[0]["hypotheses"][0]["score"])


def test_prefixes_sampling_alignments_and_pass_through(trained_dir, core, tokenizer, tmp_path):
    from hf_variants.inference import DecodeOptions, TranslationRequest

    sources = read_sentences("en", "val", n=4)
    prefixes = ["Ein Hund", "", "Zwei", "Die Frau"]
    write(tmp_path / "prefix.de", prefixes)
    _, lines = run(trained_dir, tmp_path, sources, "--prefix", str(tmp_path / "prefix.de"), "--num_beams", "2")
    expected = core.translate(
        [TranslationRequest(s, prefix=p) for s, p in zip(sources, prefixes)], DecodeOptions(num_beams=2)
    )
    assert lines == [r.text for r in expected]
    assert all(line.startswith(p) for line, p in zip(lines, prefixes))
    sample = ["--do_sample", "--top_k", "20", "--seed", "3", "--nbest", "2"]
    _, first = run(trained_dir, tmp_path, sources, *sample, name="s1")
    _, again = run(trained_dir, tmp_path, sources, *sample, name="s2")
    assert first == again and all(len(json.loads(row)["hypotheses"]) == 2 for row in first)
    result, aligned = run(trained_dir, tmp_path, sources, "--alignments", "--num_beams", "2", name="al")
    assert result["alignments"] is True
    for source, line in zip(sources, aligned):
        text, _, pairs = line.partition(" ||| ")
        assert pairs and all(
            0 <= int(i) < len(source.split()) and 0 <= int(j) < len(text.split())
            for i, j in (pair.split("-") for pair in pairs.split())
        )
    result, blocked = run(trained_dir, tmp_path, sources, "--no_repeat_ngram_size", "1", "--num_beams", "1", name="nr")
    assert result["no_repeat_ngram_size"] == 1
    for line in blocked:
        ids = tokenizer(line, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(set(ids)) or line != line.strip()
    result, _ = run(trained_dir, tmp_path, sources, "--repetition_penalty", "1.3", name="rp")
    assert result["repetition_penalty"] == 1.3


def test_token_batches_buffers_and_batch_sizes_change_nothing(trained_dir, tmp_path):
    sources = read_sentences("en", "val", n=40)
    greedy = ["--num_beams", "1"]
    _, at_64 = run(trained_dir, tmp_path, sources, *greedy, name="b64")
    for extra in (["--batch_size", "7"], ["--max_tokens", "150"], ["--buffer_size", "5", "--batch_size", "3"]):
        _, lines = run(trained_dir, tmp_path, sources, *greedy, *extra, name="x")
        assert lines == at_64, extra


def test_max_length_limits_the_output_and_max_source_length_truncates(trained_dir, tokenizer, tmp_path, caplog):
    """--max_length L: each greedy output is the unlimited one cut to L - 1 tokens (the decoder's start token
    counts), L chosen below the longest unlimited output so that one is cut whatever the fixture model says;
    --max_source_length truncates the sources, counted and warned per line."""
    sources = read_sentences("en", "val", n=5)
    greedy = ["--num_beams", "1", "--output_format", "jsonl"]
    _, rows = run(trained_dir, tmp_path, sources, *greedy, "--max_new_tokens", "64", name="full")
    full = [json.loads(row)["hypotheses"][0]["tokens"] for row in rows]
    limit = max(len(tokens) for tokens in full)  # the longest output (its `</s>` included) is cut to limit - 1
    assert limit >= 2, full
    result, rows = run(trained_dir, tmp_path, sources, *greedy, "--max_length", str(limit), name="ml")
    assert result["max_length"] == limit and result["truncated_inputs"] == 0
    cut = [json.loads(row)["hypotheses"][0] for row in rows]
    assert [h["tokens"] for h in cut] == [tokens[: limit - 1] for tokens in full]
    assert sum(len(tokens) > limit - 1 for tokens in full) >= 1
    _, short = run(trained_dir, tmp_path, sources, "--num_beams", "1", "--max_length", str(limit), name="mltext")
    assert short == [h["text"] for h in cut]
    with caplog.at_level(logging.WARNING, logger="hf_variants.translate"):
        result, _ = run(trained_dir, tmp_path, sources, "--max_source_length", "8", name="ms")
    lengths = [len(tokenizer(s)["input_ids"]) for s in sources]
    cut = [i + 1 for i, n in enumerate(lengths) if n > 8]
    assert cut and result["truncated_inputs"] == len(cut) and result["truncated_lines"] == cut
    assert f"line {cut[0]}: truncated from {lengths[cut[0] - 1]} to 8 tokens" in caplog.text


def test_errors_before_the_model_loads(trained_dir, tokenizer, tmp_path, monkeypatch):
    """Each refusal names the flag and comes before any weights load (loading is replaced by a failure here)."""

    def no_loading(location):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(translate, "load_translator", no_loading)
    sources = read_sentences("en", "val", n=3)
    src = write(tmp_path / "src.en", sources)
    write(tmp_path / "two.txt", ["a", "b"])
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), languages=["en", "fr"], target_languages=["fr"]
    )
    en_fr = save_model(TransformerNmtForConditionalGeneration(config), tokenizer, tmp_path / "en_fr")
    run_dir = tmp_path / "runs" / "x"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text("{}")
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    (onnx_dir / "config.json").write_text("{}")
    (onnx_dir / "onnx_manifest.json").write_text("{}")  # what makes a folder an ONNX export
    cases = [
        (["--nbest", "5", "--num_beams", "4"], r"--nbest 5 > --num_beams 4"),
        (["--nbest", "5"], r"--nbest 5 > --num_beams 4 \(the model's saved num_beams\)"),
        (["--prefix", str(tmp_path / "two.txt")], r"src\.en has 3 lines but --prefix .*two\.txt has 2"),
        (["--references", str(src), str(tmp_path / "two.txt")], r"has 3 lines but --references .*two\.txt has 2"),
        (["--top_k", "5"], "--top_k 5 needs --do_sample"),
        (["--do_sample", "--num_beams", "3"], "--num_beams 3 must be 1"),
        (["--nbest", "2", "--output_format", "text"], "--nbest 2 writes JSON Lines"),
        (["--max_length", "10", "--max_len_b", "3"], "--max_length is a fixed output limit"),
        (["--max_new_tokens", "999"], "--max_new_tokens 999: more target positions"),
        (
            ["--tgt_lang", "fr"],
            r"--tgt_lang 'fr' is an unknown language: .* from \['en'\] into \['de'\]",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(DataError, match=message):
            translate.main(["--model", str(trained_dir), "--input", str(src), "--output", str(tmp_path / "o"), *extra])
    for model_flags, message in [
        (
            ["--model", str(en_fr), "--tgt_lang", "en"],
            r"--tgt_lang 'en' is not a target language of this model: .* into \['fr'\]",
        ),
        (["--model", str(run_dir)], rf"--model {run_dir} is a training run folder: pass its saved model, --model "),
        (["--onnx", str(onnx_dir), "--alignments"], "--alignments: they come from the decoder's cross-attention"),
        (["--model", str(tmp_path / "nowhere")], "no such model folder"),
    ]:
        with pytest.raises(refusals(), match=message):
            translate.main([*model_flags, "--input", str(src), "--output", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_the_command_exits_2_with_one_line(trained_dir, tmp_path):
    src = write(tmp_path / "src.en", ["A dog."])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(trained_dir), "--input", str(src), "--output", "-"]
        + ["--nbest", "5", "--num_beams", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "translate.py: error: --nbest 5 > --num_beams 4: beam search returns at most num_beams hypotheses"
    )


def test_a_pipe_gets_its_line_back_before_stdin_closes(trained_dir, core):
    """A real process fed through a pipe that stays open: the first line's translation arrives on stdout while the
    writer still holds stdin open (the input is read in buffers cut short when no more is ready)."""
    import select

    from hf_variants.inference import DecodeOptions

    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--model", str(trained_dir), "--input", "-", "--output", "-", "--no_progress"]
        + ["--num_beams", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=ENV,
    )
    try:
        proc.stdin.write(b"A dog runs.\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 240)
        assert ready, "no answer while stdin stayed open"
        first = proc.stdout.readline().decode("utf-8").rstrip("\n")
        assert proc.poll() is None  # still running: stdin is open
        proc.stdin.write(b"Two men talk.\n")
        proc.stdin.close()
        rest = proc.stdout.read().decode("utf-8").splitlines()
        assert proc.wait(timeout=240) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    expected = [r.text for r in core.translate(["A dog runs.", "Two men talk."], DecodeOptions(num_beams=1))]
    assert [first, *rest] == expected
