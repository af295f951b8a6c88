#!/usr/bin/env python
"""Scoring throughput (forced decoding of given pairs, pairs/s) of a trained transformer_nmt checkpoint on
test_2016_flickr (1,000 pairs: the sources and their reference translations), side by side in one run:

- `torch_fp32`: `hf_variants.inference.scoring.score_pairs` on the PyTorch model (one forward over each target);
- `ort_fp32`, `ort_int8`: `score_pairs` on ONNX Runtime (`hf_variants.export_onnx --int8 --scoring_graph`'s
  folder): the scoring graph, each batch's whole targets in one run;
- `ort_step_fp32`, `ort_step_int8`: the same folder without the scoring graph (what a folder exported without
  `--scoring_graph` does): the step graph run over the target one position at a time, on the shared-cache graph;
- `ct2_fp32`, `ct2_int8`: CTranslate2's `Translator.score_batch` on `hf_variants.export_ctranslate2`'s conversion
  (`compute_type` float32 / int8), when installed.

What `hf-variants-score` does, timed whole: tokenizing the pairs, length-sorted batches of `--batch` pairs
(CTranslate2: `max_batch_size=--batch`, its own length sorting), the scores. Every engine runs in its own process
(`timing.EngineProcesses`) with `--threads` threads; calls are interleaved over the engines (A, B, C, ..., A, B, C,
...) after one warm-up each, whose scores give the agreement columns (the largest difference of a pair's log-prob
from torch fp32's, and the corpus perplexity); the median of `--reps` kept, on `--clock` (`cpu`, the default: the
process's CPU time, robust on a shared machine for 1-thread engines; `wall`: elapsed time, for a quiet machine or
several threads). Prints pairs/s per engine and the ratios; writes `--output`.json with the load average before
and after.

    python benchmarks/bench_scoring.py --model runs/transformer_nmt-en-de/model [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import CLOCKS, EngineProcesses, cpu_model, write_result  # noqa: E402

DATA_DIR = ROOT / "training" / "data" / "multi30k"
ENGINES = ["torch_fp32", "ort_fp32", "ort_int8", "ort_step_fp32", "ort_step_int8", "ct2_fp32", "ct2_int8"]
RATIOS = [
    ("ort_int8", "ct2_int8"),
    ("ort_fp32", "ct2_fp32"),
    ("torch_fp32", "ct2_fp32"),
    ("ort_int8", "torch_fp32"),
    ("ort_fp32", "torch_fp32"),
    ("ort_int8", "ort_step_int8"),
    ("ort_fp32", "ort_step_fp32"),
]


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def pairs(args) -> tuple[list[str], list[str]]:
    from hf_variants.training.corpus import read_lines

    sources = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.src}.gz"))[: args.limit]
    targets = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.tgt}.gz"))[: args.limit]
    return sources, targets


def prepare(args, workdir: Path) -> list[str]:
    """Convert the checkpoint for CTranslate2 and ONNX Runtime into `workdir`; the engines to run."""
    from hf_variants.commands.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model)
    if model.config.model_type != "transformer_nmt":
        raise SystemExit(f"{args.model}: a transformer_nmt checkpoint (CTranslate2 takes the baseline only).")
    names = [n for n in args.engines if not n.startswith("ct2_") or installed("ctranslate2")]
    names = [n for n in names if not n.startswith("ort_") or installed("onnxruntime")]
    if any(n.startswith("ct2_") for n in names):
        from hf_variants.deploy.ctranslate2 import export

        export(model, tokenizer, workdir / "ct2")
    if any(n.startswith("ort_") for n in names):
        from hf_variants.onnx.export import export

        started = time.perf_counter()
        export(model, tokenizer, workdir / "onnx", int8=True, progress=False, scoring=True)
        print(f"exported to ONNX in {time.perf_counter() - started:.1f} s", flush=True)
    return names


def engine(name: str, args, workdir: Path):
    """`score()` of engine `name`: the log-probability of every test pair, in order."""
    sources, targets = pairs(args)
    if name.startswith("ct2_"):
        import ctranslate2
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(workdir / "ct2")
        compute = {"ct2_fp32": "float32", "ct2_int8": "int8"}[name]
        translator = ctranslate2.Translator(
            str(workdir / "ct2"), device="cpu", compute_type=compute, intra_threads=args.threads, inter_threads=1
        )

        def score():
            source = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(sources)["input_ids"]]
            # CTranslate2 appends the end token to a target itself (and scores it)
            target = [tokenizer.convert_ids_to_tokens(ids[:-1]) for ids in tokenizer(text_target=targets)["input_ids"]]
            results = translator.score_batch(source, target, max_batch_size=args.batch, batch_type="examples")
            return [math.fsum(r.log_probs) for r in results], sum(len(r.log_probs) for r in results)

        return score
    from hf_variants.inference import Translator
    from hf_variants.inference.scoring import score_pairs

    if name.startswith("ort_"):
        from hf_variants.onnx.modeling import OrtModelForSeq2SeqLM

        if name.startswith("ort_step_"):  # this process scores on the step graph
            OrtModelForSeq2SeqLM.has_scoring_graph = property(lambda self: False)
        translator = Translator.from_pretrained(
            str(workdir / "onnx"), engine="onnx", precision=name.split("_")[-1], num_threads=args.threads
        )
    else:
        translator = Translator.from_pretrained(args.model, engine="torch", num_threads=args.threads)

    def score():
        with torch.inference_mode():
            results = score_pairs(translator, sources, targets, batch_size=args.batch)
        return [r.log_prob for r in results], sum(r.tokens for r in results)

    return score


def worker(args) -> None:
    """One engine in this process: build it, then answer each stdin line ("go" or "go scores") with the seconds of
    scoring the test set and its target tokens (and, asked "scores", the per-pair log-probabilities) as a JSON line."""
    torch.set_num_threads(args.threads)
    score = engine(args.worker, args, Path(args.workdir))
    clock = CLOCKS[args.clock]
    print(json.dumps({"ready": args.worker}), flush=True)
    for line in sys.stdin:
        start = clock()
        log_probs, tokens = score()
        answer = {"seconds": clock() - start, "tokens": tokens}
        if "scores" in line:
            answer["log_probs"] = log_probs
        print(json.dumps(answer), flush=True)


def measure(args, names: list[str], workdir: Path) -> dict:
    """Per engine: pairs/s (median of the interleaved calls), target tokens/s, agreement with torch fp32."""
    n = len(pairs(args)[0])
    forwarded = [a for a in sys.argv[1:] if a != "--engines" and a not in args.engines]
    rows: dict = {}
    with EngineProcesses(pause=args.pause) as engines:
        for name in names:
            worker_argv = ["--engines", name, "--worker", name, "--workdir", str(workdir)]
            engines.start(name, [sys.executable, str(Path(__file__).resolve()), *forwarded, *worker_argv])
        for name in names:
            answer = engines.call(name, "go scores")  # warm-up, and the scores
            rows[name] = {"tokens": answer["tokens"], "log_probs": answer["log_probs"], "seconds": []}
        for _ in range(args.reps):
            for name in names:
                rows[name]["seconds"].append(engines.call(name, "go")["seconds"])
    reference = rows.get("torch_fp32", {}).get("log_probs")
    for row in rows.values():
        log_probs = row.pop("log_probs")
        median = statistics.median(row["seconds"])
        row["pairs_per_s"] = round(n / median, 1)
        row["tokens_per_s"] = round(row["tokens"] / median, 1)
        row["corpus_ppl"] = round(math.exp(-math.fsum(log_probs) / row["tokens"]), 4)
        if reference is not None:
            row["max_abs_diff_vs_torch_fp32"] = max(abs(a - b) for a, b in zip(log_probs, reference))
    print(" | ".join(f"{name} {row['pairs_per_s']:7.1f}" for name, row in rows.items()) + " pairs/s")
    print("ratios: " + " | ".join(f"{k} {v:.2f}x" for k, v in ratios(rows).items()), flush=True)
    return rows


def ratios(rows: dict) -> dict:
    return {f"{a}/{b}": rows[a]["pairs_per_s"] / rows[b]["pairs_per_s"] for a, b in RATIOS if a in rows and b in rows}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained transformer_nmt model folder (or checkpoint)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64, help="pairs a batch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--limit", type=int, help="the first N pairs only (smoke runs)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="what a call's seconds are")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between two engines' calls")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "scoring_1thread"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_scoring-") as tmp:
        names = prepare(args, Path(tmp))
        load_before = load_average()
        rows = measure(args, names, Path(tmp))
        load_after = load_average()
    record = {
        "model": args.model,
        "data": f"test_2016_flickr {args.src}-{args.tgt}",
        "pairs": len(pairs(args)[0]),
        "threads": args.threads,
        "batch": args.batch,
        "reps": args.reps,
        "clock": args.clock,
        "cpu": cpu_model(),
        "load_average": {"before": load_before, "after": load_after},
        "engines": rows,
        "ratios": {k: round(v, 3) for k, v in ratios(rows).items()},
    }
    write_result(Path(args.output).with_suffix(".json"), record)
    print(f"wrote {Path(args.output).with_suffix('.json')}")


if __name__ == "__main__":
    main()
