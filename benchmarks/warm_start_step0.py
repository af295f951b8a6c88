"""Step-0 distance of every warm-started variant from its pretrained baseline (`hf_variants.warm_start`).

For each variant setting: the validation loss (token-mean cross-entropy, eval mode, no label smoothing) on the first
N pairs of a validation split, its difference from the base's, the largest |logit difference| and the mean
KL(base || variant) per target token. Variants whose start is exact show ~1e-6 differences.

    python benchmarks/warm_start_step0.py --base DIR [--pairs 500] [--json benchmarks/results/warm_start_step0.json]

DIR: a saved transformer_nmt (or MarianMTModel) folder with its tokenizer. Without a trained baseline at hand,
`--train_base DIR --train_steps 600` first trains a small post-norm baseline (d 64, 2 + 2 layers, BPE 2000) on the
bundled Multi30k en-de for that many steps on the CPU (batches of 32 pairs; 3-5 min on 2 busy cores) and saves it
to DIR (no training beyond that: it is a weakly trained base, enough to tell exact starts from inexact ones).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from timing import write_result  # noqa: E402

import hf_variants  # noqa: F401, E402 (registers the model types)
from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration  # noqa: E402
from hf_variants.convert.warm_start import load_base, warm_start  # noqa: E402

DATA = ROOT / "training" / "data" / "multi30k"

# (label, model type, config overrides, warm_start keyword arguments)
SETTINGS = [
    ("MUTE plain", "mute_nmt", {"merge": "plain"}, {}),
    ("MUTE bias+seq (default)", "mute_nmt", {}, {}),
    ("HySAN gated_sum (default, e1)", "hysan_nmt", {}, {}),
    ("HySAN sum", "hysan_nmt", {"fusion": "sum"}, {}),
    ("HySAN concat", "hysan_nmt", {"fusion": "concat"}, {}),
    ("MG-SA n-gram, phrase heads' W^o zeroed (default)", "mgsa_nmt", {"phrase_type": "ngram"}, {}),
    ("MG-SA n-gram, phrase heads' W^o copied", "mgsa_nmt", {"phrase_type": "ngram"}, {"phrase_heads_output": "copy"}),
    ("MIMO (bilingual base)", "mimo_nmt", {}, {}),
    ("MIMO -task attention", "mimo_nmt", {"task_attention": False}, {}),
    ("Tied from the decoder (default)", "tied_nmt", {}, {"tied_init": "decoder"}),
    ("Tied from the encoder", "tied_nmt", {}, {"tied_init": "encoder"}),
]


def read(split: str, lang: str, n: int) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in itertools.islice(f, n)]


def train_base(out: Path, steps: int, src: str = "en", tgt: str = "de") -> None:
    from hf_variants.tokenization import train_tokenizer

    torch.manual_seed(0)
    rng = random.Random(0)
    sources, targets = read("train", src, 29000), read("train", tgt, 29000)
    tokenizer = train_tokenizer(sources[:10000] + targets[:10000], vocab_size=2000)
    config = TransformerNmtConfig.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        d_model=64,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        dropout=0.1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
    )
    model = TransformerNmtForConditionalGeneration(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / 100, (100 / (s + 1)) ** 0.5))
    model.train()
    start = time.time()
    for step in range(steps):
        index = rng.sample(range(len(sources)), 32)
        batch = model.prepare_translation_inputs(
            tokenizer, [sources[i] for i in index], text_target=[targets[i] for i in index], max_length=40
        )
        model(**batch).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"trained the base: {steps} steps in {time.time() - start:.0f} s")
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)


@torch.no_grad()
def evaluate(model, reference, batches) -> dict:
    """Token-mean loss of `model`, and against `reference` logits: max |difference|, mean KL(ref || model)."""
    total = tokens = kl = 0.0
    diff = 0.0
    for batch, ref_logits in zip(batches, reference):
        out = model(**batch).logits.float()
        mask = batch["labels"] != -100
        total += F.cross_entropy(out[mask], batch["labels"][mask], reduction="sum").item()
        tokens += mask.sum().item()
        if ref_logits is not None:
            diff = max(diff, (out - ref_logits)[mask].abs().max().item())
            kl += F.kl_div(
                out[mask].log_softmax(-1), ref_logits[mask].log_softmax(-1), log_target=True, reduction="sum"
            ).item()
    return {"loss": total / tokens, "max_logit_diff": diff, "kl": kl / tokens}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path)
    parser.add_argument("--train_base", type=Path, help="train a small baseline into this folder first")
    parser.add_argument("--train_steps", type=int, default=600)
    parser.add_argument("--pairs", type=int, default=500)
    parser.add_argument("--source_lang", default="en")
    parser.add_argument("--target_lang", default="de")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a small model gains nothing from more threads on a shared CPU
    if args.train_base:
        train_base(args.train_base, args.train_steps, args.source_lang, args.target_lang)
        args.base = args.train_base
    if args.base is None:
        parser.error("--base or --train_base is required")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base, _ = load_base(str(args.base))
    sources = read("val", args.source_lang, args.pairs)
    targets = read("val", args.target_lang, args.pairs)
    # each model prepares its own inputs (the same ids; a base that names its languages, as train.py's do, makes
    # MIMO / Tied read the target language's id)
    lang = {"tgt_lang": args.target_lang} if base.config.languages else {}

    def inputs_for(model):
        return [
            model.prepare_translation_inputs(
                tokenizer, sources[i : i + 50], text_target=targets[i : i + 50], max_length=64, **lang
            )
            for i in range(0, len(sources), 50)
        ]

    batches = inputs_for(base)
    with torch.no_grad():
        reference = [base(**batch).logits.float() for batch in batches]
    rows = [{"setting": "base (transformer_nmt)", **evaluate(base, reference, batches)}]
    for label, model_type, overrides, kwargs in SETTINGS:
        model = warm_start(base, model_type, overrides, **kwargs)
        rows.append(
            {
                "setting": label,
                "model_type": model_type,
                "overrides": overrides,
                **kwargs,
                **evaluate(model, reference, inputs_for(model)),
            }
        )
    base_loss = rows[0]["loss"]
    print(
        f"Step-0 validation loss on the first {args.pairs} pairs of val.{args.source_lang}-{args.target_lang} "
        f"(base: {args.base})\n"
    )
    print("| setting | loss | Δ vs base | max abs Δ logit | KL(base ‖ variant) / token |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['setting']} | {row['loss']:.4f} | {row['loss'] - base_loss:+.4f} | "
            f"{row['max_logit_diff']:.2e} | {row['kl']:.2e} |"
        )
    if args.json:
        write_result(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
