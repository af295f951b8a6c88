#!/usr/bin/env python
"""ONNX Runtime decoding with and without attention fusion (`export_onnx --no_fuse_attention`), side by side.

The baseline of a dims class (bench_inference's random MarianMTModel weights converted to ours) is exported twice
(fused: attention as `com.microsoft::MultiHeadAttention`; unfused: generic ONNX ops), fp32 and int8, and each of the
four engines decodes the same batch (`--batch` 32 sources of up to `--src_len` 15 tokens, exactly
`--new_tokens` 20 new tokens, greedy and beam 4 with length penalty 0.6) through `OrtModelForSeq2SeqLM.generate`
at `--threads` 1, calls interleaved (fused fp32, unfused fp32, fused int8, unfused int8, ...) after one warm-up
each, medians of `--reps`. Both clocks are recorded per call: process CPU time (what the engine computed: the
number to trust on a shared, busy machine) and wall time. One process is enough at 1 thread (ORT's sessions run
inline, no pool spins beside another); with more threads, use bench_inference.py (one process per engine).

    python benchmarks/bench_ort_fusion.py [--size small] [--reps 7] [--threads 1]

Prints tok/s per engine and the fused / unfused ratios, the graphs' node counts, the CPU model; writes
benchmarks/results/ort_fusion.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_inference import _Vocabulary, marian_and_ours  # noqa: E402
from timing import random_batch  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def node_counts(path: Path) -> dict:
    import onnx

    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return {"nodes": len(nodes), "ops": dict(Counter(n.op_type for n in nodes).most_common(6))}


def decoding_parser(doc: str, reps: int, output: str) -> argparse.ArgumentParser:
    """The arguments of the ORT decoding benchmarks (this one and bench_ort_search_op.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src_len", type=int, default=15)
    parser.add_argument("--new_tokens", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output", default=str(RESULTS_DIR / output))
    return parser


def generation_settings(beams: int, new_tokens: int) -> dict:
    """The benchmarks' decoding: exactly `new_tokens` new tokens, greedy or beam search with length penalty 0.6."""
    return dict(
        num_beams=beams,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **({"length_penalty": 0.6} if beams > 1 else {}),
    )


def time_decoding(run, order: list[str], args) -> tuple[dict, dict]:
    """`run(name)` decodes the benchmark batch with engine `name`. One warm-up call each (their outputs are
    returned, checked to hold `args.new_tokens` new tokens), then `args.reps` rounds of calls interleaved in `order`;
    tok/s from the medians of process CPU time (what the engine computed: the number to trust on a busy machine) and
    of wall time."""
    outputs = {name: run(name) for name in order}
    if any(out.shape[1] != args.new_tokens + 1 for out in outputs.values()):
        raise RuntimeError(f"Output lengths differ from {args.new_tokens} new tokens")
    cpu, wall = {name: [] for name in order}, {name: [] for name in order}
    for _ in range(args.reps):
        for name in order:
            c, w = time.process_time(), time.perf_counter()
            run(name)
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    tokens = args.batch * args.new_tokens
    row = {
        "cpu_tok_s": {name: round(tokens / statistics.median(cpu[name]), 1) for name in order},
        "wall_tok_s": {name: round(tokens / statistics.median(wall[name]), 1) for name in order},
    }
    return outputs, row


def ratios(row: dict, numerator: str, denominator: str) -> dict:
    """`numerator` / `denominator` tok/s of a `time_decoding` row, per clock."""
    return {
        clock: round(row[f"{clock}_tok_s"][numerator] / row[f"{clock}_tok_s"][denominator], 2)
        for clock in ("cpu", "wall")
    }


def clock_ratios(row: dict, first: str, second: str) -> None:
    """Add to a `time_decoding` row `ratio_cpu` / `ratio_wall`: per precision (fp32, int8), engine
    `<first>_<precision>`'s tok/s over `<second>_<precision>`'s."""
    by_clock = {p: ratios(row, f"{first}_{p}", f"{second}_{p}") for p in ("fp32", "int8")}
    row["ratio_cpu"] = {p: r["cpu"] for p, r in by_clock.items()}
    row["ratio_wall"] = {p: r["wall"] for p, r in by_clock.items()}


def print_rates(row: dict, label: str) -> None:
    """Print a `time_decoding` row's tok/s per engine, CPU time and wall time."""
    print(f"[{label}] cpu tok/s " + " | ".join(f"{n} {v}" for n, v in row["cpu_tok_s"].items()))
    print(f"[{label}] wall tok/s " + " | ".join(f"{n} {v}" for n, v in row["wall_tok_s"].items()))


def paired_row(row: dict, outputs: dict, first: str, second: str, label: str) -> dict:
    """Complete and print a `time_decoding` row of engines `<first>_<precision>` and `<second>_<precision>` (fp32,
    int8): whether each pair decoded the same tokens, and first / second tok/s per precision and clock."""
    for p in ("fp32", "int8"):
        row[f"tokens_equal_{p}"] = bool(torch.equal(outputs[f"{first}_{p}"], outputs[f"{second}_{p}"]))
    clock_ratios(row, first, second)
    print_rates(row, label)
    print(
        f"[{label}] {first}/{second} cpu {row['ratio_cpu']} wall {row['ratio_wall']}; tokens equal "
        f"fp32 {row['tokens_equal_fp32']} int8 {row['tokens_equal_int8']}",
        flush=True,
    )
    return row


def write_results(results: dict, output: str) -> dict:
    """Print the CPU model beside the numbers and write `results` as JSON to `output`; returns `results`."""
    print("CPU:", results["cpu"])
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv=None) -> dict:
    args = decoding_parser(__doc__, 7, "ort_fusion.json").parse_args(argv)

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    torch.set_num_threads(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_fusion-")  # the exports; sessions keep their graphs
    workdir = Path(scratch.name)
    engines, graphs = {}, {}
    for fused in (True, False):
        kind = "fused" if fused else "unfused"
        started = time.perf_counter()
        folder = export(ours, _Vocabulary(args.vocab), workdir / kind, int8=True, fuse_attention=fused)
        print(f"exported {kind} in {time.perf_counter() - started:.1f} s", flush=True)
        for precision in ("fp32", "int8"):
            engines[f"{kind}_{precision}"] = OrtModelForSeq2SeqLM.from_pretrained(
                folder, precision=precision, num_threads=args.threads
            )
            graphs[f"{kind}_{precision}"] = node_counts(
                folder / f"decoder_model{'_int8' if precision == 'int8' else ''}.onnx"
            )
    scratch.cleanup()
    order = ["fused_fp32", "unfused_fp32", "fused_int8", "unfused_int8"]
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "step_graphs": graphs, "rows": {}}
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)
        outputs, row = time_decoding(lambda name: engines[name].generate(**inputs, **gen), order, args)
        key = "greedy" if beams == 1 else f"beam{beams}"
        row["fp32_tokens_equal"] = bool(torch.equal(outputs["fused_fp32"], outputs["unfused_fp32"]))
        by_clock = {p: ratios(row, f"fused_{p}", f"unfused_{p}") for p in ("fp32", "int8")}
        row["ratio_cpu"] = {p: r["cpu"] for p, r in by_clock.items()}
        row["ratio_wall"] = {p: r["wall"] for p, r in by_clock.items()}
        results["rows"][key] = row
        print(f"[{args.size} {key}] cpu tok/s " + " | ".join(f"{n} {v}" for n, v in row["cpu_tok_s"].items()))
        print(f"[{args.size} {key}] wall tok/s " + " | ".join(f"{n} {v}" for n, v in row["wall_tok_s"].items()))
        print(f"[{args.size} {key}] fused/unfused cpu {row['ratio_cpu']} wall {row['ratio_wall']}", flush=True)
    print("step graph nodes:", {name: g["nodes"] for name, g in graphs.items()}, "| CPU:", results["cpu"])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
