#!/usr/bin/env python
"""What cutting the vocabulary (`hf-variants-prune-vocabulary`) buys at the shapes of the checkpoints people start
from: NLLB-200 distilled 600M (256,206 tokens) and M2M100 418M (128,112 tokens), converted to the baseline
(pre-norm, fairseq positions, tied embeddings), random weights.

For each shape and each kept vocabulary size (`--kept`: the tokens a three-language corpus keeps, e.g. 16k and 32k),
side by side in one run:
- size: parameters and fp32 megabytes, full against pruned (exact, from the models);
- decoding speed: `generate()` on a batch of `--batch` random sources of `--src_len` tokens (ids the pruned model
  keeps, the same sources for both), exactly `--new_tokens` new tokens, greedy and beam 4 (length penalty 0.6),
  timed interleaved (`timing.interleaved`, the median of `--reps`, process CPU time) at `--threads` threads:
  tokens/s of each and the ratio (pruned speed / full speed).

The pruned model is the full one through `hf_variants.convert.prune.prune_model` (the rows of the special tokens
and of random kept ids, in order), so it is the code path the command runs. Random weights decode to random tokens:
the speed of a decoding step depends on the shapes, not on the weights.

    python benchmarks/bench_prune_vocabulary.py --threads 1 --reps 3 \
        --output benchmarks/results/prune_vocabulary_1thread

(about 6 GB of memory at the NLLB-600M shape: the full and a pruned model at once). Smoke run (tiny shapes, seconds):
`python benchmarks/bench_prune_vocabulary.py --shapes tiny --kept 300 --reps 1 --new_tokens 4 --output /tmp/smoke`.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import generation_settings, interleaved, write_result  # noqa: E402

# converted-model dimensions (the checkpoints' config.json): vocabulary, width, layers, heads, FFN
SHAPES = {
    "nllb-600M": dict(vocab_size=256206, d_model=1024, layers=12, heads=16, ffn=4096),
    "m2m100-418M": dict(vocab_size=128112, d_model=1024, layers=12, heads=16, ffn=4096),
    "tiny": dict(vocab_size=2000, d_model=32, layers=2, heads=4, ffn=64),
}


def converted_model(shape: dict):
    """A random baseline with the converted layout at `shape` (eval mode)."""
    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration

    config = TransformerNmtConfig(
        vocab_size=shape["vocab_size"],
        d_model=shape["d_model"],
        encoder_layers=shape["layers"],
        decoder_layers=shape["layers"],
        encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"],
        encoder_ffn_dim=shape["ffn"],
        decoder_ffn_dim=shape["ffn"],
        max_position_embeddings=1024,
        position_embedding_type="fairseq_sinusoidal",
        normalize_before=True,
        init_method="normal",
        dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    torch.manual_seed(0)
    return TransformerNmtForConditionalGeneration(config).eval()


def kept_ids(vocab_size: int, kept: int, seed: int = 0) -> list[int]:
    """The special ids 0-3 and random others, `kept` in all, in order."""
    generator = torch.Generator().manual_seed(seed)
    others = (torch.randperm(vocab_size - 4, generator=generator)[: kept - 4] + 4).tolist()
    return sorted([0, 1, 2, 3, *others])


def size(model) -> dict:
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": parameters, "fp32_mb": round(parameters * 4 / 2**20, 1)}


def measure(name: str, shape: dict, kept: int, args) -> dict:
    """One shape and kept size: sizes and greedy / beam-4 decoding speed of the full and the pruned model."""
    from hf_variants.convert.prune import prune_model

    full = converted_model(shape)
    ids = kept_ids(shape["vocab_size"], kept)
    pruned = prune_model(full, ids, [])
    generator = torch.Generator().manual_seed(1)
    picks = torch.randint(4, kept, (args.batch, args.src_len), generator=generator)
    new_source = picks.clone()
    new_source[:, -1] = 2  # </s> closes every source
    old_source = torch.tensor(ids)[new_source]  # the same sentences in the full vocabulary
    inputs = {"full": {"input_ids": old_source}, "pruned": {"input_ids": new_source}}
    models = {"full": full, "pruned": pruned}
    row = {"shape": name, "kept": kept, "full": size(full), "pruned": size(pruned)}
    for beams in (1, 4):
        settings = generation_settings(beams, args.new_tokens)

        def decode(which, settings=settings):
            with torch.inference_mode():
                models[which].generate(**inputs[which], **settings)

        seconds = interleaved({w: (lambda w=w: decode(w)) for w in models}, args.reps)
        tokens = args.batch * args.new_tokens
        key = "greedy" if beams == 1 else "beam4"
        row[key] = {w: round(tokens / seconds[w], 1) for w in models}
        row[key]["speedup"] = round(seconds["full"] / seconds["pruned"], 3)
    print(
        f"{name:12s} kept {kept:6d}: {row['full']['fp32_mb']:8.1f} -> {row['pruned']['fp32_mb']:8.1f} MB fp32, "
        f"greedy {row['greedy']['full']:7.1f} -> {row['greedy']['pruned']:7.1f} tok/s "
        f"({row['greedy']['speedup']:.2f}x), beam 4 {row['beam4']['full']:7.1f} -> {row['beam4']['pruned']:7.1f} "
        f"tok/s ({row['beam4']['speedup']:.2f}x)",
        flush=True,
    )
    models.clear()
    del full, pruned
    gc.collect()
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["nllb-600M", "m2m100-418M"], choices=sorted(SHAPES))
    parser.add_argument("--kept", nargs="+", type=int, default=[16000, 32000], help="kept vocabulary sizes")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src_len", type=int, default=24)
    parser.add_argument("--new_tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output", required=True, help="result file (.json appended)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.shapes:
        for kept in args.kept:
            if not 4 < kept < SHAPES[name]["vocab_size"]:
                parser.error(
                    f"--kept {kept}: must be between 4 and the {name} vocabulary ({SHAPES[name]['vocab_size']})"
                )
            rows.append(measure(name, SHAPES[name], kept, args))
    settings = {k: getattr(args, k) for k in ("batch", "src_len", "new_tokens", "threads", "reps")}
    return write_result(Path(args.output).with_suffix(".json"), {"settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
