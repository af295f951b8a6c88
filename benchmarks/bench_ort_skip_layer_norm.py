#!/usr/bin/env python
"""ONNX Runtime's SkipLayerNormFusion on and off (`onnx_generation.DISABLED_OPTIMIZERS`), side by side.

ORT's graph optimizer (ORT_ENABLE_ALL) fuses every residual Add + LayerNormalization into one
`com.microsoft::SkipLayerNormalization`. Two measurements, each at `--threads` threads in this one process:

- the kernels alone: one-node graphs, SkipLayerNormalization against Add + LayerNormalization (fusion off) on
  [rows, 1, d_model] (rows 32 and 128: greedy and beam 4 at batch 32; d_model 256 and 512: the small and base
  presets), microseconds per session run (process CPU time, best of 3 x 300 runs; the run's fixed cost is in both);
- whole decodings: the baseline of a dims class (bench_inference's random MarianMTModel weights converted to ours),
  exported once (fp32 and int8), loaded twice through `OrtModelForSeq2SeqLM.from_pretrained` (`disabled_optimizers`
  default: fusion off; `()`: every optimizer), decoding the same batch (`--batch` 32 sources of up to `--src_len`
  15 tokens, exactly `--new_tokens` 20 new tokens, greedy and beam 4 with length penalty 0.6), calls interleaved
  after one warm-up each, medians of `--reps`; `rows_equal` compares the two engines' sequences.

    python benchmarks/bench_ort_skip_layer_norm.py [--size small] [--reps 5] [--threads 1]

Prints the times and the unfused / fused speed ratios, the CPU model; writes
benchmarks/results/ort_skip_layer_norm.json.
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
    cpu_model,
    decoding_parser,
    generation_settings,
    ratios,
    time_decoding,
    write_results,
)
from timing import random_batch  # noqa: E402


def kernel_times(threads: int, runs: int = 300) -> dict:
    """Microseconds per run of SkipLayerNormalization and of Add + LayerNormalization, per [rows, d_model]."""
    import numpy as np
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from hf_variants.onnx.modeling import default_session_options

    out = {}
    for rows, width in ((32, 256), (128, 256), (32, 512), (128, 512)):
        weights = [
            numpy_helper.from_array(np.ones(width, np.float32), "gamma"),
            numpy_helper.from_array(np.zeros(width, np.float32), "beta"),
        ]
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, 1, width]) for n in ("x", "skip")]
        graphs = {
            "fused": [
                helper.make_node(
                    "SkipLayerNormalization",
                    ["x", "skip", "gamma", "beta"],
                    ["y"],
                    domain="com.microsoft",
                    epsilon=1e-5,
                )
            ],
            "unfused": [
                helper.make_node("Add", ["x", "skip"], ["sum"]),
                helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
            ],
        }
        feeds = {n: np.random.default_rng(0).standard_normal((rows, 1, width), np.float32) for n in ("x", "skip")}
        row, results = {}, {}
        for kind, nodes in graphs.items():
            graph = helper.make_graph(
                nodes, kind, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=weights
            )
            model = helper.make_model(
                graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
            )
            model.ir_version = 9
            session = onnxruntime.InferenceSession(
                model.SerializeToString(),
                default_session_options(threads, spinning=False),
                providers=["CPUExecutionProvider"],
                disabled_optimizers=["SkipLayerNormFusion"],  # the unfused graph stays two nodes
            )
            results[kind] = session.run(None, feeds)[0]
            best = []
            for _ in range(3):
                start = time.process_time()
                for _ in range(runs):
                    session.run(None, feeds)
                best.append((time.process_time() - start) / runs * 1e6)
            row[f"{kind}_us"] = round(min(best), 1)
        row["fused / unfused time"] = round(row["fused_us"] / row["unfused_us"], 2)
        row["max_abs_difference"] = float(np.abs(results["fused"] - results["unfused"]).max())
        out[f"{rows}x{width}"] = row
        print(f"[kernel {rows} x {width}] {row}", flush=True)
    return out


def main(argv=None) -> dict:
    args = decoding_parser(__doc__, 5, "ort_skip_layer_norm.json").parse_args(argv)

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    torch.set_num_threads(args.threads)
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "batch": args.batch}
    results["kernels"] = kernel_times(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_skip_layer_norm-")
    folder = export(ours, _Vocabulary(args.vocab), Path(scratch.name) / "onnx", int8=True)
    engines = {
        f"{kind}_{precision}": OrtModelForSeq2SeqLM.from_pretrained(
            folder,
            precision=precision,
            num_threads=args.threads,
            **({} if kind == "unfused" else {"disabled_optimizers": ()}),
        )
        for precision in ("fp32", "int8")
        for kind in ("unfused", "fused")
    }
    results["rows"] = {}
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)
        outputs, row = time_decoding(lambda name: engines[name].generate(**inputs, **gen), list(engines), args)
        key = "greedy" if beams == 1 else f"beam{beams}"
        for precision in ("fp32", "int8"):
            same = outputs[f"unfused_{precision}"] == outputs[f"fused_{precision}"]
            row[f"rows_equal_{precision}"] = round(float(same.all(1).float().mean()), 4)
            row[f"unfused / fused_{precision}"] = ratios(row, f"unfused_{precision}", f"fused_{precision}")
        row["paths"] = {name: model.last_decoding["path"] for name, model in engines.items()}
        results["rows"][key] = row
        print(f"[{args.size} {key}] cpu tok/s {row['cpu_tok_s']}", flush=True)
        print(
            f"[{args.size} {key}] unfused / fused: fp32 {row['unfused / fused_fp32']}, int8 "
            f"{row['unfused / fused_int8']}; rows equal fp32 {row['rows_equal_fp32']} int8 {row['rows_equal_int8']}",
            flush=True,
        )
    scratch.cleanup()
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
