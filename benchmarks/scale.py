#!/usr/bin/env python
"""WMT-size corpora on one machine: time to the first step, peak memory per process, the second rank's
unique memory, tokenization throughput and the cache's size, for synthetic corpora of distinct pairs.

Corpora: every line joins two sentences of the bundled Multi30k training set (line i: sentence a and sentence
a + k, a = i mod 29000, k = 1 + i div 29000), so all lines are distinct and about as long as WMT sentences (~26
tokens); 450k, 4.5M and 40M pairs (plain text, written once into --work_dir). Validation: the bundled val set (50
pairs); no test set (the final evaluation translates the 50 validation pairs greedily).

For each corpus, `training/train.py` runs 3 steps of the tiny preset (the model is not what is measured):

- `first`: a first launch (empty cache, the tokenizer trained on --tokenizer_sample_lines sentences);
- `relaunch`: a new run folder with the same cache and `--tokenizer` the first run's `model/` folder (what a user
  relaunching from a trained model passes: its tokenizer.json carries padding settings and `model_max_length`, which
  must not change the cache key);
- `2proc`: `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU) into a new run folder, the first run's
  `tokenizer/` and the same cache: the second rank memory-maps what the first built.

Each process is sampled every 0.5 s: peak RSS (the kernel's VmHWM), split by the largest samples of its two parts
(anonymous memory: heap, Python objects, tensors; mapped: pages of memory-mapped files such as the Arrow cache,
which the kernel can drop and processes share), and the USS (unique set size: memory no other process shares) of
the second rank. Time to the first step is when log.jsonl gets step 1.

Run it on a quiet machine (nothing else running: the numbers are wall times and memory of a 2-core box). After
(this code) and before (the code before the Arrow pipeline: main at 4652af5, exported once with `git archive`):

    mkdir -p ../before && git archive 4652af5 | tar -x -C ../before
    python benchmarks/scale.py --sizes 450k 4.5M 40M --work_dir ../scale                 # after
    python benchmarks/scale.py --sizes 450k 4.5M --work_dir ../scale --code_dir ../before
    python benchmarks/scale.py --report     # RESULTS.md section "scale", results/scale.md, results/scale.png

Results go to benchmarks/results/scale.json (`--results`), one record per (size, run, version), replaced when
rerun. `--code_dir DIR` runs the same commands with the code in DIR (PYTHONPATH=DIR, DIR/training/train.py) and
records them as version "before" (`--version` to name it otherwise). A run whose processes together exceed
`--rss_limit_gb` (default 20) is killed and recorded as such: the old code on 4.5M distinct pairs reached 24 GB
and would otherwise take the machine down; 40M "before" is pointless for the same reason. The
corpora need disk: about 0.12 / 1.2 / 11 GB for 450k / 4.5M / 40M pairs (266 bytes a pair), plus the cache
(reported).

    python benchmarks/scale.py --sizes 2k --work_dir scale-smoke --smoke   # a quick check of the script (tiny
                                                                            # vocabulary; JSON, table, plot there)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import run_metadata, write_result

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT / "training" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
SIZES = {"2k": 2_000, "450k": 450_000, "4.5M": 4_500_000, "40M": 40_000_000}


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def make_corpus(folder: Path, pairs: int) -> Path:
    """train.en / train.de with `pairs` distinct lines (two bundled sentences each), plus val.* (the bundled
    validation set); written once (a `.done` marker)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / ".done").is_file():
        return folder
    t0 = time.time()
    for lang in ("en", "de"):
        sents = read(MULTI30K / f"train.{lang}.gz")
        n = len(sents)
        if pairs > n * (n - 1):
            raise ValueError(f"at most {n * (n - 1)} distinct pairs")
        with open(folder / f"train.{lang}", "w", encoding="utf-8") as f:
            done = 0
            k = 1
            while done < pairs:
                m = min(n, pairs - done)
                f.write("\n".join(f"{sents[a]} {sents[(a + k) % n]}" for a in range(m)) + "\n")
                done += m
                k += 1
        with (
            gzip.open(MULTI30K / f"val.{lang}.gz", "rt", encoding="utf-8") as src,
            open(folder / f"val.{lang}", "w", encoding="utf-8") as dst,
        ):
            dst.writelines(line for _, line in zip(range(50), src))
    (folder / ".done").write_text(json.dumps({"pairs": pairs, "seconds": time.time() - t0}))
    return folder


def descendants(pid: int):
    import psutil

    try:
        proc = psutil.Process(pid)
        return [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def is_train_script(proc) -> bool:
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - a process that ended
        return False
    return any(a.endswith("train.py") for a in cmd[1:3]) and not any("accelerate" in a for a in cmd[:3])


def rank_of(proc) -> int | None:
    """The rank of a train.py process (its RANK); None for the launcher and for worker processes forked by a
    train.py process (e.g. datasets' map workers, which share its command line)."""
    if not is_train_script(proc):
        return None
    try:
        if is_train_script(proc.parent()):
            return None
        return int(proc.environ().get("RANK", 0))
    except Exception:  # noqa: BLE001
        return None


def status(pid: int) -> dict[str, int]:
    """Memory fields of /proc/PID/status in bytes: VmRSS, VmHWM (peak RSS), RssAnon (private and anonymous: the
    heap, Python objects, tensors) and RssFile (pages of mapped files, e.g. a memory-mapped Arrow cache: page cache
    the kernel can drop and other processes share)."""
    out = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def rss(pid: int) -> int:
    return status(pid).get("VmRSS", 0)


def kill_tree(proc) -> None:
    for p in reversed(descendants(proc.pid)):
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass


def run(cmd: list[str], run_dir: Path, env: dict, timeout: float, rss_limit_gb: float) -> dict:
    """Run a train.py command; sample memory every 0.5 s; time to step 1 (log.jsonl) and to the end. The whole
    process tree is killed after `timeout` seconds or when its processes together hold more than `rss_limit_gb`."""
    import psutil

    t0 = time.time()
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    peak: dict[int, int] = {}  # pid -> VmHWM
    peak_anon: dict[int, int] = {}  # pid -> largest RssAnon sampled
    peak_file: dict[int, int] = {}  # pid -> largest RssFile sampled
    ranks: dict[int, int] = {}  # pid -> rank (train.py processes)
    uss_rank1, uss_rank1_at_step, first_step = 0, None, None
    last_uss = 0.0
    killed = None
    while proc.poll() is None:
        if time.time() - t0 > timeout:
            killed = f"timeout after {timeout:.0f} s"
            kill_tree(proc)
            break
        procs = descendants(proc.pid)
        total = sum(rss(p.pid) for p in procs)
        if total > rss_limit_gb * 2**30:
            killed = f"killed at {total / 2**30:.1f} GB resident (--rss_limit_gb {rss_limit_gb:g})"
            kill_tree(proc)
            break
        for p in procs:
            if p.pid not in ranks:
                r = rank_of(p)
                if r is not None:
                    ranks[p.pid] = r
            mem = status(p.pid)
            peak[p.pid] = max(peak.get(p.pid, 0), mem.get("VmHWM", 0))
            peak_anon[p.pid] = max(peak_anon.get(p.pid, 0), mem.get("RssAnon", 0))
            peak_file[p.pid] = max(peak_file.get(p.pid, 0), mem.get("RssFile", 0))
        if time.time() - last_uss > 1.0:
            last_uss = time.time()
            for p in procs:
                if ranks.get(p.pid) == 1:
                    try:
                        uss_rank1 = max(uss_rank1, p.memory_full_info().uss)
                    except psutil.Error:
                        pass
        if first_step is None and (run_dir / "log.jsonl").is_file():
            if any(json.loads(x).get("step") == 1 for x in (run_dir / "log.jsonl").read_text().splitlines() if x):
                first_step = time.time() - t0
                for p in procs:
                    if ranks.get(p.pid) == 1:
                        try:
                            uss_rank1_at_step = p.memory_full_info().uss
                        except psutil.Error:
                            pass
        time.sleep(0.5)
    wall = time.time() - t0
    proc.wait()
    log.close()
    out = (run_dir.parent / f"{run_dir.name}.out").read_text(errors="replace")
    train_procs = {pid: peak.get(pid, 0) for pid in ranks}
    workers = {pid: v for pid, v in peak.items() if pid not in ranks and pid != proc.pid}
    result = {
        "returncode": proc.returncode,
        "wall_sec": round(wall, 1),
        "first_step_sec": round(first_step, 1) if first_step else None,
        "peak_rss_gb_per_rank": {
            str(ranks[p]): round(v / 2**30, 3) for p, v in sorted(train_procs.items(), key=lambda x: ranks[x[0]])
        },
        "peak_rss_gb_other_processes": round(max(workers.values(), default=0) / 2**30, 3),
        # sampled every 0.5 s (VmHWM is the kernel's exact peak of their sum at one moment)
        "peak_anon_gb_per_rank": {
            str(ranks[p]): round(peak_anon.get(p, 0) / 2**30, 3) for p in sorted(train_procs, key=lambda q: ranks[q])
        },
        "peak_file_gb_per_rank": {
            str(ranks[p]): round(peak_file.get(p, 0) / 2**30, 3) for p in sorted(train_procs, key=lambda q: ranks[q])
        },
        "uss_gb_rank1": round(uss_rank1 / 2**30, 3) if uss_rank1 else None,
        "uss_gb_rank1_at_first_step": round(uss_rank1_at_step / 2**30, 3) if uss_rank1_at_step else None,
    }
    m = re.search(
        r"Tokenized \S+/train: (\d+) rows x (\d+) languages in ([\d.]+) s \((\d+) sentences/s, (\d+) "
        r"worker",
        out,
    )
    if m:
        result["tokenized_sentences_per_sec"] = int(m.group(4))
        result["tokenize_sec"] = float(m.group(3))
        result["tokenize_workers"] = int(m.group(5))
    m = re.search(r"Read \S+/train: (\d+) rows in ([\d.]+) s", out)
    if m:
        result["read_sec"] = float(m.group(2))
    m = re.search(r"Tokenizer trained in ([\d.]+) s", out)
    if m:
        result["tokenizer_train_sec"] = float(m.group(1))
    m = re.search(r"Training a shared .*? on (.*?) \[", out)
    if m:
        result["tokenizer_sample"] = m.group(1)
    m = re.search(r"ready in ([\d.]+) s\)", out)
    if m:
        result["data_ready_sec"] = float(m.group(1))
    if killed:
        result["killed"] = killed
    if proc.returncode != 0:
        result["error_tail"] = out[-3000:]
    return result


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def train_cmd(
    code: Path, data: Path, out: Path, cache: Path, steps: int, processes: int, tokenizer: Path | None, smoke: bool
) -> list[str]:
    args = [
        "--data_dir",
        str(data),
        "--valid_prefix",
        "val",
        "--test_prefix",
        "",
        "--preset",
        "tiny",
        "--max_steps",
        str(steps),
        "--logging_steps",
        "1",
        "--eval_steps",
        "1000",
        "--eval_bleu_pairs",
        "0",
        "--num_beams",
        "1",
        "--max_len_b",
        "5",
        "--output_dir",
        str(out),
        "--num_examples",
        "0",
        "--warmup_steps",
        "1",
    ]
    if (code / "training" / "data_pipeline.py").is_file():  # not in the code before the Arrow pipeline
        args += ["--data_cache_dir", str(cache)]
    if smoke:
        args += ["--vocab_size", "1000"]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    script = str(code / "training" / "train.py")
    if processes == 1:
        return [sys.executable, script] + args
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(29500 + os.getpid() % 1000),
        script,
    ] + args


def measure(args) -> None:
    results_path = Path(args.results)
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": []}
    work = Path(args.work_dir)
    code = Path(args.code_dir).resolve() if args.code_dir else ROOT
    if not (code / "training" / "train.py").is_file():
        raise SystemExit(f"--code_dir {code}: no training/train.py there")
    version = args.version or ("before" if args.code_dir else "after")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(code)
    env.setdefault("HF_HUB_OFFLINE", "1")
    for size in args.sizes:
        pairs = SIZES[size]
        t0 = time.time()
        data = make_corpus(work / f"corpus-{size}", pairs)
        print(f"[{size}] corpus ready ({time.time() - t0:.0f} s): {data}", flush=True)
        cache = work / f"cache-{size}-{version}"
        runs_dir = work / f"runs-{size}-{version}"
        if "first" in args.runs:
            shutil.rmtree(cache, ignore_errors=True)
        tokenizers = {"relaunch": runs_dir / "first" / "model", "2proc": runs_dir / "first" / "tokenizer"}
        for name in args.runs:
            out = runs_dir / name
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            processes = 2 if name == "2proc" else 1
            load = os.getloadavg()
            cmd = train_cmd(code, data, out, cache, args.steps, processes, tokenizers.get(name), args.smoke)
            print(f"[{size}] {name}: load average {load[0]:.2f} — {' '.join(cmd)}", flush=True)
            result = run(cmd, out, env, args.timeout, args.rss_limit_gb)
            commit = (
                subprocess.run(
                    ["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
                ).stdout.strip()
                or None
            )  # None: an exported tree (git archive)
            result.update(
                size=size,
                pairs=pairs,
                run=name,
                version=version,
                code=str(code),
                commit=commit,
                processes=processes,
                load_avg_1min_before=round(load[0], 2),
                command=" ".join(cmd),
                cache_gb=round(du(cache) / 2**30, 3),
                date=time.strftime("%Y-%m-%d %H:%M:%S"),
                metadata=run_metadata(),
            )
            if version == "after" and cache.exists():
                result["cache_gb_by_stage"] = {
                    stage: round(sum(du(p) for p in cache.glob(f"{stage}-*")) / 2**30, 3)
                    for stage in ("rows", "measured", "pairs")
                }
            print(json.dumps(result, indent=1), flush=True)
            results["runs"] = [
                r for r in results["runs"] if (r["size"], r["run"], r["version"]) != (size, name, version)
            ] + [result]
            write_result(results_path, results)


# ------------------------------------------------------------------------------------------------ report
REPORTED_BEFORE = [  # measured with the code before the pipeline (a 24 GB machine, 2026-11-24)
    {
        "size": "4.5M",
        "pairs": 4_500_000,
        "run": "first",
        "version": "before (24 GB machine)",
        "wall_sec": 476,
        "first_step_sec": None,
        "peak_rss_gb_per_rank": {"0": 24.0},
        "note": "killed by the OOM killer at 24 GB after 7 min 56 s, still training the tokenizer",
    },
]


def report(results_path: Path) -> None:
    """The table (results/scale.md next to the JSON and, for the standard results file, RESULTS.md's "scale"
    section) and the plot (scale.png next to the JSON): peak RSS and time to the first step against corpus size,
    before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import write_section

    runs = json.loads(results_path.read_text())["runs"] + REPORTED_BEFORE
    order = {s: i for i, s in enumerate(SIZES)}
    runs.sort(key=lambda r: (order[r["size"]], r["version"], ["first", "relaunch", "2proc"].index(r["run"])))
    lines = [
        "| corpus | code | run | first step (s) | wall, 3 steps (s) | peak RSS per process (GB) | rank 1 USS (GB) "
        "| tokenization (sentences/s) | cache (GB) | load avg | note |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        rss = ", ".join(f"{v:.2f}" for v in r.get("peak_rss_gb_per_rank", {}).values())
        if r.get("peak_anon_gb_per_rank"):
            rss += (
                " [anon "
                + ", ".join(f"{v:.2f}" for v in r["peak_anon_gb_per_rank"].values())
                + "; mapped "
                + ", ".join(f"{v:.2f}" for v in r["peak_file_gb_per_rank"].values())
                + "]"
            )
        if r.get("peak_rss_gb_other_processes"):
            rss += f" (workers {r['peak_rss_gb_other_processes']:.2f})"
        lines.append(
            f"| {r['size']} | {r['version']} | {r['run']} | {r.get('first_step_sec') or '—'} | "
            f"{r.get('wall_sec') if r.get('returncode', 0) == 0 or r.get('killed') else 'failed'} | {rss} | "
            f"{r.get('uss_gb_rank1_at_first_step') or r.get('uss_gb_rank1') or '—'} | "
            f"{r.get('tokenized_sentences_per_sec', '—')} | {r.get('cache_gb', '—')} | "
            f"{r.get('load_avg_1min_before', '—')} | "
            + "; ".join(str(r[k]) for k in ("note", "killed") if r.get(k))
            + " |"
        )
    table = "\n".join(lines)
    results_path.with_suffix(".md").write_text(table + "\n")
    print(table)
    if results_path.resolve() == RESULTS.resolve():
        if not write_section("scale", table):
            print(
                "benchmarks/RESULTS.md has no <!-- scale:start --> / <!-- scale:end --> markers: table not "
                "written there",
                file=sys.stderr,
            )
        else:
            print("wrote the scale section of benchmarks/RESULTS.md")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for version, marker in (("after", "o"), ("before", "s"), ("before (24 GB machine)", "x")):
        for run_name, style in (("first", "-"), ("relaunch", "--")):
            pts = [r for r in runs if r["version"] == version and r["run"] == run_name]
            if not pts:
                continue
            xs = [r["pairs"] for r in pts]
            axes[0].plot(
                xs,
                [max(r.get("peak_rss_gb_per_rank", {"0": 0}).values()) for r in pts],
                marker=marker,
                linestyle=style,
                label=f"{version}, {run_name}",
            )
            axes[1].plot(
                xs,
                [r.get("first_step_sec") or r.get("wall_sec") for r in pts],
                marker=marker,
                linestyle=style,
                label=f"{version}, {run_name}",
            )
            for r in pts:  # a run killed (memory or time limit) before its first step: its wall time, marked x
                if r.get("killed") and not r.get("first_step_sec"):
                    axes[1].plot([r["pairs"]], [r["wall_sec"]], "kx", markersize=9)
    for ax, ylabel in zip(axes, ("peak RSS of the training process (GB)", "time to the first step (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("distinct training pairs")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].axhline(2, color="grey", lw=0.8, ls=":")
    axes[1].axhline(480, color="grey", lw=0.8, ls=":")
    fig.suptitle(
        "training/train.py on synthetic WMT-like corpora, 2 CPU cores (x: killed before its first step)", fontsize=10
    )
    fig.tight_layout()
    plot = results_path.with_suffix(".png")
    fig.savefig(plot)
    print(f"wrote {plot}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["450k", "4.5M"])
    p.add_argument("--runs", nargs="+", choices=["first", "relaunch", "2proc"], default=["first", "relaunch", "2proc"])
    p.add_argument("--work_dir", default=str(Path(tempfile.gettempdir()) / "hf_variants_scale"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=4 * 3600)
    p.add_argument(
        "--code_dir",
        "--before",
        dest="code_dir",
        help="run the code in this folder (e.g. main at 4652af5, before the Arrow pipeline; see above) "
        "instead of this checkout; recorded as version 'before'",
    )
    p.add_argument("--version", help="the version label recorded (default: 'before' with --code_dir, else 'after')")
    p.add_argument(
        "--rss_limit_gb",
        type=float,
        default=20.0,
        help="kill a run whose processes together hold more than this (recorded as killed)",
    )
    p.add_argument(
        "--results", help="the JSON file (default: benchmarks/results/scale.json; with --smoke: WORK_DIR/scale.json)"
    )
    p.add_argument("--smoke", action="store_true", help="a tiny vocabulary; results in --work_dir, not results/")
    p.add_argument(
        "--report",
        action="store_true",
        help="write the table (RESULTS.md section 'scale' and results/scale.md) and the plot from --results",
    )
    args = p.parse_args()
    if args.results is None:
        args.results = str(Path(args.work_dir) / "scale.json") if args.smoke else str(RESULTS)
    if args.report:
        report(Path(args.results))
    else:
        measure(args)


if __name__ == "__main__":
    main()
