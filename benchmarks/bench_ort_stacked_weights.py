#!/usr/bin/env python
"""ONNX Runtime int8 of the models with stacked unit weights (MUTE's units, MIMO's streams: `StackedLinear`,
[units, in, out]): split per unit before quantizing (`onnx_quantization.split_stacked_matmuls`, the exporter's
default: every unit's output channels get their own scales) against kept stacked (one scale per stacked tensor, as
before), speed and accuracy side by side.

For each model of `--models` (random weights of the `--size` preset, or the trained model at `--model_dir`, one
model type): one export (float32 and the split int8 graphs), the same float32 graphs quantized again without the
split into a copy of the folder; the three engines (`fp32`, `int8_split`, `int8_stacked`) decode the same batch in
this one process (ORT sessions only), calls interleaved (bench_ort_fusion's `time_decoding`: `--batch` sources of up
to `--src_len` tokens, exactly `--new_tokens` new tokens, greedy and beam 4); accuracy against fp32 as
bench_ort_int8_weights measures it (relative logit error along fp32's greedy tokens, greedy tokens equal to fp32's).

    python benchmarks/bench_ort_stacked_weights.py [--models mute mimo] [--size small] [--threads 1] [--reps 5]
    python benchmarks/bench_ort_stacked_weights.py --model_dir benchmarks/runs/warm_mute/model --models mute

Prints the tables, the ratios split / stacked and the CPU model (`lscpu`); writes
benchmarks/results/ort_stacked_weights.json. Trained weights are the accuracy that matters (random units are alike);
BLEU: `bench_inference.py --bleu_model`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_inference import _Vocabulary  # noqa: E402
from bench_ort_fusion import (  # noqa: E402
    cpu_model,
    decoding_parser,
    generation_settings,
    ratios,
    time_decoding,
    write_results,
)
from bench_ort_int8_weights import accuracy  # noqa: E402
from efficiency import build, language_inputs  # noqa: E402
from timing import random_batch  # noqa: E402

ENGINES = ("fp32", "int8_split", "int8_stacked")


def stacked_copy(folder: Path, target: Path) -> Path:
    """A copy of the exported `folder` whose int8 graphs are quantized from its float32 graphs without the split."""
    from hf_variants.onnx.quantization import quantize

    shutil.copytree(folder, target)
    manifest = json.loads((folder / "onnx_manifest.json").read_text())
    pairs = [(manifest["graphs"]["fp32"][part], manifest["graphs"]["int8"][part]) for part in ("encoder", "decoder")]
    shared = manifest.get("shared_cache") or {}
    if shared.get("written"):
        pairs.append((shared["graphs"]["fp32"], shared["graphs"]["int8"]))
    for fp32_name, int8_name in pairs:
        quantize(target / fp32_name, target / int8_name, split_units=False)
    return target


def load(args, name: str):
    """The model to export and its tokenizer-like vocabulary (a trained folder's own tokenizer)."""
    if args.model_dir is None:
        return build(name, args.size, args.vocab).eval(), _Vocabulary(args.vocab)
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_variants  # noqa: F401  (registers the model types)

    return AutoModelForSeq2SeqLM.from_pretrained(args.model_dir).eval(), AutoTokenizer.from_pretrained(args.model_dir)


def bench_model(name: str, args, workdir: Path) -> dict:
    from hf_variants import OrtModelForSeq2SeqLM
    from hf_variants.onnx.export import export

    model, tokenizer = load(args, name)
    started = time.perf_counter()
    folder = export(model, tokenizer, workdir / name, int8=True)
    manifest = json.loads((folder / "onnx_manifest.json").read_text())
    print(f"[{name}] exported in {time.perf_counter() - started:.1f} s; split {manifest['int8']}", flush=True)
    stacked = stacked_copy(folder, workdir / f"{name}_stacked")
    threads = args.threads
    models = {
        "fp32": OrtModelForSeq2SeqLM.from_pretrained(folder, precision="fp32", num_threads=threads),
        "int8_split": OrtModelForSeq2SeqLM.from_pretrained(folder, precision="int8", num_threads=threads),
        "int8_stacked": OrtModelForSeq2SeqLM.from_pretrained(stacked, precision="int8", num_threads=threads),
    }
    vocab = model.config.vocab_size
    inputs, _ = random_batch(args.batch, args.src_len, 2, vocab)
    inputs.update(language_inputs(model, args.batch))
    result = {
        "split": manifest["int8"]["split_stacked_matmuls"],
        "accuracy": accuracy(models, inputs, args.new_tokens),
    }
    for beams in args.beams:
        gen = generation_settings(beams, args.new_tokens)
        _, row = time_decoding(lambda engine: models[engine].generate(**inputs, **gen), list(ENGINES), args)
        row["split_vs_stacked"] = ratios(row, "int8_split", "int8_stacked")
        key = "greedy" if beams == 1 else f"beam{beams}"
        result[key] = row
        print(f"[{name} {key}] cpu tok/s {row['cpu_tok_s']} wall tok/s {row['wall_tok_s']}", flush=True)
        print(f"[{name} {key}] int8 split / stacked {row['split_vs_stacked']}", flush=True)
    return result


def main(argv=None) -> dict:
    parser = decoding_parser(__doc__, 5, "ort_stacked_weights.json")
    parser.add_argument("--models", nargs="+", default=["mute", "mimo"], choices=["mute", "mimo"])
    parser.add_argument("--model_dir", default=None, help="a trained model folder (one model type in --models)")
    args = parser.parse_args(argv)
    if args.model_dir is not None and len(args.models) != 1:
        parser.error("--model_dir takes one model in --models")
    torch.set_num_threads(args.threads)
    results = {"cpu": cpu_model(), "size": args.size, "threads": args.threads, "model_dir": args.model_dir}
    with tempfile.TemporaryDirectory(prefix="bench_ort_stacked_weights-") as scratch:
        for name in args.models:
            results[name] = bench_model(name, args, Path(scratch))
    return write_results(results, args.output)


if __name__ == "__main__":
    main()
