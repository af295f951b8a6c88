#!/usr/bin/env python
"""Does checkpoint averaging's memory grow with the number of checkpoints? `averaging.average_checkpoints` (what
`--average_last` runs) and the whole `hf-variants-average` command (the mean, the model it is loaded into, the saved
folder) on K = 1, 2, 4, 8 checkpoints of one model, each in a forked child (`timing.peak_memory_mb`: the peak
resident memory above the child's start), beside the size of one model's float32 weights.

    python benchmarks/average_memory.py                  # base dims (about 52M parameters, 200 MB a checkpoint)
    python benchmarks/average_memory.py --preset small --counts 1 2 4

Writes `benchmarks/results/average_memory_<preset>.json` and the RESULTS.md section `average_memory`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from quality import ensure_tokenizer
from report import write_section
from safetensors.torch import save_file
from timing import peak_memory_mb, write_result

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
from hf_variants.commands import average  # noqa: E402
from hf_variants.training import averaging, checkpointing

ROOT = Path(__file__).resolve().parents[1]


def fake_run(folder: Path, preset: str, tokenizer: Path, count: int) -> int:
    """A run folder with `count` checkpoints of one model (its config, tokenizer and random weights a step apart);
    returns the bytes of one checkpoint's weights."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    model = TransformerNmtForConditionalGeneration(TransformerNmtConfig.from_preset(preset, vocab_size=vocab))
    model.config.save_pretrained(folder / "model_config")
    shutil.copytree(tokenizer, folder / "tokenizer")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied, as saved
    for step in range(1, count + 1):
        out = folder / "checkpoints" / f"step_{step}"
        out.mkdir(parents=True)
        save_file({k: v + 0.01 * step if v.is_floating_point() else v for k, v in state.items()}, str(out / "w"))
        os.rename(out / "w", out / "model.safetensors")
        (out / checkpointing.MARKER).write_text(json.dumps({"step": step, "format": checkpointing.FORMAT_VERSION}))
    return sum(v.numel() * v.element_size() for v in state.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a forked child of a process with an OpenMP pool could hang in it
    tokenizer = ensure_tokenizer("en-de", 8000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        model_bytes = fake_run(run, args.preset, tokenizer, max(args.counts))
        paths = [p for _, p in checkpointing.list_checkpoints(run / "checkpoints")]
        for k in args.counts:
            mean = peak_memory_mb(lambda k=k: averaging.average_checkpoints(paths[-k:]))
            out = Path(tmp) / f"avg{k}"
            command = peak_memory_mb(
                lambda k=k, out=out: average.main([str(run), "--last", str(k), "--output_dir", str(out)])
            )
            rows.append({"k": k, "mean_peak_mb": mean, "command_peak_mb": command})
            print(rows[-1], flush=True)
    model_mb = model_bytes / 2**20
    record = {"preset": args.preset, "model_mb": model_mb, "rows": rows}
    write_result(ROOT / "benchmarks" / "results" / f"average_memory_{args.preset}.json", record)
    lines = [
        f"`python benchmarks/average_memory.py --preset {args.preset}`: peak resident memory above the start, in a "
        f"forked child, against one model's float32 weights ({model_mb:.0f} MB):",
        "",
        "| checkpoints averaged | `average_checkpoints` (the mean) | in models | `hf-variants-average` (mean, model, "
        "saved folder) | in models |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['k']} | {row['mean_peak_mb']:.0f} MB | {row['mean_peak_mb'] / model_mb:.2f} | "
            f"{row['command_peak_mb']:.0f} MB | {row['command_peak_mb'] / model_mb:.2f} |"
        )
    write_section("average_memory", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
