"""MUTE vs the baseline Transformer of the same dimensions: parameters, decoding speed, encoder and training cost.

The baseline is `transformer_nmt` with MUTE's backbone options (pre-norm, Shaw relative keys+values clip 16, i.e.
the paper's "Transformer + Relative"), so the only difference is the multi-unit encoder. Both models are built
side by side in one process and get the same inputs; decoding lengths are forced equal
(`min_new_tokens == max_new_tokens`), so tokens/s compare the same work. Timed runs are interleaved
(A, B, A, B, ...) and the median is reported. By default the clock is the process CPU time with one torch
thread (`--clock cpu --threads 1`): on a shared, loaded machine this measures the work done and not the waiting;
`--clock wall` measures elapsed time instead. The paper reports ~3.1% slower decoding with 4 units (890 -> 863
tok/s on GPU). Prints one line per measurement and a JSON summary line.

    python benchmarks/bench_mute.py [--sizes small base] [--units 4] [--batch 8] [--new_tokens 24] [--reps 3]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import CLOCKS, baseline_config, interleaved

from hf_variants import MuteConfig, MuteForConditionalGeneration, TransformerNmtForConditionalGeneration


def per_unit_parameters(config: MuteConfig) -> int:
    """Spec §1.6: one unit = attention 4d^2+4d + relative table (2m+1) d_head + FFN 2 d f + f + d + FFN LN 2d."""
    d, f = config.d_model, config.encoder_ffn_dim
    head_dim = d // config.encoder_attention_heads
    return 4 * d * d + 4 * d + (2 * config.max_relative_positions + 1) * head_dim + 2 * d * f + f + d + 2 * d


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=["tiny", "small", "base", "big"])
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--train_steps", type=int, default=2, help="timed training steps per model (0 = skip)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {
        "clock": args.clock,
        "units": args.units,
        "batch": args.batch,
        "src_len": args.src_len,
        "new_tokens": args.new_tokens,
    }
    for size in args.sizes:
        torch.manual_seed(0)
        mute_config = MuteConfig.from_preset(size, vocab_size=args.vocab, num_units=args.units, dropout=0.0)
        base_config = baseline_config(mute_config)
        mute = MuteForConditionalGeneration(mute_config).eval()
        base = TransformerNmtForConditionalGeneration(base_config).eval()
        n_mute, n_base = mute.num_parameters(), base.num_parameters()
        unit = per_unit_parameters(mute_config)
        layers, units, d = mute_config.encoder_layers, args.units, mute_config.d_model
        extras = layers * (
            units + (units**2 if mute_config.merge == "seq" else 0) + (d if mute_config.has_mask_unit else 0)
        )
        formula_ok = n_mute - n_base == (units - 1) * layers * unit + extras
        row = {
            "params_mute": n_mute,
            "params_baseline": n_base,
            "params_ratio": round(n_mute / n_base, 3),
            "params_delta": n_mute - n_base,
            "params_delta_formula_ok": formula_ok,
        }
        print(
            f"{size:5s} params   MUTE {n_mute / 1e6:7.2f}M | baseline {n_base / 1e6:7.2f}M | "
            f"+{(n_mute - n_base) / 1e6:.2f}M = (I-1) x L x {unit:,} + {extras:,} (alpha, M, mask): {formula_ok}",
            flush=True,
        )

        g = torch.Generator().manual_seed(1)
        input_ids = torch.randint(4, args.vocab, (args.batch, args.src_len), generator=g)
        attention_mask = torch.ones_like(input_ids)
        for r in range(args.batch):  # realistic padding: lengths from half to full
            attention_mask[r, args.src_len // 2 + r % (args.src_len // 2) :] = 0
        inputs = {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}
        src_tokens = int(attention_mask.sum())

        def encode(model):
            with torch.inference_mode():
                model.get_encoder()(**inputs)

        t = interleaved({"mute": lambda: encode(mute), "base": lambda: encode(base)}, args.reps, args.clock)
        row["encoder_time_ratio"] = round(t["mute"] / t["base"], 3)
        print(
            f"{size:5s} encoder  MUTE {src_tokens / t['mute']:8.1f} src tok/s | baseline "
            f"{src_tokens / t['base']:8.1f} | time ratio {t['mute'] / t['base']:.2f}x",
            flush=True,
        )

        for beams in (1, 4):
            gen = dict(
                num_beams=beams,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                **({"length_penalty": 0.6} if beams > 1 else {}),
            )

            def decode(model, gen=gen):
                with torch.inference_mode():
                    out = model.generate(**inputs, **gen)
                assert out.shape[1] == args.new_tokens + 1

            t = interleaved({"mute": lambda: decode(mute), "base": lambda: decode(base)}, args.reps, args.clock)
            tokens = args.batch * args.new_tokens
            tps_m, tps_b = tokens / t["mute"], tokens / t["base"]
            key = "greedy" if beams == 1 else f"beam{beams}"
            row[f"{key}_tok_s_mute"], row[f"{key}_tok_s_baseline"] = round(tps_m, 1), round(tps_b, 1)
            row[f"{key}_speed_ratio"] = round(tps_m / tps_b, 3)
            print(
                f"{size:5s} {key:8s} MUTE {tps_m:8.1f} tok/s | baseline {tps_b:8.1f} tok/s | "
                f"ratio {tps_m / tps_b:.3f} ({100 * (1 - tps_m / tps_b):+.1f}% slower)",
                flush=True,
            )

        if args.train_steps:
            labels = torch.randint(4, args.vocab, (args.batch, args.new_tokens), generator=g)
            tgt_tokens = args.batch * args.new_tokens

            def train_steps(model):
                model.train()
                for _ in range(args.train_steps):
                    model(**inputs, labels=labels).loss.backward()
                    model.zero_grad(set_to_none=True)
                    model.after_optimizer_step()
                model.eval()

            t = interleaved(
                {"mute": lambda: train_steps(mute), "base": lambda: train_steps(base)},
                max(1, args.reps - 1),
                args.clock,
            )
            tps_m, tps_b = tgt_tokens * args.train_steps / t["mute"], tgt_tokens * args.train_steps / t["base"]
            row["train_tok_s_mute"], row["train_tok_s_baseline"] = round(tps_m, 1), round(tps_b, 1)
            row["train_speed_ratio"] = round(tps_m / tps_b, 3)
            print(
                f"{size:5s} training MUTE {tps_m:8.1f} tgt tok/s | baseline {tps_b:8.1f} | "
                f"ratio {tps_m / tps_b:.3f} (fwd+bwd, bias module and penalty on)",
                flush=True,
            )
        results[size] = row
        mute = base = None  # free both before the next size
    results["torch_threads"] = torch.get_num_threads()
    print(json.dumps({"bench": "mute", **results}))
    return results


if __name__ == "__main__":
    main()
