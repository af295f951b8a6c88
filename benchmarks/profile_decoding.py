#!/usr/bin/env python
"""Where decoding time goes: a torch.profiler breakdown of `generate` for MarianMTModel and ours (issue 22 item 1).

The same random weights as benchmarks/bench_inference.py (Marian converted to ours), the same batch (`--batch` 32
sources of up to `--src_len` 15 tokens, padded rows), exactly `--new_tokens` 20 new tokens, greedy and beam 4
(length penalty 0.6), `--threads` 2. For each engine, dims class and decoding: `--reps` profiled `generate` calls
after one warm-up, and as many unprofiled calls for the wall time.

The profile is cut two ways:
- by region of the decoding step, marked by this script only (it wraps the functions below in
  `torch.profiler.record_function`; the package itself carries no profiling code): the encoder, the decoder's mask
  building and position encodings, its self-attention (cache update separately), cross-attention and FFN sublayers,
  the rest of the decoder (embeddings, norms, the layer loop), the output projection (`lm_head`), the cache
  reordering of beam search, the logits processors, and the rest of `generate` (search bookkeeping, stopping
  criteria, input preparation);
- by kind of operator: matrix work (GEMMs, batched GEMMs, the attention kernels, int8 GEMMs) against everything
  else (copies, concatenations, elementwise and reductions, index and mask ops).

Times are per `generate` call, in ms: operator self time (each aten op counted once, in its innermost region), and
"Python + dispatch", the wall time of a call without the profiler minus its operator time measured with it (the
profiler's own overhead inflates the operator times a little, so this is a lower bound of the interpreter's part).

    python benchmarks/profile_decoding.py [--sizes small base] [--engines marian_fp32 ours_fp32 ours_int8]
        [--label before|after] [--reps 3]

`HF_VARIANTS_ROOT=DIR` profiles the hf_variants of another checkout (the "before" run on main); this script and
the benchmark helpers it imports stay this checkout's.

`--label` names the run: the JSON goes to `benchmarks/results/profile_decoding_<label>.json`, and the `profile`
section of benchmarks/RESULTS.md is rebuilt from every stored label (`before` and `after` side by side).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
# the hf_variants profiled: this checkout's, or another one's (`HF_VARIANTS_ROOT=/work/main` for the "before" run)
sys.path.insert(0, os.environ.get("HF_VARIANTS_ROOT", str(ROOT)))
import hf_variants  # noqa: E402,F401  (first: the helpers below put this checkout on sys.path too)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_inference import marian_and_ours  # noqa: E402
from report import write_section  # noqa: E402
from timing import random_batch  # noqa: E402

from hf_variants import quantize_for_cpu  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"

# operators that are matrix work (their self time); everything else is "other"
MATRIX_OPS = {
    "aten::addmm",
    "aten::mm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::_int_mm",
    "onednn::qlinear_pointwise",
    "quantized::linear_dynamic",
    "aten::_weight_int8pack_mm",
    "aten::mkldnn_rnn_layer",
}

REGIONS = [
    "encoder",
    "decoder: masks",
    "decoder: positions",
    "decoder: self-attention",
    "decoder: cache update",
    "decoder: cross-attention",
    "decoder: FFN",
    "decoder: other",
    "lm_head",
    "beam: cache reorder",
    "logits processors",
    "generate: other",
]


_IN_DECODER = [0]  # > 0 while a decoder forward runs: masks and positions are marked there only


def _wrap(owner, name: str, label: str, decoder_only: bool = False) -> None:
    """Replace `owner.name` (a function or method) by one that runs inside `record_function(label)` (with
    `decoder_only`: only when called from a decoder's forward; the encoder's one call stays in "encoder")."""
    original = getattr(owner, name)
    if getattr(original, "_profile_label", None):
        return

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if decoder_only and not _IN_DECODER[0]:
            return original(*args, **kwargs)
        with record_function(label):
            return original(*args, **kwargs)

    wrapped._profile_label = label
    if isinstance(owner, type) and isinstance(vars(owner).get(name), staticmethod):
        wrapped = staticmethod(wrapped)  # (our `_reorder_cache`: a staticmethod, as transformers calls it)
    setattr(owner, name, wrapped)


def _wrap_module(module: torch.nn.Module, label: str, decoder: bool = False) -> None:
    forward = module.forward

    def wrapped(*args, **kwargs):
        _IN_DECODER[0] += decoder
        try:
            with record_function(label):
                return forward(*args, **kwargs)
        finally:
            _IN_DECODER[0] -= decoder

    module.forward = wrapped


def instrument(model) -> None:
    """Mark the regions of one model (ours or Marian, fp32 or int8) for the profiler."""
    import transformers.models.marian.modeling_marian as marian_module
    from transformers import cache_utils, generation

    import hf_variants.modeling_transformer_nmt as ours_module

    for module in (marian_module, ours_module):
        for fn in ("create_causal_mask", "create_bidirectional_mask"):
            if hasattr(module, fn):
                _wrap(module, fn, "decoder: masks", decoder_only=True)
    _wrap(cache_utils.DynamicLayer, "update", "decoder: cache update")
    for cls in (cache_utils.Cache, cache_utils.EncoderDecoderCache):
        if "reorder_cache" in vars(cls):
            _wrap(cls, "reorder_cache", "beam: cache reorder")
    owner = next((c for c in type(model).__mro__ if "_reorder_cache" in vars(c)), None)  # ours: the mixin's
    if owner is not None and not owner.__module__.startswith("transformers."):
        _wrap(owner, "_reorder_cache", "beam: cache reorder")
    _wrap(generation.logits_process.LogitsProcessorList, "__call__", "logits processors")
    _wrap_module(model.get_encoder(), "encoder")
    decoder = model.model.decoder
    _wrap_module(decoder, "decoder: other", decoder=True)
    if isinstance(decoder, ours_module.TransformerNmtStack):
        _wrap(decoder, "position_embeddings", "decoder: positions")  # the instance's method only
    elif getattr(decoder, "embed_positions", None) is not None:
        _wrap_module(decoder.embed_positions, "decoder: positions")
    for layer in decoder.layers:
        _wrap_module(layer.self_attn, "decoder: self-attention")
        _wrap_module(layer.encoder_attn, "decoder: cross-attention")
        if hasattr(layer, "ffn"):
            _wrap_module(layer.ffn, "decoder: FFN")
        else:  # Marian: fc1, fc2, final_layer_norm are the layer's own modules
            for name in ("fc1", "fc2", "final_layer_norm"):
                _wrap_module(getattr(layer, name), "decoder: FFN")
    _wrap_module(model.lm_head, "lm_head")


def top_operators(prof, limit: int) -> list[dict]:
    """The `limit` operators with the most self CPU time (per profiled call): name, ms, calls, matrix or not."""
    rows = [
        event for event in prof.key_averages() if event.key not in REGIONS and not event.key.startswith("ProfilerStep")
    ]
    rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "self_ms": round(e.self_cpu_time_total / 1000.0, 2),
            "calls": e.count,
            "matrix": e.key in MATRIX_OPS,
        }
        for e in rows[:limit]
    ]


def breakdown(prof, calls: int) -> dict:
    """{region: {"matrix": ms, "other": ms}} per call, from the profiler's event tree."""
    labels = set(REGIONS)
    table = {region: {"matrix": 0.0, "other": 0.0} for region in REGIONS}
    for event in prof.events():
        if event.name in labels or event.name.startswith("ProfilerStep"):
            continue
        parent, region = event.cpu_parent, "generate: other"
        while parent is not None:
            if parent.name in labels:
                region = parent.name
                break
            parent = parent.cpu_parent
        kind = "matrix" if event.name in MATRIX_OPS else "other"
        table[region][kind] += event.self_cpu_time_total / 1000.0 / calls
    return table


def engines_for(size: str, names: list[str], vocab: int) -> dict:
    marian, ours = marian_and_ours(size, vocab)
    engines = {}
    for name in names:
        if name == "marian_fp32":
            engines[name] = marian
        elif name == "ours_fp32":
            engines[name] = ours
        elif name == "ours_int8":
            engines[name] = quantize_for_cpu(copy.deepcopy(ours))
        elif name == "marian_int8":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engines[name] = torch.ao.quantization.quantize_dynamic(
                    copy.deepcopy(marian), {torch.nn.Linear}, dtype=torch.qint8
                )
        else:
            raise ValueError(f"unknown engine {name!r}")
    return engines


def profile_engine(model, inputs: dict, gen: dict, reps: int, top: int = 15) -> dict:
    """Median wall time of `reps` plain calls, then `reps` calls profiled one by one; the profile kept is the one
    with the median operator time (a call disturbed by another process on the machine does not count)."""

    def call():
        with torch.inference_mode():
            return model.generate(**inputs, **gen)

    call()  # warm-up (also before instrumenting: the wall time is of the plain model)
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    wall = sorted(walls)[len(walls) // 2] * 1000.0
    instrument(model)
    call()
    tables = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        tables.append((breakdown(prof, 1), top_operators(prof, top)))
    tables.sort(key=lambda t: sum(v["matrix"] + v["other"] for v in t[0].values()))
    table, ops_top = tables[len(tables) // 2]
    ops = sum(v["matrix"] + v["other"] for v in table.values())
    return {
        "wall_ms": round(wall, 1),
        "op_ms": round(ops, 1),
        "matrix_ms": round(sum(v["matrix"] for v in table.values()), 1),
        "python_dispatch_ms": round(max(wall - ops, 0.0), 1),
        "top_ops": ops_top,
        "regions": {r: {k: round(v, 2) for k, v in kinds.items()} for r, kinds in table.items()},
    }


def run(args) -> dict:
    results = {}
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    for size in args.sizes:
        for beams in args.beams:
            key = f"{size} {'greedy' if beams == 1 else f'beam{beams}'}"
            gen = dict(
                num_beams=beams,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                **({"length_penalty": 0.6} if beams > 1 else {}),
            )
            engines = engines_for(size, args.engines, args.vocab)  # fresh (uninstrumented) models per setting
            results[key] = {}
            for name, model in engines.items():
                row = profile_engine(model, inputs, gen, args.reps, args.top)
                results[key][name] = row
                print(
                    f"[{key}] {name}: wall {row['wall_ms']:.1f} ms, ops {row['op_ms']:.1f} (matrix "
                    f"{row['matrix_ms']:.1f}), python+dispatch {row['python_dispatch_ms']:.1f}",
                    flush=True,
                )
                share = 100.0 * row["matrix_ms"] / row["op_ms"] if row["op_ms"] else 0.0
                print(f"    matrix work {share:.0f}% of operator time, other {100 - share:.0f}%")
                for region, kinds in row["regions"].items():
                    if kinds["matrix"] + kinds["other"] >= 0.05:
                        print(f"    {region:26s} matrix {kinds['matrix']:8.2f}  other {kinds['other']:8.2f}")
                print(f"    top {args.top} operators by self CPU time (ms per call, calls):")
                for op in row["top_ops"]:
                    matrix = "  matrix" if op["matrix"] else ""
                    print(f"      {op['op']:48s} {op['self_ms']:8.2f} {op['calls']:6d}{matrix}")
    return results


def markdown(stored: dict) -> str:
    """One table per setting: regions as rows, (label, engine) as columns, 'matrix / other' ms per call."""
    labels = list(stored)
    first = stored[labels[0]]
    settings = first["settings"]
    lines = [
        f"torch.profiler, {settings['threads']} threads, batch {settings['batch']} x up to {settings['src_len']} "
        f"source tokens, exactly {settings['new_tokens']} new tokens; ms per `generate` call, operator self "
        "time as **matrix / other** (matrix: GEMMs, batched GEMMs, attention kernels, int8 GEMMs; other: "
        "copies, concatenations, elementwise, reductions, masks). Wall: median call without the profiler. "
        "Python + dispatch: wall minus all operator time. Rows are regions of the decoding step (the "
        "script marks them; see its docstring). Load average at the start of each run: "
        + ", ".join(f"{label} {stored[label].get('load_average', '?')}" for label in labels)
        + ".",
        "",
    ]
    for setting in first["results"]:
        columns = [(label, engine) for label in labels for engine in stored[label]["results"].get(setting, {})]
        if not columns:
            continue
        lines += [
            f"**{setting}**",
            "",
            "| region | " + " | ".join(f"{e} ({label})" for label, e in columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for region in REGIONS:
            cells = []
            for label, engine in columns:
                kinds = stored[label]["results"][setting][engine]["regions"][region]
                cells.append(f"{kinds['matrix']:.1f} / {kinds['other']:.1f}")
            lines.append(f"| {region} | " + " | ".join(cells) + " |")
        for field, title in (
            ("matrix_ms", "all matrix work"),
            ("op_ms", "all operators"),
            ("python_dispatch_ms", "Python + dispatch"),
            ("wall_ms", "**wall**"),
        ):
            lines.append(
                f"| {title} | "
                + " | ".join(f"{stored[label]['results'][setting][engine][field]:.1f}" for label, engine in columns)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=["tiny", "small", "base"])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["marian_fp32", "ours_fp32"],
        choices=["marian_fp32", "ours_fp32", "marian_int8", "ours_int8"],
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src_len", type=int, default=15)
    parser.add_argument("--new_tokens", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15, help="operators listed by self CPU time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="after", help="name of this run (e.g. before, after)")
    parser.add_argument("--no_write", action="store_true", help="print only (smoke runs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"hf_variants from {Path(hf_variants.__file__).parent}", flush=True)
    load = os.getloadavg()[0]
    results = run(args)
    if args.no_write:
        return results
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"profile_decoding_{args.label}.json"
    out.write_text(
        json.dumps(
            {
                "settings": {k: v for k, v in vars(args).items() if k != "no_write"},
                "load_average": round(load, 2),
                "torch": torch.__version__,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    stored = {}
    for label in ("before", "after"):
        path = RESULTS_DIR / f"profile_decoding_{label}.json"
        if path.is_file():
            stored[label] = json.loads(path.read_text())
    write_section("profile", markdown(stored))
    return results


if __name__ == "__main__":
    main()
