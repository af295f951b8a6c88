#!/usr/bin/env python
"""Plots of the benchmark results: BLEU vs parameters and BLEU vs decoding speed, one point per model.

Reads `benchmarks/results/quality.json` (BLEU, params: benchmarks/quality.py) and
`benchmarks/results/efficiency.json` (beam-4 decoding tokens/s at the same dims: benchmarks/efficiency.py) and writes
`benchmarks/results/bleu_vs_params.png` and `benchmarks/results/bleu_vs_speed.png`.

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
SPEED_OF = {"baseline": "baseline", "marian": "marian", "hysan_e1": "hysan", "mgsa_ngram": "mgsa", "tied": "tied",
            "mute_bias_seq": "mute"}


def scatter(points, xlabel, path, title, logx=False):
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, x, y, is_base in points:
        ax.scatter([x], [y], s=60, marker="s" if is_base else "o", zorder=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
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
    scatter([(r["label"], r["params"] / 1e6, r["bleu"], r["name"] in ("baseline", "marian")) for r in rows],
            "parameters (M)", RESULTS_DIR / "bleu_vs_params.png", title)
    eff_path = RESULTS_DIR / "efficiency.json"
    if eff_path.is_file():
        eff = json.loads(eff_path.read_text())["results"].get("small", {})
        points = [(r["label"], eff[SPEED_OF[r["name"]]]["beam4_tokens_per_sec"], r["bleu"],
                   r["name"] in ("baseline", "marian"))
                  for r in rows if SPEED_OF.get(r["name"]) in eff]
        scatter(points, "beam-4 decoding tokens/s (1 CPU thread, CPU time)", RESULTS_DIR / "bleu_vs_speed.png",
                title)


if __name__ == "__main__":
    main()
