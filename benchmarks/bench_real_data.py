#!/usr/bin/env python
"""Decoding speed on real data: a trained transformer_nmt checkpoint translating test_2016_flickr (1,000
sentences) through the translation core, as hf-variants-translate and evaluation do (length-sorted batches of
`--batch` sources, each sentence under the model's saved length rule), greedy and beam 4 (length penalty 0.6).
Every engine is the core's `Translator` on it:

- `torch_fp32`: the checkpoint's own `generate()`;
- `ct2_fp32`, `ct2_int8`: CTranslate2 on `hf_variants.export_ctranslate2`'s conversion (when installed);
- `ort_fp32`, `ort_int8`: ONNX Runtime on `python -m hf_variants.export_onnx --int8`'s folder
  (`OrtModelForSeq2SeqLM.generate`: bound greedy / beam search, finished sentences leaving the batch);
- `ort_int8_keep_all`: the same int8 graphs decoding every sentence of a batch to the batch's end
  (`drop_finished = False`, as transformers' loop does).

The fixed-length benchmark (`bench_inference.py`: exactly 20 new tokens for every sentence) cannot show what a real
batch does: its sentences end at different steps (small baseline, greedy, batches of 32: a third of the rows a
batch decodes are past their sentence's end). CTranslate2 takes finished sentences out of its batches; this is the
benchmark of doing the same.

Every engine runs in its own process (`timing.EngineProcesses`); each call translates the whole test set; calls are
interleaved over the engines (A, B, C, ..., A, B, C, ...) after one warm-up each, whose translations give the BLEU
column; the median of `--reps` kept. Prints sentences/s, new tokens and BLEU per engine and the ratios; writes
`--output`.json/.md and the `real_data` section of benchmarks/RESULTS.md. Run it on a quiet machine.

    python benchmarks/bench_real_data.py --model runs/transformer_nmt-en-de-small/model [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_inference import ctranslate2_module, ort_module  # noqa: E402
from report import write_section  # noqa: E402
from timing import EngineProcesses, cpu_model, write_result  # noqa: E402

DATA_DIR = ROOT / "training" / "data" / "multi30k"
ENGINES = ["torch_fp32", "ct2_fp32", "ct2_int8", "ort_fp32", "ort_int8", "ort_int8_keep_all"]
RATIOS = [("ort_int8", "ct2_int8"), ("ort_int8", "ort_int8_keep_all"), ("ort_int8", "torch_fp32")]


def test_set(args, tokenizer) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """The sources, their token ids, and the batches (index lists, longest sources first) `evaluation.translate`
    makes of them."""
    from hf_variants.training.corpus import read_lines
    from hf_variants.training.evaluation import length_sorted_batches

    sources = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.src}.gz"))[: args.limit]
    ids = tokenizer(sources)["input_ids"]
    return sources, ids, length_sorted_batches([len(row) for row in ids], args.batch)


def prepare(args, workdir: Path) -> list[str]:
    """Convert the checkpoint for the engines that need it (CTranslate2, ONNX Runtime) into `workdir`; the engines to
    run."""
    from hf_variants.commands.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model)
    if model.config.model_type != "transformer_nmt":
        raise SystemExit(f"{args.model}: a transformer_nmt checkpoint (CTranslate2 takes the baseline only).")
    names = [name for name in args.engines if not name.startswith("ct2_") or ctranslate2_module() is not None]
    names = [name for name in names if not name.startswith("ort_") or ort_module() is not None]
    if any(name.startswith("ct2_") for name in names):
        from hf_variants.deploy.ctranslate2 import export

        export(model, tokenizer, workdir / "ct2")
    if any(name.startswith("ort_") for name in names):
        from hf_variants.onnx.export import export

        started = time.perf_counter()
        export(model, tokenizer, workdir / "onnx", int8=True)
        print(f"exported to ONNX in {time.perf_counter() - started:.1f} s", flush=True)
    return names


def engine(name: str, args, workdir: Path):
    """`translate(batch, beams)` of engine `name` through the translation core (`Translator` on the torch, ONNX
    Runtime or CTranslate2 engine, each sentence under the model's saved length rule): the hypotheses' token ids (no
    start token, eos or padding)."""
    from hf_variants.inference import DecodeOptions, Translator

    kind, precision = name.split("_")[:2]
    folders = {"torch": args.model, "ct2": str(workdir / "ct2"), "ort": str(workdir / "onnx")}
    engines = {"torch": "torch", "ct2": "ctranslate2", "ort": "onnx"}
    translator = Translator.from_pretrained(
        folders[kind], engine=engines[kind], precision=precision, num_threads=args.threads
    )
    if name.endswith("_keep_all"):  # every sentence of a batch decoded to the batch's end, as transformers' loop
        translator.engine.model.drop_finished = False
    tokenizer = translator.tokenizer
    sources, _, _ = test_set(args, tokenizer)
    special = {tokenizer.pad_token_id, translator.config.eos_token_id}

    def translate(batch, beams):
        options = DecodeOptions(num_beams=beams, length_penalty=0.6 if beams > 1 else 1.0)
        results = translator.translate([sources[i] for i in batch], options, batch_size=len(batch))
        return [[t for t in r.hypotheses[0].token_ids if t not in special] for r in results]

    return translate, tokenizer


def worker(args) -> None:
    """One engine in this process: build it, then answer each stdin line ("BEAMS" or "BEAMS text") with the seconds
    of translating the test set and its new tokens (and, asked "text", its translations) as a JSON line."""
    torch.set_num_threads(args.threads)
    translate, tokenizer = engine(args.worker, args, Path(args.workdir))
    _, _, batches = test_set(args, tokenizer)
    print(json.dumps({"ready": args.worker}), flush=True)
    for line in sys.stdin:
        beams, *text = line.split()
        outputs = {}
        start = time.perf_counter()
        for batch in batches:
            outputs.update(zip(batch, translate(batch, int(beams))))
        seconds = time.perf_counter() - start
        answer = {"seconds": seconds, "tokens": sum(len(row) for row in outputs.values())}
        if text:
            hypotheses = tokenizer.batch_decode([outputs[i] for i in range(len(outputs))], skip_special_tokens=True)
            answer["text"] = [h.strip() for h in hypotheses]
        print(json.dumps(answer), flush=True)


def measure(args, names: list[str], workdir: Path) -> dict:
    """Per decoding ("greedy", "beam4") and engine: sentences/s (median of the interleaved calls), new tokens, BLEU
    and chrF."""
    from hf_variants.training import evaluation
    from hf_variants.training.corpus import read_lines

    references = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.tgt}.gz"))[: args.limit]
    forwarded = [a for a in sys.argv[1:] if a != "--engines" and a not in args.engines]
    results = {}
    with EngineProcesses(pause=args.pause) as engines:
        for name in names:
            worker_argv = ["--engines", name, "--worker", name, "--workdir", str(workdir)]
            engines.start(name, [sys.executable, str(Path(__file__).resolve()), *forwarded, *worker_argv])
        for beams in (1, 4):
            key, rows = "greedy" if beams == 1 else f"beam{beams}", {}
            for name in names:
                answer = engines.call(name, f"{beams} text")  # warm-up, and the translations
                score = evaluation.score(answer["text"], references)
                rows[name] = {"tokens": answer["tokens"], "bleu": round(score["bleu"], 2), "seconds": []}
            for _ in range(args.reps):
                for name in names:
                    rows[name]["seconds"].append(engines.call(name, beams)["seconds"])
            for row in rows.values():
                row["sentences_per_s"] = round(len(references) / statistics.median(row["seconds"]), 1)
            results[key] = rows
            print(f"[{key}] " + " | ".join(f"{n} {r['sentences_per_s']:7.1f}" for n, r in rows.items()) + " sent/s")
            print(f"[{key}] ratios: " + " | ".join(f"{k} {v:.2f}x" for k, v in ratios(rows).items()), flush=True)
    return results


def ratios(rows: dict) -> dict:
    return {
        f"{a}/{b}": rows[a]["sentences_per_s"] / rows[b]["sentences_per_s"]
        for a, b in RATIOS
        if a in rows and b in rows
    }


def markdown(results: dict, args) -> str:
    lines = [
        f"`{args.model}` on test_2016_flickr {args.src}-{args.tgt} ({args.limit or 1000} sentences), batches of "
        f"{args.batch} sources, {args.threads} thread(s) per engine, median of {args.reps} interleaved runs; "
        f"{cpu_model()}, torch {torch.__version__}.",
        "",
        "| decoding | engine | sentences/s | new tokens | BLEU |",
        "|---|---|---:|---:|---:|",
    ]
    for key, rows in results.items():
        for name, row in rows.items():
            lines.append(f"| {key} | {name} | {row['sentences_per_s']} | {row['tokens']} | {row['bleu']} |")
    lines.append("")
    for key, rows in results.items():
        lines.append(f"- {key}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios(rows).items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained transformer_nmt checkpoint (as translate.py takes)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every engine")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--limit", type=int, help="the first N test sentences only (smoke runs)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between two calls")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "real_data"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one engine (see `worker`)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        names = prepare(args, Path(tmp))
        results = measure(args, names, Path(tmp))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "workdir")}
    summary = {key: ratios(rows) for key, rows in results.items()}
    record = {"settings": settings, "results": results, "ratios": summary}
    write_result(out.with_suffix(".json"), record)
    table = markdown(results, args)
    out.with_suffix(".md").write_text(table)
    if not args.limit:
        write_section(out.name, table)
    return results


if __name__ == "__main__":
    main()
