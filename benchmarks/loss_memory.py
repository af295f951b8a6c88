#!/usr/bin/env python
"""Memory and time of the training step's output projection + loss, from the decoder's hidden states [tokens, d] and
the projection [V, d], three ways side by side in one run:
- `F.linear` + `F.cross_entropy(logits.float(), labels, label_smoothing=0.1)` (what the models computed before);
- `F.linear` + the backbone's `smoothed_cross_entropy` (chunked, gradient computed in the forward into one buffer);
- the backbone's `projected_smoothed_cross_entropy` (`skip_logits=True`, what train.py runs: the logits are
  computed a chunk at a time and never held whole).

Each measurement runs in a fresh process: the hidden states, the projection and the labels (5% of them -100) are
created, the resident memory is read, one forward + backward runs, and the peak resident memory (VmHWM) above it is
the extra memory of the step; then the median time of --reps forward + backward passes. All take the same inputs.

    python benchmarks/loss_memory.py                      # 2048 x 8000 (train.py's default batch and vocabulary)
    python benchmarks/loss_memory.py --shapes 2048x8000 4096x32000 --dtypes float32 bfloat16 --write
                                                          # --write: RESULTS.md section "loss_memory"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, statistics, sys, time
import torch
import torch.nn.functional as F
sys.path.insert(0, {root!r})
from hf_variants.loss_transformer_nmt import projected_smoothed_cross_entropy, smoothed_cross_entropy

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
tokens, vocab, d, dtype, which, reps = {tokens}, {vocab}, {d}, getattr(torch, {dtype!r}), {which!r}, {reps}
hidden = torch.randn(tokens, d).to(dtype).requires_grad_()
weight = (torch.randn(vocab, d) * d ** -0.5).to(dtype).requires_grad_()
labels = torch.randint(0, vocab, (tokens,))
labels[torch.rand(tokens) < 0.05] = -100

def step():
    if which == "projected":
        loss = projected_smoothed_cross_entropy(hidden, weight, None, labels, 0.1)
    elif which == "F.cross_entropy":
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100, label_smoothing=0.1)
    else:
        loss = smoothed_cross_entropy(F.linear(hidden, weight), labels, 0.1)
    loss.backward()
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    return loss.detach(), grads

torch.set_num_threads(torch.get_num_threads())
before = status("VmRSS")
loss, grads = step()
peak = status("VmHWM") - before
del grads
times = []
for _ in range(reps):
    t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
print(json.dumps({{"peak_extra_mb": peak / 2 ** 20, "seconds": statistics.median(times), "loss": float(loss)}}))
"""


def measure(tokens: int, vocab: int, d: int, dtype: str, which: str, reps: int) -> dict:
    code = CHILD.format(root=str(ROOT), tokens=tokens, vocab=vocab, d=d, dtype=dtype, which=which, reps=reps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["2048x8000"], help="tokens x vocabulary")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--d", type=int, default=512, help="hidden size (the projection is [vocab, d])")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--write", action="store_true", help="write the table into RESULTS.md (section loss_memory)")
    args = p.parse_args()
    import os

    import torch

    methods = ("F.cross_entropy", "smoothed_cross_entropy", "projected")
    lines = [
        f"Forward + backward of the output projection ([V, {args.d}], no bias) and the loss from hidden states that "
        f"require a gradient, 5% of the labels -100, label smoothing 0.1; {torch.get_num_threads()} thread(s), "
        f"load average {os.getloadavg()[0]:.2f} at the start; peak extra = the process's peak RSS above its "
        f"memory with the inputs allocated; time: median of {args.reps}; ratios against F.linear + "
        f"F.cross_entropy. `python benchmarks/loss_memory.py {' '.join(sys.argv[1:])}`",
        "",
        "| tokens x vocab | dtype | one [N, V] tensor (MB) | peak extra (MB): F.linear + F.cross_entropy "
        "| F.linear + smoothed_cross_entropy | projected (skip_logits) | memory ratios | time (ms): F.cross_entropy "
        "| smoothed | projected | time ratios | loss difference (projected) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for line in lines:
        print(line)
    for shape in args.shapes:
        tokens, vocab = (int(x) for x in shape.lower().split("x"))
        for dtype in args.dtypes:
            ref, chunked, projected = (measure(tokens, vocab, args.d, dtype, m, args.reps) for m in methods)
            one = tokens * vocab * (2 if dtype == "bfloat16" else 4) / 2**20
            mem = [r["peak_extra_mb"] for r in (ref, chunked, projected)]
            sec = [r["seconds"] * 1e3 for r in (ref, chunked, projected)]
            lines.append(
                f"| {tokens} x {vocab} | {dtype} | {one:.1f} | {mem[0]:.1f} | {mem[1]:.1f} | {mem[2]:.1f} | "
                f"{mem[1] / mem[0]:.2f} / {mem[2] / mem[0]:.2f} | {sec[0]:.1f} | {sec[1]:.1f} | {sec[2]:.1f} | "
                f"{sec[1] / sec[0]:.2f} / {sec[2] / sec[0]:.2f} | {abs(projected['loss'] - ref['loss']):.1e} |"
            )
            print(lines[-1])
    if args.write:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from report import write_section

        if write_section("loss_memory", "\n".join(lines)):
            print("wrote the loss_memory section of benchmarks/RESULTS.md")
        else:
            print("benchmarks/RESULTS.md has no loss_memory markers: not written", file=sys.stderr)


if __name__ == "__main__":
    main()
