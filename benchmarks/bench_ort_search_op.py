#!/usr/bin/env python
"""ONNX Runtime decoding: the whole loop in ORT's `com.microsoft::BeamSearch` op (`hf_variants.onnx_generation`)
against transformers' Python loop over the step graph, and greedy and beam search bound on the shared-cache graph
(`hf_variants.onnx_bound`, the default path), side by side.

The baseline of a dims class (bench_inference's random MarianMTModel weights converted to ours) is exported once
(fused attention, fp32 and int8); each precision decodes the same batch (`--batch` 32 sources of up to `--src_len`
15 tokens, exactly `--new_tokens` 20 new tokens, greedy and beam 4 with length penalty 0.6) through
`OrtModelForSeq2SeqLM.generate` with `use_search_op=True` (the op), `use_search_op=False` (the loop) and the
default (`bound`: the shared-cache graph bound once) at `--threads` 1, calls interleaved (op fp32,
loop fp32, bound fp32, op int8, ...) after one warm-up each, medians of `--reps`; process CPU time and wall time per
call. Every hypothesis has the length limit here (min = max new
tokens), where the op's beam search is transformers' (`onnx_generation.fixed_length`: the default policy takes the
op too); `tokens_equal` / `rows_equal` say how far the op's hypotheses agree with the loop's (fp32: all; int8:
activation scales depend on the rows quantized together, which differ between the two paths).

    python benchmarks/bench_ort_search_op.py [--size small] [--reps 5] [--threads 1]

Prints tok/s per engine, the op / loop ratios and the CPU model; writes benchmarks/results/ort_search_op.json.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_inference import _Vocabulary, marian_and_ours  # noqa: E402
from bench_ort_fusion import (  # noqa: E402
    clock_ratios,
    cpu_model,
    decoding_parser,
    generation_settings,
    print_rates,
    ratios,
    time_decoding,
    write_results,
)
from timing import random_batch  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"


def main(argv=None) -> dict:
    args = decoding_parser(__doc__, 5, "ort_search_op.json").parse_args(argv)

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    torch.set_num_threads(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    # the exported folder lives until the end: the op's sessions are built from it on first use of each setting
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_search_op-")
    started = time.perf_counter()
    folder = export(ours, _Vocabulary(args.vocab), Path(scratch.name) / "onnx", int8=True)
    print(f"exported in {time.perf_counter() - started:.1f} s", flush=True)
    models = {
        p: OrtModelForSeq2SeqLM.from_pretrained(folder, precision=p, num_threads=args.threads)
        for p in ("fp32", "int8")
    }
    # path -> (use_search_op, the path generate() must report); "bound": the default path
    paths = {"op": (True, "search_op"), "loop": (False, "python_loop"), "bound": (None, "shared_cache_{mode}")}
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "batch": args.batch, "rows": {}}
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)
        kinds = ("op", "loop", "bound")
        mode = "greedy" if beams == 1 else "beam"
        order = [f"{kind}_{p}" for p in ("fp32", "int8") for kind in kinds]

        def run(name):
            kind, precision = name.split("_")
            model, (use_search_op, expected) = models[precision], paths[kind]
            expected = expected.format(mode=mode)
            out = model.generate(**inputs, **gen, use_search_op=use_search_op)
            if model.last_decoding["path"] != expected:
                raise RuntimeError(f"{name}: {model.last_decoding}")
            return out

        outputs, row = time_decoding(run, order, args)
        key = "greedy" if beams == 1 else f"beam{beams}"
        for p in ("fp32", "int8"):
            op, loop = outputs[f"op_{p}"], outputs[f"loop_{p}"]
            row[f"tokens_equal_{p}"] = round(float((op == loop).float().mean()), 4)
            row[f"rows_equal_{p}"] = round(float((op == loop).all(1).float().mean()), 4)
            # the bound search and the loop run the same graph: the same sequences
            row[f"bound_rows_equal_loop_{p}"] = round(float((outputs[f"bound_{p}"] == loop).all(1).float().mean()), 4)
            row[f"bound_over_op_{p}"] = ratios(row, f"bound_{p}", f"op_{p}")
        clock_ratios(row, "op", "loop")
        results["rows"][key] = row
        print_rates(row, f"{args.size} {key}")
        print(
            f"[{args.size} {key}] op/loop cpu {row['ratio_cpu']} wall {row['ratio_wall']}; rows equal fp32 "
            f"{row['rows_equal_fp32']} int8 {row['rows_equal_int8']}",
            flush=True,
        )
        print(
            f"[{args.size} {key}] bound/op fp32 {row['bound_over_op_fp32']} int8 {row['bound_over_op_int8']}; "
            f"bound rows equal to the loop's fp32 {row['bound_rows_equal_loop_fp32']} int8 "
            f"{row['bound_rows_equal_loop_int8']}",
            flush=True,
        )
    scratch.cleanup()
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
