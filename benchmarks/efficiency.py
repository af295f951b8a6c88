#!/usr/bin/env python
"""Efficiency table: every variant against the baseline of the same dims, and the baseline against MarianMTModel.

One process builds every model of a dims class (`small`: d 256, 4 heads, FFN 1024, 3+3 layers, vocab 8k; `base`:
d 512, 8 heads, FFN 2048, 6+6) with random weights, in the configurations the quality table trains
(benchmarks/quality.py): the baseline, transformers' `MarianMTModel`, MUTE (+bias+seq, 4 units), HySAN (e1, gated
sum), MG-SA (n-gram, SAN, ON-LSTM), Tied (blocks = encoder + decoder layers of the baseline, so about its
parameters) and MIMO (n=4, 4 languages). All get the same inputs. Measured, side by side:

- parameters;
- training tokens/s: forward + backward + Adam step on a padded batch (source + target tokens counted);
- decoding tokens/s, greedy and beam 4, with output lengths forced equal (`min_new_tokens == max_new_tokens`),
  generated tokens per sentence counted (not per beam), encoder included;
- peak memory of one training step and of one beam-4 `generate`: on CUDA `max_memory_allocated`; on the CPU the
  peak resident-set growth of a forked child that runs just that call (allocator caching included, so a coarse
  but comparable number).

Timed calls are interleaved over the models (A, B, C, ..., A, B, C, ...) after one warm-up each and the median
is kept. The clock is the process CPU time with one torch thread by default (`--clock cpu --threads 1`), so other
jobs on a shared machine disturb the ratios little; `--clock wall --threads 0` measures elapsed time. Ratios are
variant / baseline for speed (> 1 = faster) and for parameters and memory (> 1 = more). Prints one line per model
and writes `benchmarks/results/efficiency.json` and `efficiency.md`.

    python benchmarks/efficiency.py [--sizes small base] [--batch 16] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import write_section  # noqa: E402
from timing import CLOCKS, interleaved, peak_memory_mb, write_result  # noqa: E402

import hf_variants  # noqa: E402
from hf_variants import TransformerNmtConfig  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
LANGUAGES = ["en", "de", "fr", "cs"]

# name -> (label, model_type, config overrides); mirrors benchmarks/quality.py
MODELS = {
    "baseline": ("Transformer baseline", "transformer_nmt", {}),
    "marian": ("MarianMTModel", "marian", {}),
    "mute": ("MUTE + bias + seq (4 units)", "mute_nmt", {}),
    "hysan": ("HySAN e1, gated sum", "hysan_nmt", {}),
    "mgsa": ("MG-SA n-gram, SAN, ON-LSTM", "mgsa_nmt", {"phrase_type": "ngram"}),
    "tied": ("Tied (enc+dec layers shared blocks)", "tied_nmt", {"tied_blocks": True}),
    "mimo": ("MIMO (n=4)", "mimo_nmt", {"languages": LANGUAGES}),
}


def build(name: str, size: str, vocab: int):
    from transformers import AutoModelForSeq2SeqLM

    _, model_type, extra = MODELS[name]
    dims = {k: v for k, v in TransformerNmtConfig.PRESETS[size].items()}
    ids = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    if model_type == "marian":
        from hf_variants.training.external import build_config

        return AutoModelForSeq2SeqLM.from_config(build_config("marian", size, {**dims, **ids}))
    fields = {**dims, **ids}
    extra = dict(extra)
    if extra.pop("tied_blocks", False):
        fields.update(
            encoder_layers=dims["encoder_layers"] + dims["decoder_layers"],
            decoder_layers=dims["encoder_layers"] + dims["decoder_layers"],
        )
    fields.update(extra)
    config = hf_variants.CONFIG_CLASSES[model_type].from_preset(size, **fields)
    return AutoModelForSeq2SeqLM.from_config(config)


def language_inputs(model, batch: int) -> dict:
    hook = getattr(model, "_language_inputs", None)
    if hook is None or not getattr(model.config, "languages", None):
        return {}
    return hook(["de"] * batch, batch)


def bench_size(size: str, args) -> dict:
    names = args.models
    models = {name: build(name, size, args.vocab) for name in names}
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, args.vocab, (args.batch, args.src_len), generator=g)
    mask = torch.ones_like(src)
    mask[1::2, args.src_len * 3 // 4 :] = 0  # half of the rows padded
    src = src.masked_fill(mask == 0, 0)
    labels = torch.randint(4, args.vocab, (args.batch, args.tgt_len), generator=g)
    train_tokens = int(mask.sum()) + labels.numel()
    extra = {name: language_inputs(m, args.batch) for name, m in models.items()}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, m in models.items()}

    def train_step(name):
        model = models[name]
        model.train()
        out = model(input_ids=src, attention_mask=mask, labels=labels, **extra[name])
        out.loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    def decode(name, beams):
        model = models[name]
        model.eval()
        with torch.no_grad():
            beam = {"num_beams": beams, "length_penalty": 0.6} if beams > 1 else {"num_beams": 1}
            model.generate(
                input_ids=src,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                **beam,
                **extra[name],
            )

    rows = {name: {"label": MODELS[name][0], "params": m.num_parameters()} for name, m in models.items()}
    t = interleaved({n: (lambda n=n: train_step(n)) for n in names}, args.reps, args.clock)
    for n in names:
        rows[n]["train_tokens_per_sec"] = train_tokens / t[n]
    for label, beams in (("greedy", 1), ("beam4", 4)):
        t = interleaved({n: (lambda n=n: decode(n, beams)) for n in names}, args.reps, args.clock)
        for n in names:
            rows[n][f"{label}_tokens_per_sec"] = args.batch * args.new_tokens / t[n]
    if not args.skip_memory:
        for n in names:
            rows[n]["train_peak_mb"] = peak_memory_mb(lambda n=n: train_step(n))
            rows[n]["beam4_peak_mb"] = peak_memory_mb(lambda n=n: decode(n, 4))
    base = rows["baseline"]
    for n, row in rows.items():
        row["ratios_vs_baseline"] = {
            key: row[key] / base[key]
            for key in (
                "params",
                "train_tokens_per_sec",
                "greedy_tokens_per_sec",
                "beam4_tokens_per_sec",
                "train_peak_mb",
                "beam4_peak_mb",
            )
            if key in row and base.get(key)
        }
    for n, row in rows.items():
        r = row["ratios_vs_baseline"]
        print(
            f"[{size}] {row['label']:32s} params {row['params'] / 1e6:7.2f}M ({r['params']:.2f}x)  "
            f"train {row['train_tokens_per_sec']:7.0f} tok/s ({r['train_tokens_per_sec']:.2f}x)  "
            f"greedy {row['greedy_tokens_per_sec']:6.0f} ({r['greedy_tokens_per_sec']:.2f}x)  "
            f"beam4 {row['beam4_tokens_per_sec']:6.0f} ({r['beam4_tokens_per_sec']:.2f}x)"
            + (
                f"  mem train {row['train_peak_mb']:.0f} MiB ({r.get('train_peak_mb', float('nan')):.2f}x) "
                f"beam4 {row['beam4_peak_mb']:.0f} MiB ({r.get('beam4_peak_mb', float('nan')):.2f}x)"
                if "train_peak_mb" in row
                else ""
            ),
            flush=True,
        )
    return rows


def markdown(results: dict, args) -> str:
    lines = [
        f"Batch {args.batch} sentences (source {args.src_len} tokens, half padded to 3/4; target {args.tgt_len}); "
        f"decoding {args.new_tokens} new tokens; median of {args.reps} interleaved runs; clock: {args.clock}, "
        f"{args.threads or 'default'} torch thread(s). Ratios are against the baseline of the same dims "
        "(speed: > 1 faster; params/memory: > 1 more).",
        "",
    ]
    for size, rows in results.items():
        lines += [
            f"**{size}**",
            "",
            "| model | params | train tok/s | greedy tok/s | beam-4 tok/s | train peak MiB | beam-4 peak MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows.values():
            r = row["ratios_vs_baseline"]

            def cell(key, fmt):
                if key not in row:
                    return "—"
                return f"{format(row[key], fmt)} ({r[key]:.2f}x)" if key in r else format(row[key], fmt)

            lines.append(
                f"| {row['label']} | {row['params'] / 1e6:.2f}M ({r['params']:.2f}x) | "
                f"{cell('train_tokens_per_sec', '.0f')} | {cell('greedy_tokens_per_sec', '.0f')} | "
                f"{cell('beam4_tokens_per_sec', '.0f')} | {cell('train_peak_mb', '.0f')} | "
                f"{cell('beam4_peak_mb', '.0f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small"], choices=["tiny", "small", "base", "big"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--tgt_len", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--skip_memory", action="store_true")
    parser.add_argument("--output", default=str(RESULTS_DIR / "efficiency"), help="path prefix of .json/.md")
    args = parser.parse_args(argv)
    if "baseline" not in args.models:
        args.models = ["baseline"] + args.models
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {size: bench_size(size, args) for size in args.sizes}
    out = Path(args.output)
    write_result(out.with_suffix(".json"), {"settings": vars(args), "results": results})
    table = markdown(results, args)
    out.with_suffix(".md").write_text(table)
    write_section(out.name, table)  # its section of benchmarks/RESULTS.md, when there is one
    print(
        json.dumps({size: {n: row["ratios_vs_baseline"] for n, row in rows.items()} for size, rows in results.items()})
    )
    return results


if __name__ == "__main__":
    main()
