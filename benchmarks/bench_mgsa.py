"""MG-SA vs the baseline Transformer of the same dimensions: parameters, training and decoding speed, side by side.

For each size (`small`: 3+3 layers d 256, 4 heads; `base`: 6+6 layers d 512, 8 heads) a baseline
`TransformerNmtForConditionalGeneration` and `MgsaForConditionalGeneration` models with the same dims get the
same inputs. MG-SA modes:
- `syntactic`: the paper's final model (syntactic phrases + tag loss + ON-LSTM, bottom layer). The parse levels are
  synthetic nested spans of 8 / 4 / 2 tokens (about what the top three levels of a parse of a 24-token sentence
  give), with random tags, so no parser is needed;
- `ngram`: n = 2, 3, 4 phrases from the attention mask, ON-LSTM interaction, no tags.
Measured: parameters (and the delta against the spec's formulas), training tokens/s (forward + backward + Adam step
on a padded batch; the paper reports 1.28 -> 1.19 steps/s, ratio 0.93, on 8 GPUs), greedy and beam-4 decoding
tokens/s with equal output lengths (`min_new_tokens == max_new_tokens`). Runs are interleaved and medians reported;
ratio = baseline time / MG-SA time (< 1 = MG-SA slower). Times are process CPU times on one thread by default
(`--clock wall --threads 0` for elapsed time), so that other jobs on a shared machine disturb them less.
Prints one line per measurement and a final JSON line.

    python benchmarks/bench_mgsa.py [--sizes small base] [--modes syntactic ngram] [--batch 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import baseline_config, random_batch, speed_vs_baseline

from hf_variants import MgsaConfig, MgsaForConditionalGeneration, TransformerNmtForConditionalGeneration
from hf_variants.phrases import ngram_phrase_index


def expected_delta(config: MgsaConfig) -> int:
    """docs/variants-spec.md §3.2: SAN composition 2*d*d_g and an ON-LSTM (d -> d_g, chunk C) per group and MG-SA
    layer, minus the phrase heads' K/V rows of the fused QKV (they read slices of the ON-LSTM state: 2 (d + 1) d_g per
    group), plus the tag classifiers (d + 1) * labels per level (training-only)."""
    d, groups, d_g, c = config.d_model, config.num_phrase_groups, config.group_dim, config.on_lstm_chunk_size
    gates = 4 * d_g + 2 * d_g // c
    per_layer = groups * (2 * d * d_g + gates * (d + d_g) + 2 * gates - 2 * (d + 1) * d_g)
    if config.uses_tag_loss:
        per_layer += groups * (d + 1) * len(config.tag_labels)
    return len(config.mgsa_layers) * per_layer


def phrase_inputs(config: MgsaConfig, inputs: dict) -> dict:
    if config.phrase_type != "syntactic":
        return {}
    index = ngram_phrase_index(inputs["attention_mask"], [8, 4, 2][: config.syntactic_levels])
    g = torch.Generator().manual_seed(2)
    tags = torch.randint(0, len(config.tag_labels), index.shape, generator=g)
    return {"phrase_index": index, "phrase_tags": tags}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=["small", "base", "big"])
    parser.add_argument("--modes", nargs="+", default=["syntactic", "ngram"], choices=["syntactic", "ngram"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--tgt_len", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: process CPU time (default; stable when other jobs share the cores), wall: elapsed",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"settings": dict(vars(args)), "torch_threads": torch.get_num_threads()}
    for size in args.sizes:
        for mode in args.modes:
            config = MgsaConfig.from_preset(size, vocab_size=args.vocab, dropout=0.0, phrase_type=mode)
            base_config = baseline_config(config)
            torch.manual_seed(0)
            baseline = TransformerNmtForConditionalGeneration(base_config)
            mgsa = MgsaForConditionalGeneration(config)
            key = f"{size}_{mode}"
            p_base, p_mgsa = baseline.num_parameters(), mgsa.num_parameters()
            row = {
                "params_baseline": p_base,
                "params_mgsa": p_mgsa,
                "params_delta": p_mgsa - p_base,
                "params_delta_formula": expected_delta(config),
            }
            print(
                f"{key:16s} params: baseline {p_base:,} | MG-SA {p_mgsa:,} | delta {p_mgsa - p_base:,} "
                f"(formula {expected_delta(config):,})",
                flush=True,
            )

            inputs, labels = random_batch(args.batch, args.src_len, args.tgt_len, args.vocab)
            mgsa_inputs = {**inputs, **phrase_inputs(config, inputs)}
            row.update(
                speed_vs_baseline(
                    {"baseline": (baseline, inputs), "mgsa": (mgsa, mgsa_inputs)},
                    labels,
                    args.new_tokens,
                    args.reps,
                    args.clock,
                    key,
                )
            )
            results[key] = row
            del baseline, mgsa
    print(json.dumps({"benchmark": "mgsa_vs_baseline", **results}))
    return results


if __name__ == "__main__":
    main()
