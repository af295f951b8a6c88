#!/usr/bin/env python
"""ONNX Runtime int8 with activations quantized per row (the exporter's default: a sentence's translation does not
depend on its batch) against per tensor (quantize_dynamic's scheme, what every int8 export had before), side by side
in one run, on the same int8 weights: decoding speed, BLEU, and how many sentences change with the batch.

One export of the model (`python -m hf_variants.export_onnx --int8`: per-row activations), a copy whose int8
graphs are quantized again from the same fp32 graphs with `activations="per_tensor"`, and an export with
`--int8_activations calibrated` (fixed scales from translating the first `--calibration_sentences` of
`--calibration_data`, by default Multi30k's training sources: not the test set). Engines, each in a process of its own
(`timing.EngineProcesses`), `--threads` intra-op threads (1 by default): `per_tensor`, `per_row` and `calibrated` (the
int8 graphs, `OrtModelForSeq2SeqLM.generate`: greedy and beam search bound on the shared-cache graph; `--schemes`
picks), and with `--fp32` the fp32 graphs. Calls are interleaved over the engines (A, B, A, B, ...) after one warm-up
each, the median of `--reps` kept (`--clock`: wall by default).

- fixed: bench_inference's batch (`--batch` 32 random sources of up to `--src_len` 15 tokens, padded rows), exactly
  `--new_tokens` 20 new tokens per sentence, greedy and beam 4 (length penalty 0.6): tokens/s;
- real: the first `--sentences` of test_2016_flickr (natural lengths) in length-sorted batches of `--batch`, the
  model's saved length rule, finished sentences leaving the batch (the bound search's default), greedy and beam 4:
  sentences/s, and BLEU / chrF (sacreBLEU) of each engine's translations against the references;
- batch: the first `--batch_sentences` sentences in their file order, translated at batch size 1 and at `--batch`,
  greedy and beam 4: how many translations differ (per row: 0 expected; per tensor: the defect it fixes).

Prints per mode the rates and each scheme over `per_tensor` (> 1: faster); writes `--output`.json/.md. The goal it
checks: batch-independent int8 (per row or calibrated) within 5% of per tensor greedy and beam 4 at 1 thread, BLEU
within 0.2. Run it on a quiet machine
with a trained model (speed numbers from a busy one are worthless; BLEU of a random model means nothing):

    python benchmarks/bench_ort_int8_activations.py --model runs/transformer_nmt-en-de-small/model --reps 5
    python benchmarks/bench_ort_int8_activations.py --random_preset small --reps 5   # speed only, random weights
    python benchmarks/bench_ort_int8_activations.py --random_preset tiny --reps 1 --sentences 40 \\
        --batch_sentences 20 --output /tmp/smoke                                      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import CLOCKS, EngineProcesses, cpu_model, generation_settings, random_batch, write_result  # noqa: E402

DATA_DIR = ROOT / "training" / "data" / "multi30k"
SCHEMES = ("per_tensor", "per_row", "calibrated")
MODES = ("fixed", "real", "batch")


def per_tensor_copy(folder: Path, target: Path) -> Path:
    """A copy of export `folder` whose int8 graphs quantize activations per tensor: quantized again from the same fp32
    graphs with the same weight format (`quantization.quantize(..., activations="per_tensor")`), the manifest's
    `int8.activations` saying so."""
    from hf_variants.onnx.quantization import quantize

    shutil.copytree(folder, target)
    manifest = json.loads((target / "onnx_manifest.json").read_text())
    int8 = manifest["int8"]
    pairs = [(manifest["graphs"]["fp32"][role], manifest["graphs"]["int8"][role]) for role in ("encoder", "decoder")]
    for entry in ("shared_cache", "scoring"):
        if manifest.get(entry, {}).get("written"):
            pairs.append((manifest[entry]["graphs"]["fp32"], manifest[entry]["graphs"]["int8"]))
    for fp32, quantized in pairs:
        quantize(target / fp32, target / quantized, int8["weights"], activations="per_tensor")
    for key in ("per_row", "opset"):
        int8.pop(key, None)
    int8["activations"] = "per_tensor"
    (target / "onnx_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return target


def prepare(args, workdir: Path) -> dict[str, Path]:
    """The model folder (`--model`, or a random one of `--random_preset`) exported, its per-tensor copy and its
    calibrated export, those of `--schemes`: engine name -> (folder, precision)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from hf_variants.onnx.export import export

    if args.model is None:
        from bench_serve import random_model

        args.model = random_model(args.random_preset, workdir / "model")
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    started = time.perf_counter()
    folder = export(model, tokenizer, workdir / "per_row", int8=True)
    print(f"exported to ONNX in {time.perf_counter() - started:.1f} s", flush=True)
    engines = {"per_tensor": (per_tensor_copy(folder, workdir / "per_tensor"), "int8"), "per_row": (folder, "int8")}
    if "calibrated" in args.schemes:
        from hf_variants.training.corpus import read_lines

        sources = [line for line in read_lines(args.calibration_data) if line.strip()][: args.calibration_sentences]
        calibrated = export(
            model,
            tokenizer,
            workdir / "calibrated",
            int8=True,
            int8_activations="calibrated",
            calibration_sources=sources,
        )
        engines["calibrated"] = (calibrated, "int8")
    engines = {name: engine for name, engine in engines.items() if name in args.schemes}
    if args.fp32:
        engines["fp32"] = (folder, "fp32")
    return engines


def test_set(args) -> tuple[list[str], list[str]]:
    from hf_variants.training.corpus import read_lines

    sources = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.src}.gz"))
    references = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.tgt}.gz"))
    return sources[: args.sentences], references[: args.sentences]


def worker(args) -> None:
    """One engine in this process (`--worker NAME`, the folder and precision from `--engine_folder`,
    `--engine_precision`), answering each stdin line ("MODE BEAMS") with a JSON line: fixed -> the seconds of one
    generate call and its new tokens; real -> the seconds of translating the test set, its translations; batch -> the
    translations at batch size 1 and at `--batch`."""
    from transformers import AutoTokenizer

    from hf_variants import OrtModelForSeq2SeqLM

    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-tensor copy's warning: that is what it is for
        model = OrtModelForSeq2SeqLM.from_pretrained(
            args.engine_folder, precision=args.engine_precision, num_threads=args.threads
        )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.engine_folder)
    sources, _ = test_set(args)
    fixed, _ = random_batch(args.batch, args.src_len, 2, len(tokenizer))
    timer = CLOCKS[args.clock]
    print(json.dumps({"ready": args.worker}), flush=True)
    for line in sys.stdin:
        mode, beams = line.split()
        settings = dict(num_beams=int(beams), **({"length_penalty": 0.6} if int(beams) > 1 else {}))
        start = timer()
        if mode == "fixed":
            out = model.generate(**fixed, **generation_settings(int(beams), args.new_tokens))
            answer = {"tokens": (out.shape[1] - 1) * args.batch}
        elif mode == "real":
            answer = {"text": translate(model, tokenizer, sources, args.batch, settings, sort=True)}
        else:
            picked = sources[: args.batch_sentences]
            answer = {
                "alone": translate(model, tokenizer, picked, 1, settings),
                "batched": translate(model, tokenizer, picked, args.batch, settings),
            }
        print(json.dumps({"seconds": timer() - start, **answer}), flush=True)


def translate(model, tokenizer, sources: list[str], batch: int, settings: dict, sort: bool = False) -> list[str]:
    """`sources` translated `batch` at a time (`sort`: longest first, as the translate command batches), in their
    order."""
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i])) if sort else list(range(len(sources)))
    texts = {}
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            picked = order[start : start + batch]
            inputs = model.prepare_translation_inputs(tokenizer, [sources[i] for i in picked])
            out = model.generate(**inputs, **settings)
            texts.update(zip(picked, tokenizer.batch_decode(out, skip_special_tokens=True)))
    return [texts[i].strip() for i in range(len(sources))]


def measure(args, argv: list[str], engines: dict) -> dict:
    """Per mode and decoding ("greedy", "beam4"): each engine's rate (median of the interleaved calls) and, for
    real, its BLEU / chrF; for batch, the sentences translated differently at batch size 1 and `--batch`."""
    _, references = test_set(args)
    forwarded = [
        a
        for a in argv
        if not a.startswith(("--model", "--random_preset")) and a not in (args.model, args.random_preset)
    ]
    results = {}
    with EngineProcesses(pause=args.pause) as processes:
        for name, (folder, precision) in engines.items():
            argv = ["--worker", name, "--engine_folder", str(folder), "--engine_precision", precision]
            processes.start(name, [sys.executable, str(Path(__file__).resolve()), *forwarded, *argv])
        for mode in args.modes:
            for beams in (1, 4):
                key, rows = f"{mode}/{'greedy' if beams == 1 else 'beam4'}", {}
                for name in engines:
                    rows[name] = dict(first=processes.call(name, f"{mode} {beams}"), seconds=[])
                for _ in range(args.reps if mode != "batch" else 0):
                    for name in engines:
                        rows[name]["seconds"].append(processes.call(name, f"{mode} {beams}")["seconds"])
                results[key] = {name: summarize(mode, row, references) for name, row in rows.items()}
                report(key, results[key])
    return results


def summarize(mode: str, row: dict, references: list[str]) -> dict:
    """One engine's numbers for one mode: its rate; BLEU / chrF (real); differing translations (batch)."""
    import sacrebleu

    first, seconds = row["first"], statistics.median(row["seconds"]) if row["seconds"] else None
    if mode == "fixed":
        return {"tokens_per_s": round(first["tokens"] / seconds, 1), "seconds": row["seconds"]}
    if mode == "real":
        return {
            "sentences_per_s": round(len(first["text"]) / seconds, 2),
            "seconds": row["seconds"],
            "bleu": round(sacrebleu.corpus_bleu(first["text"], [references]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(first["text"], [references]).score, 2),
        }
    differ = sum(a != b for a, b in zip(first["alone"], first["batched"]))
    return {"sentences": len(first["alone"]), "differ_batch_1_vs_batched": differ}


def report(key: str, rows: dict) -> None:
    rate = next((k for k in ("tokens_per_s", "sentences_per_s") for r in rows.values() if k in r), None)
    if rate is None:
        differ = (f"{n}: {r['differ_batch_1_vs_batched']} / {r['sentences']} differ" for n, r in rows.items())
        print(f"[{key}] batch size 1 against batched: " + " | ".join(differ), flush=True)
        return
    line = " | ".join(f"{n} {r[rate]}" + (f" (BLEU {r['bleu']})" if "bleu" in r else "") for n, r in rows.items())
    over = "".join(f" | {name} / per_tensor {value:.3f}x" for name, value in _over_per_tensor(rows, rate).items())
    print(f"[{key}] {rate}: {line}{over}", flush=True)


def _over_per_tensor(rows: dict, rate: str) -> dict:
    """Each scheme's rate over per tensor's (where both ran)."""
    if "per_tensor" not in rows:
        return {}
    return {name: row[rate] / rows["per_tensor"][rate] for name, row in rows.items() if name != "per_tensor"}


def markdown(results: dict, args) -> str:
    lines = [
        f"`{args.model}`, ONNX Runtime int8, activations {', '.join(args.schemes)} (the same int8 weights; "
        f"calibrated on {args.calibration_sentences} sentences of {Path(args.calibration_data).name}), "
        f"{args.threads} thread(s), batches of {args.batch}, median of {args.reps} interleaved runs ({args.clock} "
        f"clock); {cpu_model()}, onnxruntime {__import__('onnxruntime').__version__}.",
        "",
        "| mode | engine | rate | BLEU | chrF | batch 1 vs batched: differing |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, rows in results.items():
        for name, row in rows.items():
            rate = row.get("tokens_per_s", row.get("sentences_per_s", ""))
            unit = " tok/s" if "tokens_per_s" in row else " sent/s" if "sentences_per_s" in row else ""
            differ = f"{row['differ_batch_1_vs_batched']} / {row['sentences']}" if "sentences" in row else ""
            bleu, chrf = row.get("bleu", ""), row.get("chrf", "")
            lines.append(f"| {key} | {name} | {rate}{unit} | {bleu} | {chrf} | {differ} |")
    return "\n".join(lines) + "\n"


def ratios(results: dict) -> dict:
    """Each scheme's speed over per tensor's (> 1: faster) and its BLEU minus per tensor's, per mode and decoding."""
    out = {}
    for key, rows in results.items():
        rate = next((k for k in ("tokens_per_s", "sentences_per_s") for r in rows.values() if k in r), None)
        for name, value in (_over_per_tensor(rows, rate) if rate else {}).items():
            out[f"{key} speed {name}/per_tensor"] = round(value, 3)
            if "bleu" in rows[name]:
                out[f"{key} BLEU {name}-per_tensor"] = round(rows[name]["bleu"] - rows["per_tensor"]["bleu"], 2)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a saved model folder (trained: its BLEU means something)")
    source.add_argument("--random_preset", default="small", help="without --model: random weights of this preset")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model's)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src_len", type=int, default=15, help="fixed: the longest random source")
    parser.add_argument("--new_tokens", type=int, default=20, help="fixed: new tokens per sentence")
    parser.add_argument("--sentences", type=int, default=1000, help="real: the first N test sentences")
    parser.add_argument("--batch_sentences", type=int, default=200, help="batch: the first N test sentences")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every engine")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--fp32", action="store_true", help="also the fp32 graphs")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES, help="int8 activation schemes")
    parser.add_argument(
        "--calibration_data", default=str(DATA_DIR / "train.en.gz"), help="calibrated: source sentences, one a line"
    )
    parser.add_argument("--calibration_sentences", type=int, default=1000, help="calibrated: the first N of them")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between two calls")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "int8_activations"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one engine (see `worker`)
    parser.add_argument("--engine_folder", help=argparse.SUPPRESS)
    parser.add_argument("--engine_precision", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = prepare(args, Path(tmp))
        results = measure(args, argv, engines)
    out = Path(args.output)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "engine_folder", "engine_precision")}
    write_result(out.with_suffix(".json"), {"settings": settings, "results": results, "ratios": ratios(results)})
    out.with_suffix(".md").write_text(markdown(results, args))
    print(json.dumps(ratios(results), indent=2))
    return results


if __name__ == "__main__":
    main()
