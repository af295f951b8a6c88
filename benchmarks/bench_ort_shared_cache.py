#!/usr/bin/env python
"""ONNX Runtime's Python decoding loop on the shared-cache step graph (preallocated buffers written in place by
`com.microsoft::DecoderMaskedMultiHeadAttention`, beam search reordering the cache indirection: `OrtSharedCache`)
against the step graph's concatenated cache (past -> present, reordered by copy), side by side.

The baseline of a dims class (bench_inference's random MarianMTModel weights converted to ours) is exported once
(fused attention, fp32 and int8: the step graph and the shared-cache graph); each precision decodes the same batch
(`--batch` 32 sources of up to `--src_len` 15 tokens, exactly `--new_tokens` 20 new tokens, greedy and beam 4 with
length penalty 0.6) through `OrtModelForSeq2SeqLM.generate(..., use_search_op=False)` (transformers' loop) loaded
with `shared_cache=True` and `shared_cache=False`, at `--threads` 1, calls interleaved (shared fp32, concat fp32,
shared int8, concat int8, ...) after one warm-up each, medians of `--reps`; process CPU time and wall time per call.
`tokens_equal` says whether both caches decoded the same tokens.

    python benchmarks/bench_ort_shared_cache.py [--size small] [--reps 5] [--threads 1]

Prints tok/s per engine, the shared / concat ratios, the shared-cache graph's export and int8 seconds, the CPU
model; writes benchmarks/results/ort_shared_cache.json.
"""

from __future__ import annotations

import json
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
    paired_row,
    time_decoding,
    write_results,
)
from timing import random_batch  # noqa: E402

CACHE_PATHS = {"shared": "shared_buffer", "concat": "concatenated"}


def main(argv=None) -> dict:
    args = decoding_parser(__doc__, 5, "ort_shared_cache.json").parse_args(argv)

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    torch.set_num_threads(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_shared_cache-")  # sessions keep their graphs
    started = time.perf_counter()
    folder = export(ours, _Vocabulary(args.vocab), Path(scratch.name) / "onnx", int8=True)
    manifest = json.loads((folder / "onnx_manifest.json").read_text())
    shared = manifest["shared_cache"]
    if not shared["written"]:
        raise RuntimeError(f"no shared-cache graph: {shared['reason']}")
    export_record = {
        "total_seconds": round(time.perf_counter() - started, 1),
        "export_seconds": manifest["export_seconds"],
        "shared_cache_export_seconds": shared["export_seconds"],
        "quantize_seconds": manifest["quantize_seconds"],
        "shared_cache_quantize_seconds": shared["quantize_seconds"],
    }
    print(f"exported: {export_record}", flush=True)
    engines = {
        f"{cache}_{p}": OrtModelForSeq2SeqLM.from_pretrained(
            folder, precision=p, num_threads=args.threads, shared_cache=cache == "shared"
        )
        for p in ("fp32", "int8")
        for cache in CACHE_PATHS
    }
    scratch.cleanup()
    order = list(engines)
    results = {
        "cpu": cpu_model(),
        "size": args.size,
        "threads": args.threads,
        "batch": args.batch,
        "export": export_record,
        "rows": {},
    }
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)

        def run(name):
            model = engines[name]
            out = model.generate(**inputs, **gen, use_search_op=False)
            if model.last_decoding.get("cache") != CACHE_PATHS[name.split("_")[0]]:
                raise RuntimeError(f"{name}: {model.last_decoding}")
            return out

        outputs, row = time_decoding(run, order, args)
        key = "greedy" if beams == 1 else f"beam{beams}"
        results["rows"][key] = paired_row(row, outputs, "shared", "concat", f"{args.size} {key}")
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
