#!/usr/bin/env python
"""ONNX Runtime int8: the weight formats of `export_onnx --int8_weights` side by side, speed and accuracy.

Two parts, both at `--threads` intra-op threads, each in this one process (ORT sessions only: no torch thread pool
spins beside them):

1. The MatMuls alone. For each MatMul shape of the dims class (d_model x d_model, d_model x ffn, ffn x d_model,
   d_model x vocab) a one-node graph, quantized by onnxruntime's `quantize_dynamic` in each format of
   `INT8_WEIGHTS`, against the float32 node; rows M of the decoder step (`--batch`, `--batch` x 4 for beam 4) and of
   the encoder (`--batch` x `--src_len`). Microseconds per call, medians of `--reps` interleaved rounds of 50 calls.
2. The whole model. The baseline of the dims class (bench_inference's random MarianMTModel weights converted to ours)
   exported once per format, fp32 from the first; each engine decodes the same batch (`--batch` sources of up to
   `--src_len` tokens, exactly `--new_tokens` new tokens, greedy and beam 4 with length penalty 0.6) through
   `OrtModelForSeq2SeqLM.generate`, calls interleaved (bench_ort_fusion's `time_decoding`); accuracy against fp32:
   the relative error of the int8 logits along fp32's greedy tokens (teacher-forced) and the share of greedy tokens
   equal to fp32's.

    python benchmarks/bench_ort_int8_weights.py [--size small] [--reps 5] [--threads 1]

Prints both tables, the ratios against the u8 format and the CPU model (`lscpu`); writes
benchmarks/results/ort_int8_weights.json. Random weights have small top-2 margins: token agreement here is a lower
bound; BLEU on trained models: `bench_inference.py --bleu_model`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
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

from hf_variants.onnx.quantization import INT8_WEIGHTS  # noqa: E402


def _session(path: Path, threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def matmul_sessions(k: int, n: int, workdir: Path, threads: int) -> dict:
    """fp32 and one int8 session per weight format of a one-MatMul graph x [M, k] @ W [k, n]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from hf_variants.onnx.quantization import quantize

    weight = np.random.default_rng(k * n).standard_normal((k, n)).astype(np.float32) * k**-0.5
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(weight, "W")],
    )
    path = workdir / f"matmul_{k}x{n}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    sessions = {"fp32": _session(path, threads)}
    for weights in INT8_WEIGHTS:
        quantize(path, path.with_name(f"{path.stem}_{weights}.onnx"), weights)
        sessions[weights] = _session(path.with_name(f"{path.stem}_{weights}.onnx"), threads)
    return sessions


def matmul_part(config, args, workdir: Path) -> list[dict]:
    d, ffn, vocab = config.d_model, config.encoder_ffn_dim, config.vocab_size
    rows = []
    for k, n in [(d, d), (d, ffn), (ffn, d), (d, vocab)]:
        sessions = matmul_sessions(k, n, workdir, args.threads)
        for m in (args.batch, args.batch * 4, args.batch * args.src_len):
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            times = {name: [] for name in sessions}
            for session in sessions.values():
                session.run(None, {"x": x})
            for _ in range(args.reps):
                for name, session in sessions.items():
                    started = time.perf_counter()
                    for _ in range(50):
                        session.run(None, {"x": x})
                    times[name].append((time.perf_counter() - started) / 50 * 1e6)
            us = {name: round(statistics.median(t), 1) for name, t in times.items()}
            rows.append({"shape": f"{m} x {k} @ {k} x {n}", "us": us})
            print(f"[matmul {m} x {k} @ {k} x {n}] us " + " | ".join(f"{a} {b}" for a, b in us.items()), flush=True)
    return rows


def accuracy(models: dict, inputs: dict, new_tokens: int) -> dict:
    """Each int8 engine against fp32 along fp32's greedy tokens: relative logit error (mean, max over the
    positions) and the share of greedy tokens equal to fp32's."""
    gen = generation_settings(1, new_tokens)
    reference = models["fp32"].generate(**inputs, **gen)
    logits = models["fp32"](**inputs, decoder_input_ids=reference[:, :-1]).logits
    result = {}
    for name, model in models.items():
        if name == "fp32":
            continue
        other = model(**inputs, decoder_input_ids=reference[:, :-1]).logits
        error = (other - logits).norm(dim=-1) / logits.norm(dim=-1)
        tokens = model.generate(**inputs, **gen)
        result[name] = {
            "relative_logit_error_mean": round(float(error.mean()), 5),
            "relative_logit_error_max": round(float(error.max()), 5),
            "greedy_tokens_equal_fp32": round(float((tokens == reference).float().mean()), 4),
        }
        print(f"[accuracy {name}] {result[name]}", flush=True)
    return result


def main(argv=None) -> dict:
    args = decoding_parser(__doc__, 5, "ort_int8_weights.json").parse_args(argv)

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    torch.set_num_threads(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_int8_weights-")
    workdir = Path(scratch.name)
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "batch": args.batch}
    results["matmuls"] = matmul_part(ours.config, args, workdir)
    models = {}
    for weights in INT8_WEIGHTS:
        started = time.perf_counter()
        folder = export(ours, _Vocabulary(args.vocab), workdir / weights, int8=True, int8_weights=weights)
        print(f"exported {weights} in {time.perf_counter() - started:.1f} s", flush=True)
        if not models:
            models["fp32"] = OrtModelForSeq2SeqLM.from_pretrained(folder, precision="fp32", num_threads=args.threads)
        models[weights] = OrtModelForSeq2SeqLM.from_pretrained(folder, precision="int8", num_threads=args.threads)
    results["accuracy"] = accuracy(models, inputs, args.new_tokens)
    results["rows"] = {}
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)
        _, row = time_decoding(lambda name: models[name].generate(**inputs, **gen), list(models), args)
        key = "greedy" if beams == 1 else f"beam{beams}"
        row["ratio_vs_u8"] = {name: ratios(row, name, "u8") for name in models if name != "u8"}
        results["rows"][key] = row
        print(f"[{args.size} {key}] cpu tok/s " + " | ".join(f"{n} {v}" for n, v in row["cpu_tok_s"].items()))
        print(f"[{args.size} {key}] wall tok/s " + " | ".join(f"{n} {v}" for n, v in row["wall_tok_s"].items()))
        print(f"[{args.size} {key}] ratio vs u8 {row['ratio_vs_u8']}", flush=True)
    scratch.cleanup()
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
