#!/usr/bin/env python
"""The baseline's final weights four ways, at one step budget: the last checkpoint (a plain run), the moving average
of the weights (`--ema_decay`), the average of the last 5 checkpoints and of the best 5 by validation BLEU
(`hf-variants-average --last 5 / --best 5`); BLEU and chrF on test_2016_flickr (beam 4, length penalty 0.6) with
sacreBLEU's paired bootstrap against the plain run.

One training run gives all four: the moving average is a shadow of the weights and never changes what is trained
(modeling_tests/test_ema.py checks that a run with `--ema_decay` trains bit for bit the weights of one without), so
the run's checkpoints are the plain run's; it validates the trained weights (`--eval_weights raw`), which ranks them
for `--best 5`, and keeps the last 5 and the best 5 (`--keep_checkpoints 5 --keep_best 5`). The recipe is
benchmarks/quality.py's baseline (small dims, the shared 8k BPE tokenizer, Adam, peak lr 1e-3, inverse-sqrt
warmup, 4,096-token batches) at a step budget (the 45-minute budget is 1,100 steps; `--steps`), so the scores do not
depend on the machine's load. EMA's cost in step time and memory is `benchmarks/ema_cost.py`.

    nice -n 10 python benchmarks/ema_averaging.py --steps 400        # train (resumable), then score the four arms
    python benchmarks/ema_averaging.py --steps 400 --table           # only rebuild the table from the run

Writes `benchmarks/results/ema_averaging.json` and the RESULTS.md section `ema_averaging`; the run folder is
`benchmarks/runs/ema_averaging_<steps>` (git-ignored).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

from quality import ensure_tokenizer
from report import write_section
from timing import write_result

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "training" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "ema_averaging.json"
ARMS = {  # name -> (label, how the weights are made)
    "plain": ("last checkpoint (a plain run)", None),
    "ema": ("moving average (--ema_decay)", None),
    "last5": ("average of the last 5 checkpoints", ["--last", "5", "--weights", "raw"]),
    "best5": ("average of the best 5 by validation BLEU", ["--best", "5", "--weights", "raw"]),
}


def train_command(args, run_dir: Path, tokenizer: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "training" / "train.py"),
        "--model_type",
        "transformer_nmt",
        "--source_lang",
        "en",
        "--target_lang",
        "de",
        "--tokenizer",
        str(tokenizer),
        "--max_steps",
        str(args.steps),
        "--max_tokens",
        "4096",
        "--warmup_steps",
        str(args.warmup),
        "--learning_rate",
        "1e-3",
        "--seed",
        "1",
        "--eval_steps",
        str(args.every),
        "--save_steps",
        str(args.every),
        "--eval_bleu_pairs",
        str(args.valid_bleu_pairs),
        "--best_metric",
        "bleu",
        "--keep_checkpoints",
        "5",
        "--keep_best",
        "5",
        "--ema_decay",
        str(args.ema_decay),
        "--ema_start_step",
        str(args.ema_start_step),
        "--eval_weights",
        "raw",
        "--final_model",
        "last",
        "--max_test_pairs",
        "1",  # the arms are scored below, on the whole test set
        "--logging_steps",
        "25",
        "--output_dir",
        str(run_dir),
        "--resume_from_checkpoint",
        "latest",
        *(["--num_threads", str(args.threads)] if args.threads else []),
    ]


def arm_model(name: str, run_dir: Path, steps: int) -> Path:
    """The model folder of an arm (built once)."""
    out = run_dir.parent / f"{run_dir.name}-{name}"
    if (out / "model.safetensors").is_file():
        return out
    if name == "plain":  # the last checkpoint's trained weights
        how = ["--checkpoints", f"step_{steps}", "--weights", "raw"]
    elif name == "ema":  # its moving average
        how = ["--checkpoints", f"step_{steps}", "--weights", "ema"]
    else:
        how = ARMS[name][1]
    cmd = [sys.executable, "-m", "hf_variants.training.average", str(run_dir), *how, "--output_dir", str(out)]
    subprocess.check_call(cmd, cwd=ROOT)
    return out


def translate(model: Path, hyps: Path) -> dict:
    if not hyps.is_file():
        cmd = [
            sys.executable,
            str(ROOT / "training" / "translate.py"),
            "--model",
            str(model),
            "--input",
            str(DATA / "test_2016_flickr.en.gz"),
            "--output",
            str(hyps),
            "--num_beams",
            "4",
            "--length_penalty",
            "0.6",
            "--no_progress",
        ]
        subprocess.check_call(cmd, cwd=ROOT)
    return {"hyps": hyps.read_text(encoding="utf-8").splitlines()}


def table(record: dict) -> str:
    rows = record["rows"]
    lines = [
        f"`python benchmarks/ema_averaging.py --steps {record['steps']}` (the baseline, small dims, "
        f"{record['steps']} steps of 4,096 tokens, warmup {record['warmup']}, EMA decay {record['ema_decay']} from "
        f"step {record['ema_start_step']}, checkpoints and validation ({record['valid_bleu_pairs']} pairs) every "
        f"{record['every']} steps); test_2016_flickr, beam 4, length penalty 0.6; p: sacreBLEU's paired bootstrap "
        "(1,000 resamples) against the last checkpoint.",
        "",
        "| final weights | checkpoints | BLEU | chrF | Δ BLEU | p (BLEU / chrF) |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    base = rows[0]
    for row in rows:
        delta = "" if row is base else f"{row['bleu'] - base['bleu']:+.2f}"
        p = "—" if row is base else f"{row['p_bleu']:.3f} / {row['p_chrf']:.3f}"
        lines.append(
            f"| {row['label']} | {row['checkpoints']} | {row['bleu']:.2f} ± {row['bleu_ci95']:.2f} | "
            f"{row['chrf']:.2f} | {delta} | {p} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="the step budget of every arm")
    parser.add_argument("--warmup", type=int, default=250)
    parser.add_argument("--every", type=int, default=50, help="validation and checkpoint cadence")
    parser.add_argument("--valid_bleu_pairs", type=int, default=200)
    parser.add_argument("--ema_decay", type=float, default=0.99)
    parser.add_argument("--ema_start_step", type=int, default=100, help="the average follows the weights until then")
    parser.add_argument("--threads", type=int, help="torch threads (default: train.py's choice)")
    parser.add_argument("--table", action="store_true", help="score and tabulate a finished run only")
    args = parser.parse_args(argv)
    run_dir = ROOT / "benchmarks" / "runs" / f"ema_averaging_{args.steps}"
    if not args.table:
        tokenizer = ensure_tokenizer("en-de", 8000)
        start = time.time()
        with open(run_dir.parent / f"{run_dir.name}.log", "a") as log:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            subprocess.check_call(train_command(args, run_dir, tokenizer), stdout=log, stderr=subprocess.STDOUT)
        print(f"trained in {(time.time() - start) / 60:.1f} min", flush=True)
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    with gzip.open(DATA / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()
    hyps, rows = {}, []
    for name, (label, _) in ARMS.items():
        model = arm_model(name, run_dir, args.steps)
        hyps[name] = translate(model, run_dir.parent / f"{run_dir.name}-{name}.test.de")["hyps"]
        card = (model / "README.md").read_text(encoding="utf-8")
        used = next(line for line in card.splitlines() if line.startswith("| Final weights |"))
        rows.append({"name": name, "label": label, "checkpoints": used.split("|")[2].strip().split(" (")[0]})
    test = PairedTest(list(hyps.items()), {"BLEU": BLEU(), "chrF": CHRF()}, [refs], test_type="bs", n_samples=1000)
    _, scores = test()
    for i, name in enumerate(scores["System"]):
        row = next(r for r in rows if r["name"] == name)
        bleu, chrf = scores["BLEU"][i], scores["chrF2"][i]
        row.update(bleu=bleu.score, bleu_ci95=bleu.ci, chrf=chrf.score, p_bleu=bleu.p_value, p_chrf=chrf.p_value)
    results = json.loads((run_dir / "results.json").read_text())
    record = {
        "steps": args.steps,
        "warmup": args.warmup,
        "every": args.every,
        "valid_bleu_pairs": args.valid_bleu_pairs,
        "ema_decay": args.ema_decay,
        "ema_start_step": args.ema_start_step,
        "train_time_sec": results.get("train_time_sec"),
        "validation": results.get("validation"),
        "rows": rows,
    }
    write_result(RESULTS, record)
    text = table(record)
    write_section("ema_averaging", text)
    print(text)


if __name__ == "__main__":
    main()
