"""`evaluation.score`: BLEU, chrF, chrF++ and TER equal to sacreBLEU's own (its Python API and its command line run as
a subprocess on the same files), with one reference set or several, every offered BLEU tokenizer, the signatures,
and the errors (reference counts, unknown tokenizers, a MeCab tokenizer without its extra)."""

import importlib.util
import json
import random
import subprocess
import sys

import pytest
import sacrebleu
from conftest import read_sentences

from hf_variants.training import evaluation

N = 120


def _perturbed(sentences, seed, drop=0.15, swaps=1):
    """Real sentences with words dropped and swapped (deterministic): hypotheses and second references that
    differ from the references as system outputs do."""
    rng = random.Random(seed)
    out = []
    for sentence in sentences:
        words = [w for w in sentence.split() if rng.random() > drop] or sentence.split()[:1]
        for _ in range(swaps):
            i, j = rng.randrange(len(words)), rng.randrange(len(words))
            words[i], words[j] = words[j], words[i]
        out.append(" ".join(words))
    return out


@pytest.fixture(scope="module")
def data():
    refs = read_sentences("de", "val", n=N)
    return {"hyps": _perturbed(refs, 0), "ref1": refs, "ref2": _perturbed(refs, 1, drop=0.05)}


def test_one_reference_equals_sacrebleu(data):
    hyps, refs = data["hyps"], data["ref1"]
    scores = evaluation.score(hyps, refs)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert scores["chrfpp"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs], word_order=2).score, abs=1e-9)
    assert scores["ter"] == pytest.approx(sacrebleu.corpus_ter(hyps, [refs]).score, abs=1e-9)
    assert 0 < scores["bleu"] < 100 and scores["chrfpp"] < scores["chrf"] and scores["ter"] > 0
    # a reference set given as one list of strings or as a list of one set: the same scores
    assert evaluation.score(hyps, [refs]) == scores


def test_multi_reference_equals_the_sacrebleu_command_line(data, tmp_path):
    """Two reference files: BLEU, chrF, chrF++ and TER (scores and signatures) equal to `sacrebleu REF1 REF2 -i HYP`
    run as a process on the same files; the second reference raises BLEU above either reference alone."""
    paths = {}
    for name in ("hyps", "ref1", "ref2"):
        paths[name] = tmp_path / name
        paths[name].write_text("".join(line + "\n" for line in data[name]), encoding="utf-8")
    refs = [data["ref1"], data["ref2"]]
    scores = evaluation.score(data["hyps"], refs)

    def cli(*flags):
        command = [sys.executable, "-m", "sacrebleu", str(paths["ref1"]), str(paths["ref2"])]
        command += ["-i", str(paths["hyps"]), "-f", "json", "-w", "6", *flags]
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120).stdout
        result = json.loads(out)
        return {entry["name"]: entry for entry in (result if isinstance(result, list) else [result])}

    main = cli("-m", "bleu", "chrf", "ter")
    plus = cli("-m", "chrf", "--chrf-word-order", "2")
    expected = {
        "bleu": main["BLEU"],
        "chrf": main["chrF2"],
        "ter": main["TER"],
        "chrfpp": plus["chrF2++"],
    }
    for key, entry in expected.items():
        assert scores[key] == pytest.approx(entry["score"], abs=1e-5), key
        signature = scores["sacrebleu_signature" if key == "bleu" else f"{key}_signature"]
        assert signature == entry["signature"] and signature.startswith("nrefs:2|"), key
    single = [evaluation.score(data["hyps"], [ref], metrics=["bleu"])["bleu"] for ref in refs]
    assert scores["bleu"] > max(single)
    # the Python API agrees too
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(data["hyps"], refs).score, abs=1e-9)


@pytest.mark.parametrize("tokenize", ["13a", "intl", "zh", "char", "none"])
def test_bleu_tokenizers(tokenize):
    """Each offered tokenizer reaches sacreBLEU: its score and its `tok:` in the signature; on Chinese text the
    tokenizers give different BLEU (13a sees one word per sentence)."""
    refs = ["我们今天去公园散步。", "他喜欢在晚上读书，也喜欢写作。", "这只猫坐在垫子上。"]
    hyps = ["我们今天去公园走路。", "他喜欢晚上读书，也写作。", "这只猫坐在垫子上。"]
    scores = evaluation.score(hyps, refs, tokenize=tokenize)
    expected = sacrebleu.BLEU(tokenize=tokenize)
    assert scores["bleu"] == pytest.approx(expected.corpus_score(hyps, [refs]).score, abs=1e-9)
    assert f"|tok:{tokenize}|" in scores["sacrebleu_signature"]
    assert ("asian:yes" in scores["ter_signature"]) == (tokenize == "zh")
    if tokenize in ("zh", "char"):
        assert scores["bleu"] != pytest.approx(evaluation.score(hyps, refs, tokenize="13a")["bleu"])


@pytest.mark.parametrize("tokenize,extra,module", [("ja-mecab", "ja", "MeCab"), ("ko-mecab", "ko", "mecab_ko")])
def test_mecab_tokenizers_need_their_extra(tokenize, extra, module):
    """Where MeCab is installed the tokenizer scores as sacreBLEU's; where it is not, the error names the flag and
    the extra to install."""
    if importlib.util.find_spec(module) is None:
        with pytest.raises(ValueError, match=rf"--bleu_tokenize {tokenize} needs .*hf-variants\[{extra}\]"):
            evaluation.check_bleu_tokenize(tokenize)
        with pytest.raises(ValueError, match=rf"hf-variants\[{extra}\]"):
            evaluation.score(["a"], ["a"], tokenize=tokenize)
    else:
        hyps, refs = ["テスト です"], ["テスト でした"]
        expected = sacrebleu.BLEU(tokenize=tokenize).corpus_score(hyps, [refs]).score
        assert evaluation.score(hyps, refs, tokenize=tokenize)["bleu"] == pytest.approx(expected)


def test_errors():
    with pytest.raises(ValueError, match=r"--bleu_tokenize 'moses' is not a sacreBLEU tokenizer offered here"):
        evaluation.check_bleu_tokenize("moses")
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        evaluation.score(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="2 hypotheses reference set 2 has 3 references"):
        evaluation.score(["a", "b"], [["a", "b"], ["a", "b", "c"]])
    with pytest.raises(ValueError, match="Nothing to score"):
        evaluation.score([], [])
    with pytest.raises(ValueError, match=r"Unknown metrics \['meteor'\]"):
        evaluation.score(["a"], ["a"], metrics=["bleu", "meteor"])


def test_the_evaluate_metric_offline():
    """The local `evaluate` metric (no Hub access) returns every score and signature from one compute()."""
    result = evaluation.load_metric().compute(
        predictions=["a cat sat on the mat"], references=[["a cat sat on the mat", "the cat sat on a mat"]]
    )
    assert result["bleu"] == pytest.approx(100.0) and result["ter"] == pytest.approx(0.0)
    for key in ("sacrebleu_signature", "chrf_signature", "chrfpp_signature", "ter_signature"):
        assert result[key].startswith("nrefs:2|")


def test_model_card_shows_every_metric_and_signature(tmp_path):
    """results.json's chrF++ and TER (overall and per direction) and the four signatures reach the model card's
    evaluation table; a record written before them shows dashes in their columns."""
    from huggingface_hub import ModelCard
    from test_model_cards import make_results, make_run

    from model_cards.card import build_model_card
    from model_cards.run_record import RunRecord

    refs = read_sentences("de", "val", n=20)
    scores = evaluation.score(_perturbed(refs, 0), refs, tokenize="intl")
    fields = {k: v for k, v in scores.items() if k in RunRecord.field_names()}
    per_direction = {"en-fr": {"bleu": 11.0, "chrf": 22.0, "chrfpp": 21.5, "ter": 77.25, "pairs": 5}}
    record = RunRecord.from_dict(make_results("transformer_nmt", per_direction=per_direction, **fields))
    run = make_run(tmp_path, "transformer_nmt", results=record.to_dict())
    text = build_model_card(run / "model", record).text
    row = f"| en→de | {scores['bleu']:.2f} | {scores['chrf']:.2f} | {scores['chrfpp']:.2f} | {scores['ter']:.2f} |"
    assert row in text and "| en-fr | 11.00 | 22.00 | 21.50 | 77.25 |" in text
    for name, key in (("BLEU", "sacrebleu_signature"), ("chrF", "chrf_signature"), ("chrF++", "chrfpp_signature")):
        assert f"- {name} signature: `{scores[key]}`" in text
    assert f"- TER signature: `{scores['ter_signature']}`" in text and "|tok:intl|" in scores["sacrebleu_signature"]
    assert ModelCard(text).data is not None
    old = RunRecord.from_dict(make_results("transformer_nmt"))
    old_text = build_model_card(run / "model", old).text
    assert "| en→de | 12.35 | 40.99 |\n" in old_text and "TER:" not in old_text and "lower is better" in text


def test_training_evaluation_uses_bleu_tokenize(tokenizer, capsys):
    """`--bleu_tokenize` of train.py: parsed (a MeCab tokenizer without its extra refused at parse time, exit 2),
    and training's evaluation (`trainer.evaluate_pairs`) scores with it: every metric and signature, overall and per
    direction."""
    import argparse

    from accelerate import Accelerator

    from hf_variants import TiedTransformerConfig, TiedTransformerForConditionalGeneration
    from hf_variants.training import options, trainer
    from hf_variants.training.corpus import Pair

    assert options.parse_args([]).bleu_tokenize == "13a" and options.parse_args(["--bleu_tokenize", "char"])
    if importlib.util.find_spec("MeCab") is None:
        with pytest.raises(SystemExit) as exit_info:
            options.parse_args(["--bleu_tokenize", "ja-mecab"])
        assert exit_info.value.code == 2 and "hf-variants[ja]" in capsys.readouterr().err
    import torch

    torch.manual_seed(0)
    config = TiedTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), languages=["en", "de", "fr"])
    model = TiedTransformerForConditionalGeneration(config).eval()
    sources = read_sentences("en", "val", n=4)
    pairs = [
        Pair("en", "de", s, t, f"l{i}") for i, (s, t) in enumerate(zip(sources, read_sentences("de", "val", n=4)))
    ]
    pairs += [
        Pair("en", "fr", s, t, f"m{i}") for i, (s, t) in enumerate(zip(sources, read_sentences("fr", "val", n=4)))
    ]
    args = argparse.Namespace(
        eval_batch_size=8, num_beams=1, length_penalty=1.0, max_len_a=0.0, max_len_b=6, source_annotations=[],
        bleu_tokenize="char",
    )  # fmt: skip
    directions = [("en", "de"), ("en", "fr")]
    result = trainer.evaluate_pairs(Accelerator(cpu=True), model, tokenizer, pairs, directions, False, args)
    hyps = [e["translation"] for e in result["examples"]]
    expected = evaluation.score(hyps, [e["reference"] for e in result["examples"]], tokenize="char")
    for key in ("bleu", "chrf", "chrfpp", "ter", "sacrebleu_signature", "chrfpp_signature", "ter_signature"):
        assert result[key] == expected[key], key
    assert "|tok:char|" in result["sacrebleu_signature"]
    french = evaluation.score(hyps[4:], [e["reference"] for e in result["examples"]][4:], tokenize="char")
    assert result["per_direction"]["en-fr"] == {k: french[k] for k in ("bleu", "chrf", "chrfpp", "ter")} | {"pairs": 4}


def test_translate_multi_reference_scores_equal_the_sacrebleu_command_line(tokenizer, tmp_path):
    """`hf-variants-translate --references REF1 REF2 --bleu_tokenize intl`: the results JSON's BLEU, chrF, chrF++ and
    TER and their signatures are those of `sacrebleu REF1 REF2 -i HYP` on the files it wrote."""
    from trained_tiny import trained_baseline

    from hf_variants.commands import translate

    model = trained_baseline(tokenizer, steps=150)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    refs = read_sentences("de", "val", n=8)
    paths = {"src": tmp_path / "src.en", "ref1": tmp_path / "ref1.de", "ref2": tmp_path / "ref2.de"}
    for name, lines in (("src", read_sentences("en", "val", n=8)), ("ref1", refs), ("ref2", _perturbed(refs, 1))):
        paths[name].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    hyp, results = tmp_path / "hyp.de", tmp_path / "results.json"
    translate.main(
        ["--model", str(tmp_path / "model"), "--input", str(paths["src"]), "--output", str(hyp)]
        + ["--references", str(paths["ref1"]), str(paths["ref2"]), "--bleu_tokenize", "intl"]
        + ["--num_beams", "1", "--results_json", str(results), "--no_progress"]
    )
    got = json.loads(results.read_text())

    def cli(*flags):
        command = [sys.executable, "-m", "sacrebleu", str(paths["ref1"]), str(paths["ref2"]), "-i", str(hyp)]
        out = subprocess.run([*command, "-f", "json", "-w", "6", *flags], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout)
        return {entry["name"]: entry for entry in (result if isinstance(result, list) else [result])}

    main, plus = cli("-m", "bleu", "chrf", "ter", "-tok", "intl"), cli("-m", "chrf", "--chrf-word-order", "2")
    for key, entry in (
        ("bleu", main["BLEU"]),
        ("chrf", main["chrF2"]),
        ("ter", main["TER"]),
        ("chrfpp", plus["chrF2++"]),
    ):
        assert got[key] == pytest.approx(entry["score"], abs=1e-5), key
        assert got["sacrebleu_signature" if key == "bleu" else f"{key}_signature"] == entry["signature"], key
    assert "nrefs:2|" in got["sacrebleu_signature"] and "|tok:intl|" in got["sacrebleu_signature"]
