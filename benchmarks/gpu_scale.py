#!/usr/bin/env python
"""Training and decoding at GPU scale: tokens/s, MFU, peak memory and recompilations of every model type.

For each model type (baseline, MUTE, HySAN, MG-SA, Tied, MIMO; `benchmarks/efficiency.py`'s configurations) at
`base` and `big` dims (`--tiny`: the tiny preset, for a smoke run on the CPU):

- training: forward + backward + Adam step (`hf_variants.training.fast_step.adam`: fused on CUDA) on token batches
  of 8k, 16k and 32k tokens (`--token_batches`; a batch's size is sentences x its longest side, padding included,
  as fairseq's --max-tokens), eager and compiled (`fast_step.compile_body`: the stacks compiled with dynamic batch
  and length dimensions); bf16 autocast on CUDA (fp32 weights, as `--mixed_precision bf16`), fp32 on the CPU.
  Batches are length-bucketed real sentence pairs: the bundled Multi30k training set (or `--data`), tokenized by
  a BPE tokenizer trained on it (`--vocab`), sorted by length and cut into batches of the token budget; each
  measurement cycles over `--train_batches` of them, drawn at random;
- decoding: `generate` on batches of 64 and 256 test sentences (`--decode_batches`), greedy and beam 4, exactly
  `--new_tokens` new tokens a sentence, the eager dynamic cache against the fast path (`cache_implementation=
  "static"` + `CompileConfig(fullgraph=True, mode="reduce-overhead")`: CUDA graphs on a GPU).

FLOPs are counted from the shapes of the operations each step runs (`torch.utils.flop_counter.FlopCounterMode` on an
eager step of every batch: matrix products and attention kernels, the backward included), padding included: the
variants' extra work (units, branches, streams, phrase heads) counts as FLOPs. MFU = FLOPs/s over the GPU's dense
bf16 peak (`PEAK_FLOPS`; None where the device is not listed, e.g. the CPU). Tokens/s count real (non-padding)
source + target tokens. Decoding tokens/s count generated tokens a sentence (not per beam), encoder included.
Recompilations: graphs dynamo compiled while warming up and while timing (the latter should be 0).

`--budget_s` trims the grid: cells run in priority order (base before big; at 16k tokens, then 8k, then 32k;
decoding at batch 64 before 256) while the next one fits (estimated by the longest cell of its kind so far: eager
training, compiled training, decoding; the first of each kind always runs); the skipped cells are listed in the
result.
One JSON (`--output`, default `benchmarks/results/gpu_scale_<device>.json`) with the commit, date, device and
versions.

    python benchmarks/gpu_scale.py --budget_s 480                          # on a GPU machine (~8 minutes)
    python benchmarks/gpu_scale.py --device cpu --tiny --budget_s 60       # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from efficiency import build, language_inputs  # noqa: E402
from timing import run_metadata  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from hf_variants.tokenization import train_tokenizer  # noqa: E402
from hf_variants.training import fast_step  # noqa: E402

MODEL_NAMES = ["baseline", "mute", "hysan", "mgsa", "tied", "mimo"]
# dense bf16 peak FLOP/s (no sparsity) by a substring of the device name
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
DATA_DIRS = [ROOT.parent / "shared" / "data" / "multi30k", ROOT / "training" / "data" / "multi30k"]


# --------------------------------------------------------------------------------------------------------- data
def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def load_data(data_dir: Path, vocab: int, work_dir: Path, max_pairs: int | None = None):
    """(tokenizer, [(source ids, target ids)] of the first `max_pairs` training pairs (all: None), test source
    sentences)."""
    src, tgt = read_lines(data_dir / "train.en.gz"), read_lines(data_dir / "train.de.gz")
    if len(src) != len(tgt):
        raise ValueError(f"{data_dir}: train.en.gz has {len(src)} lines, train.de.gz {len(tgt)}")
    src, tgt = src[:max_pairs], tgt[:max_pairs]
    tokenizer = train_tokenizer(src + tgt, vocab_size=vocab, output_dir=work_dir / "tokenizer")
    encoded = tokenizer(src, text_target=tgt)
    pairs = list(zip(encoded["input_ids"], encoded["labels"]))
    return tokenizer, pairs, read_lines(data_dir / "test_2016_flickr.en.gz")


def token_batches(pairs, max_tokens: int) -> list[list[int]]:
    """Indices of length-bucketed batches: pairs sorted by (source, target) length, cut where sentences x the
    longest side would exceed `max_tokens`."""
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    batches, current, longest = [], [], 0
    for i in order:
        size = max(len(pairs[i][0]), len(pairs[i][1]))
        if current and (len(current) + 1) * max(longest, size) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, size)
    if current:
        batches.append(current)
    return batches


def collate(pairs, indices, pad: int, device) -> dict:
    rows = [pairs[i] for i in indices]
    s, t = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    input_ids = torch.full((len(rows), s), pad, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    for k, (a, b) in enumerate(rows):
        input_ids[k, : len(a)] = torch.tensor(a)
        labels[k, : len(b)] = torch.tensor(b)
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != pad).long(), "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------------ helpers
def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device) -> float:
    """CUDA: the peak allocated memory since the last reset; CPU: the process's peak resident set so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
        return names[0] if names else platform.processor() or "cpu"
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "cpu"


def peak_flops(name: str) -> float | None:
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def metadata(device) -> dict:
    """`timing.run_metadata()` (commit, date, CPU, library versions) and the device the run measured."""
    return {**run_metadata(), "device": device_name(device)}


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(json.dumps(record, indent=2) + "\n")
    os.replace(f.name, path)


# ----------------------------------------------------------------------------------------------------- training
def train_cell(name, size, max_tokens, compiled, data, args, device) -> dict:
    tokenizer, pairs, batches_by_budget = data["tokenizer"], data["pairs"], data["batches"]
    model = build(name, size, len(tokenizer)).to(device).train()
    optimizer = fast_step.adam(model.parameters(), device, lr=1e-4)
    rng = random.Random(f"{name}-{size}-{max_tokens}")
    chosen = rng.sample(batches_by_budget[max_tokens], min(args.train_batches, len(batches_by_budget[max_tokens])))
    batches = []
    for indices in chosen:
        batch = collate(pairs, indices, tokenizer.pad_token_id, device)
        batch.update({k: v.to(device) for k, v in language_inputs(model, len(indices)).items()})
        batches.append(batch)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(batch):
        with autocast:
            loss = model(**batch, skip_logits=True).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.after_optimizer_step()

    flops = []
    for batch in batches:  # counted on eager steps (a compiled graph's operations are the same products)
        with FlopCounterMode(display=False) as counter:
            step(batch)
        flops.append(counter.get_total_flops())
    graphs_before = fast_step.recompilations()
    if compiled:
        fast_step.compile_body(model, backend=args.backend)
        for batch in batches:  # every shape once: the compilation, and any recompilation, happen here
            step(batch)
    graphs_warm = fast_step.recompilations()
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.train_rounds):
        for batch in batches:
            step(batch)
    synchronize(device)
    seconds = time.perf_counter() - start
    rounds = args.train_rounds
    real = rounds * sum(int(b["attention_mask"].sum() + (b["labels"] != -100).sum()) for b in batches)
    padded = rounds * sum(b["input_ids"].numel() + b["labels"].numel() for b in batches)
    achieved = rounds * sum(flops) / seconds
    peak = peak_flops(data["device_name"])
    return {
        "model": name,
        "size": size,
        "token_batch": max_tokens,
        "compiled": compiled,
        "steps": rounds * len(batches),
        "sentences_per_step": sum(b["input_ids"].shape[0] for b in batches) / len(batches),
        "tokens_per_s": real / seconds,
        "padded_tokens_per_s": padded / seconds,
        "tflops_per_s": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "flops_per_step": sum(flops) / len(flops),
        "peak_memory_mb": peak_mb(device),
        "graphs_compiled_warmup": graphs_warm - graphs_before,
        "recompilations_timed": fast_step.recompilations() - graphs_warm,
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------------------------------- decoding
def decode_cell(name, size, batch_size, beams, data, args, device) -> dict:
    tokenizer = data["tokenizer"]
    model = build(name, size, len(tokenizer)).to(device).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    sentences = (data["test"] * (batch_size // len(data["test"]) + 1))[:batch_size]
    inputs = tokenizer(sentences, padding=True, return_tensors="pt")
    inputs = {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    inputs.update({k: v.to(device) for k, v in language_inputs(model, batch_size).items()})
    settings = dict(num_beams=beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if beams > 1:
        settings["length_penalty"] = 0.6
    compile_config = CompileConfig(fullgraph=True, mode=args.decode_mode, backend=args.backend)
    compile_config._compile_all_devices = True  # the CPU smoke run compiles too
    paths = {
        "eager_dynamic": {},
        "static_compiled": {"cache_implementation": "static", "compile_config": compile_config},
    }
    result = {"model": name, "size": size, "batch": batch_size, "num_beams": beams, "new_tokens": args.new_tokens}
    outputs = {}
    for path, extra in paths.items():
        graphs_before = fast_step.recompilations()
        with torch.inference_mode():
            model.generate(**inputs, **settings, **extra)  # warm-up (the compilation)
            graphs_warm = fast_step.recompilations()
            reset_peak(device)
            synchronize(device)
            start = time.perf_counter()
            out = model.generate(**inputs, **settings, **extra)
            synchronize(device)
        seconds = time.perf_counter() - start
        outputs[path] = out
        result[path] = {
            "tokens_per_s": batch_size * args.new_tokens / seconds,
            "seconds": seconds,
            "peak_memory_mb": peak_mb(device),
            "graphs_compiled_warmup": graphs_warm - graphs_before,
            "recompilations_timed": fast_step.recompilations() - graphs_warm,
        }
    result["speedup"] = result["static_compiled"]["tokens_per_s"] / result["eager_dynamic"]["tokens_per_s"]
    result["same_tokens"] = bool(torch.equal(outputs["eager_dynamic"], outputs["static_compiled"]))
    return result


# ---------------------------------------------------------------------------------------------------------- grid
def grid(args) -> list[tuple]:
    """The cells in priority order: (kind, model, size, parameters...)."""
    cells = []
    order = sorted(args.token_batches, key=lambda n: (n != 16384, n))  # 16k first: the goals are stated there
    for size in args.sizes:
        for name in args.models:
            cells.append(("train", name, size, order[0], False))
            cells.append(("train", name, size, order[0], True))
        for name in args.models:
            for beams in (1, 4):
                cells.append(("decode", name, size, args.decode_batches[0], beams))
        for tokens in order[1:]:
            for name in args.models:
                cells += [("train", name, size, tokens, False), ("train", name, size, tokens, True)]
        for batch in args.decode_batches[1:]:
            for name in args.models:
                cells += [("decode", name, size, batch, 1), ("decode", name, size, batch, 4)]
    return cells


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget_s", type=float, default=480.0, help="wall-clock budget of the measurements")
    p.add_argument("--tiny", action="store_true", help="tiny dims and small batches (a CPU smoke run)")
    p.add_argument("--models", nargs="+", default=MODEL_NAMES, choices=MODEL_NAMES)
    p.add_argument("--sizes", nargs="+", help="presets (default: base big; tiny with --tiny)")
    p.add_argument("--token_batches", nargs="+", type=int, help="tokens a training batch (default 8192 16384 32768)")
    p.add_argument("--decode_batches", nargs="+", type=int, help="sentences a decoding batch (default 64 256)")
    p.add_argument("--train_batches", type=int, default=8, help="distinct batches a training measurement cycles")
    p.add_argument("--train_rounds", type=int, default=2, help="timed passes over them")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--max_pairs", type=int, help="use the first N training pairs (default: all; 3000 with --tiny)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager/aot_eager: quick checks)")
    p.add_argument("--decode_mode", default="reduce-overhead", help="torch.compile mode of the decoding step")
    p.add_argument("--data", type=Path, help="a folder with train.en.gz, train.de.gz, test_2016_flickr.en.gz")
    p.add_argument("--threads", type=int, help="torch threads on the CPU (default: torch's)")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    args.sizes = args.sizes or (["tiny"] if args.tiny else ["base", "big"])
    args.token_batches = args.token_batches or ([512, 1024] if args.tiny else [8192, 16384, 32768])
    args.decode_batches = args.decode_batches or ([8] if args.tiny else [64, 256])
    if args.tiny:
        args.vocab = min(args.vocab, 1000)
        args.new_tokens = min(args.new_tokens, 8)
        args.train_batches = min(args.train_batches, 3)
        args.train_rounds = min(args.train_rounds, 1)
        args.max_pairs = args.max_pairs or 3000
    if args.data is None:
        args.data = next((d for d in DATA_DIRS if (d / "train.en.gz").exists()), DATA_DIRS[-1])
    for name in ("train.en.gz", "train.de.gz", "test_2016_flickr.en.gz"):
        if not (args.data / name).exists():
            p.error(f"--data {args.data}: {name} is missing")
    if args.budget_s <= 0:
        p.error(f"--budget_s must be > 0, got {args.budget_s}")
    args.output = args.output or ROOT / "benchmarks" / "results" / f"gpu_scale_{torch.device(args.device).type}.json"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.monotonic()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    with tempfile.TemporaryDirectory() as work:
        tokenizer, pairs, test = load_data(args.data, args.vocab, Path(work), args.max_pairs)
    data = {
        "tokenizer": tokenizer,
        "pairs": pairs,
        "test": test,
        "batches": {n: token_batches(pairs, n) for n in args.token_batches},
        "device_name": device_name(device),
    }
    record = {
        "metadata": metadata(device),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "output"},
        "flops": "FlopCounterMode on eager steps (products and attention kernels, backward included, padding "
        "included); MFU over PEAK_FLOPS (dense bf16) of the device",
        "peak_flops": peak_flops(data["device_name"]),
        "train": [],
        "decode": [],
        "skipped": [],
    }
    record["settings"]["data"] = os.path.relpath(args.data, ROOT)
    spent: dict[tuple, float] = {}  # the longest cell of each kind so far: the estimate of the next one
    for cell in grid(args):
        kind = cell[0]
        estimate = (kind, cell[-1]) if kind == "train" else (kind,)  # compiled training cells take longer
        elapsed = time.monotonic() - start
        if estimate in spent and elapsed + spent[estimate] > args.budget_s:  # the first of each kind always runs
            record["skipped"].append(list(cell))
            continue
        began = time.monotonic()
        if kind == "train":
            row = train_cell(*cell[1:], data, args, device)
        else:
            row = decode_cell(*cell[1:], data, args, device)
        record[kind].append(row)
        spent[estimate] = max(spent.get(estimate, 0.0), time.monotonic() - began)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record["wall_s"] = time.monotonic() - start
    write_json(args.output, record)
    print(
        f"{len(record['train'])} training and {len(record['decode'])} decoding cells, {len(record['skipped'])} "
        f"skipped, {record['wall_s']:.0f} s -> {args.output}"
    )
    return record


if __name__ == "__main__":
    main()
