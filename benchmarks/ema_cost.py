#!/usr/bin/env python
"""What the moving average of the weights (`--ema_decay`, hf_variants/training/ema.py) costs a training step, side
by side in one run: the step time with and without the average's update (interleaved blocks of the same steps,
medians of CPU time), the update alone, the swap in and out around a validation, and the memory: the average's
bytes against the training state (weights, gradients, Adam's two moments), and the peak resident memory of a few
training steps with and without it (each in a forked child, `timing.peak_memory_mb`).

    python benchmarks/ema_cost.py                      # small dims (the benchmark's), batches of ~4,096 tokens
    python benchmarks/ema_cost.py --preset base --reps 5

Writes `benchmarks/results/ema_cost_<preset>.json` and the RESULTS.md section `ema_cost`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from report import write_section
from timing import interleaved, peak_memory_mb, random_batch, train_step, write_result

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.training.ema import ExponentialMovingAverage

ROOT = Path(__file__).resolve().parents[1]


def build(preset: str, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset(preset, vocab_size=vocab)).train()
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=128, help="sentences per batch (x 32 source tokens)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timed block")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decay", type=float, default=0.999)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    inputs, labels = random_batch(args.batch, 32, 32, args.vocab)
    model, optimizer = build(args.preset, args.vocab)
    average = ExponentialMovingAverage(model, args.decay)
    step = {"n": 0}

    def plain():
        for _ in range(args.steps):
            train_step(model, optimizer, inputs, labels)

    def with_average():
        for _ in range(args.steps):
            train_step(model, optimizer, inputs, labels)
            step["n"] += 1
            average.update(step["n"])

    times = interleaved({"plain": plain, "ema": with_average}, args.reps)
    update = interleaved({"update": lambda: average.update(10**6)}, args.reps * 5)["update"]

    def swap():
        with average.swapped_in():
            pass

    swap_time = interleaved({"swap": swap}, args.reps * 5)["swap"]
    params = sum(p.numel() for p in model.parameters())
    ema_bytes = sum(t.numel() * t.element_size() for t in average.shadow)
    state_bytes = 4 * params * 4  # float32 weights, gradients, Adam's exp_avg and exp_avg_sq

    def run(with_ema: bool):
        def fn():
            m, opt = build(args.preset, args.vocab)
            ema = ExponentialMovingAverage(m, args.decay) if with_ema else None
            for i in range(2):
                train_step(m, opt, inputs, labels)
                if ema is not None:
                    ema.update(i + 1)

        return fn

    peaks = {"plain": peak_memory_mb(run(False)), "ema": peak_memory_mb(run(True))}
    record = {
        "preset": args.preset,
        "params": params,
        "batch": f"{args.batch} x 32 source / 32 target tokens",
        "threads": args.threads,
        "load_average_1min": os.getloadavg()[0],
        "step_s_plain": times["plain"] / args.steps,
        "step_s_ema": times["ema"] / args.steps,
        "step_time_ratio": times["ema"] / times["plain"],
        "update_s": update,
        "update_share_of_step": update / (times["plain"] / args.steps),
        "swap_in_and_out_s": swap_time,
        "ema_mb": ema_bytes / 2**20,
        "training_state_mb": state_bytes / 2**20,
        "ema_to_training_state": ema_bytes / state_bytes,
        "peak_mb_plain": peaks["plain"],
        "peak_mb_ema": peaks["ema"],
        "peak_ratio": peaks["ema"] / peaks["plain"],
    }
    out = ROOT / "benchmarks" / "results" / f"ema_cost_{args.preset}.json"
    write_result(out, record)
    text = (
        f"`python benchmarks/ema_cost.py --preset {args.preset}` ({params / 1e6:.2f}M parameters, batches of "
        f"{record['batch']}, {args.threads} thread(s), 1-minute load average {record['load_average_1min']:.1f} on "
        "2 cores; CPU time, medians of interleaved blocks):\n\n"
        "| | without | with `--ema_decay` | ratio |\n| --- | ---: | ---: | ---: |\n"
        f"| training step | {record['step_s_plain']:.3f} s | {record['step_s_ema']:.3f} s | "
        f"{record['step_time_ratio']:.3f} |\n"
        f"| peak resident memory of 2 steps (forked child) | {peaks['plain']:.0f} MB | {peaks['ema']:.0f} MB | "
        f"{record['peak_ratio']:.3f} |\n"
        f"| float32 training state (weights, gradients, Adam moments) | {record['training_state_mb']:.0f} MB | "
        f"{record['training_state_mb'] + record['ema_mb']:.0f} MB | {1 + record['ema_to_training_state']:.3f} |\n\n"
        f"The update alone (`torch._foreach_lerp_` over {params / 1e6:.2f}M parameters) takes "
        f"{update * 1e3:.1f} ms ({100 * record['update_share_of_step']:.1f} % of a step); swapping the average in "
        f"and out around a validation {swap_time * 1e3:.1f} ms."
    )
    write_section("ema_cost", text)
    print(text)


if __name__ == "__main__":
    main()
