"""Paths a new user takes first.

- After `import hf_variants`, `pipeline("translation", model=FOLDER)` loads a saved folder without
  `trust_remote_code` (as `AutoModelForSeq2SeqLM.from_pretrained` does); greedy translation with `translate.py
  --num_beams 1` on a model saved with the papers' beam settings passes no length penalty.
- Own data: a `datasets` dataset with flat language-named columns (a `save_to_disk` folder), named columns
  (`--source_column/--target_column`), in-memory `Dataset`s through `train_on_datasets`; a data error ends the
  command with one line naming the file or column and the flag to pass, and leaves no run folder.
- Logs: off a terminal, training writes progress lines (log records), never a bar's carriage returns.
- Threads: on a busy machine the default leaves the busy cores alone and says so in one line.
- Install: a wheel installed into a fresh virtual environment has every console script, and `hf-variants-train`
  runs outside the checkout (as does `accelerate launch -m hf_variants.training.train`); without data flags it
  names them in one line (the wheel has no bundled corpus).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, environment_with_running_packages, read_sentences
from transformers import pipeline
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hf_variants  # noqa: F401  (registers the model types and the translation task)
from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.commands import translate
from hf_variants.training import progress, train
from hf_variants.training.corpus import DataError


def saved_model(tokenizer, path):
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset("tiny", vocab_size=len(tokenizer)))
    model.generation_config.num_beams, model.generation_config.length_penalty = 4, 0.6  # what train.py saves
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def test_pipeline_loads_a_folder_without_trust_remote_code(tokenizer, tmp_path):
    model = saved_model(tokenizer, tmp_path / "model")
    sentences = read_sentences("en", "val", n=3)
    by_path = pipeline("translation", model=str(tmp_path / "model"))
    assert type(by_path.model) is TransformerNmtForConditionalGeneration
    expected = pipeline("translation", model=model, tokenizer=tokenizer)(sentences, max_new_tokens=8)
    assert by_path(sentences, max_new_tokens=8) == expected
    # the saved config still ships the remote-code pipeline (for processes without the package)
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["custom_pipelines"]["translation"]["impl"] == "pipeline_translation.TranslationPipeline"
    assert model.config.custom_pipelines == {}  # in this process the registered task serves it


def test_greedy_translate_passes_no_length_penalty(tokenizer, tmp_path):
    model = saved_model(tokenizer, tmp_path / "model")
    src = tmp_path / "src.en"
    src.write_text("\n".join(read_sentences("en", "val", n=2)) + "\n")
    logger = hf_logging.get_logger("transformers.generation.configuration_utils")  # where generate() validates
    logger.warning_once.cache_clear()  # the warning is emitted once per process
    with CaptureLogger(logger) as captured:
        translate.main(
            [
                "--model",
                str(tmp_path / "model"),
                "--input",
                str(src),
                "--output",
                str(tmp_path / "out"),
                "--num_beams",
                "1",
                "--no_progress",
            ]
        )
    assert "length_penalty" not in captured.out
    # what translate.py passed before: the same call with the length penalty warns (the check above can fail)
    logger.warning_once.cache_clear()
    inputs = model.prepare_translation_inputs(tokenizer, read_sentences("en", "val", n=1))
    with CaptureLogger(logger) as captured:
        model.generate(**inputs, num_beams=1, length_penalty=0.6, max_new_tokens=3)
    assert "['length_penalty']" in captured.out


# ------------------------------------------------------------------------------------------------- own data
QUICK = ["--preset", "tiny", "--max_steps", "2", "--warmup_steps", "1", "--eval_bleu_pairs", "2", "--num_beams", "1"]
QUICK += ["--max_len_b", "3", "--num_examples", "0", "--progress_interval", "0"]


def en_fr(n: int, split: str = "train") -> tuple[list[str], list[str]]:
    return read_sentences("en", split, n=n), read_sentences("fr", split, n=n)


def test_flat_language_columns_of_a_save_to_disk_folder_train(tokenizer, tmp_path, capsys):
    """A `Dataset.save_to_disk` folder with flat `en`/`fr` columns (before: "no 'translation' column", a traceback
    and an empty run folder); the log off a terminal has progress lines and no carriage return."""
    from datasets import Dataset

    en, fr = en_fr(40)
    Dataset.from_dict({"id": list(range(40)), "en": en, "fr": fr}).save_to_disk(str(tmp_path / "flat"))
    tokenizer.save_pretrained(tmp_path / "tok")
    capsys.readouterr()  # the test's own save_to_disk bar
    run = tmp_path / "run"
    args = ["--dataset_name", str(tmp_path / "flat"), "--source_lang", "en", "--target_lang", "fr"]
    results = train.main(args + ["--tokenizer", str(tmp_path / "tok"), "--output_dir", str(run)] + QUICK)
    assert results["train_pairs"] == 40 and results["eval_pairs"] == 0
    log = (run / "train.log").read_text()
    assert "progress: step 1/2 (50%)" in log and "progress: step 2/2 (100%)" in log
    assert f"progress: tokenizing {tmp_path / 'flat'}[train]: 100% (40 of the first worker's 40 rows)" in log
    assert "\r" not in log and "\r" not in capsys.readouterr().err


def test_train_on_datasets_with_named_columns(tokenizer, tmp_path):
    """The Python entry point: in-memory `Dataset`s with columns named by `source_column`/`target_column`."""
    from datasets import Dataset

    en, fr = en_fr(30)
    val_en, val_fr = en_fr(6, "val")
    tokenizer.save_pretrained(tmp_path / "tok")
    train_set = Dataset.from_dict({"english": en, "french": fr})
    valid_set = Dataset.from_dict({"english": val_en, "french": val_fr})
    options = dict(source_lang="en", target_lang="fr", source_column="english", target_column="french")
    results = train.train_on_datasets(
        train_set,
        validation=valid_set,
        tokenizer=str(tmp_path / "tok"),
        output_dir=str(tmp_path / "run"),
        dataset_name="my pairs",
        **options,
        **{flag.removeprefix("--"): value for flag, value in zip(QUICK[::2], QUICK[1::2])},
    )
    assert results["train_pairs"] == 30 and results["eval_pairs"] == 6
    assert results["hyperparameters"]["dataset_name"] == "my pairs"
    assert (tmp_path / "run" / "model" / "config.json").is_file()
    with pytest.raises(DataError, match=r"no column 'anglais' \(the 'en' side"):
        train.train_on_datasets(train_set, **{**options, "source_column": "anglais"}, output_dir=str(tmp_path / "r2"))
    assert not (tmp_path / "r2").exists()
    with pytest.raises(ValueError, match="^train_on_datasets: --max_steps must be a positive integer, got 0$"):
        train.train_on_datasets(train_set, **options, max_steps=0)


@pytest.mark.parametrize(
    "layout, flags, message",
    [
        (
            "tsv",
            [],
            "Language 'de' is not in {data} (it has: en, fr): pass --source_lang en --target_lang fr (or the "
            "reverse).",
        ),
        (  # column names are for datasets: never silently ignored
            "tsv",
            ["--source_lang", "en", "--target_lang", "fr", "--source_column", "en", "--target_column", "fr"],
            "--source_column/--target_column name the text columns of a --dataset_name dataset.",
        ),
        (
            "odd_columns",
            ["--source_lang", "en", "--target_lang", "fr"],
            "has no 'translation' column and no two columns named by language codes (its columns: english, "
            "french): name the text columns with --source_column COLUMN --target_column COLUMN.",
        ),
    ],
)
def test_a_data_error_is_one_line_and_leaves_no_run_folder(layout, flags, message, tmp_path, monkeypatch, capsys):
    en, fr = en_fr(4)
    if layout == "tsv":
        data = tmp_path / "train.tsv"
        data.write_text("en\tfr\n" + "".join(f"{a}\t{b}\n" for a, b in zip(en, fr)))
        flags = ["--train_file", str(data)] + flags
    else:
        from datasets import Dataset

        data = tmp_path / "odd"
        Dataset.from_dict({"english": en, "french": fr}).save_to_disk(str(data))
        flags = ["--dataset_name", str(data)] + flags
    run = tmp_path / "runs" / "new"
    monkeypatch.setattr(sys, "argv", ["hf-variants-train", *flags, "--output_dir", str(run), "--preset", "tiny"])
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith("hf-variants-train: error: ") and message.format(data=data) in err
    assert not run.exists()


def test_a_deepspeed_launch_is_refused_naming_fsdp(tmp_path, monkeypatch, capsys):
    """Accelerate's DeepSpeed launch (it sets ACCELERATE_USE_DEEPSPEED) stops at once with one line pointing to
    FSDP, instead of a run whose checkpoints the loop cannot read back."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(sys, "argv", ["hf-variants-train", "--preset", "tiny", "--output_dir", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DeepSpeed is not supported" in err and "fsdp.yaml" in err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------------------- logs
class NotATerminal(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_lines_off_a_terminal(caplog):
    clock = iter([5.0, 12.0, 13.0, 30.0])
    bar = progress.training_progress(4, 0, disable=False, interval=10.0, stream=NotATerminal())
    assert isinstance(bar, progress.ProgressLines)
    bar.clock, bar.start, bar.last = lambda: next(clock), 0.0, 0.0
    with caplog.at_level(logging.INFO, logger="hf_variants.train"):
        for step in range(1, 5):
            bar.set_postfix(loss=f"{5 - step:.3f}", tok_s="100", refresh=False)
            bar.update(1)
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [  # step 1 at 5 s: too early; step 2 at 12 s; step 3 at 13 s: too early; step 4: the end
        "progress: step 2/4 (50%), loss 3.000, tok_s 100, elapsed 0:00:12, ETA 0:00:12",
        "progress: step 4/4 (100%), loss 1.000, tok_s 100, elapsed 0:00:30, ETA 0:00:00",
    ]


def test_the_run_log_leaves_out_http_requests(tmp_path, capsys):
    """An upload's HTTP requests (httpx logs each at INFO) stay out of the run's log; the run's records stay in."""

    class Accelerator:
        is_main_process = True

    train.setup_logging(Accelerator(), tmp_path)
    try:
        logging.getLogger("httpx").info('HTTP Request: POST http://hub/api/repos/create "HTTP/1.1 200 OK"')
        logging.getLogger("huggingface_hub.hf_api").info("uploading")
        train.logger.info("Pushed to http://hub/org/name")
        for handler in logging.getLogger().handlers:
            handler.flush()
        log = (tmp_path / "train.log").read_text()
    finally:
        for handler in list(logging.getLogger().handlers):
            logging.getLogger().removeHandler(handler)
            handler.close()
    assert "Pushed to http://hub/org/name" in log
    assert "HTTP Request" not in log and "uploading" not in log
    assert "HTTP Request" not in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------- threads
@pytest.mark.parametrize(
    "cores, processes, load, threads",
    [(2, 1, 0.3, 2), (2, 1, 1.9, 1), (2, 1, 3.5, 1), (16, 2, 4.0, 6), (16, 2, 1.0, 8), (8, 1, None, 8)],
)
def test_threads_from_load_leave_busy_cores_alone(cores, processes, load, threads):
    chosen, reason = train.threads.load_fitted(cores, processes, load)
    assert chosen == threads
    assert (reason is None) == (threads == cores // processes)
    asked = train.threads.choose(None, True, None, cores, processes, {}, load)
    assert (asked.threads, asked.source, asked.note) == (threads, "load", reason)


@pytest.mark.parametrize("load", [0.0, 1.9, 64.0])
def test_the_default_thread_count_ignores_the_load(load):
    """Without --threads_from_load the count is the cores per process whatever the load average says; the user's
    OMP_NUM_THREADS counts unless a launcher set it; --num_threads wins; a resume keeps the recorded count."""
    choose = train.threads.choose
    assert choose(None, False, None, 2, 1, {}, load) == train.threads.ThreadChoice(
        2, "cores", "2 core(s) / 1 process(es) on this machine"
    )
    assert choose(None, False, None, 16, 3, {}, load).threads == 5
    assert choose(None, False, None, 2, 4, {}, load).threads == 1
    assert choose(None, False, None, 16, 1, {"OMP_NUM_THREADS": "3"}, load).key == (3, "OMP_NUM_THREADS")
    launched = {"OMP_NUM_THREADS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO"}  # accelerate launch's default, not ours
    assert choose(None, False, None, 16, 2, launched, load).key == (8, "cores")
    assert choose(4, False, 1, 2, 1, {"OMP_NUM_THREADS": "3"}, load).key == (4, "flag")
    kept = choose(None, False, 1, 16, 1, {}, load)
    assert kept.key == (1, "checkpoint")
    assert "Keeping the run's 1 CPU thread(s) per process" in kept.note and "--num_threads 16" in kept.note
    assert choose(None, False, 2, 2, 1, {}, load).note is None  # the same count: nothing to say


def test_set_cpu_threads_on_a_busy_machine_keeps_the_count(monkeypatch, caplog):
    class Accelerator:
        device, num_processes = torch.device("cpu"), 1

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.5, 9.0, 9.0))
    for name in ("LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", *train.threads.LAUNCHER_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    try:
        with caplog.at_level(logging.INFO, logger="hf_variants.train"):
            assert train.set_cpu_threads(train.parse_args(["--preset", "tiny"]), Accelerator()).threads == 2
            assert torch.get_num_threads() == 2 and "load average" not in caplog.text
            asked = train.parse_args(["--preset", "tiny", "--threads_from_load"])
            assert train.set_cpu_threads(asked, Accelerator()).threads == 1
            assert torch.get_num_threads() == 1
            assert "1 CPU thread(s) per process instead of 2: the load average 9.5" in caplog.text
        train.set_cpu_threads(train.parse_args(["--num_threads", "2"]), Accelerator())  # the flag always wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_thread_flags_are_checked(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--preset", "tiny", "--num_threads", "2", "--threads_from_load"])
    assert "--threads_from_load picks them by the load: give one" in capsys.readouterr().err
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    for name in train.threads.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        train.parse_args(["--preset", "tiny"])
    assert "OMP_NUM_THREADS='two' is not a positive integer" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------- install
def test_nested_environment_sees_the_running_environment_from_a_venv(tmp_path):
    """The environments the install tests build see the packages of the environment the suite runs in, also when
    that is a virtual environment (where `venv --system-site-packages` would expose the base interpreter's
    packages instead): a module installed only into an outer venv is importable in the environment built from
    it, and the inner environment's own packages come first."""
    outer = environment_with_running_packages(tmp_path / "outer")
    outer_site = subprocess.run(
        [str(outer), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(outer_site, "outer_only.py").write_text("WHERE = 'outer'\n")
    script = f"""
import subprocess, sys
from pathlib import Path
sys.path.insert(0, {str(REPO_ROOT / "modeling_tests")!r})
from conftest import environment_with_running_packages
inner = environment_with_running_packages(Path({str(tmp_path / "inner")!r}))
site = subprocess.run([str(inner), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      capture_output=True, text=True, check=True).stdout.strip()
Path(site, "shadowed.py").write_text("WHERE = 'inner'\\n")
Path({outer_site!r}, "shadowed.py").write_text("WHERE = 'outer'\\n")
code = "import outer_only, shadowed, torch, transformers; print(outer_only.WHERE, shadowed.WHERE)"
print(subprocess.run([str(inner), "-c", code], capture_output=True, text=True, check=True).stdout.strip())
"""
    shown = subprocess.run([str(outer), "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout.split() == ["outer", "inner"]


def test_wheel_install_has_every_console_script(tmp_path, checkout_wheel):
    """A wheel built from the checkout, installed into a fresh virtual environment (the running environment's
    packages for torch and the other dependencies, `environment_with_running_packages`; the wheel itself without
    dependencies), used from outside the checkout."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
        import tomli as tomllib

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"hf-variants-train", "hf-variants-translate", "hf-variants-export-onnx", "hf-variants-publish"} <= set(
        scripts
    )
    wheel = checkout_wheel
    assert "hf_variants/training/train.py" in zipfile.ZipFile(wheel).namelist()
    venv = tmp_path / "venv"
    python, bin_dir = environment_with_running_packages(venv), venv / "bin"
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for name in scripts:
        assert (bin_dir / name).is_file(), f"the wheel installs no {name}"
    check = (  # where the package would be imported from, and the installed entry points (no torch import)
        "import importlib.metadata as m, importlib.util as u; print(u.find_spec('hf_variants').origin); "
        "print(sorted({e.name for e in m.entry_points(group='console_scripts') if e.name.startswith('hf-variants')}))"
    )
    shown = subprocess.run([str(python), "-c", check], capture_output=True, text=True, cwd=outside, env=env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    where, names = shown.stdout.splitlines()
    assert Path(where).is_relative_to(venv), where  # the wheel's copy, not the checkout's
    assert names == str(sorted(scripts))
    helped = subprocess.run(
        ["accelerate", "launch", "--cpu", "--num_processes", "1", "-m", "hf_variants.training.train", "--help"],
        capture_output=True,
        text=True,
        cwd=outside,
        env=env,
    )
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "--source_column" in helped.stdout and "--train_file" in helped.stdout
    helped = subprocess.run(["hf-variants-train", "--help"], capture_output=True, text=True, cwd=outside, env=env)
    assert helped.returncode == 0 and "--dataset_name" in helped.stdout, helped.stderr[-3000:]
    # the wheel has no bundled corpus: without data flags, one line naming them (before: a TypeError traceback)
    bare = subprocess.run(
        ["hf-variants-train", "--preset", "tiny"], capture_output=True, text=True, cwd=outside, env=env
    )
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1, bare.stderr[-3000:]
    assert "error: no training data: pass --train_file FILE" in bare.stderr and "--data_dir DIR" in bare.stderr
    assert not (outside / "runs").exists()


def test_ci_runs_the_readmes_set_up_in_a_fresh_virtual_environment():
    """.ci/run does what the README's two set-up commands do (CI sees what a newcomer sees): a fresh virtual
    environment, the same installs, and exactly the README's test command."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Set-up (two commands)", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    install, test = (block.strip() for block in blocks)
    steps = [step.strip() for step in install.split("&&")]
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], steps
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r'python3 -m venv "\$WORK/venv"\n(?:#.*\n)*\. "\$WORK/venv/bin/activate"', ci)
    for step in steps[2:]:
        if step.startswith("pip install"):
            assert f"python -m pip install --quiet {step.removeprefix('pip install ')}" in ci, step
    assert test == "python -m pytest modeling_tests -q -n auto --dist loadfile"
    assert re.search(r"\n\s+python -m pytest modeling_tests -q -n auto --dist loadfile\n", ci)
