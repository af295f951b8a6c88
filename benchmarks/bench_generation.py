"""Generation speed of `transformer_nmt` vs `transformers.MarianMTModel` of identical dimensions, side by side.

Both models get the same (converted) weights and the same inputs; output lengths are forced equal
(`min_new_tokens == max_new_tokens`), so tokens/s compare the same work. Runs are interleaved (A, B, A, B, ...) and
the median is reported (process CPU time on one torch thread by default: `--clock wall --threads 0` for elapsed
time). Peak memory: the resident-set growth of one beam-4 generation in a forked child (CUDA allocator peak on a GPU).
Prints one line per setting and a JSON summary.

    python benchmarks/bench_generation.py [--sizes small base] [--batch 16] [--new_tokens 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import CLOCKS, interleaved, peak_memory_mb
from transformers import MarianConfig, MarianMTModel

from hf_variants.convert.marian import convert_marian

SIZES = {
    "small": dict(
        d_model=256,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
    ),
    "base": dict(
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
    ),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for size in args.sizes:
        torch.manual_seed(0)
        config = MarianConfig(
            vocab_size=args.vocab,
            max_position_embeddings=512,
            scale_embedding=True,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=1,
            forced_eos_token_id=None,
            activation_function="relu",
            dropout=0.0,
            **SIZES[size],
        )
        marian = MarianMTModel(config).eval()
        ours = convert_marian(marian).eval()
        g = torch.Generator().manual_seed(1)
        input_ids = torch.randint(3, args.vocab, (args.batch, args.src_len), generator=g)
        attention_mask = torch.ones_like(input_ids)
        for row in range(args.batch):  # realistic padding: lengths from half to full
            attention_mask[row, args.src_len // 2 + row % (args.src_len // 2) :] = 0
        inputs = {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}
        for beams in (1, 4):
            gen = dict(
                num_beams=beams,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                length_penalty=0.6,
                do_sample=False,
            )
            models = {"marian": marian, "ours": ours}

            def generate(name, gen=gen):
                with torch.inference_mode():
                    return models[name].generate(**inputs, **gen)

            same = torch.equal(generate("marian"), generate("ours"))
            t = interleaved({name: (lambda name=name: generate(name)) for name in models}, args.reps, args.clock)
            tokens = args.batch * args.new_tokens
            tps_m, tps_o = tokens / t["marian"], tokens / t["ours"]
            key = f"{size}_beam{beams}"
            results[key] = {
                "marian_tok_s": round(tps_m, 1),
                "ours_tok_s": round(tps_o, 1),
                "speedup": round(tps_o / tps_m, 3),
                "identical_outputs": same,
            }
            memory = ""
            if beams == 4:
                mem = {name: peak_memory_mb(lambda name=name: generate(name)) for name in models}
                results[key].update(marian_peak_mb=round(mem["marian"], 1), ours_peak_mb=round(mem["ours"], 1))
                memory = f" | peak MiB Marian {mem['marian']:.0f}, ours {mem['ours']:.0f}"
            print(
                f"{key:12s} Marian {tps_m:8.1f} tok/s | transformer_nmt {tps_o:8.1f} tok/s | "
                f"ratio {tps_o / tps_m:5.2f}x | identical outputs: {same}{memory}",
                flush=True,
            )
        del marian, ours
    results["torch_threads"] = torch.get_num_threads()
    results["clock"] = args.clock
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
