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
import os
import time
from pathlib import Path

import pytest
import torch

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
