"""The documentation runs: every code block of docs/user-guide.md, docs/serving.md, README.md and training/README.md,
in order, as a reader would paste them, so that no command or snippet of the docs can rot. A block or command that
cannot run here is listed in `NOT_RUN` with its reason, and the test checks the reason (it never skips one
silently): a new block runs, or fails until it is run or classified.

How each block runs (the only changes the test makes, all listed here):

- **Scratch folder.** Each document's blocks run in a temporary folder of their own (the working directory), which
  holds what the docs name as the reader's own files: `data/` (the first 48 / 8 / 8 English-French pairs of the
  bundled Multi30k train / val / test_2016_flickr, as the guide describes them: TSV with an `en<TAB>fr` header,
  `{prefix}.{lang}` text files, JSONL `{"translation": ...}` rows), `in.en`, `ref.de`, `test.en.gz` and `test.jsonl`
  (8 en-de pairs of test_2016_flickr), `clean.tsv`, `bt.tsv` and `valid.tsv` (48, 16 and 8 en-de pairs of train /
  train / val: training/README.md's corpora), `training/data` (the clone's bundled data, linked), `opus-mt-en-de`
  (a tiny random `MarianMTModel` with a small tokenizer, where a reader has Helsinki-NLP's), and
  `nllb-200-distilled-600M` / `m2m100_418M` (tiny random `M2M100ForConditionalGeneration`s with an NLLB and an M2M100
  tokenizer over a small SentencePiece model, M2M100's with its LayerDrop of 0.05, where a reader has facebook's);
  `data/` also holds its text files under NLLB-200's codes (`train.eng_Latn`, ...), as the guide's section 12 names
  them.
- **python** blocks run with `exec` in one namespace per document (as one interactive session), in order.
- **bash** blocks: every command (backslash continuations joined, `#` comments dropped, `&&` chains split) runs in
  this process:
  * a console script (`hf-variants-X`) through the function pyproject.toml's `[project.scripts]` names, with
    `sys.argv` set to its arguments; `python -m hf_variants.X` through `runpy.run_module`; `python training/X.py`
    through `runpy.run_path` on the clone's script; none may exit with a non-zero status;
  * `accelerate launch [LAUNCHER OPTIONS] (-m hf_variants.training.train | training/train.py) ARGS` runs the
    training command in this one process; the launcher options are checked, not executed: every `--config_file`
    must be one of the clone's accelerate configs and parse as YAML, `--machine_rank` must be below its
    `num_machines`;
  * `accelerate launch [LAUNCHER OPTIONS] -m hf_variants.commands.translate ARGS` (or `.score`) runs for real: the
    launcher with the guide's options (checked as above) and a free `--main_process_port`, its processes (gloo on
    CPUs, one thread each as the guide says) in the scratch folder; it must exit with status 0;
  * a launch over several machines (`--num_machines` above 1, or a config's `num_machines`) is one command per
    machine: they must follow each other with `--machine_rank` 0, 1, ... and be identical apart from it; they are
    checked, not run here (one process cannot be two machines): `test_multi_node.py` runs the guide's one-machine
    rehearsal block for real, as two launchers;
  * training commands get `TINY_TRAINING` appended (`--preset tiny --max_steps 2`, the first 48 / 8 training /
    validation rows, small evaluation settings): the docs' `--preset small/base/big` and long runs become a tiny
    model trained for 2 steps, in the run folder the command names (`--run_name` of its default folder); a command
    without `--output_dir` whose default run folder an earlier command of the same document wrote (the docs list
    alternatives) gets `--overwrite_output_dir`;
  * `hf-variants-export-onnx` gets `--no_shared_cache` appended: two graphs (encoder, decoder step) instead of
    three, the shared-cache step graph being the slowest third of the export (the ONNX tests cover it);
  * `hf-variants-publish` uploads to the in-process Hub server of `conftest_hub` (`HF_ENDPOINT`, any token);
  * `zcat FILE | COMMAND` feeds COMMAND's standard input, `COMMAND > FILE` writes its standard output to FILE;
  * `pip install -e ".[EXTRAS]"` is not executed (no package installs in the suite): each extra must exist in
    pyproject.toml; `pip install NAME==VERSION` must pin a version pyproject.toml's requirement allows. The real
    install from a wheel is `test_new_user_paths.py::test_wheel_install_*`.
  * A command ending in `&` (the server: `hf-variants-serve ... &`) starts in the background as a real process
    (`python -m hf_variants.serve`, what the console script runs); `kill %1` sends it SIGTERM and its exit status
    must be 0. The guide's port 8000 becomes a free port the test picks, in every block (`--port 8000`,
    `127.0.0.1:8000`); the test stops a server still running at its end.
  * `curl` commands run the real `curl` against it, and must exit 0.
  * Any other command fails the test (add it to `run_command` with an honest way to run it, or to `NOT_RUN`).
- Blocks without a language are file listings, never commands (checked).
"""

from __future__ import annotations

import contextlib
import gzip
import ipaddress
import itertools
import json
import math
import re
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import DATA_DIR, REPO_ROOT
from conftest_hub import hub  # noqa: F401
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

GUIDE = REPO_ROOT / "docs" / "user-guide.md"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
TRAIN_MODULE = "hf_variants.training.train"
CLONE_SCRIPTS = {
    "training/train.py": "hf_variants.training.train",
    "training/translate.py": "hf_variants.commands.translate",
}
TINY_TRAINING = [
    "--preset",
    "tiny",
    "--max_steps",
    "2",
    "--warmup_steps",
    "1",
    "--eval_steps",
    "1",
    "--eval_bleu_pairs",
    "4",
    "--num_beams",
    "1",
    "--max_len_b",
    "4",
    "--max_train_pairs",
    "48",
    "--max_valid_pairs",
    "8",
    "--max_test_pairs",
    "4",
    "--num_examples",
    "0",
]
SPLITS = {"train": ("train", 48), "valid": ("val", 8), "test": ("test_2016_flickr", 8)}


# --------------------------------------------------------------------------------------------- blocks, commands
@dataclass
class Block:
    lang: str
    code: str
    line: int
    recipe: str | None  # the `<!-- recipe:NAME -->` marker right before the block


def code_blocks(text: str) -> list[Block]:
    """Every fenced block, in order."""
    pattern = r"(?:<!-- recipe:(\w+) -->\s*)?^```(\w*)\n(.*?)^```"
    return [
        Block(m.group(2), m.group(3), text[: m.start(2)].count("\n") + 1, m.group(1))
        for m in re.finditer(pattern, text, re.M | re.S)
    ]


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, `&&` chains split."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1 :]
    return [c for c in commands if c]


# ----------------------------------------------------------------------------------- what the test does not run
def covered_by_test_recipes(block: Block, argv: list[str]) -> None:
    import test_recipes

    assert block.recipe and test_recipes.recipes()[block.recipe] == argv, "not the recipe test_recipes runs"


def the_suite_itself(block: Block, argv: list[str]) -> None:
    assert argv[:4] == ["python", "-m", "pytest", "modeling_tests"], argv


def needs_parse_files(block: Block, argv: list[str]) -> None:
    assert "--source_annotations" in argv and argv[argv.index("--source_annotations") + 1] == "parses", argv
    assert not any(flag in argv for flag in ("--data_dir", "--train_file", "--dataset_name")), argv  # bundled data
    assert not list(DATA_DIR.glob("*.parses*")), "the bundled data has parses now: run the command"
    assert "--source_annotations" in (REPO_ROOT / "modeling_tests" / "test_training.py").read_text()


def a_virtual_environment(block: Block, argv: list[str]) -> None:
    assert argv in (["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]), argv
    ci_test = (REPO_ROOT / "modeling_tests" / "test_new_user_paths.py").read_text()
    assert "def test_ci_runs_the_readmes_set_up_in_a_fresh_virtual_environment(" in ci_test
    assert 'python3 -m venv "$WORK/venv"' in (REPO_ROOT / ".ci" / "run").read_text()


def a_hub_repository(block: Block, argv: None) -> None:
    assert re.search(r'from_pretrained\("ORG/NAME", trust_remote_code=True\)', block.code), block.code
    assert 'pipeline("translation", model="ORG/NAME", trust_remote_code=True)' in block.code
    pushed = (REPO_ROOT / "modeling_tests" / "test_hub_push.py").read_text()
    assert "AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)" in pushed
    assert 'pipeline("translation", model=repo, trust_remote_code=True)' in pushed


# reason -> (what the reader needs that this machine has not, where it is tested instead, the check of both)
NOT_RUN = {
    "recipe": (
        "a paper recipe: WMT14 / OPUS-100 and the paper's GPUs",
        "test_recipes.py::test_recipe_dry_run (2 steps on a slice, the same flags)",
        covered_by_test_recipes,
    ),
    "suite": ("the test suite itself", "CI (.ci/run)", the_suite_itself),
    "venv": (
        "a fresh virtual environment (the suite runs in one already)",
        ".ci/run makes one as the README does (test_new_user_paths.py::"
        "test_ci_runs_the_readmes_set_up_in_a_fresh_virtual_environment)",
        a_virtual_environment,
    ),
    "parses": (
        "source parses (*.en.parses), which the bundled Multi30k has not",
        "test_training.py (MG-SA trained with --source_annotations parses on synthetic parses)",
        needs_parse_files,
    ),
    "hub": (
        "a model repository on the Hub (ORG/NAME)",
        "test_hub_push.py::test_pushed_model_translates_like_the_local_model_in_a_fresh_process (the same loads "
        "from a Hub server, in a process without hf_variants)",
        a_hub_repository,
    ),
}


def not_run(block: Block, argv: list[str] | None) -> str | None:
    """The `NOT_RUN` reason of a command (or, `argv` None, of a python block), checked; None when it runs."""
    if argv is None:
        if "ORG/NAME" not in block.code:
            return None
        reason = "hub"
    elif block.recipe:
        reason = "recipe"
    elif argv[:3] == ["python", "-m", "pytest"]:
        reason = "suite"
    elif argv[:3] == ["python3", "-m", "venv"] or argv[0] == ".":
        reason = "venv"
    elif "--source_annotations" in argv and not any(f in argv for f in ("--data_dir", "--train_file")):
        reason = "parses"
    else:
        return None
    NOT_RUN[reason][2](block, argv)
    return reason


# ---------------------------------------------------------------------------------------------- scratch folder
def write_data(folder: Path) -> None:
    folder.mkdir()
    for name, (split, n) in SPLITS.items():
        sides = {}
        for lang in ("en", "fr"):
            with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                sides[lang] = [line.rstrip("\n") for line in itertools.islice(f, n)]
            (folder / f"{name}.{lang}").write_text("\n".join(sides[lang]) + "\n", encoding="utf-8")
            nllb = {"en": "eng_Latn", "fr": "fra_Latn"}[lang]  # the same text under NLLB-200's codes (section 12)
            (folder / f"{name}.{nllb}").write_text("\n".join(sides[lang]) + "\n", encoding="utf-8")
        pairs = list(zip(sides["en"], sides["fr"]))
        (folder / f"{name}.tsv").write_text("en\tfr\n" + "".join(f"{a}\t{b}\n" for a, b in pairs), encoding="utf-8")
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"translation": {"en": a, "fr": b}}, ensure_ascii=False) + "\n" for a, b in pairs),
            encoding="utf-8",
        )
    with gzip.open(DATA_DIR / "train.fr.gz", "rt", encoding="utf-8") as f:
        mono = [line.rstrip("\n") for line in itertools.islice(f, SPLITS["train"][1], SPLITS["train"][1] + 16)]
    (folder / "mono.fr").write_text("\n".join(mono) + "\n", encoding="utf-8")


def write_own_files(folder: Path, tokenizer) -> None:
    """The reader's own files the README and training/README name (besides `data/`)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    test = {}
    for lang in ("en", "de"):
        with gzip.open(DATA_DIR / f"test_2016_flickr.{lang}.gz", "rt", encoding="utf-8") as f:
            test[lang] = [line.rstrip("\n") for line in itertools.islice(f, 8)]
    (folder / "in.en").write_text("\n".join(test["en"]) + "\n", encoding="utf-8")
    (folder / "ref.de").write_text("\n".join(test["de"]) + "\n", encoding="utf-8")
    with gzip.open(folder / "test.en.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(test["en"]) + "\n")
    (folder / "test.jsonl").write_text(
        "".join(
            json.dumps({"translation": {"en": a, "de": b}}, ensure_ascii=False) + "\n" for a, b in zip(*test.values())
        ),
        encoding="utf-8",
    )
    for name, split, start, count in (("clean", "train", 0, 48), ("bt", "train", 48, 16), ("valid", "val", 0, 8)):
        sides = []
        for lang in ("en", "de"):  # training/README.md's corpora: en-de TSV files with a header
            with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                sides.append([line.rstrip("\n") for line in itertools.islice(f, start, start + count)])
        rows = "".join(f"{a}\t{b}\n" for a, b in zip(*sides))
        (folder / f"{name}.tsv").write_text("en\tde\n" + rows, encoding="utf-8")
    (folder / "training").mkdir()
    (folder / "training" / "data").symlink_to(REPO_ROOT / "training" / "data")
    torch.manual_seed(0)
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=len(tokenizer),
            decoder_vocab_size=len(tokenizer),
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
            forced_eos_token_id=tokenizer.eos_token_id,
            share_encoder_decoder_embeddings=True,
        )
    )
    marian.save_pretrained(folder / "opus-mt-en-de")
    tokenizer.save_pretrained(folder / "opus-mt-en-de")
    with torch.random.fork_rng(devices=[]):  # the blocks see the random state they saw before these folders
        write_m2m100_checkpoints(folder)


def write_m2m100_checkpoints(folder: Path) -> None:
    """Tiny random `nllb-200-distilled-600M` and `m2m100_418M` folders (the guide's section 12): an NLLB and an
    M2M100 tokenizer over one SentencePiece model trained on 300 lines of the bundled data (fairseq's special ids:
    <s> 0, <pad> 1, </s> 2, <unk> 3), M2M100's LayerDrop 0.05 as the real 418M has."""
    import io

    import sentencepiece
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer, NllbTokenizer

    lines = []
    for lang in ("en", "fr", "de"):
        with gzip.open(DATA_DIR / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            lines += [line.rstrip("\n") for line in itertools.islice(f, 100)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    spm = folder / "spm"
    spm.mkdir()
    (spm / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    pieces = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    (spm / "vocab.json").write_text(json.dumps({pieces.id_to_piece(i): i for i in range(pieces.get_piece_size())}))
    nllb = NllbTokenizer.from_pretrained(spm, additional_special_tokens=["eng_Latn", "fra_Latn", "deu_Latn"])
    m2m = M2M100Tokenizer(spm / "vocab.json", spm / "sentencepiece.bpe.model")
    for name, tokenizer, vocab, layerdrop in (
        ("nllb-200-distilled-600M", nllb, len(nllb), 0.0),
        ("m2m100_418M", m2m, 408, 0.05),
    ):
        torch.manual_seed(0)
        config = M2M100Config(
            vocab_size=vocab,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=256,
            encoder_layerdrop=layerdrop,
            decoder_layerdrop=layerdrop,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        )
        M2M100ForConditionalGeneration(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


# ---------------------------------------------------------------------------------------------------- running
def console_function(name: str):
    module, _, function = SCRIPTS[name].partition(":")
    return getattr(__import__(module, fromlist=[function]), function)


def exit_status(run) -> object:
    """The exit status of `run()`: its `SystemExit` code, or what a console script's function returned."""
    try:
        result = run()
    except SystemExit as exit_:
        return exit_.code
    return result if not isinstance(result, dict) else None  # runpy returns the module's globals


def run_console_script(name: str, args: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [name, *args])
    status = exit_status(console_function(name))
    assert status in (None, 0), f"{name} {shlex.join(args)} exited with {status!r}"


def run_python(argv: list[str], monkeypatch) -> None:
    """`python -m MODULE ARGS` or `python training/SCRIPT.py ARGS` (the clone's script)."""
    if argv[1] == "-m":
        target, args = argv[2], argv[3:]
        assert target.startswith("hf_variants."), argv
        monkeypatch.setattr(sys, "argv", [target, *args])
        status = exit_status(lambda: runpy.run_module(target, run_name="__main__", alter_sys=True))
    else:
        target, args = argv[1], argv[2:]
        assert target in CLONE_SCRIPTS, f"not one of the clone's scripts: {target}"
        monkeypatch.setattr(sys, "argv", [target, *args])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the clone first
        status = exit_status(lambda: runpy.run_path(str(REPO_ROOT / target), run_name="__main__"))
    assert status in (None, 0), f"{shlex.join(argv)} exited with {status!r}"


def check_launcher_options(options: list[str]) -> tuple[int, int]:
    """`accelerate launch` options before the script: config files of the clone, a machine rank it has, a main
    process address and port. Returns (machines, this machine's rank)."""
    config, machines, rank = {}, None, 0
    it = iter(options)
    for option in it:
        if option == "--config_file":
            path = REPO_ROOT / next(it)
            assert path.is_file() and path.is_relative_to(REPO_ROOT / "training" / "accelerate_configs"), path
            config = yaml.safe_load(path.read_text())
            assert config["distributed_type"] in ("MULTI_GPU", "FSDP", "MULTI_CPU", "NO"), config
        elif option == "--machine_rank":
            rank = int(next(it))
        elif option == "--num_machines":
            machines = int(next(it))
            assert machines >= 1
        elif option == "--num_processes":
            assert int(next(it)) >= 1
        elif option == "--mixed_precision":
            assert next(it) in ("no", "fp16", "bf16")
        elif option == "--main_process_ip":
            ipaddress.ip_address(next(it))
        elif option == "--main_process_port":
            assert 1 <= int(next(it)) < 65536
        else:
            assert option in ("--multi_gpu", "--cpu"), f"launcher option {option} not checked by the test"
    machines = machines or config.get("num_machines", 1)
    assert 0 <= rank < machines, (rank, machines)
    return machines, rank


def training_args(args: list[str], written: set[str]) -> list[str]:
    """TINY_TRAINING appended, keeping the run folder the command names (its default run name carries its
    `--preset`); `--overwrite_output_dir` for a default run folder an earlier command wrote."""
    from hf_variants.training.options import parse_args
    from hf_variants.training.train import RUNS_DIR, resolve_languages, run_name_for

    parsed = parse_args(args)
    name = run_name_for(parsed, resolve_languages(parsed)[1])
    folder = parsed.output_dir or str(RUNS_DIR / name)
    args = args + TINY_TRAINING + ([] if parsed.output_dir or parsed.run_name else ["--run_name", name])
    if folder in written and not parsed.output_dir:
        args.append("--overwrite_output_dir")
    written.add(folder)
    return args


@contextlib.contextmanager
def shell_streams(argv: list[str]):
    """`zcat FILE | COMMAND` and `COMMAND > FILE`: yields COMMAND with its standard input and output redirected
    (to real files: the commands read and write file descriptors, as they do on a pipe)."""
    with pytest.MonkeyPatch.context() as streams, contextlib.ExitStack() as files:
        if "|" in argv:
            cut = argv.index("|")
            assert argv[0] == "zcat" and cut == 2, f"pipe not handled by the test: {shlex.join(argv)}"
            unpacked = Path(argv[1]).with_suffix(".zcat")
            with gzip.open(argv[1], "rb") as f:
                unpacked.write_bytes(f.read())
            streams.setattr(sys, "stdin", files.enter_context(open(unpacked, encoding="utf-8")))
            argv = argv[cut + 1 :]
        if ">" in argv:
            cut = argv.index(">")
            assert cut == len(argv) - 2, f"redirection not handled by the test: {shlex.join(argv)}"
            streams.setattr(sys, "stdout", files.enter_context(open(argv[-1], "w", encoding="utf-8")))
            argv = argv[:cut]
        yield argv


BACKGROUND: list[subprocess.Popen] = []  # the `&` commands of a document still running


def run_in_shell(argv: list[str]) -> bool:
    """The server in the background, its SIGTERM and the curl commands that call it; False for any other command."""
    if argv[-1] == "&":  # a server in the background (the console script's module, in a real process)
        assert argv[0] == "hf-variants-serve" and SCRIPTS[argv[0]] == "hf_variants.commands.serve:cli", argv
        BACKGROUND.append(subprocess.Popen([sys.executable, "-m", "hf_variants.serve", *argv[1:-1]]))
        return True
    if argv == ["kill", "%1"]:
        process = BACKGROUND.pop()
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, f"the server exited with {process.returncode}"
        return True
    if argv[0] == "curl":
        assert shutil.which("curl"), "the guide's curl commands need curl"
        result = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, f"{shlex.join(argv)} exited with {result.returncode}: {result.stderr}"
        return True
    return False


LAUNCHED_COMMANDS = ("hf_variants.commands.translate", "hf_variants.commands.score")


def run_launch(options: list[str], module: str, args: list[str]) -> None:
    """`accelerate launch OPTIONS -m MODULE ARGS` for real, in the scratch folder (the working directory), on a free
    port; its processes see this checkout's package."""
    from test_training import free_port, subprocess_env

    command = [sys.executable, "-m", "accelerate.commands.launch", *options, "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    done = subprocess.run([*command, "-m", module, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, f"accelerate launch -m {module} exited with {done.returncode}: {done.stderr[-4000:]}"


def run_command(argv: list[str], monkeypatch, written: set[str], machines: dict) -> None:
    """Run one command of a document (see the module docstring); `machines`: the state of a launch over several
    machines, carried from command to command."""
    if run_in_shell(argv):
        return
    with shell_streams(argv) as argv:
        if argv[:2] == ["accelerate", "launch"]:
            script = next(i for i, a in enumerate(argv) if a == "-m" or a in CLONE_SCRIPTS)
            count, rank = check_launcher_options(argv[2:script])
            if count > 1:  # one command per machine, identical apart from the rank: checked, not run here
                i = argv.index("--machine_rank")
                same = argv[:i] + argv[i + 2 :]
                if rank == 0:
                    machines.update(command=same, next=1, count=count)
                else:
                    assert machines.get("command") == same and machines.get("next") == rank, (machines, argv)
                    machines["next"] += 1
                return
            if argv[script] == "-m" and argv[script + 1] in LAUNCHED_COMMANDS:
                run_launch(argv[2:script], argv[script + 1], argv[script + 2 :])
                return
            if argv[script] == "-m":
                assert argv[script + 1] == TRAIN_MODULE, argv
                assert SCRIPTS["hf-variants-train"].startswith(TRAIN_MODULE + ":")
                argv = ["hf-variants-train", *argv[script + 2 :]]
            else:
                assert argv[script] == "training/train.py", argv
                argv = ["python", *argv[script:]]
        if argv[0] == "hf-variants-train":
            argv = [argv[0], *training_args(argv[1:], written)]
        elif argv[:2] == ["python", "training/train.py"]:
            argv = argv[:2] + training_args(argv[2:], written)
        name, args = argv[0], argv[1:]
        if name == "python":
            run_python(argv, monkeypatch)
        elif name == "hf-variants-export-onnx":
            run_console_script(name, args + ["--no_shared_cache"], monkeypatch)
        elif name in SCRIPTS:
            run_console_script(name, args, monkeypatch)
        elif argv[:3] == ["pip", "install", "-e"] and len(argv) == 4:
            extras = re.fullmatch(r"\.\[([\w,-]+)\]", argv[3]).group(1).split(",")
            assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"]), extras
        elif argv[:2] == ["pip", "install"] and len(argv) == 3 and "==" in argv[2]:
            pinned = Requirement(argv[2])
            (version,) = (s.version for s in pinned.specifier)
            declared = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
            assert any(r.name == pinned.name and r.specifier.contains(version) for r in declared), argv
        else:
            raise AssertionError(f"the test does not know how to run this command: {shlex.join(argv)}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_document(path: Path, tmp_path: Path, monkeypatch, tokenizer) -> dict:
    """Every block of the document at `path`, in a scratch folder; returns the python namespace and the counts."""
    port = free_port()  # the docs' server port 8000, as a free one
    text = path.read_text(encoding="utf-8").replace("--port 8000", f"--port {port}")
    blocks = code_blocks(text.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    assert {b.lang for b in blocks} <= {"", "bash", "python"}, {b.lang for b in blocks}
    for block in blocks:  # listings, not commands
        if not block.lang:
            assert not re.search(r"^\s*(hf-variants|python|pip|accelerate|import|from)\b", block.code, re.M), block
    write_data(tmp_path / "data")
    write_own_files(tmp_path, tokenizer)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_guide_test_token")
    namespace: dict = {"__name__": "docs"}
    counts = {"bash": 0, "python": 0, "not run": {}, "namespace": namespace}
    written: set[str] = set()
    machines: dict = {}
    try:
        for block in blocks:
            where = f"{path.relative_to(REPO_ROOT)}:{block.line}"
            if block.lang == "python":
                reason = not_run(block, None)
                if reason is None:
                    exec(compile(block.code, where, "exec"), namespace)
                    counts["python"] += 1
                else:
                    counts["not run"].setdefault(reason, []).append(where)
            elif block.lang == "bash":
                commands = shell_commands(block.code)
                reasons = [not_run(block, argv) for argv in commands]  # checked before anything runs
                for argv, reason in zip(commands, reasons):
                    if reason is None:
                        run_command(argv, monkeypatch, written, machines)
                    else:
                        counts["not run"].setdefault(reason, []).append(where)
                counts["bash"] += any(reason is None for reason in reasons)
    finally:
        while BACKGROUND:
            process = BACKGROUND.pop()
            process.kill()
            process.wait()
    assert machines.get("next", 0) == machines.get("count", 0), machines  # every machine's command came
    return counts


# ------------------------------------------------------------------------------------------------------ tests
def test_every_code_block_of_the_user_guide_runs(tmp_path, monkeypatch, hub, tokenizer):  # noqa: F811
    ran = run_document(GUIDE, tmp_path, monkeypatch, tokenizer)
    assert not ran["not run"]
    # section 12: NLLB converted, pruned (its greedy translations of the text kept), fine-tuned, translated
    pruned = json.loads((tmp_path / "nllb-600M-en-fr" / "prune.json").read_text())
    assert pruned["languages"] == ["eng_Latn", "fra_Latn"] and pruned["tokenization_mismatches"] == 0
    assert pruned["vocab_size_after"] < pruned["vocab_size_before"]
    assert all(row["lines"] == 48 for row in pruned["translations"].values())
    assert json.loads((tmp_path / "mimo-from-nllb" / "config.json").read_text())["target_language_token"]
    tuned = json.loads((tmp_path / "runs" / "nllb-en-fr" / "model" / "config.json").read_text())
    assert tuned["languages"] == ["eng_Latn", "fra_Latn"] and tuned["language_token_ids"]
    assert (tmp_path / "hyp-nllb.fr").read_text().count("\n") == 8
    # what the blocks produced: a sample of the promised results
    results = json.loads((tmp_path / "runs" / "en-fr" / "results.json").read_text())
    assert results["train_pairs"] == 48
    assert (tmp_path / "hyp.fr").read_text().count("\n") == 8
    assert (tmp_path / "runs" / "en-fr-flat" / "model" / "config.json").is_file()
    namespace = ran["namespace"]
    assert namespace["results"]["train_pairs"] == 48  # train_on_datasets
    # the Seq2SeqTrainer section: BLEU and chrF from the generated translations, the plain cross-entropy
    assert {"eval_bleu", "eval_chrf", "eval_loss"} <= set(namespace["metrics"])
    # the fine-tuned model (the guide's later sections load another one into `model`), its validation rows
    model, collator = namespace["trainer"].model, namespace["collator"]
    validation = namespace["tokenized"]["validation"]
    plain = namespace["cross_entropy"](model, validation, collator)
    smoothed = namespace["cross_entropy"](model, validation, collator, label_smoothing=0.1)
    # eval_loss is the label-smoothed one (the 8 validation rows are one evaluation batch): equal to it, whatever the
    # (nearly untrained) model predicts, where "above the plain one" depended on how much it had learnt
    assert namespace["metrics"]["eval_loss"] == pytest.approx(smoothed["loss"], rel=1e-5)
    assert plain["tokens"] == smoothed["tokens"] > 0 and plain["perplexity"] == pytest.approx(math.exp(plain["loss"]))
    # back-translation: the reverse model's samples of the 16 French lines as a training corpus (tsv_pairs), beside
    # the 48 real pairs, tagged; their best checkpoints averaged
    synthetic = (tmp_path / "data" / "bt.tsv").read_text(encoding="utf-8").splitlines()
    mono = (tmp_path / "data" / "mono.fr").read_text(encoding="utf-8").splitlines()
    assert synthetic[0] == "fr\ten" and 0 < len(synthetic) - 1 <= 16
    assert all(line.split("\t")[0] in mono and len(line.split("\t")) == 2 for line in synthetic[1:])
    bt = json.loads((tmp_path / "runs" / "en-fr-bt" / "results.json").read_text())
    assert [(c["pairs"], c["tag"]) for c in bt["corpora"]] == [(48, None), (len(synthetic) - 1, "<BT>")]
    assert "(the best 2 by validation bleu" in (tmp_path / "runs" / "en-fr-bt-best2" / "README.md").read_text()
    # section 8: n-best lists, prefixes, alignments, the Python API
    nbest = [json.loads(line) for line in (tmp_path / "nbest.jsonl").read_text().splitlines()]
    assert len(nbest) == 8 and all(len(row["hypotheses"]) == 4 for row in nbest)
    prefixed = (tmp_path / "prefixed.fr").read_text().splitlines()
    assert len(prefixed) == 8 and all(line.startswith("Un homme") for line in prefixed[::2])
    assert all(" ||| " in line for line in (tmp_path / "aligned.fr").read_text().splitlines())
    assert [len(r.hypotheses) for r in namespace["translations"]] == [2, 2]
    for row in map(json.loads, (tmp_path / "sampled.jsonl").read_text().splitlines()):  # samples best first
        assert [h["score"] for h in row["hypotheses"]] == sorted((h["score"] for h in row["hypotheses"]), reverse=True)
    # large jobs: two processes, and three shards merged, each line translated
    for name in ("train.beam.fr", "train.shards.fr"):
        assert (tmp_path / name).read_text().count("\n") == 48 and not (tmp_path / f"{name}.work").exists()
    # reranking: tuned on the development set, applied to the test set
    assert (tmp_path / "valid.reranked.fr").read_text().count("\n") == 8
    assert set(json.loads((tmp_path / "rerank.json").read_text())["weights"]) == {
        "forward",
        "forward_log_prob",
        "length",
        "reverse",
    }
    assert (tmp_path / "test.reranked.fr").read_text().count("\n") == 8
    # distillation: the teacher's beam translations of the 48 training sources (2 processes), the student
    distilled = (tmp_path / "data" / "distilled.tsv").read_text(encoding="utf-8").splitlines()
    assert distilled[0] == "en\tfr" and 0 < len(distilled) - 1 <= 48
    student = json.loads((tmp_path / "runs" / "en-fr-student" / "results.json").read_text())
    assert [c["pairs"] for c in student["corpora"]] == [len(distilled) - 1, 48]
    assert (tmp_path / "student.fr").read_text().count("\n") == 8
    published = hub.files("my-org/en-fr-transformer")
    assert {"README.md", "config.json", "model.safetensors"} <= set(published)
    assert ran["bash"] >= 7 and ran["python"] >= 5
    served = namespace["answer"]["translations"]  # the server's n-best answer to the guide's Python client
    assert len(served) == 2 and all(len(item["hypotheses"]) == 2 for item in served)
    check_terminology(tmp_path, namespace)


def check_terminology(tmp_path: Path, namespace: dict) -> None:
    """Section 13: the glossary's terms and a request's own constraints through the translation core, the translate
    command and the server."""
    terminology, glossary = namespace["terminology"], namespace["glossary"]
    assert [len(r.constraints) for r in terminology] == [1, 2, 0, 2]
    for request, result in zip(namespace["requests"], terminology):
        assert result.constraints_met is (None if not result.constraints else not result.unmet_constraints)
        if result.constraints_met and request.source in namespace["sources"]:
            assert all(check.found for check in glossary.check(request.source, result.text))
    # ... from the command line: each line's own constraints, then its glossary terms' ("hat" -> "chapeau" once)
    from hf_variants.training.evaluation import term_accuracy

    rows = [json.loads(line) for line in (tmp_path / "terms.jsonl").read_text(encoding="utf-8").splitlines()]
    assert (
        len(rows) == 8 and rows[0]["constraints"] == [["chapeau"]] and rows[1]["constraints"] == [["herbe", "pelouse"]]
    )
    assert rows[0]["glossary"][0]["source"] == "hat" and all("glossary" in row for row in rows)
    assert [bool(row.get("constraints")) for row in rows] == [True, True, True, True, True, False, True, False]
    for row in rows:
        met = row["hypotheses"][0].get("constraints_met")
        assert row.get("unmet_constraints", []) == [
            c for c, ok in zip(row.get("constraints", []), met or []) if not ok
        ]
    summary = json.loads((tmp_path / "terms.json").read_text())
    assert summary["constrained_sentences"] == 6 and summary["constrained_num_beams"] == [6]
    assert summary["constraints_met_sentences"] + summary["unmet_constraints_sentences"] == 6
    texts = [row["hypotheses"][0]["text"] for row in rows]
    sources = (tmp_path / "data" / "test.en").read_text(encoding="utf-8").splitlines()
    assert summary["term_accuracy"] == term_accuracy(sources, texts, glossary)["term_accuracy"] and "bleu" in summary
    # ... over HTTP: the request's glossary ("park") over the server's ("people", "dog")
    item = namespace["terms_answer"]["translations"][0]
    assert [t["source"] for t in item["glossary"]] == ["people", "dog", "park"]
    assert item["constraints"] == [["personnes", "gens"], ["chien"], ["parc", "jardin"]]
    assert namespace["terms_answer"]["unmet_constraints"] == ([0] if item["unmet_constraints"] else [])


def test_every_code_block_of_the_readme_runs(tmp_path, monkeypatch, tokenizer):
    ran = run_document(REPO_ROOT / "README.md", tmp_path, monkeypatch, tokenizer)
    assert set(ran["not run"]) == {"venv", "suite", "hub"}, ran["not run"]
    assert json.loads((tmp_path / "runs" / "transformer_nmt-en-de" / "results.json").read_text())["train_pairs"] == 48
    assert json.loads((tmp_path / "mute-from-opus" / "config.json").read_text())["model_type"] == "mute_nmt"
    assert (tmp_path / "out.de").read_text().count("\n") == 8
    assert ran["bash"] >= 3 and ran["python"] >= 1


def test_every_code_block_of_the_training_readme_runs(tmp_path, monkeypatch, tokenizer):
    ran = run_document(REPO_ROOT / "training" / "README.md", tmp_path, monkeypatch, tokenizer)
    assert set(ran["not run"]) == {"recipe", "parses"}, ran["not run"]
    assert len(ran["not run"]["recipe"]) == 5
    assert (tmp_path / "runs" / "tied_nmt-en-de-bi" / "model" / "config.json").is_file()
    assert (tmp_path / "hyp.de").read_text().count("\n") == 8  # the last command: test.jsonl's 8 rows
    assert ran["namespace"]["metric"].name == "sacrebleu_chrf"
    assert ran["bash"] >= 4 and ran["python"] >= 1


def test_every_code_block_of_the_serving_page_runs(tmp_path, monkeypatch, tokenizer):
    """docs/serving.md, the operator's page: its server (on a tiny en -> de model saved where the page names the
    reader's model), probes, requests, paragraphs, the LibreTranslate mount, metrics and SIGTERM (exit status 0)."""
    import torch

    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), languages=["en", "de"], target_languages=["de"]
    )
    folder = tmp_path / "runs" / "en-de" / "model"
    TransformerNmtForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ran = run_document(REPO_ROOT / "docs" / "serving.md", tmp_path, monkeypatch, tokenizer)
    assert not ran["not run"] and ran["bash"] >= 6 and not BACKGROUND


def test_the_guide_lists_every_console_script():
    text = GUIDE.read_text(encoding="utf-8")
    assert set(SCRIPTS) == set(re.findall(r"^\| `(hf-variants-[\w-]+)` \|", text, re.M))
