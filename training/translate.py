#!/usr/bin/env python
"""Translate a file with a trained checkpoint (batched beam search), and score it against references.

    python training/translate.py --model runs/transformer_nmt-en-de-small/model \\
        --input training/data/multi30k/test_2016_flickr.en.gz --output hyp.de \\
        --references training/data/multi30k/test_2016_flickr.de.gz --tgt_lang de

`--model` is a saved model folder (`run_dir/model`, or a Hub id with `--trust_remote_code`) or a training checkpoint
folder (`run_dir/checkpoints/step_N`, loaded into the run's model config). Input: one sentence a line, plain or
.gz; empty lines give empty output lines so the output stays line-aligned. With `--references`, BLEU and chrF
(sacreBLEU, signatures included) are printed as JSON and written to `--results_json` if given.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from training import checkpointing, evaluation  # noqa: E402
from training.corpus import DataError, read_lines  # noqa: E402

logger = logging.getLogger("hf_variants.translate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="saved model folder, Hub id, or a training checkpoint folder")
    p.add_argument("--tokenizer", help="default: the model folder (or the run's tokenizer for a checkpoint)")
    p.add_argument("--input", required=True, help="source sentences, one a line (plain or .gz)")
    p.add_argument("--output", required=True, help="translations, one a line")
    p.add_argument("--references", help="reference translations (plain or .gz) to score against")
    p.add_argument("--source_annotation", action="append", default=[], metavar="NAME=FILE",
                   help="a per-sentence model input aligned with --input (e.g. parses=test.en.parses for the "
                        "syntactic MG-SA); repeatable")
    p.add_argument("--src_lang")
    p.add_argument("--tgt_lang", help="target language (needed by multilingual models)")
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--length_penalty", type=float, default=0.6)
    p.add_argument("--max_len_a", type=float, default=1.2)
    p.add_argument("--max_len_b", type=int, default=10)
    p.add_argument("--max_length", type=int, help="truncate source sentences to this many tokens (default: never)")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--results_json", help="write the scores here")
    p.add_argument("--trust_remote_code", action="store_true", help="for Hub ids whose code is not installed")
    p.add_argument("--int8", action="store_true",
                   help="int8 CPU inference: every linear layer gets int8 weights and dynamically quantized int8 "
                        "activations (hf_variants.quantize_for_cpu)")
    return p


def load_model_and_tokenizer(model_path: str, tokenizer_path: str | None = None, trust_remote_code: bool = False):
    import hf_variants  # noqa: F401  (registers the model types)
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    path = Path(model_path)
    if (path / checkpointing.MARKER).is_file():  # run_dir/checkpoints/step_N: the run's config + these weights
        run_dir = path.parent.parent
        config_dir = run_dir / "model" if (run_dir / "model" / "config.json").is_file() else None
        if config_dir is None:
            raise FileNotFoundError(f"{path} is a checkpoint, but {run_dir}/model/config.json (the run's config) "
                                    f"is missing; pass the run's model folder instead.")
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(config_dir))
        checkpointing.load_model_weights(model, checkpointing.load_weights(path))
        tokenizer_path = tokenizer_path or str(run_dir / "tokenizer")
    else:
        model = AutoModelForSeq2SeqLM.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, trust_remote_code=trust_remote_code)
    model.eval()
    return model, tokenizer


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, args.trust_remote_code)
    if args.int8:
        from hf_variants import quantize_for_cpu

        quantize_for_cpu(model)
    languages = list(getattr(model.config, "languages", None) or [])
    tgt_lang = args.tgt_lang
    if tgt_lang is None and languages:
        if len(languages) == 2 and not getattr(model.config, "target_language_tags", False):
            tgt_lang = languages[1]
            logger.info("--tgt_lang not given: using %s (the model's languages are %s)", tgt_lang, languages)
        else:
            raise SystemExit(f"This model translates into several languages ({', '.join(languages)}): pass "
                             f"--tgt_lang.")
    sources = read_lines(args.input)
    references = read_lines(args.references) if args.references else None
    if references is not None and len(references) != len(sources):
        raise DataError(f"{args.input} has {len(sources)} lines but {args.references} has {len(references)}; line "
                        f"{min(len(sources), len(references)) + 1} has no counterpart.")
    variant_inputs = {}
    for item in args.source_annotation:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--source_annotation expects NAME=FILE, got {item!r}")
        values = read_lines(path)
        if len(values) != len(sources):
            raise DataError(f"{args.input} has {len(sources)} lines but {path} has {len(values)}.")
        variant_inputs[name] = values
    keep = [i for i, s in enumerate(sources) if s.strip()]
    if len(keep) < len(sources):
        logger.warning("%d empty input lines (e.g. line %d): their output lines are empty", len(sources) - len(keep),
                       next(i for i, s in enumerate(sources) if not s.strip()) + 1)
    start = time.time()
    hyps = evaluation.translate(model, tokenizer, [sources[i].strip() for i in keep], tgt_lang, src_lang=args.src_lang,
                                batch_size=args.batch_size, num_beams=args.num_beams,
                                length_penalty=args.length_penalty, max_len_a=args.max_len_a,
                                max_len_b=args.max_len_b, max_length=args.max_length,
                                variant_inputs={k: [v[i] for i in keep] for k, v in variant_inputs.items()})
    elapsed = time.time() - start
    outputs = [""] * len(sources)
    for i, h in zip(keep, hyps):
        outputs[i] = h.replace("\n", " ")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("".join(line + "\n" for line in outputs), encoding="utf-8")
    result = {"model": args.model, "input": args.input, "output": args.output, "sentences": len(sources),
              "empty_inputs": len(sources) - len(keep), "tgt_lang": tgt_lang, "num_beams": args.num_beams,
              "int8": args.int8,
              "length_penalty": args.length_penalty, "seconds": round(elapsed, 2),
              "sentences_per_sec": round(len(keep) / max(elapsed, 1e-9), 2)}
    if references is not None:
        scores = evaluation.score(outputs, references)
        result.update(references=args.references, bleu=scores["bleu"], chrf=scores["chrf"],
                      sacrebleu_signature=scores["sacrebleu_signature"], chrf_signature=scores["chrf_signature"])
    if args.results_json:
        Path(args.results_json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    with torch.inference_mode():
        main()
