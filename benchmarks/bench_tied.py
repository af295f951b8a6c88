"""Tied Transformer vs the baseline Transformer of the same dimensions: parameters and speed.

For each size (the paper's IWSLT `small` dims with 8 blocks, and `base` dims with 6), both models are built in this
process with random weights and given the same inputs: greedy and beam-4 decoding with the output length forced
(`min_new_tokens == max_new_tokens`), and training steps (forward + backward + Adam). Timings alternate between the
two models (median of `--reps` runs after a warm-up; CPU-time clock by default, `--clock wall`). The parameter
counts are also checked against the formulas of `configuration_tied`, and the paper's "12-block tied ~ 6-block
baseline" comparison is printed for the big dims.

    python benchmarks/bench_tied.py [--reps 2] [--sizes small base]

The last line is a JSON record (one entry per size) for the benchmark table.
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import CLOCKS, baseline_config, interleaved, train_step

from hf_variants import (
    TiedTransformerConfig,
    TiedTransformerForConditionalGeneration,
    TransformerNmtForConditionalGeneration,
)
from hf_variants.configuration_tied import tied_parameter_count, untied_parameter_count

SIZES = {"small": dict(preset="small", blocks=8), "base": dict(preset="base", blocks=6)}


def configs(size: str, vocab_size: int):
    spec = SIZES[size]
    tied = TiedTransformerConfig.from_preset(
        spec["preset"],
        vocab_size=vocab_size,
        encoder_layers=spec["blocks"],
        decoder_layers=spec["blocks"],
        languages=["en", "de"],
    )
    return tied, baseline_config(tied)  # same dims, norms, dropout, vocabulary


def bench_size(size: str, args) -> dict:
    tied_config, base_config = configs(size, args.vocab_size)
    torch.manual_seed(0)
    models = {
        "tied": TiedTransformerForConditionalGeneration(tied_config),
        "baseline": TransformerNmtForConditionalGeneration(base_config),
    }
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert params["tied"] == tied_parameter_count(tied_config), (params["tied"], tied_parameter_count(tied_config))
    assert params["baseline"] == untied_parameter_count(base_config)

    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, args.vocab_size, (args.batch, args.src_len), generator=g)
    mask = torch.ones_like(src)
    mask[1::2, args.src_len * 3 // 4 :] = 0  # half of the rows padded
    src = src.masked_fill(mask == 0, 0)
    direction = {"tgt_lang_ids": torch.ones(args.batch, dtype=torch.long)}
    labels = torch.randint(4, args.vocab_size, (args.batch, args.tgt_len), generator=g)

    def inputs(name):
        return {"input_ids": src, "attention_mask": mask, **(direction if name == "tied" else {})}

    results = {name: {} for name in models}
    for mode, gen in (("greedy", dict(num_beams=1)), ("beam4", dict(num_beams=4, length_penalty=0.6))):
        for model in models.values():
            model.eval()

        def decode(name, gen=gen):
            with torch.no_grad():
                models[name].generate(**inputs(name), max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, **gen)

        times = interleaved({name: (lambda name=name: decode(name)) for name in models}, args.reps, args.clock)
        for name, t in times.items():
            results[name][f"{mode}_s"] = round(t, 4)
            results[name][f"{mode}_tokens_per_s"] = round(args.batch * args.gen_len / t, 1)

    steps = {}
    for name, model in models.items():
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        steps[name] = lambda model=model, name=name, optimizer=optimizer: train_step(
            model, optimizer, inputs(name), labels
        )
    target_tokens = int((labels != -100).sum())
    for name, t in interleaved(steps, args.reps, args.clock).items():  # the warm-up run creates Adam's state
        results[name]["train_step_s"] = round(t, 4)
        results[name]["train_target_tokens_per_s"] = round(target_tokens / t, 1)

    record = {
        "size": size,
        "d_model": tied_config.d_model,
        "ffn_dim": tied_config.encoder_ffn_dim,
        "heads": tied_config.encoder_attention_heads,
        "blocks": tied_config.num_blocks,
        "vocab_size": args.vocab_size,
        "params": params,
        "param_ratio_tied_over_baseline": round(params["tied"] / params["baseline"], 4),
        **results,
        "speed_ratio_tied_over_baseline": {
            key: round(results["baseline"][key] / results["tied"][key], 3)  # > 1: tied faster
            for key in ("greedy_s", "beam4_s", "train_step_s")
        },
    }
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=sorted(SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--tgt_len", type=int, default=24)
    parser.add_argument("--gen_len", type=int, default=24)
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1 by default: on a shared 2-core machine, 2 threads were ~10x slower (contention)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    records = []
    for size in args.sizes:
        record = bench_size(size, args)
        records.append(record)
        p = record["params"]
        print(
            f"\n== {size}: d={record['d_model']} ff={record['ffn_dim']} heads={record['heads']} "
            f"L={record['blocks']} V={record['vocab_size']}"
        )
        print(
            f"params   tied {p['tied']:>12,}  baseline {p['baseline']:>12,}  ratio "
            f"{record['param_ratio_tied_over_baseline']:.3f}"
        )
        for key, label in (("greedy_s", "greedy"), ("beam4_s", "beam 4"), ("train_step_s", "train step")):
            print(
                f"{label:<10} tied {record['tied'][key]:8.3f}s  baseline {record['baseline'][key]:8.3f}s  "
                f"baseline/tied {record['speed_ratio_tied_over_baseline'][key]:.3f}"
            )

    # The paper's comparison at its WMT (big) dims, from the formulas (checked against real models above).
    big6 = TiedTransformerConfig.from_preset("big", vocab_size=32000, languages=["en", "de"])
    big12 = TiedTransformerConfig.from_preset(
        "big", vocab_size=32000, languages=["en", "de"], encoder_layers=12, decoder_layers=12
    )
    paper = {
        "tied_6": tied_parameter_count(big6),
        "tied_12": tied_parameter_count(big12),
        "baseline_6": untied_parameter_count(big6),
    }
    print(
        f"\nbig dims (V=32000): tied 6 blocks {paper['tied_6'] / 1e6:.1f}M, tied 12 blocks "
        f"{paper['tied_12'] / 1e6:.1f}M, baseline 6+6 layers {paper['baseline_6'] / 1e6:.1f}M"
    )
    print(
        json.dumps(
            {
                "benchmark": "tied",
                "threads": args.threads,
                "batch": args.batch,
                "src_len": args.src_len,
                "gen_len": args.gen_len,
                "reps": args.reps,
                "clock": args.clock,
                "results": records,
                "big_formula": paper,
            }
        )
    )


if __name__ == "__main__":
    main()
