"""No command destroys its input, every command checks its flags and its output before working, and sizes are
bounded before allocation (`hf_variants.outputs`, `hf_variants.sizing`).

- a matrix: every command that writes a folder or a file (warm_start, export_onnx, export_ctranslate2,
  convert_marian, convert_legacy, translate) x every relation of output to input (the same path, the output inside
  the input, the input inside the output, --force on a folder the command did not write): exit status and message,
  and every input file byte-identical afterwards (hashed);
- `--force` replaces a folder the command wrote (saying what it deletes) and nothing else; a failure while writing
  leaves the old output whole and no temporary folder;
- flags out of range exit 2 naming the flag and the range, before any model loads;
- manifests read back (the output manifest, CTranslate2's `hf_variants_export.json`, `warm_start.json`) are
  untrusted: paths outside their folder and wrong types are refused;
- the parameter estimate is close to the built models' counts and a config that would not fit is refused naming its
  fields, in milliseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from test_training import data_dir, tiny_args, tokenizer_dir  # noqa: F401 (fixtures)

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.outputs import (
    OUTPUT_MANIFEST,
    OutputPathError,
    atomic_output_dir,
    atomic_write_file,
    check_not_an_input,
    check_output_dir,
    check_output_file,
    float_in_range,
    int_in_range,
    is_inside_folder,
    read_output_manifest,
    relation,
)
from hf_variants.sizing import ModelTooLargeError, check_fits, estimate_parameters


def tree_hash(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------------------------------------ primitives
def test_relation_of_output_and_input_paths(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(model)
    assert relation(model, model) == "is"
    assert relation(tmp_path / "link", model) == "is"  # a symlink is resolved
    assert relation(model / "sub", model) == "lies inside"
    assert relation(model / "not_yet" / "deeper", model) == "lies inside"  # an output that does not exist yet
    assert relation(tmp_path / "link" / "new", model) == "lies inside"
    assert relation(tmp_path, model) == "contains"
    assert relation(tmp_path / "other", model) is None
    assert relation(tmp_path / "model2", model) is None  # a common prefix is not a parent
    with pytest.raises(OutputPathError, match=r"--output_dir .* lies inside --model"):
        check_not_an_input(model / "onnx", {"--model": str(model), "--tokenizer": None})
    check_not_an_input(tmp_path / "out", {"--model": "org/hub-id-not-a-folder"})  # no local path: skipped


def test_output_paths_that_cannot_be_written(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(OutputPathError, match="afile.* is not a folder"):
        check_output_file(afile / "out.de")
    with pytest.raises(OutputPathError, match="is a folder; give a file name"):
        check_output_file(tmp_path)
    with pytest.raises(OutputPathError, match="exists and is not a folder"):
        check_output_dir(afile, command="x")
    with pytest.raises(OutputPathError, match="afile.* is not a folder"):
        check_output_dir(afile / "deeper", command="x")
    assert check_output_file(tmp_path / "new" / "out.de") == tmp_path / "new" / "out.de"
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    with pytest.raises(OutputPathError, match="is a symbolic link"):
        check_output_dir(tmp_path / "link", command="x")


def test_flag_validators_name_the_range():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int_in_range(1))
    parser.add_argument("--penalty", type=float_in_range(0.0, 2.0))
    assert parser.parse_args(["--batch_size", "3", "--penalty", "0.5"]).batch_size == 3
    for argv, needle in (
        (["--batch_size", "0"], "argument --batch_size: expected an integer >= 1, got '0'"),
        (["--batch_size", "x"], "argument --batch_size: expected an integer >= 1, got 'x'"),
        (["--penalty", "nan"], "argument --penalty: expected a finite number in [0.0, 2.0], got 'nan'"),
        (["--penalty", "3"], "argument --penalty: expected a finite number in [0.0, 2.0], got '3'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2


def test_atomic_output_dir_force_replaces_only_its_own_output(tmp_path, capsys):
    out = tmp_path / "out"
    with atomic_output_dir(out, command="cmd") as staging:
        (staging / "a.txt").write_text("1")
        (staging / "sub").mkdir()
        (staging / "sub" / "b.txt").write_text("2")
    assert read_output_manifest(out) == {"command": "cmd", "files": ["a.txt", "sub/b.txt"]}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary sibling left
    # without --force: refused; another command's --force: refused; untouched
    with pytest.raises(FileExistsError, match="--force"):
        check_output_dir(out, command="cmd")
    with pytest.raises(OutputPathError, match="written by cmd"):
        check_output_dir(out, command="other", force=True)
    # a failure while writing leaves the old output whole and no temporary folder
    before = tree_hash(out)
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(out, command="cmd", force=True) as staging:
            (staging / "a.txt").write_text("half")
            raise RuntimeError("boom")
    assert tree_hash(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # --force replaces it and says what it deletes
    with atomic_output_dir(out, command="cmd", force=True) as staging:
        (staging / "c.txt").write_text("3")
    assert "--force: replacing" in capsys.readouterr().out
    assert sorted(tree_hash(out)) == [OUTPUT_MANIFEST, "c.txt"]
    # a file the command did not write: refused, named
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="notes.txt"):
        check_output_dir(out, command="cmd", force=True)


@pytest.mark.parametrize("exchange", [True, False])
def test_atomic_output_dir_swaps_with_or_without_renameat2(exchange, tmp_path, monkeypatch):
    from hf_variants import outputs

    if not exchange:  # a system without RENAME_EXCHANGE: two renames
        monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    for value in ("1", "2"):
        with atomic_output_dir(out, command="cmd", force=True, log=None) as staging:
            (staging / "v.txt").write_text(value)
    assert (out / "v.txt").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_untrusted_output_manifest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    for bad in ('{"command": "cmd", "files": ["../elsewhere"]}', '{"command": 3, "files": []}', "[", '{"files": 1}'):
        (out / OUTPUT_MANIFEST).write_text(bad)
        assert read_output_manifest(out) is None
        with pytest.raises(OutputPathError, match="no command of this package"):
            check_output_dir(out, command="cmd", force=True)
    assert not is_inside_folder(out, "/etc/passwd")
    (out / "escape").symlink_to(tmp_path)
    assert not is_inside_folder(out, "escape/x")
    assert is_inside_folder(out, "x")


def test_atomic_write_file_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_file(target, "one\n")
    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError):
        atomic_write_file(tmp_path / "adir", "two\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "out.txt"]
    assert target.read_text() == "one\n"


# ------------------------------------------------------------------------------------------------ sizing
def test_parameter_estimate_is_close_to_every_built_model():
    from hf_variants import MODEL_CLASSES

    for model_type, (config_class, _, generation_class) in MODEL_CLASSES.items():
        for preset in ("tiny", "small"):
            config = config_class.from_preset(preset, vocab_size=500)
            with torch.device("meta"):
                real = sum(p.numel() for p in generation_class(config).parameters())
            assert 0.8 * real <= estimate_parameters(config) <= 1.01 * real, (model_type, preset)


def test_a_config_too_large_is_refused_naming_its_fields_before_allocation():
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=500)
    config.encoder_layers = 100000
    started = time.perf_counter()
    with pytest.raises(ModelTooLargeError, match=r"encoder_layers=100000.*--allow_large_model") as error:
        check_fits(config, available=2**30, override_flag="--allow_large_model")
    assert time.perf_counter() - started < 0.1
    assert "GiB available" in str(error.value)
    small = TransformerNmtConfig.from_preset("tiny", vocab_size=500)
    assert check_fits(small, available=2**30) == 4 * 4 * estimate_parameters(small)
    # activations count when the batch size is given
    with pytest.raises(ModelTooLargeError, match="activations of 1,000,000 tokens"):
        check_fits(small, tokens=10**6, available=2**30)


# ------------------------------------------------------------------------------------------------ the command matrix
FIXTURES = Path(__file__).parent / "fixtures" / "legacy"


def _tiny_baseline(folder: Path, tokenizer=None) -> Path:
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer) if tokenizer is not None else 60)
    TransformerNmtForConditionalGeneration(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def _tiny_marian(folder: Path) -> Path:
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=60,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=59,
        decoder_start_token_id=59,
        eos_token_id=0,
    )
    MarianMTModel(config).save_pretrained(folder)
    return folder


def _main(command: str):
    if command == "warm_start":
        from hf_variants.commands.warm_start import main
    elif command == "export_onnx":
        from hf_variants.commands.export_onnx import main
    elif command == "export_ctranslate2":
        from hf_variants.commands.export_ctranslate2 import main
    elif command == "convert_marian":
        from hf_variants.commands.convert_marian import main
    else:
        from hf_variants.commands.convert_legacy import main
    return main


# command -> (how its input folder is made, its argv with the input and the output)
COMMANDS = {
    "warm_start": (
        _tiny_baseline,
        lambda i, o: ["--base", i, "--model_type", "mute_nmt", "--config_overrides", "num_units=2", "--output_dir", o],
    ),
    "export_onnx": (_tiny_baseline, lambda i, o: ["--model", i, "--output_dir", o]),
    "export_ctranslate2": (_tiny_baseline, lambda i, o: ["--model", i, "--output_dir", o]),
    "convert_marian": (_tiny_marian, lambda i, o: ["--marian", i, "--output_dir", o]),
    "convert_legacy": (
        lambda folder: Path(shutil.copytree(FIXTURES / "mute_nmt", folder)),
        lambda i, o: ["--model", i, "--output_dir", o],
    ),
}
INPUT_FLAG = {"warm_start": "--base", "convert_marian": "--marian"}
# relation -> (where the output is, given the input folder; --force; the message)
RELATIONS = {
    "output_is_input": (lambda i: i, False, "is {flag}"),
    "output_is_input_force": (lambda i: i, True, "is {flag}"),
    "output_is_input_by_symlink": (lambda i: i.parent / "link", True, "is {flag}"),
    "output_inside_input": (lambda i: i / "out", False, "lies inside {flag}"),
    "output_holds_input": (lambda i: i.parent, True, "contains {flag}"),
    "force_on_a_foreign_folder": (lambda i: i.parent / "foreign", True, "--force replaces only a folder that"),
}


@pytest.fixture(scope="module")
def command_inputs(tmp_path_factory):
    """One input folder per command (made once; the tests check they are never changed)."""
    return {name: make(tmp_path_factory.mktemp(name) / "input") for name, (make, _) in COMMANDS.items()}


@pytest.fixture
def no_loading(monkeypatch):
    """Any model, config or tokenizer load fails the test: the refusals come before anything loads."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the command loaded a model before checking its output")

    for name in ("AutoModelForSeq2SeqLM", "AutoConfig", "AutoTokenizer", "MarianMTModel"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refuse)


@pytest.mark.parametrize("relation_name", list(RELATIONS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_destroys_its_input(command, relation_name, command_inputs, no_loading, capsys):
    source = command_inputs[command]
    where, force, message = RELATIONS[relation_name]
    output = where(source)
    if relation_name == "output_is_input_by_symlink" and not output.exists():
        output.symlink_to(source)
    if relation_name == "force_on_a_foreign_folder":
        output.mkdir(exist_ok=True)
        (output / "results.txt").write_text("someone's work\n")
    foreign_before = tree_hash(output) if relation_name == "force_on_a_foreign_folder" else None
    before = tree_hash(source)
    siblings = sorted(p.name for p in source.parent.iterdir())
    argv = COMMANDS[command][1](str(source), str(output)) + (["--force"] if force else [])
    with pytest.raises(SystemExit) as exit_info:
        _main(command)(argv)
    assert exit_info.value.code == 2, capsys.readouterr()
    err = capsys.readouterr().err
    assert message.format(flag=INPUT_FLAG.get(command, "--model")) in err, err
    assert tree_hash(source) == before  # byte-identical
    assert sorted(p.name for p in source.parent.iterdir()) == siblings  # no temporary folder either
    if foreign_before is not None:
        assert tree_hash(output) == foreign_before


def test_warm_start_force_replaces_its_own_output_and_refuses_a_model_too_large(command_inputs, tmp_path, capsys):
    from hf_variants.commands.warm_start import main
    from hf_variants.convert.warm_start import load_warm_start_report

    base = command_inputs["warm_start"]
    out = tmp_path / "variant"
    argv = ["--base", str(base), "--output_dir", str(out), "--model_type"]
    main([*argv, "mute_nmt"])
    first = tree_hash(out)
    assert read_output_manifest(out)["command"] == "warm_start"
    assert load_warm_start_report(out).model_type == "mute_nmt"
    with pytest.raises(SystemExit) as exit_info:  # not empty, no --force
        main([*argv, "mute_nmt"])
    assert exit_info.value.code == 2 and "pass --force" in capsys.readouterr().err
    main([*argv, "mimo_nmt", "--force"])
    printed = capsys.readouterr().out
    assert "--force: replacing" in printed and "model.safetensors" in printed
    assert tree_hash(out)["model.safetensors"] != first["model.safetensors"]
    assert load_warm_start_report(out).model_type == "mimo_nmt"
    # a variant that would not fit: refused naming the field, before it is built, nothing written
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["--base", str(base), "--model_type", "mute_nmt", "--config_overrides", "num_units=1000000"]
            + ["--output_dir", str(tmp_path / "huge")]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "num_units=1000000" in err and "--allow_large_model" in err, err
    assert time.perf_counter() - started < 20 and not (tmp_path / "huge").exists()
    # flags checked at parse time
    for bad, flag in ((["--config_overrides", "num_units"], "--config_overrides"), (["--seed", "-1"], "--seed")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--base", str(base), "--model_type", "mute_nmt", "--output_dir", str(tmp_path / "x"), *bad])
        assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_warm_start_report_is_read_as_untrusted(tmp_path):
    from hf_variants.convert.warm_start import load_warm_start_report

    good = {"base": "b", "model_type": "mute_nmt", "copied": {}, "derived": {}, "initialised": {}}
    cases = {
        "[1]": "expected a JSON object",
        "{": "is not valid JSON",
        json.dumps({**good, "unused_base_tensors": "x"}): "`unused_base_tensors` must be a list of strings",
        json.dumps({**good, "copied": {"a": 1}, "unused_base_tensors": []}): "`copied` must be an object of strings",
        json.dumps({**good, "model_type": "gpt2", "unused_base_tensors": []}): "`model_type` must be one of",
    }
    for text, message in cases.items():
        (tmp_path / "warm_start.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            load_warm_start_report(tmp_path)
    (tmp_path / "warm_start.json").unlink()
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    outside.write_text(json.dumps({**good, "unused_base_tensors": []}))
    (tmp_path / "warm_start.json").symlink_to(outside)
    with pytest.raises(ValueError, match="points outside"):
        load_warm_start_report(tmp_path)


def test_ctranslate2_export_manifest_is_read_as_untrusted(tmp_path):
    from hf_variants.deploy.ctranslate2 import MANIFEST, read_export_manifest

    good = {"source_model_type": "transformer_nmt", "quantization": "int8", "suppress_sequences": [["<pad>"]]}
    (tmp_path / MANIFEST).write_text(json.dumps(good))
    assert read_export_manifest(tmp_path) == good
    for bad, message in (
        ({**good, "suppress_sequences": [[1]]}, "`suppress_sequences` must be a list of non-empty lists"),
        ({**good, "suppress_sequences": "<pad>"}, "`suppress_sequences` must be a list"),
        ({**good, "quantization": 8}, "`quantization` must be a string"),
        ({**good, "quantization": "int3"}, "`quantization` must be one of"),
    ):
        (tmp_path / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            read_export_manifest(tmp_path)


# ------------------------------------------------------------------------------------------------ translate
TRANSLATE_CASES = {
    # name: (--output given the work folder, extra argv, message)
    "output_is_input": (lambda w: w / "src.en", [], "--output '{w}/src.en' is --input"),
    "output_is_input_by_symlink": (lambda w: w / "link.en", [], "is --input"),
    "output_is_references": (lambda w: w / "ref.de", ["--references", "{w}/ref.de"], "is --references"),
    "output_inside_model": (lambda w: w / "model" / "hyp.de", [], "lies inside --model"),
    "output_is_a_folder": (lambda w: w / "outdir", [], "is a folder; give a file name"),
    "output_under_a_file": (lambda w: w / "afile" / "out.de", [], "'{w}/afile' is not a folder"),
    "results_json_is_input": (lambda w: w / "hyp.de", ["--results_json", "{w}/src.en"], "--results_json"),
    "results_json_is_output": (lambda w: w / "hyp.de", ["--results_json", "{w}/hyp.de"], "the same file"),
    "batch_size_0": (lambda w: w / "hyp.de", ["--batch_size", "0"], "argument --batch_size: expected an integer >= 1"),
    "batch_size_-3": (lambda w: w / "hyp.de", ["--batch_size", "-3"], "argument --batch_size: expected an integer"),
    "num_beams_0": (lambda w: w / "hyp.de", ["--num_beams", "0"], "argument --num_beams: expected an integer >= 1"),
    "max_len_a_nan": (lambda w: w / "hyp.de", ["--max_len_a", "nan"], "argument --max_len_a: expected a finite"),
    "max_length_0": (lambda w: w / "hyp.de", ["--max_length", "0"], "argument --max_length: expected an integer >= 1"),
}


@pytest.fixture(scope="module")
def translate_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("translate")
    _tiny_baseline(work / "model")
    (work / "src.en").write_text("a small house .\ntwo dogs .\n")
    (work / "ref.de").write_text("ein kleines Haus .\nzwei Hunde .\n")
    (work / "link.en").symlink_to(work / "src.en")
    (work / "outdir").mkdir()
    (work / "afile").write_text("a file\n")
    return work


@pytest.mark.parametrize("case", list(TRANSLATE_CASES))
def test_translate_checks_flags_and_output_before_loading(case, translate_work, no_loading, capsys, monkeypatch):
    from hf_variants.commands import translate

    where, extra, message = TRANSLATE_CASES[case]
    w = translate_work
    before = tree_hash(w)
    argv = ["--model", str(w / "model"), "--input", str(w / "src.en"), "--output", str(where(w)), "--no_progress"]
    monkeypatch.setattr(sys, "argv", ["hf-variants-translate", *argv, *(a.format(w=w) for a in extra)])
    with pytest.raises(SystemExit) as exit_info:
        translate.cli()
    assert exit_info.value.code == 2
    assert message.format(w=w) in capsys.readouterr().err
    assert tree_hash(w) == before and sorted(p.name for p in w.iterdir()) == [
        "afile",
        "link.en",
        "model",
        "outdir",
        "ref.de",
        "src.en",
    ]


# ------------------------------------------------------------------------------------------------ train
TRAIN_RELATIONS = {
    # name: (--output_dir given the data folder and the tokenizer folder, extra flags, message)
    "output_is_data_dir": (lambda d, t: d, [], "is --data_dir"),
    "output_inside_data_dir": (lambda d, t: d / "run", [], "lies inside --data_dir"),
    "output_holds_tokenizer": (lambda d, t: t.parent, ["--overwrite_output_dir"], "contains --"),
    "output_is_tokenizer_overwrite": (lambda d, t: t, ["--overwrite_output_dir"], "is --tokenizer"),
}


@pytest.mark.parametrize("case", list(TRAIN_RELATIONS))
def test_train_never_writes_into_its_inputs(case, data_dir, tokenizer_dir):
    from hf_variants.training import train
    from hf_variants.training.corpus import DataError

    where, extra, message = TRAIN_RELATIONS[case]
    out = where(data_dir, tokenizer_dir)
    before = {"data": tree_hash(data_dir), "tokenizer": tree_hash(tokenizer_dir)}
    parent = sorted(p.name for p in tokenizer_dir.parent.iterdir())
    with pytest.raises(DataError, match=message):
        train.main(tiny_args(data_dir, out, *extra, tokenizer=tokenizer_dir, steps=1))
    assert {"data": tree_hash(data_dir), "tokenizer": tree_hash(tokenizer_dir)} == before
    assert sorted(p.name for p in tokenizer_dir.parent.iterdir()) == parent


def test_train_overwrites_only_its_own_run_folder_and_refuses_a_model_too_large(data_dir, tokenizer_dir, tmp_path):
    from hf_variants.training import run_lock, train
    from hf_variants.training.corpus import DataError

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.json").write_text("{}\n")
    (foreign / "thesis.tex").write_text("months of work\n")
    before = tree_hash(foreign)
    with pytest.raises(OutputPathError, match=r"--overwrite_output_dir deletes only a folder that train wrote"):
        train.main(tiny_args(data_dir, foreign, "--overwrite_output_dir", tokenizer=tokenizer_dir, steps=1))
    after = {k: v for k, v in tree_hash(foreign).items() if k not in run_lock.LOCK_FILES}  # the lock stays
    assert after == before
    # encoder_layers=100000: refused from the config, naming the field, in seconds, leaving no run folder
    started = time.perf_counter()
    with pytest.raises(DataError, match=r"encoder_layers=100000.*--allow_large_model"):
        train.main(
            tiny_args(
                data_dir,
                tmp_path / "huge",
                "--config_overrides",
                "encoder_layers=100000",
                tokenizer=tokenizer_dir,
                steps=1,
            )
        )
    assert time.perf_counter() - started < 60 and not (tmp_path / "huge").exists()


# ------------------------------------------------------------------------------------------------ publish
@pytest.mark.parametrize(
    "argv, message",
    [
        (["{m}", "--repo_id", "bad id"], "argument --repo_id: Invalid repo id"),
        (["{m}", "--repo_id", "no-namespace"], "argument --repo_id: Invalid repo id"),
        (["{m}/missing", "--repo_id", "org/name"], "argument run_dir: "),
        (["{m}", "--repo_id", "org/name", "--commit_message", " "], "argument --commit_message: the commit message"),
    ],
)
def test_publish_checks_its_flags_before_reading_anything(argv, message, command_inputs, monkeypatch, capsys):
    from hf_variants.commands import publish

    monkeypatch.setattr(publish, "push_to_hub", lambda *a, **k: pytest.fail("publish went on with a bad flag"))
    model = command_inputs["export_onnx"]
    before = tree_hash(model)
    with pytest.raises(SystemExit) as exit_info:
        publish.main([a.format(m=model) for a in argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert tree_hash(model) == before
    from model_cards.publish import IGNORE_PATTERNS

    assert OUTPUT_MANIFEST in IGNORE_PATTERNS  # the output manifest is never uploaded


def test_export_force_replaces_its_own_output_and_a_failure_keeps_it_whole(tokenizer, tmp_path, capsys, monkeypatch):
    pytest.importorskip("ctranslate2")
    from hf_variants.commands.export_ctranslate2 import main
    from hf_variants.deploy import ctranslate2 as ct2

    model = _tiny_baseline(tmp_path / "model", tokenizer)
    out = tmp_path / "ct2"
    main(["--model", str(model), "--output_dir", str(out)])
    first = tree_hash(out)
    assert read_output_manifest(out)["command"] == "export_ctranslate2" and "model.bin" in first
    assert ct2.read_export_manifest(out)["quantization"] == "float32"
    # an export that fails while writing: the old export stays whole, no temporary folder is left
    calls = []

    def failing_vocabulary(tokenizer, config):
        calls.append(1)
        if len(calls) == 2:  # the second call writes the manifest, after the spec was saved
            raise RuntimeError("disk full")
        return real_vocabulary(tokenizer, config)

    real_vocabulary = ct2.vocabulary
    monkeypatch.setattr(ct2, "vocabulary", failing_vocabulary)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["--model", str(model), "--output_dir", str(out), "--force", "--quantization", "int8"])
    assert tree_hash(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "model"]
    monkeypatch.setattr(ct2, "vocabulary", real_vocabulary)
    capsys.readouterr()
    main(["--model", str(model), "--output_dir", str(out), "--force", "--quantization", "int8"])
    assert "--force: replacing" in capsys.readouterr().out
    assert ct2.read_export_manifest(out)["quantization"] == "int8" and tree_hash(out) != first


def test_train_overwrites_its_own_run_folder(data_dir, tokenizer_dir, tmp_path, capsys):
    from hf_variants.training import train

    run = tmp_path / "run"
    args = tiny_args(data_dir, run, "--eval_steps", "1", "--num_beams", "1", tokenizer=tokenizer_dir, steps=1)
    train.main(args)
    assert read_output_manifest(run) == {"command": "train", "files": []}
    assert (run / "results.json").is_file()
    capsys.readouterr()
    train.main(args + ["--overwrite_output_dir", "--seed", "2"])
    assert "--overwrite_output_dir: deleting" in capsys.readouterr().err
    assert json.loads((run / "results.json").read_text())["hyperparameters"]["seed"] == 2


def test_the_functions_behind_the_commands_refuse_their_input_too(command_inputs, tokenizer, tmp_path):
    """Called from Python: the folder a model was loaded from (`name_or_path`) is an input of the exports."""
    from transformers import AutoModelForSeq2SeqLM

    from hf_variants.convert.legacy import convert_checkpoint
    from hf_variants.convert.warm_start import warm_start
    from hf_variants.deploy.ctranslate2 import export as export_ctranslate2
    from hf_variants.onnx.export import export as export_onnx

    model_dir = _tiny_baseline(tmp_path / "model", tokenizer)
    before = tree_hash(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    for export in (export_ctranslate2, export_onnx):
        with pytest.raises(OutputPathError, match="is the model's folder"):
            export(model, tokenizer, model_dir, force=True)
        with pytest.raises(OutputPathError, match="lies inside the model's folder"):
            export(model, tokenizer, model_dir / "export", force=True)
    with pytest.raises(OutputPathError, match="is --base"):
        warm_start(str(model_dir), "mute_nmt", output_dir=model_dir, force=True)
    legacy = command_inputs["convert_legacy"]
    legacy_before = tree_hash(legacy)
    with pytest.raises(OutputPathError, match="contains --model"):
        convert_checkpoint(legacy, legacy.parent, force=True)
    assert tree_hash(model_dir) == before and tree_hash(legacy) == legacy_before
