#!/usr/bin/env python
"""Memory and time of the training loss: `F.cross_entropy(logits.float(), labels, label_smoothing=0.1)` (what the
models computed before) against the backbone's `smoothed_cross_entropy` (chunked, gradient computed in the forward
into one buffer), forward + backward on logits that require a gradient, side by side in one run.

Each measurement runs in a fresh process: the logits [tokens, vocab] and labels (5% of them -100) are created, the
resident memory is read, one forward + backward runs, and the peak resident memory (VmHWM) above it is the extra
memory of the loss; then the median time of --reps forward + backward passes. Both take the same inputs.

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
from hf_variants.modeling_transformer_nmt import smoothed_cross_entropy

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
tokens, vocab, dtype, which, reps = {tokens}, {vocab}, getattr(torch, {dtype!r}), {which!r}, {reps}
logits = (torch.randn(tokens, vocab) * 2).to(dtype).requires_grad_()
labels = torch.randint(0, vocab, (tokens,))
labels[torch.rand(tokens) < 0.05] = -100

def step():
    if which == "F.cross_entropy":
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, label_smoothing=0.1)
    else:
        loss = smoothed_cross_entropy(logits, labels, 0.1)
    loss.backward()
    grad, logits.grad = logits.grad, None
    return loss.detach(), grad

torch.set_num_threads(torch.get_num_threads())
before = status("VmRSS")
loss, grad = step()
peak = status("VmHWM") - before
del grad
times = []
for _ in range(reps):
    t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
print(json.dumps({{"peak_extra_mb": peak / 2 ** 20, "seconds": statistics.median(times), "loss": float(loss)}}))
"""


def measure(tokens: int, vocab: int, dtype: str, which: str, reps: int) -> dict:
    code = CHILD.format(root=str(ROOT), tokens=tokens, vocab=vocab, dtype=dtype, which=which, reps=reps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["2048x8000"], help="tokens x vocabulary")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--write", action="store_true", help="write the table into RESULTS.md (section loss_memory)")
    args = p.parse_args()
    import os
    import torch

    lines = [f"Forward + backward of the loss on logits that require a gradient, 5% of the labels -100, label smoothing "
             f"0.1; {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f} at the start; peak "
             f"extra = the process's peak RSS above its memory with the logits allocated; time: median of "
             f"{args.reps}. `python benchmarks/loss_memory.py {' '.join(sys.argv[1:])}`",
             "",
             "| tokens x vocab | dtype | one [N, V] tensor (MB) | F.cross_entropy peak extra (MB) | ours peak extra (MB) "
             "| memory ratio | F.cross_entropy (ms) | ours (ms) | time ratio | loss difference |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for line in lines:
        print(line)
    for shape in args.shapes:
        tokens, vocab = (int(x) for x in shape.lower().split("x"))
        for dtype in args.dtypes:
            ref = measure(tokens, vocab, dtype, "F.cross_entropy", args.reps)
            ours = measure(tokens, vocab, dtype, "smoothed_cross_entropy", args.reps)
            one = tokens * vocab * (2 if dtype == "bfloat16" else 4) / 2 ** 20
            lines.append(
                f"| {tokens} x {vocab} | {dtype} | {one:.1f} | {ref['peak_extra_mb']:.1f} | "
                f"{ours['peak_extra_mb']:.1f} | {ours['peak_extra_mb'] / ref['peak_extra_mb']:.2f} | "
                f"{ref['seconds'] * 1e3:.1f} | {ours['seconds'] * 1e3:.1f} | {ours['seconds'] / ref['seconds']:.2f} | "
                f"{abs(ours['loss'] - ref['loss']):.1e} |")
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
