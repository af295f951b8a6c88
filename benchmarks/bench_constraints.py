#!/usr/bin/env python
"""What lexically constrained decoding costs, side by side in one run: sentences/s of the translation core on
test_2016_flickr's sources at beam 4 and 8 (`--beams`) with 0, 1, 2 and 4 constraints per sentence
(`--constraints`), on PyTorch fp32 and ONNX Runtime int8 (`--onnx DIR`, an export of the same model with
`--int8`), timed interleaved (`timing.interleaved`, process CPU time, the median of `--reps`), one thread by
default. 0 constraints is the plain path (generate()); the others run the constrained beam search. Each row gives
sentences/s, its time over the unconstrained time of the same engine and beam (`vs_unconstrained`), and the share
of sentences whose best hypothesis holds every constraint (`all_met`).

The constraints of a sentence are words of its reference translation (test_2016_flickr.de), the k longest of at
least 4 letters (fewer where the reference has fewer): the setting of the constrained-decoding papers (Post & Vilar
2018, Hu et al. 2019), where the phrases are reachable and the search must place them.

    python benchmarks/bench_constraints.py --model DIR --onnx ONNX_DIR --threads 1 --reps 3 --sentences 300 \\
        --output benchmarks/results/constraints_1thread

Without a checkpoint at hand, `--train_tiny STEPS --export_onnx` trains the tiny baseline (bench_translation_core's
`train_tiny`) and exports it with its int8 graphs. A smoke run: `--train_tiny 30 --export_onnx --sentences 8
--reps 1`.
"""

from __future__ import annotations

import argparse
import gzip
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_translation_core import DATA_DIR, load_average, sources, train_tiny  # noqa: E402
from timing import interleaved, write_result  # noqa: E402


def references(n: int | None) -> list[str]:
    with gzip.open(DATA_DIR / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n else lines


def reference_words(reference: str, k: int) -> tuple[str, ...]:
    """The k longest words (letters only, at least 4) of a reference, in their order there, each once."""
    words = [w.strip(".,;:!?\"'()") for w in reference.split()]
    words = list(dict.fromkeys(w for w in words if len(w) >= 4 and w.isalpha()))
    chosen = set(sorted(words, key=lambda w: (-len(w), words.index(w)))[:k])
    return tuple(w for w in words if w in chosen)


def engines(args) -> dict:
    from hf_variants.inference import Translator

    found = {"torch": Translator.from_pretrained(args.model, num_threads=args.threads)}
    if args.onnx:
        found["onnx_int8"] = Translator.from_pretrained(
            args.onnx, engine="onnx", precision="int8", num_threads=args.threads, tokenizer=args.model
        )
    return found


def measure(args) -> dict:
    from hf_variants.inference import DecodeOptions, TranslationRequest

    texts, refs = sources(args.sentences), references(args.sentences)
    requests = {
        k: [TranslationRequest(t, constraints=reference_words(r, k)) for t, r in zip(texts, refs)]
        for k in args.constraints
    }
    translators = engines(args)
    fns, outputs = {}, {}
    for engine, translator in translators.items():
        for beams in args.beams:
            for k in args.constraints:
                name = f"{engine}_beam{beams}_c{k}"

                def run(t=translator, r=requests[k], o=DecodeOptions(num_beams=beams), name=name):
                    outputs[name] = t.translate(r, o, batch_size=args.batch)

                fns[name] = run
    seconds = interleaved(fns, args.reps, clock="cpu")
    rows = {}
    for name, value in seconds.items():
        base = name.rsplit("_c", 1)[0] + "_c0"
        results = outputs[name]
        with_constraints = [r for r in results if r.constraints]
        rows[name] = {
            "seconds": round(value, 3),
            "sentences_per_s": round(len(texts) / value, 1),
            "vs_unconstrained": round(value / seconds[base], 3) if base in seconds else None,
            "all_met": round(sum(bool(r.constraints_met) for r in with_constraints) / len(with_constraints), 3)
            if with_constraints
            else None,
            "constraints": sum(len(r.constraints) for r in results),
        }
        row = rows[name]
        print(
            f"{name:24s} {value:8.2f} s  {row['sentences_per_s']:8.1f} sent/s  x{row['vs_unconstrained']} of "
            f"unconstrained  all met: {row['all_met']}"
        )
    return {"sentences": len(texts), "batch_size": args.batch, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a saved model folder (a run's model/)")
    p.add_argument("--train_tiny", type=int, metavar="STEPS", help="no --model: train the tiny baseline STEPS steps")
    p.add_argument("--export_onnx", action="store_true", help="export the model to ONNX (with int8 graphs)")
    p.add_argument("--onnx", help="its ONNX export with int8 graphs (hf-variants-export-onnx --int8)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--beams", type=int, nargs="+", default=[4, 8])
    p.add_argument("--constraints", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sentences", type=int, help="test sentences (default: all 1,000)")
    p.add_argument("--output", help="write OUTPUT.json")
    args = p.parse_args()
    if (args.model is None) == (args.train_tiny is None):
        p.error("pass --model DIR or --train_tiny STEPS")
    if 0 not in args.constraints:
        args.constraints = [0, *args.constraints]  # the unconstrained rows the ratios divide by
    torch.set_num_threads(args.threads)
    work = tempfile.TemporaryDirectory()
    if args.train_tiny:
        args.model = train_tiny(args.train_tiny, Path(work.name))
    if args.export_onnx:
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        from hf_variants.onnx.export import export

        model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        args.onnx = str(export(model, tokenizer, Path(work.name) / "onnx", int8=True, progress=False))
    record = {"command": " ".join(sys.argv), "threads": args.threads, "load_average_before": load_average()}
    record["constraints"] = measure(args)
    record["load_average_after"] = load_average()
    record["own_max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if args.output:
        write_result(f"{args.output}.json", record)
    print(f"load average before {record['load_average_before']}, after {record['load_average_after']}")


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"{time.time() - start:.0f} s")
