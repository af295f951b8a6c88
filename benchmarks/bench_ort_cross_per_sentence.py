#!/usr/bin/env python
"""Bound beam search on the shared-cache step graph with the cross-attention keys/values and the source padding fed
once per sentence (each sentence's beams the queries of one MultiHeadAttention: what `export_onnx` writes since
session 9) against the same graph fed them once per row (what the runtime feeds a folder exported before, whose
manifest has no `shared_cache["cross_attention"]`: keys/values repeated per beam, one query per row), side by side.

The baseline of a dims class (bench_inference's random MarianMTModel weights converted to ours) is exported once
(fp32 and int8); a copy of the folder without the manifest's `cross_attention` entry is the per-row engine. Each
precision decodes the same batch (`--batch` 32 sources of up to `--src_len` 15 tokens, exactly `--new_tokens` 20
new tokens, beam 4 with length penalty 0.6) through `OrtModelForSeq2SeqLM.generate` (bound beam search), at
`--threads` 1, calls interleaved (per_sentence fp32, per_row fp32, per_sentence int8, per_row int8) after one
warm-up each, medians of `--reps`; process CPU time and wall time per call. `tokens_equal` says whether both
decoded the same tokens.

    python benchmarks/bench_ort_cross_per_sentence.py [--size small] [--reps 7] [--threads 1] [--beams 4]

Prints tok/s per engine, the per_sentence / per_row ratios, the CPU model; writes
benchmarks/results/ort_cross_per_sentence_<size>.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_inference import _Vocabulary, marian_and_ours  # noqa: E402
from bench_ort_fusion import (  # noqa: E402
    RESULTS_DIR,
    cpu_model,
    decoding_parser,
    generation_settings,
    paired_row,
    time_decoding,
    write_results,
)
from timing import random_batch  # noqa: E402

FEEDS = ("per_sentence", "per_row")


def main(argv=None) -> dict:
    parser = decoding_parser(__doc__, 7, "")
    parser.set_defaults(beams=[4], output=None)
    args = parser.parse_args(argv)
    args.output = args.output or str(RESULTS_DIR / f"ort_cross_per_sentence_{args.size}.json")

    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    torch.set_num_threads(args.threads)
    _, ours = marian_and_ours(args.size, args.vocab)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    scratch = tempfile.TemporaryDirectory(prefix="bench_ort_cross_per_sentence-")  # sessions keep their graphs
    folders = {"per_sentence": export(ours, _Vocabulary(args.vocab), Path(scratch.name) / "onnx", int8=True)}
    manifest = json.loads((folders["per_sentence"] / "onnx_manifest.json").read_text())
    if manifest["shared_cache"].get("cross_attention") != "per_sentence":
        raise RuntimeError(f"the export's shared-cache graph does not take the source per sentence: {manifest}")
    folders["per_row"] = Path(shutil.copytree(folders["per_sentence"], Path(scratch.name) / "per_row"))
    del manifest["shared_cache"]["cross_attention"]
    (folders["per_row"] / "onnx_manifest.json").write_text(json.dumps(manifest))
    engines = {
        f"{feed}_{p}": OrtModelForSeq2SeqLM.from_pretrained(folders[feed], precision=p, num_threads=args.threads)
        for p in ("fp32", "int8")
        for feed in FEEDS
    }
    scratch.cleanup()
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "batch": args.batch, "rows": {}}
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)

        def run(name):
            model = engines[name]
            out = model.generate(**inputs, **gen)
            if model.last_decoding["path"] != "shared_cache_beam":
                raise RuntimeError(f"{name}: {model.last_decoding}")
            return out

        outputs, row = time_decoding(run, list(engines), args)
        key = f"beam{beams}"
        results["rows"][key] = paired_row(row, outputs, "per_sentence", "per_row", f"{args.size} {key}")
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
