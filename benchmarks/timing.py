"""Helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this folder is on `sys.path`):
interleaved runs, median kept, with a CPU-time or wall clock; peak memory of one call; a variant against the
baseline of the same dims (its config, a random batch, training and decoding speed); engines in processes of their
own; the decoding settings every speed benchmark uses; and `write_result`, which stamps a result JSON with where and
on what it was measured (`run_metadata`: commit, date, CPU model, library versions) and writes it atomically."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "transformers", "onnxruntime", "ctranslate2")

# process CPU time: robust on a shared machine (measures the work, not the waiting); wall: elapsed time
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def interleaved(fns: dict, reps: int, clock="cpu") -> dict:
    """Median seconds of each zero-argument function, runs interleaved (A, B, C, A, B, C, ...) after one warm-up
    each. `clock` is a name of CLOCKS or a clock function."""
    timer = CLOCKS[clock] if isinstance(clock, str) else clock
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = timer()
            fn()
            times[name].append(timer() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def baseline_config(config):
    """The baseline of the same dims as a variant's config: every field the two configs share (dims, norms,
    positions, dropout, vocabulary), the baseline's defaults for the rest."""
    from hf_variants import TransformerNmtConfig

    fields = TransformerNmtConfig().to_dict()
    return TransformerNmtConfig(
        **{
            k: v
            for k, v in config.to_dict().items()
            if k in fields and k not in ("model_type", "architectures", "auto_map")
        }
    )


def random_batch(batch: int, src_len: int, tgt_len: int, vocab: int, seed: int = 1) -> tuple[dict, torch.Tensor]:
    """Random token ids (no special tokens), source and target lengths from half to full, padding masked."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (batch, src_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for row in range(batch):
        attention_mask[row, src_len // 2 + row % (src_len // 2) :] = 0
    labels = torch.randint(4, vocab, (batch, tgt_len), generator=g)
    for row in range(batch):
        labels[row, tgt_len // 2 + row % (tgt_len // 2) :] = -100
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}, labels


def train_step(model, optimizer, inputs: dict, labels: torch.Tensor) -> None:
    """One optimizer step: forward with labels, backward, update."""
    model(**inputs, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def speed_vs_baseline(
    models: dict, labels: torch.Tensor, new_tokens: int, reps: int, clock: str = "cpu", key: str = ""
) -> dict:
    """A variant against the baseline of the same dims: training tokens/s (Adam, the target tokens of `labels`)
    and decoding tokens/s, greedy and beam 4 (length penalty 0.6), exactly `new_tokens` new tokens per sentence
    for both, each measured interleaved. `models` = {"baseline": (model, inputs), name: (model, inputs)}; returns
    `train_tok_s_<name>`, `greedy_tok_s_<name>`, `beam4_tok_s_<name>` for both and the `*_ratio`s (baseline time /
    variant time: > 1, the variant is faster), and prints them, each line headed by `key`."""
    (name,) = [n for n in models if n != "baseline"]
    row = {}

    def record(what: str, tokens: int, seconds: dict) -> None:
        for n in models:
            row[f"{what}_tok_s_{n}"] = round(tokens / seconds[n], 1)
        row[f"{what}_ratio"] = round(seconds["baseline"] / seconds[name], 3)
        print(
            f"{key:16s} {what:7s} "
            + " | ".join(f"{n} {tokens / seconds[n]:9.1f} tok/s" for n in models)
            + f" | ratio {row[f'{what}_ratio']:5.2f}x",
            flush=True,
        )

    optimizers = {n: torch.optim.Adam(m.parameters(), lr=1e-4) for n, (m, _) in models.items()}
    for model, _ in models.values():
        model.train()
    record(
        "train",
        int((labels != -100).sum()),
        interleaved(
            {n: (lambda n=n, m=m, x=x: train_step(m, optimizers[n], x, labels)) for n, (m, x) in models.items()},
            reps,
            clock,
        ),
    )
    for model, _ in models.values():
        model.eval()
    for beams in (1, 4):
        gen = dict(
            num_beams=beams,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **({"length_penalty": 0.6} if beams > 1 else {}),
        )
        lengths = {}

        def decode(n, m, x, gen=gen):
            with torch.inference_mode():
                lengths[n] = m.generate(**x, **gen).shape[1]

        seconds = interleaved(
            {n: (lambda n=n, m=m, x=x: decode(n, m, x)) for n, (m, x) in models.items()}, reps, clock
        )
        assert set(lengths.values()) == {new_tokens + 1}, lengths  # equal output lengths: tokens/s compare
        batch = next(iter(models.values()))[1]["input_ids"].shape[0]
        record("greedy" if beams == 1 else f"beam{beams}", batch * new_tokens, seconds)
    return row


def peak_memory_mb(fn) -> float:
    """Peak memory growth of `fn()` in MiB: CUDA allocator peak, or on the CPU the resident-set high-water mark of a
    forked child running `fn` minus its resident set at the start."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        try:
            with open("/proc/self/statm") as f:
                rss0 = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            fn()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            os.write(write, str((peak - rss0) / 2**20).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        value = f.read()
    os.waitpid(pid, 0)
    return float(value) if value else float("nan")


class EngineProcesses:
    """Engines each in a process of their own (in one process, torch's OpenMP pool and ONNX Runtime's threads spin
    against each other), called one at a time: `start(name, argv)` launches `argv` and waits for its first JSON line
    (built: one process builds at a time, none beside a timing); `call(name, request)` writes the request as a line
    and returns the JSON line it answers, then pauses `pause` seconds (idle threads stop spinning before the next
    engine runs). Use as a context manager: the processes end with it."""

    def __init__(self, pause: float = 0.0):
        self.pause, self.procs = pause, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            try:
                proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()

    def _reply(self, name: str) -> dict:
        line = self.procs[name].stdout.readline()
        if not line:
            raise RuntimeError(f"The worker process of engine {name} exited (its error is printed above).")
        return json.loads(line)

    def start(self, name: str, argv: list[str]) -> dict:
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self._reply(name)

    def call(self, name: str, request) -> dict:
        self.procs[name].stdin.write(f"{request}\n")
        self.procs[name].stdin.flush()
        answer = self._reply(name)
        time.sleep(self.pause)
        return answer


def generation_settings(beams: int, new_tokens: int) -> dict:
    """The benchmarks' decoding: exactly `new_tokens` new tokens, greedy or beam search with length penalty 0.6."""
    return dict(
        num_beams=beams,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **({"length_penalty": 0.6} if beams > 1 else {}),
    )


def cpu_model() -> str:
    """The CPU's model name as `lscpu` reports it (the processor string of `platform` where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run_metadata() -> dict:
    """Where and on what a result was measured: the checkout's commit (`uncommitted`: whether the package or the
    benchmarks differ from it), the UTC date, the CPU model and the versions of torch, transformers, onnxruntime and
    ctranslate2 (None where one is not installed)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    return {
        "commit": _git("rev-parse", "--short=7", "HEAD") or None,
        "uncommitted": bool(_git("status", "--porcelain", "--", "hf_variants", "benchmarks")),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "versions": versions,
    }


ABSOLUTE_PATH = re.compile(r"(?:^|(?<=[\s=(:'\"`]))/[^\s'\"`]+")


def _relative(match: re.Match) -> str:
    path = Path(match.group(0).rstrip(".,;:)"))
    tail = match.group(0)[len(str(path)) :]
    if path.is_relative_to(ROOT):
        return path.relative_to(ROOT).as_posix() + tail
    return Path(*path.parts[-2:]).as_posix() + tail


def portable(value):
    """`value` with every absolute path in its strings made relative: to the repository root where it lies inside it,
    else its last two components (a run's folder and its file): a result names no folder of the machine it ran on."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    if isinstance(value, str):
        return ABSOLUTE_PATH.sub(_relative, value)
    return value


def write_result(path: str | Path, record: dict, metadata: dict | None = None) -> dict:
    """Write `record` as JSON to `path`, atomically (a temporary file beside it, then renamed), headed by
    `"metadata"` (`run_metadata()` unless given) and with absolute paths made `portable`; returns what was written."""
    path = Path(path)
    body = portable({k: v for k, v in record.items() if k != "metadata"})
    written = {"metadata": metadata or run_metadata(), **body}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(json.dumps(written, indent=2) + "\n")
    os.replace(f.name, path)
    return written
