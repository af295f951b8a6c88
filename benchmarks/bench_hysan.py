"""HySAN vs the baseline Transformer of the same dimensions: parameters, training and decoding speed, side by side.

For each size (`small` = the paper's IWSLT setting, 2+2 layers d 256; `base` = 6+6 layers d 512), a baseline
`TransformerNmtForConditionalGeneration` and a `HysanForConditionalGeneration` with the same dims (pre-norm, as
HySAN's default) and each HySAN fusion asked for get the same inputs:
- parameters, and the delta against the paper's Table-2 formulas (concat L*4*d^2, gated sum L*d^2/4 for e1);
- training tokens/s (forward + backward + Adam step on a padded batch, target tokens counted);
- greedy and beam-4 decoding tokens/s with output lengths forced equal (`min_new_tokens == max_new_tokens`).
Runs are interleaved (baseline, HySAN, baseline, ...) and medians reported; ratio = HySAN / baseline (< 1 = slower).
`--clock cpu` times with the process CPU clock (use it with `--threads 1` on a shared, oversubscribed machine, where
wall time mostly measures the other jobs). Prints one line per measurement and a final JSON line.

    python benchmarks/bench_hysan.py [--sizes small base] [--fusions gated_sum] [--batch 8] [--reps 3]
                                     [--threads 1 --clock cpu]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import baseline_config, random_batch, speed_vs_baseline

from hf_variants import HysanConfig, HysanForConditionalGeneration, TransformerNmtForConditionalGeneration

SIZES = {  # HySAN's presets (the baseline gets the same dims)
    "small": "small",
    "base": "base",
}


def expected_delta(config: HysanConfig) -> int:
    d = config.d_model
    l_enc, l_dec = config.num_branches("encoder"), config.num_branches("decoder")
    if config.fusion == "concat":  # H: l*d -> d replaces W^o in every self-attention
        return config.encoder_layers * (l_enc - 1) * d * d + config.decoder_layers * (l_dec - 1) * d * d
    if config.fusion == "gated_sum":  # one bias-free squeeze gate d -> d/r -> d per self-attention
        return (config.encoder_layers + config.decoder_layers) * 2 * d * (d // config.gate_reduction)
    return 0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=sorted(SIZES))
    parser.add_argument("--fusions", nargs="+", default=["gated_sum"], choices=["sum", "concat", "gated_sum"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--tgt_len", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"settings": {k: v for k, v in vars(args).items()}, "torch_threads": torch.get_num_threads()}
    for size in args.sizes:
        for fusion in args.fusions:
            config = HysanConfig.from_preset(SIZES[size], vocab_size=args.vocab, dropout=0.0, fusion=fusion)
            base_config = baseline_config(config)
            torch.manual_seed(0)
            baseline = TransformerNmtForConditionalGeneration(base_config)
            hysan = HysanForConditionalGeneration(config)
            key = f"{size}_{fusion}"
            p_base, p_hysan = baseline.num_parameters(), hysan.num_parameters()
            row = {
                "params_baseline": p_base,
                "params_hysan": p_hysan,
                "params_delta": p_hysan - p_base,
                "params_delta_formula": expected_delta(config),
            }
            print(
                f"{key:16s} params: baseline {p_base:,} | HySAN {p_hysan:,} | delta {p_hysan - p_base:,} "
                f"(formula {expected_delta(config):,})",
                flush=True,
            )

            inputs, labels = random_batch(args.batch, args.src_len, args.tgt_len, args.vocab)
            row.update(
                speed_vs_baseline(
                    {"baseline": (baseline, inputs), "hysan": (hysan, inputs)},
                    labels,
                    args.new_tokens,
                    args.reps,
                    args.clock,
                    key,
                )
            )
            results[key] = row
            del baseline, hysan
    print(json.dumps({"benchmark": "hysan_vs_baseline", **results}))
    return results


if __name__ == "__main__":
    main()
