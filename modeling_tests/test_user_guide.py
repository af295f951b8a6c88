"""docs/user-guide.md runs: every code block of the guide, in order, as a reader would paste them, so the guide
cannot rot.

How each block runs (the only changes the test makes, all listed here):

- **Scratch folder.** The blocks run in one temporary folder (the working directory) that holds `data/`: the first
  48 / 8 / 8 English-French pairs of the bundled Multi30k train / val / test_2016_flickr, as the guide describes
  them (TSV with an `en<TAB>fr` header, `{prefix}.{lang}` text files, JSONL `{"translation": ...}` rows).
- **python** blocks run with `exec` in one shared namespace (as one interactive session), in order.
- **bash** blocks: every command (backslash continuations joined) runs in this process through the function its
  console script names in pyproject.toml's `[project.scripts]` (what `hf-variants-X` runs once installed), with
  `sys.argv` set to the command's arguments; the command must not exit with a non-zero status.
  * Training commands get `TINY_TRAINING` appended (`--preset tiny --max_steps 2` and small evaluation settings):
    the guide's `--preset small/base/big` and long runs become a tiny model trained for 2 steps. The same holds
    for `accelerate launch [LAUNCHER OPTIONS] -m hf_variants.training.train ARGS`, which runs the module's command
    in this one process; the launcher options are checked, not executed: every `--config_file` must be one of the
    clone's accelerate configs and parse as YAML, `--machine_rank` must be below its `num_machines`.
  * `hf-variants-export-onnx` gets `--no_shared_cache` appended: two graphs (encoder, decoder step) instead of
    three, the shared-cache step graph being the slowest third of the export (the ONNX tests cover it).
  * `hf-variants-publish` uploads to the in-process Hub server of `conftest_hub` (`HF_ENDPOINT`, any token).
  * `pip install -e ".[EXTRAS]"` is not executed (no package installs in the suite): each extra must exist in
    pyproject.toml. The real install from a wheel is `test_new_user_paths.py::test_wheel_install_*`.
  * A command ending in `&` (the server: `hf-variants-serve ... &`) starts in the background as a real process
    (`python -m hf_variants.serve`, what the console script runs); `kill %1` sends it SIGTERM and its exit status
    must be 0. The guide's port 8000 becomes a free port the test picks, in every block (`--port 8000`,
    `127.0.0.1:8000`); the test stops a server still running at its end.
  * `curl` commands run the real `curl` against it, and must exit 0.
  * Any other command fails the test (add it to `run_command` with an honest way to run it).
- Blocks without a language are file listings, never commands (checked).
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import DATA_DIR, REPO_ROOT
from conftest_hub import hub  # noqa: F401

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

GUIDE = REPO_ROOT / "docs" / "user-guide.md"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
TRAIN_MODULE = "hf_variants.training.train"
TINY_TRAINING = [
    "--preset",
    "tiny",
    "--max_steps",
    "2",
    "--warmup_steps",
    "1",
    "--eval_steps",
    "0",
    "--eval_bleu_pairs",
    "4",
    "--num_beams",
    "1",
    "--max_len_b",
    "4",
    "--max_test_pairs",
    "4",
    "--num_examples",
    "0",
]
SPLITS = {"train": ("train", 48), "valid": ("val", 8), "test": ("test_2016_flickr", 8)}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def shell_commands(code: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", code)
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def write_data(folder: Path) -> None:
    folder.mkdir()
    for name, (split, n) in SPLITS.items():
        sides = {}
        for lang in ("en", "fr"):
            with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                sides[lang] = [line.rstrip("\n") for line in itertools.islice(f, n)]
            (folder / f"{name}.{lang}").write_text("\n".join(sides[lang]) + "\n", encoding="utf-8")
        pairs = list(zip(sides["en"], sides["fr"]))
        (folder / f"{name}.tsv").write_text("en\tfr\n" + "".join(f"{a}\t{b}\n" for a, b in pairs), encoding="utf-8")
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"translation": {"en": a, "fr": b}}, ensure_ascii=False) + "\n" for a, b in pairs),
            encoding="utf-8",
        )


def console_function(name: str):
    module, _, function = SCRIPTS[name].partition(":")
    return getattr(__import__(module, fromlist=[function]), function)


def run_console_script(name: str, args: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [name, *args])
    try:
        status = console_function(name)()
    except SystemExit as exit_:
        status = exit_.code
    assert status in (None, 0), f"{name} {shlex.join(args)} exited with {status!r}"


def check_launcher_options(options: list[str]) -> None:
    """`accelerate launch` options before `-m`: config files of the clone, a machine rank it has."""
    config = {}
    it = iter(options)
    for option in it:
        if option == "--config_file":
            path = REPO_ROOT / next(it)
            assert path.is_file() and path.is_relative_to(REPO_ROOT / "training" / "accelerate_configs"), path
            config = yaml.safe_load(path.read_text())
            assert config["distributed_type"] in ("MULTI_GPU", "FSDP", "MULTI_CPU", "NO"), config
        elif option == "--machine_rank":
            assert 0 <= int(next(it)) < config.get("num_machines", 1)
        elif option == "--num_processes":
            assert int(next(it)) >= 1
        else:
            assert option in ("--multi_gpu", "--cpu"), f"launcher option {option} not checked by the test"


BACKGROUND: list[subprocess.Popen] = []  # the `&` commands of the guide still running


def run_command(argv: list[str], monkeypatch) -> None:
    if argv[-1] == "&":  # a server in the background (the console script's module, in a real process)
        assert argv[0] == "hf-variants-serve" and SCRIPTS[argv[0]] == "hf_variants.serve.cli:cli", argv
        BACKGROUND.append(subprocess.Popen([sys.executable, "-m", "hf_variants.serve", *argv[1:-1]]))
        return
    if argv == ["kill", "%1"]:
        process = BACKGROUND.pop()
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, f"the server exited with {process.returncode}"
        return
    if argv[0] == "curl":
        assert shutil.which("curl"), "the guide's curl commands need curl"
        result = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, f"{shlex.join(argv)} exited with {result.returncode}: {result.stderr}"
        return
    name, args = argv[0], argv[1:]
    if argv[:2] == ["accelerate", "launch"]:
        m = args.index("-m")
        check_launcher_options(args[1:m])
        assert args[m + 1] == TRAIN_MODULE, args
        assert SCRIPTS["hf-variants-train"].startswith(TRAIN_MODULE + ":")
        name, args = "hf-variants-train", args[m + 2 :]
    if name == "hf-variants-train":
        run_console_script(name, args + TINY_TRAINING, monkeypatch)
    elif name == "hf-variants-export-onnx":
        run_console_script(name, args + ["--no_shared_cache"], monkeypatch)
    elif name in SCRIPTS:
        run_console_script(name, args, monkeypatch)
    elif argv[:3] == ["pip", "install", "-e"] and len(argv) == 4:
        extras = re.fullmatch(r"\.\[([\w,-]+)\]", argv[3]).group(1).split(",")
        assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"]), extras
    else:
        raise AssertionError(f"the test does not know how to run this guide command: {shlex.join(argv)}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_code_block_of_the_user_guide_runs(tmp_path, monkeypatch, hub):  # noqa: F811
    port = free_port()
    text = GUIDE.read_text(encoding="utf-8").replace("--port 8000", f"--port {port}")
    blocks = code_blocks(text.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    assert {lang for lang, _ in blocks} == {"", "bash", "python"}
    for lang, code in blocks:  # listings, not commands
        if not lang:
            assert not re.search(r"^\s*(hf-variants|python|pip|accelerate|import|from)\b", code, re.M), code
    write_data(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_guide_test_token")
    namespace: dict = {"__name__": "user_guide"}
    ran = {"bash": 0, "python": 0}
    try:
        for lang, code in blocks:
            if lang == "python":
                exec(compile(code, f"{GUIDE.name} block", "exec"), namespace)
            elif lang == "bash":
                for argv in shell_commands(code):
                    run_command(argv, monkeypatch)
            else:
                continue
            ran[lang] += 1
    finally:
        while BACKGROUND:
            process = BACKGROUND.pop()
            process.kill()
            process.wait()
    # what the blocks produced: a sample of the promised results
    results = json.loads((tmp_path / "runs" / "en-fr" / "results.json").read_text())
    assert results["train_pairs"] == 48
    assert (tmp_path / "hyp.fr").read_text().count("\n") == 8
    assert (tmp_path / "runs" / "en-fr-flat" / "model" / "config.json").is_file()
    assert namespace["results"]["train_pairs"] == 48  # train_on_datasets
    # section 8: n-best lists, prefixes, alignments, the Python API
    nbest = [json.loads(line) for line in (tmp_path / "nbest.jsonl").read_text().splitlines()]
    assert len(nbest) == 8 and all(len(row["hypotheses"]) == 4 for row in nbest)
    prefixed = (tmp_path / "prefixed.fr").read_text().splitlines()
    assert len(prefixed) == 8 and all(line.startswith("Un homme") for line in prefixed[::2])
    assert all(" ||| " in line for line in (tmp_path / "aligned.fr").read_text().splitlines())
    assert [len(r.hypotheses) for r in namespace["translations"]] == [2, 2]
    published = hub.files("my-org/en-fr-transformer")
    assert {"README.md", "config.json", "model.safetensors"} <= set(published)
    assert ran["bash"] >= 7 and ran["python"] >= 5
    served = namespace["answer"]["translations"]  # the server's n-best answer to the guide's Python client
    assert len(served) == 2 and all(len(item["hypotheses"]) == 2 for item in served)


def test_the_guide_lists_every_console_script():
    text = GUIDE.read_text(encoding="utf-8")
    assert set(SCRIPTS) == set(re.findall(r"^\| `(hf-variants-[\w-]+)` \|", text, re.M))
