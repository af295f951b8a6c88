#!/usr/bin/env python
"""Plots of the benchmark results: BLEU vs parameters and BLEU vs decoding speed, one point per model.

Reads `benchmarks/results/quality.json` (BLEU, params: benchmarks/quality.py) and
`benchmarks/results/efficiency.json` (beam-4 decoding tokens/s at the same dims: benchmarks/efficiency.py) and writes
`benchmarks/results/bleu_vs_params.png` and `benchmarks/results/bleu_vs_speed.png` (the one-epoch table), and
`benchmarks/results/bleu_vs_params_45min.png` (the runs at the 45-minute budget).

    python benchmarks/plots.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# quality.py run name -> efficiency.py model name (the same configuration at the same dims; the MUTE ablations
# without the sequential merge were not timed, so only MUTE + bias + seq has a speed point)
SPEED_OF = {
    "baseline": "baseline",
    "marian": "marian",
    "hysan_e1": "hysan",
    "mgsa_ngram": "mgsa",
    "tied": "tied",
    "mute_bias_seq": "mute",
}


SHORT = {
    "baseline": "baseline (post-norm)",
    "marian": "MarianMTModel",
    "baseline_rel": "pre-norm + relative",
    "hysan_e1": "HySAN e1",
    "mgsa_ngram": "MG-SA n-gram",
    "tied": "Tied (6 shared)",
    "mute": "MUTE",
    "mute_bias": "MUTE + bias",
    "mute_bias_seq": "MUTE + bias + seq",
    "baseline_marian_defaults": "baseline, GELU + N(0, 0.02)",
    "baseline_45min_run1": "baseline, first run",
    "baseline_45min_seed2": "baseline, seed 2",
}


def scatter(points, xlabel, path, title, logx=False):
    """One marker per model (squares: the references) with its label; labels of nearby points are stacked so
    they do not overlap, and points in the right third are labelled on their left."""
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    xspan, yspan = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    placed = []  # (normalised x, normalised label y) of the labels already placed
    for label, x, y, is_base, *ci in sorted(points, key=lambda p: (-p[2], p[1])):
        dots = ax.scatter([x], [y], s=60, marker="s" if is_base else "o", zorder=3)
        if ci and ci[0] is not None:  # the 95% bootstrap interval of BLEU over the test sentences
            ax.errorbar([x], [y], yerr=[ci[0]], fmt="none", capsize=3, alpha=0.5, color=dots.get_facecolor()[0])
        nx, ny = (x - min(xs)) / xspan, (y - min(ys)) / yspan
        dy = 4
        while any(abs(nx - px) < 0.25 and abs(ny + dy / 300 - py) < 0.045 for px, py in placed):
            dy -= 11
        placed.append((nx, ny + dy / 300))
        left = nx > 0.66
        ax.annotate(
            label,
            (x, y),
            textcoords="offset points",
            xytext=(-6 if left else 6, dy),
            fontsize=8,
            ha="right" if left else "left",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("BLEU, test_2016_flickr en→de")
    if logx:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    quality = json.loads((RESULTS_DIR / "quality.json").read_text())
    rows = [r for r in quality["rows"] if r["group"] == "en-de"]
    budget = quality["budget"]
    title = f"Multi30k en→de, {budget['steps']} steps x {budget['max_tokens']} tokens, small dims"
    scatter(
        [
            (SHORT.get(r["name"], r["label"]), r["params"] / 1e6, r["bleu"], r["name"] in ("baseline", "marian"))
            for r in rows
        ],
        "parameters (M)",
        RESULTS_DIR / "bleu_vs_params.png",
        title,
    )
    # the runs at the longer 45-minute budget (NAME_45min), once there are some besides the baseline and Marian
    longer = [r for r in quality["rows"] if r["group"] == "45min"]
    if len(longer) > 2:
        ref = quality.get("reference_45min") or {}
        scatter(
            [
                (
                    SHORT.get(r["name"].removesuffix("_45min"), r["label"]),
                    r["params"] / 1e6,
                    r["bleu"],
                    r["name"].startswith("baseline_45min") or r["name"] == "marian_45min",
                    r.get("bleu_ci95"),
                )
                for r in longer
            ],
            "parameters (M)",
            RESULTS_DIR / "bleu_vs_params_45min.png",
            f"Multi30k en→de, the 45-minute budget ({ref.get('steps')} x {ref.get('max_tokens')} tokens); bars: 95% "
            "bootstrap CI",
        )
    eff_path = RESULTS_DIR / "efficiency.json"
    if eff_path.is_file():
        eff = json.loads(eff_path.read_text())["results"].get("small", {})
        points = [
            (
                SHORT.get(r["name"], r["label"]),
                eff[SPEED_OF[r["name"]]]["beam4_tokens_per_sec"],
                r["bleu"],
                r["name"] in ("baseline", "marian"),
            )
            for r in rows
            if SPEED_OF.get(r["name"]) in eff
        ]
        scatter(points, "beam-4 decoding tokens/s (1 CPU thread, CPU time)", RESULTS_DIR / "bleu_vs_speed.png", title)


if __name__ == "__main__":
    main()
