"""Sharded, resumable translation and scoring (hf_variants/commands/sharding.py) on a tiny trained baseline and a
few hundred lines in small units: the output of work units, of job-array shards merged and of a real two-process
`accelerate launch` (gloo, one thread each) is byte-identical to one process' for text, n-best JSON Lines with
scores, tsv_pairs and seeded samples, on torch, ONNX Runtime and CTranslate2, and for the scorer; the merge names
missing and damaged units; a changed input, model setting or unit size is refused naming it (`--allow_changed`
records it); SIGINT / SIGTERM drop the unit in progress and exit 130 / 143 with the line that says how to resume;
after a SIGKILL of one process of a launch the same command keeps the finished units (counted, untouched) and ends
with the same output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, read_sentences
from test_train_stops import sigint_as_at_a_terminal
from test_training import free_port
from trained_tiny import one_torch_thread, save_en_de_baseline

from hf_variants.commands import score, translate
from hf_variants.commands.common import refusals

LINES = 120
ONE = ["--no_progress", "--num_threads", "1", "--buffer_size", "10"]  # every run: 1 thread, buffers of 10 lines
UNITS = ["--unit_lines", "20"]
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO_ROOT),
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


one_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """The model folder, its ONNX Runtime export (the default graphs: the bound searches) and its CTranslate2
    export, and the input: 120 validation sentences with two empty lines."""
    root = tmp_path_factory.mktemp("sharded")
    model = save_en_de_baseline(tokenizer, root / "model")
    out = {"torch": root / "model", "root": root}
    if _has("onnxruntime"):
        from hf_variants.onnx.export import export

        export(model, tokenizer, root / "onnx", progress=False)
        out["onnx"] = root / "onnx"
    if _has("ctranslate2"):
        from hf_variants.deploy.ctranslate2 import export

        export(model, tokenizer, root / "ct2")
        out["ctranslate2"] = root / "ct2"
    sources = read_sentences("en", "val", n=LINES)
    sources[7] = sources[61] = ""
    out["input"] = write(root / "src.en", sources)
    out["target"] = write(root / "tgt.de", read_sentences("de", "val", n=LINES))
    return out


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def translate_args(folders, engine: str, output: Path, *extra) -> list[str]:
    model = ["--model", str(folders[engine])] + (["--tokenizer", str(folders["torch"])] if engine == "onnx" else [])
    return [*model, "--input", str(folders["input"]), "--output", str(output), *ONE, *extra]


def shards_then_merge(main, args: list[str], shards: int = 3) -> dict:
    for i in range(shards):
        assert main([*args, *UNITS, "--num_shards", str(shards), "--shard_index", str(i)]) is None
    return main([*args, *UNITS, "--num_shards", str(shards), "--merge"])


CASES = {
    "torch-text": ("torch", ["--num_beams", "1"]),
    "torch-nbest": ("torch", ["--nbest", "2", "--num_beams", "2", "--scores"]),
    "torch-pairs": ("torch", ["--num_beams", "2", "--output_format", "tsv_pairs", "--src_lang", "en"]),
    "torch-samples": ("torch", ["--do_sample", "--seed", "4", "--nbest", "2", "--top_k", "20", "--max_len_b", "8"]),
    "onnx-text": ("onnx", ["--num_beams", "2"]),
    "onnx-nbest": ("onnx", ["--nbest", "2", "--num_beams", "2"]),
    "ctranslate2-text": ("ctranslate2", ["--num_beams", "1"]),
    "ctranslate2-nbest": ("ctranslate2", ["--nbest", "2", "--num_beams", "2"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_units_and_merged_shards_equal_one_process(folders, tmp_path, case):
    engine, flags = CASES[case]
    if engine not in folders:
        pytest.skip(f"the {engine} engine is not installed")
    plain = translate.main(translate_args(folders, engine, tmp_path / "plain", *flags))
    units = translate.main(translate_args(folders, engine, tmp_path / "units", *flags, *UNITS))
    merged = shards_then_merge(translate.main, translate_args(folders, engine, tmp_path / "shards", *flags))
    expected = (tmp_path / "plain").read_bytes()
    assert (tmp_path / "units").read_bytes() == expected and (tmp_path / "shards").read_bytes() == expected
    assert units["work"]["units"] == 6 and units["work"]["units_translated"] == 6
    assert merged["work"]["units_kept"] == 6 and merged["work"]["units_translated"] == 0
    for key in ("sentences", "empty_inputs", "too_long_lines", "truncated_lines", "pairs"):
        assert plain.get(key) == units.get(key) == merged.get(key), key
    assert not (tmp_path / "units.work").exists() and not (tmp_path / "shards.work").exists()


@pytest.mark.parametrize("nbest", [False, True])
def test_the_scorer_in_units_and_shards_equals_one_process(folders, tmp_path, nbest):
    if nbest:
        translate.main(translate_args(folders, "torch", tmp_path / "nbest.jsonl", "--nbest", "3", "--num_beams", "3"))
        inputs = ["--nbest_input", str(tmp_path / "nbest.jsonl")]
    else:
        inputs = ["--source", str(folders["input"]), "--target", str(folders["target"])]
    args = ["--model", str(folders["torch"]), *inputs, *ONE, "--token_scores"]
    plain = score.main([*args, "--output", str(tmp_path / "plain.jsonl")])
    units = score.main([*args, "--output", str(tmp_path / "units.jsonl"), *UNITS])
    merged = shards_then_merge(score.main, [*args, "--output", str(tmp_path / "shards.jsonl")])
    expected = (tmp_path / "plain.jsonl").read_bytes()
    assert (tmp_path / "units.jsonl").read_bytes() == expected == (tmp_path / "shards.jsonl").read_bytes()
    for key in ("sentences", "scored", "tokens", "log_prob", "ppl"):
        assert plain[key] == units[key] == merged[key], key


def test_the_merge_names_missing_and_damaged_units(folders, tmp_path):
    args = translate_args(folders, "torch", tmp_path / "out.de", "--num_beams", "1", *UNITS, "--num_shards", "3")
    for i in (0, 1):
        translate.main([*args, "--shard_index", str(i)])
    with pytest.raises(refusals()) as error:
        translate.main([*args, "--merge"])
    message = str(error.value)
    assert "2 of the 6 units are not done" in message
    assert "unit 2 (lines 41-60): missing; unit 5 (lines 101-120): missing" in message
    assert not (tmp_path / "out.de").exists()
    translate.main([*args, "--shard_index", "2"])
    part = tmp_path / "out.de.work" / "unit_000003.part"
    data = bytearray(part.read_bytes())
    data[0] = ord("X") if data[0] != ord("X") else ord("Y")
    part.write_bytes(bytes(data))  # the same size, another content
    with pytest.raises(refusals(), match=r"unit 3 \(lines 61-80\): its part's SHA-256 differs from its record's"):
        translate.main([*args, "--merge"])
    assert not (tmp_path / "out.de").exists() and not list(tmp_path.glob(".out.de.tmp-*"))


def test_a_changed_input_model_setting_or_unit_size_is_refused_naming_it(folders, tmp_path):
    source = write(tmp_path / "src.en", folders["input"].read_text(encoding="utf-8").splitlines())
    args = ["--model", str(folders["torch"]), "--input", str(source), "--output", str(tmp_path / "o"), *ONE]
    args += ["--num_beams", "1", "--num_shards", "2"]
    translate.main([*args, *UNITS, "--shard_index", "0"])
    text = source.read_text(encoding="utf-8")
    source.write_text(text.replace("A", "B", 1), encoding="utf-8")  # the same path and size, another line
    with pytest.raises(refusals()) as error:
        translate.main([*args, "--shard_index", "1"])  # --unit_lines from the work folder
    assert f"--input {source.resolve()} (sha256): sha256 " in str(error.value)
    assert "pass --allow_changed to keep its 3 finished units" in str(error.value)
    with pytest.raises(refusals(), match=r"--num_beams: 1 then, 2 now"):
        translate.main([*args[:-4], "--num_beams", "2", "--num_shards", "2", "--shard_index", "1"])
    with pytest.raises(refusals(), match=r"--unit_lines: 20 then, 30 now.*give another --work_dir"):
        translate.main([*args, "--unit_lines", "30", "--shard_index", "1", "--allow_changed"])
    translate.main([*args, "--shard_index", "1", "--allow_changed"])
    manifest = json.loads((tmp_path / "o.work" / "manifest.json").read_text())
    (override,) = manifest["overrides"]
    assert {c["field"] for c in override["changes"]} == {"inputs.--input.sha256"}
    assert manifest["inputs"]["--input"]["sha256"] == override["changes"][0]["now"]


# ------------------------------------------------------------------------------------------- real processes
GATED = REPO_ROOT / "modeling_tests" / "gated_command.py"


class gated:
    """A command run through gated_command.py: it holds still inside the unit after the first `after` units of
    `work` are done, until a signal stops it (the environment to run it with: `env`)."""

    def __init__(self, work: Path, after: int, folder: Path):
        folder.mkdir()
        self.folder = folder
        self.env = dict(ENV, GATE_WORK=str(work), GATE_AFTER=str(after), GATE_DIR=str(folder))

    def wait_blocked(self, procs, processes: int = 1, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while len(list(self.folder.glob("blocked.*"))) < processes:
            assert time.time() < deadline, "the command did not reach its gate in time"
            assert all(p.poll() is None for p in procs), "a process ended before its gate"
            time.sleep(0.02)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (/proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_sigint_and_sigterm_drop_the_unit_in_progress_and_the_rerun_resumes(folders, tmp_path):
    translate.main(translate_args(folders, "torch", tmp_path / "plain.de", "--num_beams", "2"))
    output, work = tmp_path / "out.de", tmp_path / "out.de.work"
    command = [sys.executable, "-m", "hf_variants.commands.translate"]
    command += translate_args(folders, "torch", output, "--num_beams", "2", "--unit_lines", "10")
    kept: dict = {}
    for sig, status, records in ((signal.SIGINT, 130, 2), (signal.SIGTERM, 143, 5)):
        gate = gated(work, records, tmp_path / f"gate-{sig.name}")
        proc = subprocess.Popen(
            [sys.executable, str(GATED), *command[2:]],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=gate.env,
            cwd=tmp_path,
            preexec_fn=sigint_as_at_a_terminal,
        )
        gate.wait_blocked([proc])  # in the unit after the first `records`, held still
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == status
        last = proc.stderr.read().decode().strip().splitlines()[-1]
        done = len(list(work.glob("unit_*.json")))
        assert done == records  # the unit held at the gate was dropped
        assert last == (
            f"hf-variants-translate: stopped by {sig.name}: {done} of the 12 units are done in {work} (a unit in "
            "progress was dropped); run the same command again to resume: the finished units are kept"
        )
        assert not list(work.glob(".*.tmp-*")) and not output.exists()
        kept = {p.name: p.stat().st_mtime_ns for p in work.glob("unit_*")}
    result = subprocess.run(command + ["--keep_work_dir"], capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert output.read_bytes() == (tmp_path / "plain.de").read_bytes()
    summary = json.loads(result.stdout)
    assert (
        summary["work"]["units_kept"] == len(kept) // 2 and summary["work"]["units_translated"] == 12 - len(kept) // 2
    )
    assert all(work.joinpath(name).stat().st_mtime_ns == mtime for name, mtime in kept.items())


def launch(module: str, args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """`accelerate launch` of `module` (or of a script: a path ending in .py) as 2 CPU processes (gloo) on a free
    port."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(free_port())]
    command += [module, *args] if module.endswith(".py") else ["-m", module, *args]
    log = open(cwd / "launch.log", "a")  # noqa: SIM115 - closed by finish()
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or ENV, cwd=cwd)


def finish(proc: subprocess.Popen, cwd: Path, timeout: float = 420) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
        proc.stdout and proc.stdout.close()


def records(work: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(work.glob("unit_*.json"))}


@pytest.mark.parametrize(
    "module, engine, flags",
    [
        ("hf_variants.commands.translate", "torch", ["--nbest", "2", "--num_beams", "2", "--scores"]),
        ("hf_variants.training.translate", "onnx", ["--num_beams", "2"]),  # the launcher path of earlier releases
        ("hf_variants.commands.score", "torch", []),
    ],
)
def test_two_processes_of_an_accelerate_launch_equal_one_process(folders, tmp_path, module, engine, flags):
    if engine not in folders:
        pytest.skip(f"the {engine} engine is not installed")
    if module.endswith("score"):
        args = [
            "--model",
            str(folders["torch"]),
            "--source",
            str(folders["input"]),
            "--target",
            str(folders["target"]),
        ]
        args += ONE
        score.main([*args, "--output", str(tmp_path / "plain")])
        args += ["--output", str(tmp_path / "out")]
    else:
        translate.main(translate_args(folders, engine, tmp_path / "plain", *flags))
        args = translate_args(folders, engine, tmp_path / "out", *flags)
    proc = launch(module, [*args, *UNITS, "--keep_work_dir"], tmp_path)
    assert finish(proc, tmp_path) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    assert (tmp_path / "out").read_bytes() == (tmp_path / "plain").read_bytes()
    done = records(tmp_path / "out.work")
    assert len(done) == 6 and {r["process"] for r in done.values()} == {0, 1}  # both processes took units


def test_sigkill_of_one_process_then_the_same_command_resumes(folders, tmp_path):
    translate.main(translate_args(folders, "torch", tmp_path / "plain.de", "--num_beams", "2"))
    args = translate_args(folders, "torch", tmp_path / "out.de", "--num_beams", "2", "--unit_lines", "10")
    work = tmp_path / "out.de.work"
    gate = gated(work, 3, tmp_path / "gate")
    proc = launch(str(GATED), ["hf_variants.commands.translate", *args, "--keep_work_dir"], tmp_path, gate.env)
    try:
        gate.wait_blocked([proc], processes=2)  # both processes held in a unit once 3 units are done
        workers = [p for p in descendants(proc.pid) if "hf_variants.commands.translate" in command_line(p)]
        workers = [p for p in workers if "accelerate.commands.launch" not in command_line(p)]
        assert len(workers) == 2, [command_line(p) for p in workers]
        os.kill(workers[1], signal.SIGKILL)
    finally:
        status = finish(proc, tmp_path)
    assert status != 0
    before = records(work)
    assert 3 <= len(before) <= 4 and not (tmp_path / "out.de").exists()  # a unit finishing as the gate closed: 4
    mtimes = {name: (work / name).stat().st_mtime_ns for name in before}
    proc = launch("hf_variants.commands.translate", [*args, "--keep_work_dir", "--results_json", "r.json"], tmp_path)
    assert finish(proc, tmp_path) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    assert (tmp_path / "out.de").read_bytes() == (tmp_path / "plain.de").read_bytes()
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["work"]["units_kept"] == len(before)
    assert summary["work"]["units_translated"] == 12 - len(before)
    after = records(work)
    assert all(after[name] == record for name, record in before.items())  # kept, not redone
    assert all((work / name).stat().st_mtime_ns == mtime for name, mtime in mtimes.items())
    assert (
        f"{len(before)} of the 12 units were done before and are kept; {12 - len(before)} to do"
        in (tmp_path / "launch.log").read_text()
    )


def test_the_sharding_flags_are_checked_before_anything_loads(folders, tmp_path, monkeypatch):
    def no_loading(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(translate, "load_translator", no_loading)
    base = ["--model", str(folders["torch"]), "--input", str(folders["input"]), "--no_progress"]
    out = ["--output", str(tmp_path / "o.de")]
    for args, message in (
        ([*base[:2], "--input", "-", *out, "--unit_lines", "10"], "--input -: sharded and resumable runs read"),
        ([*base, "--output", "-", "--num_shards", "2", "--shard_index", "0"], "--output -: sharded"),
        ([*base, *out, "--num_shards", "2"], r"give this task's --shard_index \(0 to 1\)"),
        ([*base, *out, "--num_shards", "2", "--shard_index", "2"], "--shard_index 2: expected 0 to 1"),
        ([*base, *out, "--unit_lines", "15", "--buffer_size", "10"], "--unit_lines 15 is not a multiple of"),
        (
            [*base, "--output", str(tmp_path / "w" / "o.de"), "--work_dir", str(tmp_path / "w")],
            "lies inside --work_dir",
        ),
        ([*base, *out, "--work_dir", str(folders["root"])], "--work_dir"),
        ([*base, *out, "--merge"], "no work folder here"),
    ):
        with pytest.raises(refusals(), match=message):
            translate.main(args)
