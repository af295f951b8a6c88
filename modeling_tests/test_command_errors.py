"""A user's mistakes on the command line end each command with ONE line naming the flag and what to pass instead, exit
status 2, before any heavy work (data, tokenizer, model loading), leaving no folder behind, and the advice names
only flags that make the intended model:

- training: a misspelled `--model_type` / `--preset` (the valid values and the closest one), a config field that does
  not exist or values that do not fit together, no data flag at all (an installed package has no bundled corpus), a
  training run folder given as `--model_name_or_path` / `--tokenizer`, a checkpoint or dataset folder that does not
  exist, `--push_to_hub` without a token or with a bad `--hub_model_id`, a rerun into a finished run; the default
  run folder is in the working directory; a run without evaluation records no evaluation split;
- data whose languages are not the run's: a `datasets` dataset with `src`/`tgt` columns is told
  `--source_column src --target_column tgt` with the languages' own codes (never `--source_lang src`), a TSV header
  naming no language is told to name them, a `--languages` run is told `--languages`;
- the other commands: a run folder given as `--model` / `--base` (export-onnx, export-ctranslate2, warm-start) names
  its `model/`, a variant given to the CTranslate2 export is refused before its weights load, a publish without a
  token says how to give one (not `token=...`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_sentences

from hf_variants import (
    MuteConfig,
    MuteForConditionalGeneration,
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
)
from hf_variants.training import options, train

QUICK = ["--preset", "tiny", "--max_steps", "2", "--warmup_steps", "1", "--eval_bleu_pairs", "2", "--num_beams", "1"]
QUICK += ["--max_len_b", "3", "--num_examples", "0", "--progress_interval", "0"]


def write_tsv(path: Path, header: str = "en\tfr", n: int = 24) -> Path:
    en, fr = read_sentences("en", n=n), read_sentences("fr", n=n)
    path.write_text(header + "\n" + "".join(f"{a}\t{b}\n" for a, b in zip(en, fr)), encoding="utf-8")
    return path


def saved_model(folder: Path, tokenizer, config_class=TransformerNmtConfig, model_class=None) -> Path:
    torch.manual_seed(0)
    model_class = model_class or TransformerNmtForConditionalGeneration
    model_class(config_class.from_preset("tiny", vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def run_folder(tmp_path, tokenizer) -> Path:
    """What a finished training run leaves (its model, tokenizer and results), without training."""
    run = tmp_path / "runs" / "done"
    saved_model(run / "model", tokenizer)
    tokenizer.save_pretrained(run / "tokenizer")
    (run / "results.json").write_text("{}\n")
    return run


def train_error(argv: list[str], monkeypatch, capsys, *, before_data: bool = True) -> str:
    """The one line `hf-variants-train ARGV` ends with (exit status 2); `before_data`: the run never started."""
    if before_data:
        monkeypatch.setattr(train, "setup_run", lambda args: pytest.fail("the run started before the refusal"))
    monkeypatch.setattr(sys, "argv", ["hf-variants-train", *argv])
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    return err.strip()


# ------------------------------------------------------------------------------------------------ training flags
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model_type", "mute"], "--model_type 'mute' is not one of transformer_nmt, mute_nmt, hysan_nmt, "),
        (["--model_type", "mute"], ": did you mean mute_nmt?"),
        (["--model_type", "transformer"], ": did you mean transformer_nmt?"),
        (["--preset", "Tiny"], "--preset 'Tiny' is not one of tiny, small, base, big: did you mean tiny?"),
        (
            ["--config_overrides", "d_modle=64"],
            "--config_overrides: `d_modle` is not a field of TransformerNmtConfig.",
        ),
        (["--config_overrides", "d_modle=64"], "Did you mean `d_model`?"),
        (["--config_overrides", "d_model=abc"], "--config_overrides: `d_model` must be an integer, got 'abc'"),
        (["--config_overrides", "d_model"], "--config_overrides: expected key=value, got 'd_model'"),
        (["--resume_from_checkpoint", "runs/nowhere/step_4"], "--resume_from_checkpoint runs/nowhere/step_4: no such"),
        (["--dataset_name", "./nowhere"], "--dataset_name ./nowhere: no such folder"),
        (["--push_to_hub", "--hub_model_id", "noslash"], "--hub_model_id: "),
    ],
)
def test_training_flags_are_refused_at_parse_time(flags, message, tmp_path, monkeypatch, capsys):
    data = write_tsv(tmp_path / "train.tsv")
    flags = ["--train_file", str(data)] + flags if "--dataset_name" not in flags else flags
    quick = QUICK[2:] if "--preset" in flags else QUICK  # the flag under test is the last --preset
    argv = flags + ["--source_lang", "en", "--target_lang", "fr", "--output_dir", str(tmp_path / "r"), *quick]
    err = train_error(argv, monkeypatch, capsys)
    assert err.startswith("hf-variants-train: error: ") and message in err, err
    assert not (tmp_path / "r").exists()


def test_a_run_folder_given_as_model_or_tokenizer_names_the_folder_inside(run_folder, tmp_path, monkeypatch, capsys):
    data = ["--train_file", str(write_tsv(tmp_path / "train.tsv")), "--source_lang", "en", "--target_lang", "fr"]
    out = ["--output_dir", str(tmp_path / "r")]
    err = train_error(data + ["--model_name_or_path", str(run_folder)] + out + QUICK, monkeypatch, capsys)
    assert (
        f"--model_name_or_path {run_folder} is a training run folder, not a model folder: pass {run_folder / 'model'}"
        in err
    )
    err = train_error(data + ["--tokenizer", str(run_folder)] + out + QUICK, monkeypatch, capsys)
    assert (
        f"--tokenizer {run_folder} is a training run folder, not a tokenizer folder: pass {run_folder / 'tokenizer'}"
        in err
    )
    err = train_error(data + ["--tokenizer", str(tmp_path / "no" / "such")] + out + QUICK, monkeypatch, capsys)
    assert f"--tokenizer {tmp_path / 'no' / 'such'}: no such folder." in err
    assert not (tmp_path / "r").exists()


def test_push_to_hub_without_a_token_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """Before: the upload failed after the whole training, telling a command-line user to "pass token=..."."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    argv = ["--train_file", str(write_tsv(tmp_path / "train.tsv")), "--source_lang", "en", "--target_lang", "fr"]
    argv += ["--push_to_hub", "--hub_model_id", "org/name", "--output_dir", str(tmp_path / "r"), *QUICK]
    err = train_error(argv, monkeypatch, capsys)
    assert "--push_to_hub: no Hugging Face token (--hub_token, the HF_TOKEN environment variable or `hf auth" in err
    assert "--hub_token" in err and "token=" not in err and not (tmp_path / "r").exists()


def test_config_values_that_do_not_fit_together_leave_no_run_folder(tmp_path, monkeypatch, capsys):
    """Known only with the run's fields: after the data, before the model; still one line and no folder."""
    argv = ["--train_file", str(write_tsv(tmp_path / "train.tsv")), "--source_lang", "en", "--target_lang", "fr"]
    argv += ["--config_overrides", "d_model=30", "--output_dir", str(tmp_path / "r"), *QUICK]
    err = train_error(argv, monkeypatch, capsys, before_data=False)
    assert "--config_overrides: `encoder_attention_heads` must be a divisor of d_model=30, got 4." in err
    assert not (tmp_path / "r").exists()


def test_no_data_flag_names_the_data_flags(tmp_path, monkeypatch, capsys):
    """An installed package has no bundled corpus: no `--data_dir` default (before: TypeError ... NoneType)."""
    monkeypatch.setattr(options, "DEFAULT_DATA_DIR", None)
    monkeypatch.chdir(tmp_path)
    err = train_error(["--preset", "tiny"], monkeypatch, capsys)
    assert "hf-variants-train: error: no training data: pass --train_file FILE" in err
    assert "--data_dir DIR" in err and "--dataset_name NAME" in err
    assert not (tmp_path / "runs").exists()


def test_default_run_folder_is_in_the_working_directory_and_a_rerun_says_what_to_do(tmp_path, monkeypatch, capsys):
    """Without --output_dir the run goes to ./runs/<name> (before: the clone's runs/, whatever the working
    directory); a second launch into the finished run is one line with the three ways on (before: a FileExistsError
    traceback); a run without evaluation records no evaluation split (before: "val")."""
    data = write_tsv(tmp_path / "train.tsv")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = ["--train_file", str(data), "--source_lang", "en", "--target_lang", "fr", *QUICK]
    results = train.main(argv)
    run = work / "runs" / "transformer_nmt-en-fr-tiny"
    recorded = json.loads((run / "results.json").read_text())
    assert recorded["train_pairs"] == results["train_pairs"] == 24
    assert recorded["eval_pairs"] == 0 and recorded["eval_split"] is None and recorded["bleu"] is None
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    err = train_error(argv, monkeypatch, capsys, before_data=False)
    assert err == (
        "hf-variants-train: error: runs/transformer_nmt-en-fr-tiny holds an earlier run: pass --overwrite_output_dir "
        "to start over, another --output_dir for a new run, or --resume_from_checkpoint latest to continue it (with "
        "a larger --max_steps or --num_epochs when it finished)."
    )
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


# --------------------------------------------------------------------------------------------- language advice
def test_src_tgt_columns_are_named_as_columns_not_languages(tmp_path, monkeypatch, capsys):
    """`--source_lang src --target_lang tgt` would train a model whose config and card claim the languages src and
    tgt: the advice is the column flags with the languages' own codes; following it trains an en-fr model."""
    from datasets import Dataset

    en, fr = read_sentences("en", n=24), read_sentences("fr", n=24)
    Dataset.from_dict({"src": en, "tgt": fr}).save_to_disk(str(tmp_path / "flat"))
    capsys.readouterr()
    argv = ["--dataset_name", str(tmp_path / "flat"), "--source_lang", "en", "--target_lang", "fr", *QUICK]
    err = train_error(argv + ["--output_dir", str(tmp_path / "r")], monkeypatch, capsys, before_data=False)
    assert (
        "(it has: src, tgt): name its text columns and their languages, --source_column src --target_column tgt "
        in err
    )
    assert "--source_lang CODE --target_lang CODE (the ISO codes of the languages in those columns" in err
    assert "--source_lang src" not in err and not (tmp_path / "r").exists()
    monkeypatch.undo()
    results = train.main(
        argv + ["--source_column", "src", "--target_column", "tgt", "--output_dir", str(tmp_path / "ok")]
    )
    config = json.loads((tmp_path / "ok" / "model" / "config.json").read_text())
    assert (config["languages"], config["target_languages"], results["directions"]) == (
        ["en", "fr"],
        ["fr"],
        ["en-fr"],
    )


@pytest.mark.parametrize(
    "header, flags, advice",
    [
        (
            "src\ttgt",
            ["--source_lang", "en", "--target_lang", "fr"],
            ": src, tgt name no language; write the languages' ISO codes (e.g. en, fr) in its header line",
        ),
        ("en\tfr", ["--languages", "en", "de"], ": pass --languages en fr."),
        (
            "en\tfr",
            ["--source_lang", "en", "--target_lang", "de"],
            ": pass --source_lang en --target_lang fr (or the reverse).",
        ),
    ],
)
def test_language_advice_names_flags_that_make_the_intended_model(
    header, flags, advice, tmp_path, monkeypatch, capsys
):
    data = write_tsv(tmp_path / "train.tsv", header)
    argv = ["--train_file", str(data), *flags, "--output_dir", str(tmp_path / "r"), *QUICK]
    err = train_error(argv, monkeypatch, capsys, before_data=False)
    assert advice in err and not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------- other commands
@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading weights or a tokenizer fails the test: the refusals come before."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the command loaded a model before refusing")

    for name in ("AutoModelForSeq2SeqLM", "AutoTokenizer", "MarianMTModel"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refuse)


def command_error(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_model_commands_name_the_model_folder_of_a_run(run_folder, tmp_path, no_model_loading, capsys):
    from hf_variants.commands import export_ctranslate2 as ctranslate2
    from hf_variants.commands import export_onnx as export
    from hf_variants.commands import warm_start

    expected = f"--model {run_folder} is a training run folder, not a model folder: pass {run_folder / 'model'}"
    for main in (export.main, ctranslate2.main):
        assert expected in command_error(
            main, ["--model", str(run_folder), "--output_dir", str(tmp_path / "o")], capsys
        )
    err = command_error(
        warm_start.main,
        ["--base", str(run_folder), "--model_type", "mute_nmt", "--output_dir", str(tmp_path / "o")],
        capsys,
    )
    assert f"--base {run_folder} is a training run folder, not a model folder: pass {run_folder / 'model'}" in err
    err = command_error(
        export.main, ["--model", str(tmp_path / "no" / "such"), "--output_dir", str(tmp_path / "o")], capsys
    )
    assert f"--model {tmp_path / 'no' / 'such'}: no such folder." in err
    assert not (tmp_path / "o").exists()


def test_convert_marian_refuses_a_model_that_is_no_marian(run_folder, tmp_path, no_model_loading, capsys):
    """Before: MarianMTModel.from_pretrained loaded a transformer_nmt folder with a warning and random weights, and
    the conversion saved that (exit status 0)."""
    from hf_variants.commands import convert_marian as marian

    err = command_error(
        marian.main, ["--marian", str(run_folder / "model"), "--output_dir", str(tmp_path / "o")], capsys
    )
    assert f"--marian {run_folder / 'model'} holds a 'transformer_nmt' model, not a MarianMTModel: it needs no" in err
    assert not (tmp_path / "o").exists()


def test_ctranslate2_refuses_a_variant_before_loading_it(tokenizer, tmp_path, no_model_loading, capsys):
    mute = saved_model(tmp_path / "mute", tokenizer, MuteConfig, MuteForConditionalGeneration)
    from hf_variants.commands import export_ctranslate2 as ctranslate2

    err = command_error(ctranslate2.main, ["--model", str(mute), "--output_dir", str(tmp_path / "o")], capsys)
    assert err.startswith("hf-variants-export-ctranslate2: error: CTranslate2 cannot express model_type='mute_nmt'")
    assert not (tmp_path / "o").exists()


def test_publish_without_a_token_says_how_to_give_one(run_folder, tmp_path, monkeypatch, capsys):
    from hf_variants.commands import publish

    monkeypatch.setattr(publish, "get_token", lambda: None)
    monkeypatch.setattr(publish, "push_to_hub", lambda *a, **k: pytest.fail("publish went on without a token"))
    err = command_error(publish.main, [str(run_folder), "--repo_id", "org/name"], capsys)
    assert "No Hugging Face token: set the HF_TOKEN environment variable or log in with `hf auth login`" in err
    assert "token=" not in err
    err = command_error(publish.main, [str(tmp_path), "--repo_id", "org/name"], capsys)
    assert "is not a saved model: config.json is missing" in err


def test_a_split_prefix_the_folder_does_not_use_names_the_prefixes_it_has(tmp_path, monkeypatch, capsys):
    """The guide's text files without `--test_prefix`: the default `test_2016_flickr` (the bundled data's) is named
    with the folder's own prefixes and the flags that choose them."""
    data = tmp_path / "data"
    data.mkdir()
    for prefix in ("train", "valid", "test"):
        for lang in ("en", "fr"):
            (data / f"{prefix}.{lang}").write_text("\n".join(read_sentences(lang, n=8)) + "\n")
    argv = ["--data_dir", str(data), "--train_prefix", "train", "--valid_prefix", "valid", "--source_lang", "en"]
    err = train_error(
        argv + ["--target_lang", "fr", "--output_dir", str(tmp_path / "r"), *QUICK],
        monkeypatch,
        capsys,
        before_data=False,
    )
    assert "No file for language 'en' of split 'test_2016_flickr'" in err
    assert "its files' prefixes: test, train, valid (--train_prefix, --valid_prefix and --test_prefix name" in err
    assert not (tmp_path / "r").exists()
