#!/usr/bin/env python
"""CPU inference side by side: MarianMTModel, ours and CTranslate2, fp32 and int8, in one run.

Speed mode (default). Per dims class (`--sizes`, default small and base): a random MarianMTModel, the same weights
converted to our baseline (`hf_variants.convert_marian`) and to CTranslate2 (`hf_variants.export_ctranslate2`), and
every variant of the efficiency table (benchmarks/efficiency.py: its configurations, random weights). Engines:

- `marian_fp32`, `marian_int8` (torch's dynamic int8, `torch.ao.quantization.quantize_dynamic`);
- `ours_fp32`, `ours_int8` (`quantize_for_cpu`: oneDNN, per-token activations), `ours_int8_per_tensor`,
  `ours_int8_fbgemm` (`quantize_for_cpu(backend="fbgemm")`, per tensor);
- `ct2_fp32`, `ct2_int8` (CTranslate2 on the converted weights, `compute_type` float32 / int8), when installed;
- `<variant>_fp32`, `<variant>_int8` for mute, hysan, mgsa, tied, mimo;
- `ort_<model>_fp32`, `ort_<model>_int8` (ONNX Runtime: `python -m hf_variants.export_onnx` of the same weights,
  attention fused into MultiHeadAttention where it qualifies (the exporter's default),
  `OrtModelForSeq2SeqLM.generate`) for the baseline (`ort_ours_*`) and every variant the
  exporter takes (all of them: MG-SA's phrase heads included), unless `--skip_ort` or onnxruntime is missing.

Every engine runs in its own process (`--worker`; in one process, torch's OpenMP pool and ORT's threads spin against
each other: torch fp32 measured ~25% slower beside ORT), built from the same seeded weights; the parent sends the
calls round-robin (A, B, C, ..., A, B, C, ...), one process at a time, with a short pause between calls.

The same batch (`--batch` 32 sources of up to `--src_len` 15 tokens, padded rows from half to full length) for all;
exactly `--new_tokens` 20 new tokens per sentence (min = max), greedy and beam 4 (length penalty 0.6); `--threads` 2
for torch and CTranslate2. Calls are interleaved over the engines (A, B, C, ..., A, B, C, ...) after one warm-up
each, the median of `--reps` kept (`--clock wall` by default: elapsed time, as a deployment sees it). Prints tok/s
per engine and the ratios (ours / Marian, ours / CTranslate2, ORT int8 / torch fp32); writes
`benchmarks/results/inference.json` and the `inference` section of benchmarks/RESULTS.md.

BLEU mode (`--bleu_model DIR`): fp32 against int8 BLEU of a checkpoint (a saved model folder or a training checkpoint
folder, as translate.py takes) on test_2016_flickr (training/data/multi30k), beam 4, length penalty 0.6; for a
transformer_nmt model also CTranslate2 fp32 / int8 when installed; ONNX Runtime fp32 / int8 for every exportable
model type when onnxruntime is installed. `--limit N` translates the first N sentences
only (smoke runs).

Numbers from a busy machine are worthless: run on a quiet one.

    python benchmarks/bench_inference.py [--sizes small base] [--reps 5] [--models baseline mute ...]
    python benchmarks/bench_inference.py --bleu_model runs/transformer_nmt-en-de-base/model --src en --tgt de
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import write_section  # noqa: E402
from timing import CLOCKS, EngineProcesses, portable, random_batch, run_metadata, write_result  # noqa: E402

from hf_variants import TransformerNmtConfig, quantize_for_cpu  # noqa: E402
from hf_variants.convert.marian import convert_marian  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
DATA_DIR = ROOT / "training" / "data" / "multi30k"
VARIANTS = ["mute", "hysan", "mgsa", "tied", "mimo"]


def ctranslate2_module():
    try:
        import ctranslate2
    except ImportError:
        return None
    return ctranslate2


class _Vocabulary:
    """The token strings CTranslate2 needs for a random model: `t<id>` (no tokenizer involved)."""

    unk_token = "<unk>"
    SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]

    def __init__(self, size: int):
        self.tokens = self.SPECIAL + [f"t{i}" for i in range(len(self.SPECIAL), size)]

    def __len__(self):
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]

    def save_pretrained(self, path):
        (Path(path) / "vocabulary.txt").write_text("\n".join(self.tokens) + "\n")


def marian_and_ours(size: str, vocab: int):
    from transformers import MarianConfig, MarianMTModel

    dims = {k: v for k, v in TransformerNmtConfig.PRESETS[size].items() if k not in ("dropout",)}
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=vocab,
        decoder_vocab_size=vocab,
        scale_embedding=True,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=1,
        forced_eos_token_id=None,
        activation_function="relu",
        dropout=0.0,
        **{"max_position_embeddings": 512, **dims},
    )
    marian = MarianMTModel(config).eval()
    ours = convert_marian(marian).eval()
    ours.generation_config = copy.deepcopy(marian.generation_config)  # the same decoding rules for both
    return marian, ours


def torch_engines(size: str, args, only: str | None = None) -> dict:
    """name -> (model, extra inputs) for every torch engine of this dims class (`only`: that one)."""
    from efficiency import build, language_inputs

    def wanted(name):
        return only is None or only == name

    marian, ours = marian_and_ours(size, args.vocab)
    engines = {name: (model, {}) for name, model in (("marian_fp32", marian), ("ours_fp32", ours)) if wanted(name)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_dynamic's and fbgemm's deprecation warnings
        if wanted("marian_int8"):
            engines["marian_int8"] = (
                torch.ao.quantization.quantize_dynamic(copy.deepcopy(marian), {torch.nn.Linear}, dtype=torch.qint8),
                {},
            )
        if wanted("ours_int8"):
            engines["ours_int8"] = (quantize_for_cpu(copy.deepcopy(ours)), {})
        if wanted("ours_int8_per_tensor"):
            engines["ours_int8_per_tensor"] = (
                quantize_for_cpu(copy.deepcopy(ours), activation_granularity="per_tensor"),
                {},
            )
        if not args.skip_fbgemm and wanted("ours_int8_fbgemm"):
            engines["ours_int8_fbgemm"] = (quantize_for_cpu(copy.deepcopy(ours), backend="fbgemm"), {})
    for name in args.models:
        if name == "baseline" or not (wanted(f"{name}_fp32") or wanted(f"{name}_int8")):
            continue
        model = build(name, size, args.vocab).eval()
        extra = language_inputs(model, args.batch)
        engines[f"{name}_fp32"] = (model, extra)
        engines[f"{name}_int8"] = (quantize_for_cpu(copy.deepcopy(model)), extra)
    return engines, ours


def ct2_engines(ours, args, workdir: Path) -> dict:
    ctranslate2 = ctranslate2_module()
    if ctranslate2 is None or args.skip_ct2:
        return {}
    from hf_variants.deploy.ctranslate2 import export

    path = export(ours, _Vocabulary(args.vocab), workdir / "ct2", force=True)
    return {
        f"ct2_{kind}": ctranslate2.Translator(
            str(path), device="cpu", compute_type=compute, intra_threads=args.threads or 0, inter_threads=1
        )
        for kind, compute in (("fp32", "float32"), ("int8", "int8"))
    }


def ort_module():
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


def ort_exports(size: str, args, workdir: Path) -> dict:
    """Export the baseline (`ours`) and every variant of `args.models` the exporter takes: name -> folder."""
    if args.skip_ort or ort_module() is None:
        return {}
    from efficiency import build

    from hf_variants.onnx.export import export

    _, ours = marian_and_ours(size, args.vocab)
    models = {"ours": ours}
    models.update({name: build(name, size, args.vocab).eval() for name in args.models if name != "baseline"})
    folders = {}
    for name, model in models.items():
        try:
            started = time.perf_counter()
            folders[name] = export(model, _Vocabulary(args.vocab), workdir / f"ort_{name}", int8=True, force=True)
            print(f"[{size}] exported {name} to ONNX in {time.perf_counter() - started:.1f} s", flush=True)
        except ValueError as error:
            print(f"[{size}] no ORT rows for {name}: {error}", flush=True)
    return folders


def engine_names(size: str, args, workdir: Path) -> list[str]:
    names = ["marian_fp32", "ours_fp32", "marian_int8", "ours_int8", "ours_int8_per_tensor"]
    if not args.skip_fbgemm:
        names.append("ours_int8_fbgemm")
    names += [f"{name}_{kind}" for name in args.models if name != "baseline" for kind in ("fp32", "int8")]
    if ctranslate2_module() is not None and not args.skip_ct2:
        names += ["ct2_fp32", "ct2_int8"]
    names += [f"ort_{name}_{kind}" for name in ort_exports(size, args, workdir) for kind in ("fp32", "int8")]
    return names


def worker(args) -> None:
    """One engine in this process: build it, then answer each stdin line ("1" or "4": beams) with the seconds of
    one generate call and the number of new tokens, as a JSON line."""
    name, size, workdir = args.worker, args.worker_size, Path(args.workdir)
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    if name.startswith("ort_"):
        from efficiency import language_inputs

        from hf_variants import OrtModelForSeq2SeqLM

        model_name, precision = name[4:].rsplit("_", 1)
        model = OrtModelForSeq2SeqLM.from_pretrained(
            workdir / size / f"ort_{model_name}", precision=precision, num_threads=args.threads or None
        )
        extra = language_inputs(model, args.batch)

        def run(gen):
            length = model.generate(**inputs, **extra, **gen).shape[1] - 1
            return length, model.last_decoding["path"]  # bound_greedy, bound_beam or loop (hf_variants.onnx.decoding)

    elif name.startswith("ct2_"):
        _, ours = marian_and_ours(size, args.vocab)
        translator = ct2_engines(ours, args, workdir / size / name)[name]
        vocabulary = _Vocabulary(args.vocab)
        source_tokens = [
            vocabulary.convert_ids_to_tokens(row[mask.bool()].tolist())
            for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])
        ]

        def run(gen):
            results = translator.translate_batch(
                source_tokens,
                beam_size=gen["num_beams"],
                length_penalty=gen.get("length_penalty", 1.0),
                min_decoding_length=args.new_tokens,
                max_decoding_length=args.new_tokens,
            )
            return min(len(r.hypotheses[0]) for r in results), None
    else:
        engines, _ = torch_engines(size, args, only=name)
        model, extra = engines[name]

        def run(gen):
            with torch.inference_mode():
                return model.generate(**inputs, **extra, **gen).shape[1] - 1, None

    timer = CLOCKS[args.clock]
    print(json.dumps({"ready": name}), flush=True)
    for line in sys.stdin:
        beams = int(line)
        gen = dict(
            num_beams=beams,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            **({"length_penalty": 0.6} if beams > 1 else {}),
        )
        start = timer()
        length, path = run(gen)
        print(json.dumps({"seconds": timer() - start, "length": length, "path": path}), flush=True)


def bench_size(size: str, args, workdir: Path) -> tuple[dict, dict]:
    """tok/s per decoding and engine, and the decoding path of each ORT engine (`last_decoding["path"]`)."""
    (workdir / size).mkdir(parents=True, exist_ok=True)
    names = engine_names(size, args, workdir / size)
    forwarded = (
        [a for a in sys.argv[1:] if a not in ("--sizes", *args.sizes)] if args._forward is None else args._forward
    )
    rows, paths = {}, {}
    with EngineProcesses(pause=args.pause) as engines:
        for name in names:
            worker_argv = ["--worker", name, "--worker_size", size, "--workdir", str(workdir)]
            engines.start(name, [sys.executable, str(Path(__file__).resolve()), *forwarded, *worker_argv])
        for beams in (1, 4):
            lengths, times = {}, {name: [] for name in names}
            key = "greedy" if beams == 1 else f"beam{beams}"
            for name in names:
                answer = engines.call(name, beams)  # warm-up
                lengths[name] = answer["length"]
                if answer.get("path"):
                    paths.setdefault(key, {})[name] = answer["path"]
            for _ in range(args.reps):
                for name in names:
                    times[name].append(engines.call(name, beams)["seconds"])
            seconds = {name: statistics.median(t) for name, t in times.items()}
            if set(lengths.values()) != {args.new_tokens}:  # equal work, or the tok/s do not compare
                raise RuntimeError(f"Output lengths differ from {args.new_tokens} new tokens: {lengths}")
            tokens = args.batch * args.new_tokens
            rows[key] = {name: round(tokens / s, 1) for name, s in seconds.items()}
            print(
                f"[{size} {key}] " + " | ".join(f"{n} {v:8.1f}" for n, v in rows[key].items()) + " tok/s", flush=True
            )
            print(
                f"[{size} {key}] ratios: " + " | ".join(f"{k} {v:.2f}x" for k, v in ratios(rows[key]).items()),
                flush=True,
            )
            if paths.get(key):
                print(f"[{size} {key}] ORT decoding: {paths[key]}", flush=True)
    return rows, paths


def ratios(row: dict) -> dict:
    """The speed ratios of a row: ours fp32 / Marian fp32, every int8 engine / Marian int8 and / CTranslate2 int8,
    ours / CTranslate2 fp32, and ORT int8 / the same model's torch fp32."""
    out = {}

    def ratio(a, b):
        if a in row and b in row:
            out[f"{a}/{b}"] = round(row[a] / row[b], 3)

    ratio("ours_fp32", "marian_fp32")
    ratio("ours_fp32", "ct2_fp32")
    for name in [n for n in row if "_int8" in n]:
        if name.startswith(("marian", "ct2")):
            continue
        ratio(name, "marian_int8")
        ratio(name, "ct2_int8")
    for name in [n for n in row if n.startswith("ort_") and n.endswith("_int8")]:
        ratio(name, f"{name[4:-5]}_fp32")  # ONNX Runtime int8 / the same model's torch fp32
    return out


def markdown(results: dict, args, paths: dict | None = None) -> str:
    lines = [
        f"Batch {args.batch} x up to {args.src_len} source tokens, exactly {args.new_tokens} new tokens, "
        f"{args.threads or 'default'} thread(s) (torch and CTranslate2), median of {args.reps} interleaved runs, "
        f"clock: {args.clock}; tok/s (generated tokens per second). Same random weights for Marian, ours and "
        "CTranslate2; the variants have their own random weights.",
        "",
    ]
    for size, rows in results.items():
        engines = list(next(iter(rows.values())))
        lines += [f"**{size}**", "", "| decoding | " + " | ".join(engines) + " |", "|---|" + "---:|" * len(engines)]
        for key, row in rows.items():
            lines.append(f"| {key} | " + " | ".join(f"{row[e]:.0f}" for e in engines) + " |")
        lines += [
            "",
            "| decoding | " + " | ".join(ratios(next(iter(rows.values())))) + " |",
            "|---|" + "---:|" * len(ratios(next(iter(rows.values())))),
        ]
        for key, row in rows.items():
            lines.append(f"| {key} | " + " | ".join(f"{v:.2f}x" for v in ratios(row).values()) + " |")
        for key, by_engine in (paths or {}).get(size, {}).items():
            ways = sorted(set(by_engine.values()))
            lines += [
                "",
                f"ORT {key}: "
                + ", ".join(f"{way} ({sum(v == way for v in by_engine.values())} engines)" for way in ways),
            ]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------- BLEU
def bleu_mode(args) -> dict:
    from hf_variants.commands.loading import load_model_and_tokenizer
    from hf_variants.training import evaluation
    from hf_variants.training.corpus import read_lines

    sources = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.src}.gz"))
    references = read_lines(str(DATA_DIR / f"test_2016_flickr.{args.tgt}.gz"))
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    model, tokenizer = load_model_and_tokenizer(args.bleu_model)
    languages = list(getattr(model.config, "languages", None) or [])
    tgt_lang = args.tgt if languages else None
    gen = dict(batch_size=args.batch, num_beams=4, length_penalty=0.6)
    hyps = {"fp32": evaluation.translate(model, tokenizer, sources, tgt_lang, **gen)}
    hyps["int8"] = evaluation.translate(quantize_for_cpu(copy.deepcopy(model)), tokenizer, sources, tgt_lang, **gen)
    ctranslate2 = ctranslate2_module()
    if model.config.model_type == "transformer_nmt" and ctranslate2 is not None and not args.skip_ct2:
        from hf_variants.deploy.ctranslate2 import export

        with tempfile.TemporaryDirectory() as tmp:
            path = export(model, tokenizer, Path(tmp) / "ct2")
            # through the translation core, as the other rows (evaluation.translate): length-sorted batches of
            # --batch sources, the length rule per sentence (evaluation's max_len_a / max_len_b)
            from hf_variants.inference import DecodeOptions, TranslationRequest, Translator

            options = DecodeOptions(
                num_beams=4, length_penalty=0.6, max_len_a=evaluation.MAX_LEN_A, max_len_b=evaluation.MAX_LEN_B
            )
            requests = [TranslationRequest(text, tgt_lang=tgt_lang) for text in sources]
            for kind, precision in (("ct2_fp32", "fp32"), ("ct2_int8", "int8")):
                translator = Translator.from_pretrained(
                    str(path), engine="ctranslate2", precision=precision, num_threads=args.threads or None
                )
                hyps[kind] = [r.text for r in translator.translate(requests, options, batch_size=args.batch)]
    ort_weights = None
    if ort_module() is not None and not args.skip_ort:  # ONNX Runtime fp32 / int8 of the same weights
        from hf_variants import OrtModelForSeq2SeqLM
        from hf_variants.onnx.export import export as export_onnx

        with tempfile.TemporaryDirectory() as tmp:
            try:
                folder = export_onnx(model, tokenizer, Path(tmp) / "onnx", int8=True)
            except ValueError as error:
                print(f"no ORT rows: {error}")
            else:
                manifest = json.loads((folder / "onnx_manifest.json").read_text())
                ort_weights = manifest["int8"]["weights"]
                for precision in ("fp32", "int8"):
                    ort = OrtModelForSeq2SeqLM.from_pretrained(
                        folder, precision=precision, num_threads=args.threads or None
                    )
                    hyps[f"ort_{precision}"] = evaluation.translate(ort, tokenizer, sources, tgt_lang, **gen)
    scores = {kind: evaluation.score(h, references) for kind, h in hyps.items()}
    run = Path(args.bleu_model)
    results_json = next((p / "results.json" for p in (run, *run.parents[:2]) if (p / "results.json").is_file()), None)
    steps = json.loads(results_json.read_text()).get("steps") if results_json else None
    result = {
        "metadata": run_metadata(),
        "model": args.bleu_model,
        "label": args.label,
        "model_type": model.config.model_type,
        "steps": steps,
        "sentences": len(sources),
        "pair": f"{args.src}-{args.tgt}",
        **{f"bleu_{k}": round(s["bleu"], 2) for k, s in scores.items()},
        **{f"chrf_{k}": round(s["chrf"], 2) for k, s in scores.items()},
        "bleu_int8_minus_fp32": round(scores["int8"]["bleu"] - scores["fp32"]["bleu"], 2),
        **({"ort_int8_weights": ort_weights} if ort_weights else {}),
    }
    print(json.dumps(result, indent=2))
    return result


def record_bleu(result: dict, path: Path, results_md: Path | None = None) -> None:
    """Add `result` to the BLEU records in `path` (one per checkpoint folder, replaced when rerun) and write their
    table into RESULTS.md (section "inference_bleu") and next to the JSON (.md). Each record keeps the `metadata` of
    its own measurement; paths are stored `portable`."""
    records = json.loads(path.read_text()) if path.is_file() else []
    if isinstance(records, dict):  # one result (older layout)
        records = [records]
    result = portable(result)
    records = [r for r in records if r.get("model") != result["model"]] + [result]
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps(records, indent=2) + "\n")
    scratch.replace(path)
    kinds = [
        k
        for k in ("fp32", "int8", "ct2_fp32", "ct2_int8", "ort_fp32", "ort_int8")
        if any(f"bleu_{k}" in r for r in records)
    ]
    lines = [
        "test_2016_flickr, beam 4, length penalty 0.6, sacreBLEU; int8 = `quantize_for_cpu` (per-token "
        "activations, oneDNN); CTranslate2 for the baseline only; ort = ONNX Runtime (`export_onnx`, int8: "
        "weights per channel in the format of the column `ORT int8 weights` (`--int8_weights`), dynamic "
        "activations).",
        "",
        "| model | model type | steps | sentences | "
        + " | ".join(f"BLEU {k}" for k in kinds)
        + " | BLEU int8 - fp32 | BLEU ort_int8 - ort_fp32 | ORT int8 weights | chrF fp32 | chrF int8 |",
        "|---|---|---:|---:|" + "---:|" * len(kinds) + "---:|---:|---|---:|---:|",
    ]
    for r in records:
        cells = " | ".join(f"{r[f'bleu_{k}']:.2f}" if f"bleu_{k}" in r else "—" for k in kinds)
        delta = r["bleu_int8_minus_fp32"] if abs(r["bleu_int8_minus_fp32"]) >= 0.005 else 0.0  # no "-0.00"
        ort_delta = "—"
        if "bleu_ort_int8" in r and "bleu_ort_fp32" in r:
            d = r["bleu_ort_int8"] - r["bleu_ort_fp32"]
            ort_delta = f"{d if abs(d) >= 0.005 else 0.0:+.2f}"
        # records from before `--int8_weights` existed were exported with u8 weights
        ort_weights = r.get("ort_int8_weights", "u8") if "bleu_ort_int8" in r else "—"
        folder = Path(r["model"])
        name = r.get("label") or (folder.parent.name if folder.name == "model" else folder.name)  # RUN/model: RUN
        lines.append(
            f"| {name} | {r.get('model_type', '?')} | "
            f"{r.get('steps', '?')} | {r['sentences']} | {cells} | {delta:+.2f} | {ort_delta} | {ort_weights} | "
            f"{r['chrf_fp32']:.2f} | {r['chrf_int8']:.2f} |"
        )
    table = "\n".join(lines) + "\n"
    path.with_suffix(".md").write_text(table)
    write_section("inference_bleu", table, **({"path": results_md} if results_md else {}))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=["tiny", "small", "base"])
    parser.add_argument("--models", nargs="+", default=["baseline"] + VARIANTS, choices=["baseline"] + VARIANTS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src_len", type=int, default=15)
    parser.add_argument("--new_tokens", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch and CTranslate2 threads (0 = default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--skip_ct2", action="store_true")
    parser.add_argument("--skip_ort", action="store_true", help="no ONNX Runtime engines")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.3,
        help="seconds between two timed calls (idle thread pools of the other processes stop spinning)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one engine (see `worker`)
    parser.add_argument("--worker_size", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--skip_fbgemm", action="store_true", help="no ours_int8_fbgemm engine")
    parser.add_argument("--output", default=str(RESULTS_DIR / "inference"), help="path prefix of .json/.md")
    parser.add_argument("--bleu_model", help="BLEU mode: fp32 vs int8 BLEU of this checkpoint on test_2016_flickr")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--limit", type=int, help="BLEU mode: first N test sentences only (smoke runs, not recorded)")
    parser.add_argument("--label", help="BLEU mode: the checkpoint's name in the table (default: its folder's)")
    args = parser.parse_args(argv)
    args._forward = None if argv is None else [a for a in argv if a != "--sizes" and a not in args.sizes]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return {}
    if args.bleu_model:
        result = bleu_mode(args)
        if not args.limit:  # smoke runs (--limit) are not recorded
            record_bleu(result, Path(args.output + "_bleu.json"))
        return result
    if ctranslate2_module() is None and not args.skip_ct2:
        print("ctranslate2 is not installed (pip install 'hf-variants[deploy]'): no CTranslate2 engines.")
    with tempfile.TemporaryDirectory() as tmp:
        measured = {size: bench_size(size, args, Path(tmp)) for size in args.sizes}
    results = {size: rows for size, (rows, _) in measured.items()}
    paths = {size: by_key for size, (_, by_key) in measured.items() if by_key}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and not k.startswith("worker")}
    write_result(
        out.with_suffix(".json"),
        {
            "settings": settings,
            "results": results,
            "ratios": {s: {k: ratios(r) for k, r in rows.items()} for s, rows in results.items()},
            "ort_decoding_paths": paths,
        },
    )
    table = markdown(results, args, paths)
    out.with_suffix(".md").write_text(table)
    write_section(out.name, table)
    return results


if __name__ == "__main__":
    main()
