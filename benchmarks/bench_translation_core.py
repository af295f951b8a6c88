#!/usr/bin/env python
"""The translation core's costs, side by side in one run, on a trained checkpoint:

1. **n-best overhead** (`nbest`): translating test_2016_flickr's sources with beam search (`--beams`), timed
   interleaved (`timing.interleaved`, process CPU time, the median of `--reps`): the plain 1-best (`best`), the
   1-best with its score and log-probability (`best_scores`: one teacher-forced forward more per batch), and the
   `--beams`-best list with scores (`nbest`), on PyTorch and on ONNX Runtime fp32 (`--onnx DIR`, an export of the
   same model). Prints seconds and the ratios to `best` of the same engine.
2. **streaming memory** (`stream`): `hf-variants-translate` in a process of its own on inputs of 1%, 10% and 100% of
   `--lines` (default 1,000,000) lines (test_2016_flickr's sources repeated), greedy with `--max_new_tokens 1`
   (the reading, batching and writing are measured, not long decodings), `--batch_size 256`; its peak resident
   set (`ru_maxrss` of the child) and its lines/s. Bounded memory: the peak does not grow with the input.

    python benchmarks/bench_translation_core.py --model runs/en-de/model [--onnx runs/en-de-onnx] \\
        [--threads 1] [--reps 3] [--lines 1000000] [--skip stream] --output benchmarks/results/translation_core

Without a checkpoint at hand, `--train_tiny STEPS --export_onnx` trains the tiny baseline for STEPS Adam steps on
the bundled Multi30k en -> de pairs (a 2,000-token BPE tokenizer trained first), saves it, and exports it to ONNX for
the ONNX Runtime rows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import interleaved, write_result  # noqa: E402

DATA_DIR = ROOT / "training" / "data" / "multi30k"


def train_tiny(steps: int, folder: Path) -> str:
    """The tiny baseline trained `steps` Adam steps (batches of 32 pairs of at most 40 tokens) on the bundled en -> de
    training pairs, saved with its tokenizer into `folder`; returns the folder."""
    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
    from hf_variants.tokenization import train_tokenizer

    def read(lang: str, n: int) -> list[str]:
        with gzip.open(DATA_DIR / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            return [next(f).rstrip("\n") for _ in range(n)]

    src, tgt = read("en", 8000), read("de", 8000)
    tokenizer = train_tokenizer(src + tgt, vocab_size=2000, languages=["en", "de"], output_dir=str(folder / "tok"))
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), dropout=0.0, languages=["en", "de"], target_languages=["de"]
    )
    model = TransformerNmtForConditionalGeneration(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        start = step * 32 % (len(src) - 32)
        batch = model.prepare_translation_inputs(
            tokenizer, src[start : start + 32], text_target=tgt[start : start + 32], max_length=40
        )
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.generation_config.num_beams, model.generation_config.length_penalty = 4, 0.6
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return str(folder / "model")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def sources(n: int | None = None) -> list[str]:
    with gzip.open(DATA_DIR / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n else lines


def nbest_overhead(args) -> dict:
    from hf_variants.inference import DecodeOptions, Translator

    texts = sources(args.sentences)
    engines = {"torch": Translator.from_pretrained(args.model, num_threads=args.threads)}
    if args.onnx:
        engines["onnx"] = Translator.from_pretrained(
            args.onnx, engine="onnx", num_threads=args.threads, tokenizer=args.model
        )
    cases = {
        "best": DecodeOptions(num_beams=args.beams),
        "best_scores": DecodeOptions(num_beams=args.beams, scores=True),
        "nbest": DecodeOptions(num_beams=args.beams, nbest=args.beams, scores=True),
    }
    fns = {
        f"{engine}_{case}": (lambda t=translator, o=options: t.translate(texts, o, batch_size=args.batch))
        for engine, translator in engines.items()
        for case, options in cases.items()
    }
    seconds = interleaved(fns, args.reps, clock="cpu")
    rows = {}
    for name, value in seconds.items():
        engine = name.split("_")[0]
        rows[name] = {
            "seconds": round(value, 3),
            "sentences_per_s": round(len(texts) / value, 1),
            "vs_best": round(value / seconds[f"{engine}_best"], 3),
        }
        print(f"{name:20s} {value:8.2f} s  {len(texts) / value:8.1f} sent/s  x{rows[name]['vs_best']:.2f} of 1-best")
    return {"sentences": len(texts), "beams": args.beams, "batch_size": args.batch, "rows": rows}


def streaming_memory(args) -> dict:
    texts = sources()
    rows = {}
    sizes = sorted({args.lines // 100, args.lines // 10, args.lines})
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            path = Path(tmp) / f"input_{size}.en"
            with open(path, "w", encoding="utf-8") as f:
                for i in range(size):
                    f.write(texts[i % len(texts)] + "\n")
            command = [
                sys.executable,
                "-c",
                "import resource, subprocess, sys, time\n"
                "start = time.perf_counter()\n"
                "code = subprocess.run(sys.argv[1:]).returncode\n"
                "print(code, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
                sys.executable,
                str(ROOT / "training" / "translate.py"),
                "--model",
                args.model,
                "--input",
                str(path),
                "--output",
                str(Path(tmp) / "out"),
                "--num_beams",
                "1",
                "--max_new_tokens",
                "1",
                "--batch_size",
                "256",
                "--no_progress",
            ]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            code, seconds, peak_kib = done.stdout.split()[-3:]
            if code != "0":
                raise SystemExit(f"translate failed on {size} lines:\n{done.stderr[-3000:]}")
            summary = json.loads(done.stdout[done.stdout.index("{") : done.stdout.rindex("}") + 1])
            lines_out = sum(1 for _ in open(Path(tmp) / "out", encoding="utf-8"))
            assert lines_out == size, (lines_out, size)
            rows[str(size)] = {
                "peak_rss_mib": round(int(peak_kib) / 1024, 1),
                "seconds": round(float(seconds), 1),  # the whole process: start, model load, translation
                "lines_per_s": summary["sentences_per_sec"],  # translating only (the command's own summary)
                "input_mib": round(path.stat().st_size / 2**20, 1),
            }
            row = rows[str(size)]
            print(
                f"{size:>9d} lines ({row['input_mib']} MiB): peak RSS {row['peak_rss_mib']} MiB, "
                f"{row['lines_per_s']} lines/s"
            )
            path.unlink()
    smallest, largest = rows[str(sizes[0])], rows[str(sizes[-1])]
    return {
        "rows": rows,
        "peak_growth": round(largest["peak_rss_mib"] / smallest["peak_rss_mib"], 3),
        "settings": "greedy, --max_new_tokens 1, --batch_size 256, default --buffer_size",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a saved model folder (a run's model/)")
    p.add_argument("--train_tiny", type=int, metavar="STEPS", help="no --model: train the tiny baseline STEPS steps")
    p.add_argument("--export_onnx", action="store_true", help="export the model to ONNX for the ONNX Runtime rows")
    p.add_argument("--onnx", help="its ONNX export (hf-variants-export-onnx), for the ONNX Runtime rows")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sentences", type=int, help="test sentences for the n-best rows (default: all 1,000)")
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--skip", nargs="*", default=[], choices=["nbest", "stream"])
    p.add_argument("--output", help="write OUTPUT.json")
    args = p.parse_args()
    if (args.model is None) == (args.train_tiny is None):
        p.error("pass --model DIR or --train_tiny STEPS")
    torch.set_num_threads(args.threads)
    work = tempfile.TemporaryDirectory()
    if args.train_tiny:
        args.model = train_tiny(args.train_tiny, Path(work.name))
    if args.export_onnx:
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        from hf_variants.onnx.export import export

        model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
        args.onnx = str(
            export(model, AutoTokenizer.from_pretrained(args.model), Path(work.name) / "onnx", progress=False)
        )
    record = {"command": " ".join(sys.argv), "threads": args.threads, "load_average_before": load_average()}
    if "nbest" not in args.skip:
        record["nbest"] = nbest_overhead(args)
    if "stream" not in args.skip:
        record["stream"] = streaming_memory(args)
    record["load_average_after"] = load_average()
    record["own_max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if args.output:
        write_result(f"{args.output}.json", record)
    print(f"load average before {record['load_average_before']}, after {record['load_average_after']}")


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"{time.time() - start:.0f} s")
