#!/usr/bin/env python
"""What the project's CPU cannot show, on a GPU: every model (efficiency.py's configurations, transformers'
MarianMTModel beside them) in bf16 and under SDPA against flex_attention, checked and timed in one process.

Per model, random weights, `--size` dims, a padded batch (half the rows padded to 3/4 of the source):

- **agreement** (fp32, TF32 off): logits of SDPA and flex_attention against eager (max |diff|); greedy and beam-4
  `generate` with the cache against `use_cache=False` (fraction of equal tokens), and flex's greedy against SDPA's;
- **bf16 training**: the loss and gradients of one batch under `torch.autocast(bfloat16)` against fp32 (relative loss
  difference, cosine of the flattened gradients), then `--fit_steps` Adam steps on that batch under autocast with
  dropout on: every loss finite and the last below the first (the step trains);
- **bf16 decoding**: with the weights cast to bf16, the largest logit error over fp32's logit range (teacher-forced),
  and greedy tokens equal to fp32's greedy (fraction; random weights have tiny margins, so this one is coarse);
- **speed** (wall clock, CUDA-synchronized, median of `--reps` runs after a warm-up, per implementation): training
  tok/s of one autocast-bf16 step (forward, backward, Adam), SDPA and flex_attention; greedy and beam-4 tok/s with bf16
  weights and exactly `--new_tokens` new tokens, SDPA and flex_attention; each ratio flex / SDPA (> 1: flex faster)
  and each model against the baseline under SDPA; peak CUDA memory of a training step and a beam-4 decoding.

Each model starts with fresh torch.compile caches (`torch._dynamo.reset()`): flex_attention is compiled, and its
recompile limit is counted per process. Every section is guarded: an error is recorded under the model's `errors`
and the run goes on. Prints one line per result and writes `--output` (JSON) after each model, so a run cut short
keeps what it measured.

    python benchmarks/gpu_check.py --size base --output gpu_check.json    # on a GPU machine
    python benchmarks/gpu_check.py --size tiny --device cpu --reps 1      # the script itself, on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from efficiency import MODELS, build, language_inputs  # noqa: E402
from report import write_section  # noqa: E402
from timing import portable, run_metadata, write_result  # noqa: E402

IMPLEMENTATIONS = ("sdpa", "flex_attention")
SECTIONS = ["agreement", "bf16_training", "bf16_decoding", "speed"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fns: dict, reps: int, device: torch.device) -> dict:
    """Median wall seconds of each zero-argument function (CUDA-synchronized), interleaved after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_mb(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return round((torch.cuda.max_memory_allocated() - start) / 2**20, 1)


def batch(args, device: torch.device):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, args.vocab, (args.batch, args.src_len), generator=g)
    mask = torch.ones_like(src)
    mask[1::2, args.src_len * 3 // 4 :] = 0
    src = src.masked_fill(mask == 0, 0)
    labels = torch.randint(4, args.vocab, (args.batch, args.tgt_len), generator=g)
    return src.to(device), mask.to(device), labels.to(device)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        width = max(a.shape[1], b.shape[1])
        a, b = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in (a, b))
    return round(float((a == b).float().mean()), 4)


def generate(model, src, mask, extra, beams: int, new_tokens: int, exact: bool, **kwargs):
    with torch.inference_mode():
        return model.generate(
            input_ids=src,
            attention_mask=mask,
            do_sample=False,
            num_beams=beams,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens if exact else 0,
            **({"length_penalty": 0.6} if beams > 1 else {}),
            **extra,
            **kwargs,
        )


def check_agreement(model, row, src, mask, labels, extra, args) -> None:
    """fp32 (TF32 off): SDPA / flex logits against eager; cached against uncached decoding; flex's greedy."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model.eval()
    logits = {}
    for implementation in ("eager",) + IMPLEMENTATIONS:
        model.set_attn_implementation(implementation)
        with torch.inference_mode():
            logits[implementation] = model(input_ids=src, attention_mask=mask, labels=labels, **extra).logits
    for implementation in IMPLEMENTATIONS:
        row[f"logits_max_diff_{implementation}_vs_eager"] = float(
            (logits[implementation] - logits["eager"]).abs().max()
        )
    model.set_attn_implementation("sdpa")
    n = args.check_new_tokens
    for beams in (1, 4):
        cached = generate(model, src, mask, extra, beams, n, False)
        full = generate(model, src, mask, extra, beams, n, False, use_cache=False)
        row[f"{'greedy' if beams == 1 else 'beam4'}_cached_vs_uncached_equal"] = agreement(cached, full)
        if beams == 1:
            greedy = cached
    model.set_attn_implementation("flex_attention")
    row["greedy_flex_vs_sdpa_equal"] = agreement(generate(model, src, mask, extra, 1, n, False), greedy)
    model.set_attn_implementation("sdpa")
    row["_greedy_fp32"] = greedy


def check_bf16_training(model, row, src, mask, labels, extra, args, device) -> None:
    """One batch's loss and gradients under autocast bf16 against fp32; then a short fit under autocast."""
    model.eval()  # no dropout: the two passes see the same function
    grads, losses = {}, {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(input_ids=src, attention_mask=mask, labels=labels, **extra).loss
        loss.backward()
        losses[name] = float(loss.detach())
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    row["bf16_loss_rel_diff"] = round(abs(losses["bf16"] - losses["fp32"]) / abs(losses["fp32"]), 5)
    row["bf16_grad_cosine"] = round(float(torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], 0)), 5)
    row["bf16_grads_finite"] = bool(torch.isfinite(grads["bf16"]).all())
    model.zero_grad(set_to_none=True)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    fit = []
    for _ in range(args.fit_steps):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=src, attention_mask=mask, labels=labels, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        fit.append(loss.detach())
    fit = [float(x) for x in fit]  # one host sync, after the loop
    row["bf16_fit_first_last"] = [round(fit[0], 4), round(fit[-1], 4)]
    row["bf16_fit_all_finite"] = all(map(math.isfinite, fit))
    row["bf16_fit_trains"] = fit[-1] < fit[0]
    model.eval()


def check_bf16_decoding(model, row, src, mask, extra, args) -> None:
    """Greedy with bf16 weights against the fp32 greedy of check_agreement (then the model stays bf16)."""
    with torch.inference_mode():
        fp32 = model(input_ids=src, attention_mask=mask, decoder_input_ids=src[:, :8], **extra).logits
        model.to(torch.bfloat16)
        bf16 = model(input_ids=src, attention_mask=mask, decoder_input_ids=src[:, :8], **extra).logits.float()
    row["bf16_logits_max_err_over_range"] = round(float((bf16 - fp32).abs().max() / (fp32.max() - fp32.min())), 5)
    greedy = generate(model, src, mask, extra, 1, args.check_new_tokens, False)
    if "_greedy_fp32" in row:
        row["bf16_greedy_vs_fp32_equal"] = agreement(greedy, row["_greedy_fp32"])
    row["bf16_beam4_runs"] = generate(model, src, mask, extra, 4, args.check_new_tokens, False).shape[0] == len(src)


def measure_speed(model, row, src, mask, labels, extra, args, device) -> None:
    """Training (autocast bf16, fp32 weights) and decoding (bf16 weights) tok/s, SDPA against flex_attention.
    Attention dropout is off in both (transformers' flex_attention takes none); each implementation's runs are
    timed as a block after its own warm-up, the switch outside the clock."""
    for module in model.modules():
        if hasattr(module, "scaling") and isinstance(getattr(module, "dropout", None), float):
            module.dropout = 0.0
    model.float().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_tokens = int(mask.sum()) + labels.numel()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=src, attention_mask=mask, labels=labels, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def per_implementation(fn) -> dict:
        seconds = {}
        for implementation in args.implementations:
            model.set_attn_implementation(implementation)
            seconds.update(timed({implementation: fn}, args.reps, device))
        model.set_attn_implementation("sdpa")
        return seconds

    seconds = per_implementation(step)
    for i in args.implementations:
        row[f"train_tok_s_{i}"] = round(train_tokens / seconds[i])
    row["train_peak_mb_sdpa"] = peak_mb(step, device)
    model.to(torch.bfloat16).eval()
    for label, beams in (("greedy", 1), ("beam4", 4)):

        def decode(beams=beams):
            generate(model, src, mask, extra, beams, args.new_tokens, True)

        seconds = per_implementation(decode)
        for i in args.implementations:
            row[f"{label}_tok_s_{i}"] = round(len(src) * args.new_tokens / seconds[i])
    row["beam4_peak_mb_sdpa"] = peak_mb(lambda: generate(model, src, mask, extra, 4, args.new_tokens, True), device)
    for what in ("train", "greedy", "beam4") if len(args.implementations) == 2 else ():
        row[f"{what}_flex_over_sdpa"] = round(row[f"{what}_tok_s_flex_attention"] / row[f"{what}_tok_s_sdpa"], 3)


def check_model(name: str, args, device: torch.device) -> dict:
    row = {"label": MODELS[name][0], "errors": {}}
    torch._dynamo.reset()  # fresh compile caches and recompile budget per model, as in a process of its own
    start = time.perf_counter()
    model = build(name, args.size, args.vocab).to(device)
    row["params_m"] = round(model.num_parameters() / 1e6, 2)
    src, mask, labels = batch(args, device)
    extra = {k: v.to(device) for k, v in language_inputs(model, len(src)).items()}
    sections = [
        ("agreement", lambda: check_agreement(model, row, src, mask, labels, extra, args)),
        ("bf16_training", lambda: check_bf16_training(model, row, src, mask, labels, extra, args, device)),
        ("bf16_decoding", lambda: check_bf16_decoding(model, row, src, mask, extra, args)),
        ("speed", lambda: measure_speed(model, row, src, mask, labels, extra, args, device)),
    ]
    for section, fn in sections:
        if section not in args.sections:
            continue
        try:
            fn()
        except Exception as error:  # recorded and reported; the other sections and models still run
            row["errors"][section] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
            model.float().to(device)
    row.pop("_greedy_fp32", None)
    row["seconds"] = round(time.perf_counter() - start, 1)
    print(f"[{name}] " + json.dumps(row), flush=True)
    return row


def checks_table(report: dict) -> str:
    """The agreement and bf16 checks of a report as a markdown table, one row per model."""
    lines = [
        f"{report['device_name']}, torch {report['torch']}, transformers {report['transformers']}; "
        f"`{report['settings']['size']}` dims, random weights, batch {report['settings']['batch']}.",
        "",
        "| model | max abs logit diff vs eager: SDPA / flex (fp32) | cached = uncached: greedy / beam 4 | "
        "flex greedy = SDPA | bf16 autocast: loss rel. diff / grad cosine | bf16 fit, 30 steps: loss first -> last "
        "| bf16 weights: logit err / range |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["models"].values():
        first, last = row["bf16_fit_first_last"]
        lines.append(
            f"| {row['label']} | {row['logits_max_diff_sdpa_vs_eager']:.1e} / "
            f"{row['logits_max_diff_flex_attention_vs_eager']:.1e} | {row['greedy_cached_vs_uncached_equal']:.0%} / "
            f"{row['beam4_cached_vs_uncached_equal']:.0%} | {row['greedy_flex_vs_sdpa_equal']:.0%} | "
            f"{row['bf16_loss_rel_diff']:.0e} / {row['bf16_grad_cosine']:.4f} | {first:.2f} -> {last:.2f}"
            f"{'' if row['bf16_fit_all_finite'] else ' (non-finite!)'} | {row['bf16_logits_max_err_over_range']:.2%} |"
        )
    return "\n".join(lines)


def speed_table(report: dict) -> str:
    """The speed section of a report as a markdown table: tok/s under SDPA, flex / SDPA, each model / baseline."""
    settings = report["settings"]
    lines = [
        f"{report['device_name']}, torch {report['torch']}, transformers {report['transformers']}; "
        f"`{settings['size']}` dims, batch {settings['batch']} x {settings['src_len']} source / "
        f"{settings['tgt_len']} target tokens; training: one autocast-bf16 step (Adam); decoding: bf16 weights, "
        f"exactly {settings['new_tokens']} new tokens; median of {settings['reps']} runs.",
        "",
        "| model | train tok/s SDPA (vs baseline) | flex / SDPA | greedy tok/s SDPA (vs baseline) | flex / SDPA | "
        "beam-4 tok/s SDPA (vs baseline) | flex / SDPA | peak MiB: train / beam 4 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = report["models"].get("baseline", {})
    for row in report["models"].values():
        cells = []
        for what in ("train", "greedy", "beam4"):
            tok_s = row[f"{what}_tok_s_sdpa"]
            cells.append(f"{tok_s} ({tok_s / base[f'{what}_tok_s_sdpa']:.2f}x)")
            cells.append(f"{row[f'{what}_flex_over_sdpa']:.2f}x")
        lines.append(
            f"| {row['label']} | " + " | ".join(cells) + f" | {row['train_peak_mb_sdpa']:.0f} / "
            f"{row['beam4_peak_mb_sdpa']:.0f} |"
        )
    return "\n".join(lines)


def write_tables(checks: Path, *speeds: Path) -> None:
    """RESULTS.md's section `gpu_checks` from a checks report and `gpu_speed_<file stem>` from each speed report
    (JSON files this script wrote)."""
    write_section("gpu_checks", checks_table(json.loads(checks.read_text())))
    for speed in speeds:
        write_section(f"gpu_speed_{speed.stem.removeprefix('gpu_speed_')}", speed_table(json.loads(speed.read_text())))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="base", choices=["tiny", "small", "base", "big"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--src_len", type=int, default=32)
    parser.add_argument("--tgt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--check_new_tokens", type=int, default=16)
    parser.add_argument("--fit_steps", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    parser.add_argument("--output", default="gpu_check.json")
    parser.add_argument(
        "--tables",
        nargs="+",
        metavar="JSON",
        help="only write RESULTS.md's tables: a checks report, then speed reports",
    )
    args = parser.parse_args(argv)
    if args.tables:
        write_tables(*map(Path, args.tables))
        return {}
    device = torch.device(args.device)
    import transformers

    report = {
        "metadata": run_metadata(),
        "settings": portable(vars(args)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "models": {},
    }
    print(json.dumps({k: v for k, v in report.items() if k != "models"}), flush=True)
    for name in args.models:
        report["models"][name] = check_model(name, args, device)
        base = report["models"].get("baseline", {})
        for key in ("train_tok_s_sdpa", "greedy_tok_s_sdpa", "beam4_tok_s_sdpa"):
            if key in base and key in report["models"][name]:
                report["models"][name][f"{key}_vs_baseline"] = round(report["models"][name][key] / base[key], 3)
        write_result(args.output, report, report["metadata"])  # after each model: a run cut short keeps its rows
    return report


if __name__ == "__main__":
    main()
