"""MIMO (L layers x n transformations) vs baselines of the same width: parameters, decoding and training speed.

The paper's comparison (Tab. 1, "Speed-Up 1.31") is MIMO 6 layers x 4 transformations against the 24-layer
Transformer of Zhang et al. (2020), which has about the same parameters. Here, side by side in one process:

- `mimo`:       MimoConfig, L=6, n=4 (4 target languages, task-aware mixing per example);
- `deep`:       the backbone Transformer with L*n = 24 encoder and 24 decoder layers (post-norm, as MIMO's units;
                its parameters plus the task-attention tables are exactly MIMO's, checked below);
- `shallow`:    the backbone with L = 6 layers (same dims and layer count, 1/n of the parameters), for reference.

All get the same inputs; decoding lengths are forced equal (`min_new_tokens == max_new_tokens`), so tokens/s
compare the same work. Timed runs are interleaved (A, B, C, A, B, C, ...) after one warm-up each and the median is
reported. Decoding tokens/s count generated tokens per sentence (not per beam), encoder pass included. Training
tokens/s: forward + backward on one batch, target tokens per second. Prints one line per measurement and a JSON
summary line. On a shared or oversubscribed CPU pass `--threads 1 --clock cpu`: with 2 OpenMP threads competing
with other processes the timings become erratic (spin-waiting), even in the ratios; one thread timed by CPU time
is stable.

    python benchmarks/bench_mimo.py [--sizes small base] [--layers 6] [--transformations 4] [--batch 4]
        [--new_tokens 16] [--reps 2] [--threads 0] [--clock wall]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from timing import interleaved

from hf_variants import (
    MimoConfig,
    MimoForConditionalGeneration,
    TransformerNmtConfig,
    TransformerNmtForConditionalGeneration,
)

LANGUAGES = ["en", "de", "fr", "cs"]


def mixing_parameters(config: MimoConfig) -> int:
    """Task-attention tables: T*n*n per MIMO link -- (2L-1) in the encoder (layer 1's self-attention is
    one-to-many), (4L-1) in the decoder (self-attention, cross-attention query, cross-attention memory, FFN) --
    plus T*n for the decoder's many-to-one ("mix" memory, mimo=True)."""
    t, n = config.num_tasks, config.num_transformations
    return t * n * n * ((2 * config.encoder_layers - 1) + (4 * config.decoder_layers - 1)) + t * n


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=["tiny", "small", "base", "big"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--transformations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--src_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--train_reps", type=int, default=1, help="timed training steps per model (0 = skip)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or this process's CPU time (stable on a shared machine with --threads 1)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n, layers = args.transformations, args.layers
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    results = {"torch_threads": torch.get_num_threads(), "clock": args.clock, "layers": layers, "transformations": n}
    for size in args.sizes:
        common = dict(vocab_size=args.vocab, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        torch.manual_seed(0)
        mimo_config = MimoConfig.from_preset(
            size, num_transformations=n, encoder_layers=layers, decoder_layers=layers, languages=LANGUAGES, **common
        )
        models = {
            "mimo": MimoForConditionalGeneration(mimo_config).eval(),
            "deep": TransformerNmtForConditionalGeneration(
                TransformerNmtConfig.from_preset(size, encoder_layers=layers * n, decoder_layers=layers * n, **common)
            ).eval(),
            "shallow": TransformerNmtForConditionalGeneration(
                TransformerNmtConfig.from_preset(size, encoder_layers=layers, decoder_layers=layers, **common)
            ).eval(),
        }
        params = {name: model.num_parameters() for name, model in models.items()}
        formula = params["deep"] + mixing_parameters(mimo_config)
        row = {
            "params": params,
            "mixing_params": mixing_parameters(mimo_config),
            "mimo_params_match_formula": params["mimo"] == formula,
        }
        print(
            f"[{size}] d={mimo_config.d_model} params: MIMO {layers}x{n} {params['mimo'] / 1e6:.2f}M | "
            f"baseline {layers * n} layers {params['deep'] / 1e6:.2f}M | baseline {layers} layers "
            f"{params['shallow'] / 1e6:.2f}M | MIMO == deep + mixing ({row['mixing_params']}): "
            f"{row['mimo_params_match_formula']}",
            flush=True,
        )

        g = torch.Generator().manual_seed(1)
        input_ids = torch.randint(4, args.vocab, (args.batch, args.src_len), generator=g)
        attention_mask = torch.ones_like(input_ids)
        for r in range(args.batch):  # lengths from half to full
            attention_mask[r, args.src_len // 2 + r % (args.src_len // 2) :] = 0
        source = {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}
        tgt_lang_ids = torch.arange(args.batch) % len(LANGUAGES)
        extra = {"mimo": {"tgt_lang_ids": tgt_lang_ids}, "deep": {}, "shallow": {}}

        for beams in (1, 4):
            gen = dict(
                num_beams=beams,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                **({"length_penalty": 0.6} if beams > 1 else {}),
            )

            def decode(name, gen=gen):
                with torch.inference_mode():
                    out = models[name].generate(**source, **extra[name], **gen)
                assert out.shape[1] == args.new_tokens + 1

            seconds = interleaved({name: (lambda name=name: decode(name)) for name in models}, args.reps, clock)
            tps = {name: args.batch * args.new_tokens / s for name, s in seconds.items()}
            key = "greedy" if beams == 1 else f"beam{beams}"
            row[f"{key}_tok_s"] = {k: round(v, 1) for k, v in tps.items()}
            row[f"{key}_speedup_vs_deep"] = round(tps["mimo"] / tps["deep"], 3)
            row[f"{key}_speedup_vs_shallow"] = round(tps["mimo"] / tps["shallow"], 3)
            print(
                f"[{size}] {key:6s} decoding tok/s: MIMO {tps['mimo']:7.1f} | deep {tps['deep']:7.1f} | "
                f"shallow {tps['shallow']:7.1f} | MIMO/deep {tps['mimo'] / tps['deep']:.2f}x | "
                f"MIMO/shallow {tps['mimo'] / tps['shallow']:.2f}x",
                flush=True,
            )

        if args.train_reps:
            labels = torch.randint(4, args.vocab, (args.batch, args.src_len), generator=g)

            def train_step(name):
                model = models[name].train()
                model(**source, **extra[name], labels=labels).loss.backward()
                model.zero_grad(set_to_none=True)
                model.eval()

            seconds = interleaved(
                {name: (lambda name=name: train_step(name)) for name in models}, args.train_reps, clock
            )
            tps = {name: labels.numel() / s for name, s in seconds.items()}
            row["train_tok_s"] = {k: round(v, 1) for k, v in tps.items()}
            row["train_speedup_vs_deep"] = round(tps["mimo"] / tps["deep"], 3)
            print(
                f"[{size}] training tok/s (fwd+bwd): MIMO {tps['mimo']:7.1f} | deep {tps['deep']:7.1f} | "
                f"shallow {tps['shallow']:7.1f} | MIMO/deep {tps['mimo'] / tps['deep']:.2f}x",
                flush=True,
            )
        results[size] = row
        models = None  # free them before the next size
    print(json.dumps({"benchmark": "mimo", **results}))
    return results


if __name__ == "__main__":
    main()
