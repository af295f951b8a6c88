"""The back-translation and reranking outputs: `hf-variants-translate --output_format tsv_pairs` (a corpus that
hf-variants-train reads as it is, lines without a pair left out and counted), the refusal of an n-best JSON Lines file
where text is expected (translate's input, training corpora, the scorer's pairs), `hf-variants-score --nbest_input`
(every hypothesis scored, the structure kept; `--reverse`), and `hf-variants-rerank` (weight 0 on the reverse model:
the 1-best; tuned weights never below the 1-best's BLEU on the tuning set)."""

from __future__ import annotations

import json
import math

import pytest
import sacrebleu
from conftest import read_sentences
from trained_tiny import one_torch_thread, trained_baseline

from hf_variants.commands import rerank, score, translate
from hf_variants.inference import Translator
from hf_variants.inference.scoring import score_pairs
from hf_variants.training import corpus, sources
from hf_variants.training.corpus import DataError

N = 12


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """An en->de model and a "reverse" de->en model (the same tiny baseline, other steps: what matters is that its
    scores differ), with their languages recorded."""
    out = {}
    for name, steps, langs in (("forward", 300, ["en", "de"]), ("reverse", 150, ["de", "en"])):
        model = trained_baseline(tokenizer, steps=steps)
        model.config.languages, model.config.target_languages = langs, [langs[1]]
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bt_data")
    src = read_sentences("en", "val", n=N)
    src[4] = ""
    return {
        "folder": folder,
        "sources": src,
        "source": write(folder / "mono.en", src),
        "refs": write(folder / "ref.de", read_sentences("de", "val", n=N)),
    }


def run_translate(model, source, out, *extra):
    return translate.main(
        ["--model", str(model), "--input", str(source), "--output", str(out), "--no_progress", *extra]
    )


def refused(main, args, capsys) -> str:
    """The one-line refusal of a command: translate.main raises it (the console script exits 2 with it), the other
    commands' main exits 2 itself."""
    from hf_variants.commands.common import refusals

    if main is translate.main:
        with pytest.raises(refusals()) as error:
            main(args)
        return str(error.value)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_tsv_pairs_is_a_training_corpus(folders, data, tmp_path):
    """The header names the languages, each line with a translation is `source<TAB>translation`, the empty line is
    left out and counted; training's TSV readers (in memory and streaming) give the same rows."""
    text = tmp_path / "plain.de"
    run_translate(folders["forward"], data["source"], text, "--num_beams", "2")
    pairs = tmp_path / "bt.tsv"
    result = run_translate(
        folders["forward"], data["source"], pairs, "--num_beams", "2", "--output_format", "tsv_pairs"
    )
    lines = pairs.read_text(encoding="utf-8").splitlines()
    translations = text.read_text(encoding="utf-8").splitlines()
    expected = [f"{s}\t{t}" for s, t in zip(data["sources"], translations) if s.strip() and t.strip()]
    assert lines == ["en\tde", *expected] and len(expected) == N - 1
    assert result["pairs"] == N - 1 and result["unpaired_lines"] == 1 and result["output_format"] == "tsv_pairs"
    loaded = corpus.load_tsv(pairs)
    assert [(r["en"], r["de"]) for r in loaded.rows] == [tuple(line.split("\t")) for line in expected]
    blocks = list(sources._tsv_blocks(pairs, ["en", "de"], {}))
    assert [list(zip(b["text.en"], b["text.de"])) for b in blocks][0] == [(r["en"], r["de"]) for r in loaded.rows]


def test_tsv_pairs_of_sampled_nbest_lists_and_its_refusals(folders, data, tmp_path, capsys):
    sampled = tmp_path / "sampled.tsv"
    flags = ["--do_sample", "--seed", "2", "--nbest", "2", "--top_k", "10", "--max_len_b", "6"]
    run_translate(folders["forward"], data["source"], sampled, *flags, "--output_format", "tsv_pairs")
    jsonl = tmp_path / "sampled.jsonl"
    run_translate(folders["forward"], data["source"], jsonl, *flags)
    rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    expected = [f"{r['source']}\t{h['text']}" for r in rows for h in r["hypotheses"] if h["text"].strip()]
    assert sampled.read_text(encoding="utf-8").splitlines()[1:] == expected and len(expected) > N
    common = ["--model", str(folders["forward"]), "--input", str(data["source"]), "--output", str(tmp_path / "x")]
    for extra, message in (
        (["--scores"], "drop --scores"),
        (["--alignments"], "drop --alignments"),
        (["--references", str(data["refs"])], "score against --references with --output_format text"),
    ):
        err = refused(translate.main, [*common, "--output_format", "tsv_pairs", *extra], capsys)
        assert message in err, err


def test_an_nbest_file_where_text_is_expected_is_refused_naming_its_line(folders, data, tmp_path, capsys):
    nbest = tmp_path / "nbest.en"  # named as text, holding n-best JSON Lines (the guide's old mistake)
    run_translate(
        folders["forward"], data["source"], nbest, "--nbest", "2", "--num_beams", "2", "--output_format", "jsonl"
    )
    common = ["--model", str(folders["forward"]), "--output", str(tmp_path / "o"), "--no_progress"]
    err = refused(translate.main, [*common, "--input", str(nbest)], capsys)
    assert f"{nbest}:1: a line of hf-variants-translate's n-best JSON Lines output" in err
    rows = tmp_path / "rows.jsonl"
    write(rows, [json.dumps({"text": "A dog."}), nbest.read_text(encoding="utf-8").splitlines()[1]])
    assert f"{rows}:2: a line of" in refused(translate.main, [*common, "--input", str(rows)], capsys)
    err = refused(
        score.main,
        ["--model", str(folders["forward"]), "--source", str(data["source"]), "--target", str(nbest)],
        capsys,
    )
    assert f"{nbest}:1: a line of hf-variants-translate's n-best" in err
    # training corpora: a TSV whose sources are n-best JSON, text files, JSONL rows; in memory and streamed
    lines = nbest.read_text(encoding="utf-8").splitlines()
    tsv = write(tmp_path / "bt.tsv", ["en\tde", "A dog.\tEin Hund.", f"{lines[2]}\tEin Hund."])
    with pytest.raises(DataError, match=f"{tsv}:3: a line of hf-variants-translate's n-best"):
        corpus.load_tsv(tsv)
    with pytest.raises(DataError, match=f"{tsv}:3: a line of hf-variants-translate's n-best"):
        list(sources._tsv_blocks(tsv, ["en", "de"], {}))
    with pytest.raises(DataError, match=f"{nbest}:1: a line of"):
        corpus.load_text_files({"en": nbest, "de": data["refs"]})
    with pytest.raises(DataError, match=f"{nbest}:1: a line of"):
        list(sources.iter_line_blocks(nbest))
    as_jsonl = write(tmp_path / "nbest.jsonl", lines)
    with pytest.raises(DataError, match=f"{as_jsonl}:1: a line of"):
        corpus.load_jsonl(as_jsonl)


def test_score_nbest_input_scores_every_hypothesis_and_keeps_the_structure(folders, data, tmp_path):
    nbest = tmp_path / "nbest.jsonl"
    run_translate(folders["forward"], data["source"], nbest, "--nbest", "3", "--num_beams", "3")
    rows = [json.loads(line) for line in nbest.read_text(encoding="utf-8").splitlines()]
    for name, reverse in (("forward", False), ("reverse", True)):
        out = tmp_path / f"{name}.jsonl"
        args = ["--model", str(folders[name]), "--nbest_input", str(nbest), "--output", str(out), "--no_progress"]
        summary = score.main(args + (["--reverse"] if reverse else []) + ["--batch_size", "5"])
        scored = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        assert [(r["source"], [h["text"] for h in r["hypotheses"]]) for r in scored] == [
            (r["source"], [h["text"] for h in r["hypotheses"]]) for r in rows
        ]
        pairs = [(r["source"], h["text"]) for r in rows for h in r["hypotheses"]]
        pairs = [(t, s) for s, t in pairs] if reverse else pairs
        want = score_pairs(Translator.from_pretrained(str(folders[name])), *zip(*pairs))
        got = [h for r in scored for h in r["hypotheses"]]
        assert [h["log_prob"] for h in got] == pytest.approx([s.log_prob for s in want], abs=1e-4)
        assert [h["tokens"] for h in got] == [s.tokens for s in want]
        assert summary["scored"] == len(pairs) == 3 * (N - 1) and summary["lines"] == N
    assert rows[4] == {"source": "", "hypotheses": [], "skipped": "empty"}


def test_rerank_with_weight_0_on_the_reverse_model_is_the_1_best(folders, data, tmp_path, capsys):
    plain = tmp_path / "plain.de"
    run_translate(folders["forward"], data["source"], plain, "--num_beams", "4")
    nbest = tmp_path / "nbest.jsonl"
    run_translate(folders["forward"], data["source"], nbest, "--nbest", "4", "--num_beams", "4")
    channel = tmp_path / "reverse.jsonl"
    score.main(
        ["--model", str(folders["reverse"]), "--nbest_input", str(nbest), "--reverse", "--output", str(channel)]
    )
    common = ["--nbest_input", str(nbest), "--features", f"reverse={channel}"]
    result = rerank.main([*common, "--weight", "reverse=0", "--output", str(tmp_path / "r0.de")])
    assert (tmp_path / "r0.de").read_text() == plain.read_text() and result["weights"]["reverse"] == 0
    # a weight on the reverse model changes the choice somewhere, by its scores
    rerank.main([*common, "--weight", "reverse=5", "--output", str(tmp_path / "r5.de")])
    assert (tmp_path / "r5.de").read_text() != plain.read_text()
    # tuning: never below the 1-best's BLEU on the tuning set; the saved weights give the same choice again
    tuned = rerank.main(
        [*common, "--references", str(data["refs"]), "--tune", "--grid", "-1", "0", "1", "3"]
        + ["--weights_out", str(tmp_path / "w.json"), "--output", str(tmp_path / "tuned.de")]
    )
    hyps = (tmp_path / "tuned.de").read_text().splitlines()
    refs = data["refs"].read_text().splitlines()
    assert tuned["bleu_reranked"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert (
        tuned["bleu_reranked"]
        >= tuned["bleu_1best"]
        == pytest.approx(sacrebleu.corpus_bleu(plain.read_text().splitlines(), [refs]).score)
    )
    again = rerank.main([*common, "--weights", str(tmp_path / "w.json"), "--output", str(tmp_path / "again.de")])
    assert (tmp_path / "again.de").read_text() == (tmp_path / "tuned.de").read_text()
    assert again["weights"] == tuned["weights"] and all(math.isfinite(w) for w in tuned["weights"].values())
    # a feature file of other hypotheses is refused naming its line
    lines = channel.read_text().splitlines()
    row = json.loads(lines[0])
    row["hypotheses"][1]["text"] = "something else"
    other = write(tmp_path / "other.jsonl", [json.dumps(row), *lines[1:]])
    args = ["--nbest_input", str(nbest), "--features", f"reverse={other}", "--output", str(tmp_path / "z")]
    err = refused(rerank.main, args, capsys)
    assert f"{other}:1: hypothesis 2 is not the n-best list's" in err
