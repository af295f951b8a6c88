#!/usr/bin/env python
"""Does translation scale out? hf-variants-translate on the same `--lines` lines (default 2,000: Multi30k's
val + test_2016_flickr English sources) as one process and as a two-process `accelerate launch` (gloo on CPUs), one
thread each (`--num_threads 1`), timed interleaved (`--reps` rounds of each, medians), with the output checked
byte-identical between them. Prints lines/s of each and the ratio two / one, twice: over the command's wall clock
(process and launcher start, model loading and merge included) and over the translation itself (the summary's
`seconds`: from the model loaded to the output written).

    python benchmarks/bench_scale_translate.py --model runs/en-de/model --reps 3 \\
        --output benchmarks/results/scale_translate                      # a trained model (the small baseline)
    python benchmarks/bench_scale_translate.py --random_preset small --reps 3 --output ...     # random weights
    python benchmarks/bench_scale_translate.py --random_preset tiny --lines 40 --reps 1 --unit_lines 10   # smoke

The ratio needs two idle cores (the machine must be quiet: each process is one thread); with GPUs, `--gpus N` launches
N processes, one per GPU (`--multi_gpu`), against one process on one GPU. The decoding settings are the model's saved
ones unless `--num_beams` is given; units of `--unit_lines` (default 200) lines, `--buffer_size` 100.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import write_result  # noqa: E402

DATA_DIR = ROOT / "training" / "data" / "multi30k"


def source_lines(count: int) -> list[str]:
    lines: list[str] = []
    for split in ("val", "test_2016_flickr", "test_2017_flickr", "train"):
        with gzip.open(DATA_DIR / f"{split}.en.gz", "rt", encoding="utf-8") as f:
            lines += [line.rstrip("\n") for line in f]
        if len(lines) >= count:
            break
    return lines[:count]


def random_model(preset: str, folder: Path) -> Path:
    """A randomly initialised baseline of `preset` dims with a tokenizer trained on the bundled data (a greedy decoding
    of random weights runs to the length rule's limit: the work per line is fixed by the rule)."""
    import torch

    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
    from hf_variants.tokenization import train_tokenizer

    with (
        gzip.open(DATA_DIR / "train.en.gz", "rt", encoding="utf-8") as en,
        gzip.open(DATA_DIR / "train.de.gz", "rt", encoding="utf-8") as de,
    ):
        texts = [next(en).rstrip("\n") for _ in range(4000)] + [next(de).rstrip("\n") for _ in range(4000)]
    tokenizer = train_tokenizer(texts, vocab_size=2000, languages=["en", "de"], output_dir=str(folder / "tok"))
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(
        preset, vocab_size=len(tokenizer), languages=["en", "de"], target_languages=["de"]
    )
    model = TransformerNmtForConditionalGeneration(config).eval()
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args, model: Path, source: Path, output: Path, processes: int) -> list[str]:
    flags = ["--model", str(model), "--input", str(source), "--output", str(output), "--no_progress"]
    flags += ["--buffer_size", str(args.buffer_size), "--unit_lines", str(args.unit_lines)]
    if args.gpus == 0:
        flags += ["--num_threads", "1"]
    if args.num_beams is not None:
        flags += ["--num_beams", str(args.num_beams)]
    module = ["-m", "hf_variants.commands.translate"]
    if processes == 1:
        return [sys.executable, *module, *flags]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*launcher, "--main_process_port", str(free_port()), *module, *flags]


def run_once(args, model: Path, source: Path, folder: Path, processes: int) -> dict:
    output = folder / f"out_{processes}.de"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.gpus == 0:
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    done = subprocess.run(command(args, model, source, output, processes), capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{processes} process(es) failed:\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    return {"wall": wall, "seconds": summary["seconds"], "bytes": output.read_bytes()}


def measure(args, model: Path, lines: list[str]) -> dict:
    counts = (1, args.gpus or 2) if args.gpus != 1 else (1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "src.en"
        source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        runs: dict[int, list[dict]] = {n: [] for n in counts}
        for _ in range(args.reps):  # interleaved: a load change hits both alike
            for n in counts:
                runs[n].append(run_once(args, model, source, folder, n))
    outputs = {run["bytes"] for n in counts for run in runs[n]}
    record = {"lines": len(lines), "identical_outputs": len(outputs) == 1, "processes": {}}
    for n in counts:
        wall = statistics.median(r["wall"] for r in runs[n])
        seconds = statistics.median(r["seconds"] for r in runs[n])
        record["processes"][str(n)] = {
            "wall_s": round(wall, 3),
            "translate_s": round(seconds, 3),
            "lines_per_s_wall": round(len(lines) / wall, 2),
            "lines_per_s": round(len(lines) / seconds, 2),
            "runs": [{"wall_s": round(r["wall"], 3), "translate_s": r["seconds"]} for r in runs[n]],
        }
    one, many = (record["processes"][str(n)] for n in counts)
    record["ratio_wall"] = round(many["lines_per_s_wall"] / one["lines_per_s_wall"], 3)
    record["ratio"] = round(many["lines_per_s"] / one["lines_per_s"], 3)
    return record


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a saved model folder (a trained baseline)")
    source.add_argument("--random_preset", choices=["tiny", "small", "base"], help="random weights of these dims")
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--unit_lines", type=int, default=200)
    p.add_argument("--buffer_size", type=int, default=100)
    p.add_argument("--num_beams", type=int)
    p.add_argument("--gpus", type=int, default=0, help="launch one process per GPU (N GPUs) instead of CPUs")
    p.add_argument("--output", help="write the result here (.json)")
    args = p.parse_args(argv)
    lines = source_lines(args.lines)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else random_model(args.random_preset, Path(tmp))
        record = measure(args, model, lines)
        record["settings"] = {k: v for k, v in vars(args).items() if k != "output"}
    for n, row in record["processes"].items():
        print(
            f"{n} process(es): {row['lines_per_s']:.1f} lines/s translating ({row['translate_s']:.2f} s), "
            f"{row['lines_per_s_wall']:.1f} lines/s wall clock ({row['wall_s']:.2f} s)"
        )
    print(
        f"ratio {record['ratio']:.2f}x translating, {record['ratio_wall']:.2f}x wall clock; outputs identical: "
        f"{record['identical_outputs']}"
    )
    if args.output:
        write_result(Path(args.output).with_suffix(".json"), record)
    return record


if __name__ == "__main__":
    main()
