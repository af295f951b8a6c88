#!/usr/bin/env python
"""Sequence-level distillation on Multi30k en -> de (docs/user-guide.md, section 14), measured: what does a tiny
student trained on a small teacher's beam translations keep of the teacher's quality, against the same student
trained on the original pairs with the same budget, and how much faster is it?

1. **teacher**: the small preset, `--teacher_steps` steps on Multi30k's training pairs (quality.py's recipe: the
   shared 8k BPE tokenizer, 4,096-token batches, Adam at 1e-3 with `--warmup` steps of warmup; beam 4 and length
   penalty 0.6 saved for decoding);
2. the teacher translates the 29,000 training sources with beam search across 2 processes of one thread each
   (`accelerate launch --multi_gpu --num_processes 2 -m hf_variants.commands.translate ... --output_format
   tsv_pairs`): the distilled corpus;
3. **student (distilled)**: the tiny preset, `--student_steps` steps on the distilled corpus (`--mix`: on it and the
   original pairs, `--corpus_weights 1 1`, as a third arm);
4. **student (original)**: the tiny preset, the same steps and batches, on the original pairs;
5. every model exported to ONNX Runtime int8 (`hf-variants-export-onnx --int8`) and translating test_2016_flickr
   (1,000 sentences, beam 4) with one thread: BLEU and chrF (sacreBLEU) of PyTorch fp32 and of ONNX Runtime int8,
   and sentences/s of each (the summary's translation time: model loading excluded); paired bootstrap resampling
   (sacreBLEU, 1,000 samples) of each model's fp32 translations against the original-data student.

    nice -n 10 python benchmarks/distill.py                  # the real run (resumable: finished steps are kept)
    python benchmarks/distill.py --table                     # the table again from benchmarks/runs/distill
    python benchmarks/distill.py --smoke                     # minutes: tiny teacher, 30 steps, 300 pairs, 40 test

Writes `benchmarks/results/distill.json` and RESULTS.md's section `distillation` (not with --smoke). The run folder is
`benchmarks/runs/distill` (git-ignored). Run it on a quiet machine with two idle cores: the sentences/s are timings.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import write_section  # noqa: E402
from timing import run_metadata, write_result  # noqa: E402

DATA = ROOT / "training" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "distill.json"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
LABELS = {
    "teacher": "teacher ({preset} preset)",
    "student": "student (tiny) on the teacher's translations",
    "mixed": "student (tiny) on the teacher's translations + the original pairs (1:1)",
    "original": "student (tiny) on the original pairs",
}


def read(split: str, lang: str, limit: int | None = None) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:limit] if limit else lines


def write_tsv(path: Path, en: list[str], de: list[str]) -> Path:
    """The pairs as a training TSV; a tab inside a sentence (Multi30k's training German has a few) becomes a space,
    as `--output_format tsv_pairs` writes it, and is counted."""
    tabbed = sum("\t" in a or "\t" in b for a, b in zip(en, de))
    if tabbed:
        print(f"{path.name}: {tabbed} pair(s) with a tab inside a sentence, written with a space instead", flush=True)
    rows = (f"{a.replace(chr(9), ' ')}\t{b.replace(chr(9), ' ')}\n" for a, b in zip(en, de))
    path.write_text("en\tde\n" + "".join(rows), encoding="utf-8")
    return path


def run(cmd: list[str], log: Path, threads: bool = True) -> None:
    """A command of the recipe, its output appended to `log`; a failure stops the script, naming the log."""
    env = dict(ENV, OMP_NUM_THREADS="1") if threads else ENV
    print(f"$ {' '.join(cmd)}", flush=True)
    with open(log, "a") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if code != 0:
        raise SystemExit(f"exit {code}: see {log}")


def prepare_data(args, work: Path) -> dict[str, Path]:
    """The original corpora as TSV (train, valid, test: the training command's --train_file / --valid_file /
    --test_file), the training sources as text (the teacher's input), and the shared tokenizer."""
    paths = {name: work / f"{name}.tsv" for name in ("train", "valid", "test")}
    paths["sources"] = work / "train.en"
    paths["test_en"], paths["test_de"] = work / "test.en", work / "test.de"
    if not paths["test_de"].is_file():
        train_en, train_de = read("train", "en", args.train_pairs), read("train", "de", args.train_pairs)
        write_tsv(paths["train"], train_en, train_de)
        write_tsv(paths["valid"], read("val", "en", args.valid_pairs), read("val", "de", args.valid_pairs))
        test_en, test_de = (
            read("test_2016_flickr", "en", args.test_pairs),
            read("test_2016_flickr", "de", args.test_pairs),
        )
        write_tsv(paths["test"], test_en, test_de)
        paths["sources"].write_text("".join(s + "\n" for s in train_en), encoding="utf-8")
        paths["test_en"].write_text("".join(s + "\n" for s in test_en), encoding="utf-8")
        paths["test_de"].write_text("".join(s + "\n" for s in test_de), encoding="utf-8")
    paths["tokenizer"] = work / "tokenizer"
    if not (paths["tokenizer"] / "tokenizer.json").is_file():
        from hf_variants.tokenization import train_tokenizer

        texts = read("train", "en", args.train_pairs) + read("train", "de", args.train_pairs)
        train_tokenizer(texts, vocab_size=args.vocab_size, languages=["en", "de"], output_dir=str(paths["tokenizer"]))
    return paths


def train(args, name: str, preset: str, steps: int, corpora: list[Path], paths: dict, work: Path) -> Path:
    """One arm's training run (resumable); returns its model folder."""
    out = work / name
    if (out / "model" / "config.json").is_file():
        return out / "model"
    cmd = [sys.executable, str(ROOT / "training" / "train.py"), "--model_type", "transformer_nmt"]
    cmd += ["--preset", preset, "--source_lang", "en", "--target_lang", "de", "--tokenizer", str(paths["tokenizer"])]
    for corpus in corpora:
        cmd += ["--train_file", str(corpus)]
    if len(corpora) > 1:
        cmd += ["--corpus_weights", *["1"] * len(corpora)]
    cmd += ["--valid_file", str(paths["valid"]), "--test_file", str(paths["test"]), "--max_test_pairs", "1"]
    cmd += ["--max_steps", str(steps), "--max_tokens", str(args.max_tokens), "--warmup_steps", str(args.warmup)]
    cmd += ["--learning_rate", "1e-3", "--seed", "1", "--eval_steps", str(steps), "--save_steps", "100"]
    cmd += ["--eval_bleu_pairs", "0", "--final_model", "last", "--keep_checkpoints", "1", "--num_examples", "0"]
    cmd += ["--num_beams", "4", "--length_penalty", "0.6", "--num_threads", str(args.threads)]
    cmd += ["--output_dir", str(out), "--resume_from_checkpoint", "latest", "--no_progress"]
    run(cmd, work / f"{name}.log")
    return out / "model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distill_corpus(teacher: Path, paths: dict, work: Path) -> Path:
    """The teacher's beam translations of the training sources, as a training corpus, across 2 processes."""
    out = work / "distilled.tsv"
    if out.is_file():
        return out
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_port", str(free_port()), "-m", "hf_variants.commands.translate"]
    cmd += ["--model", str(teacher), "--input", str(paths["sources"]), "--output", str(out), "--no_progress"]
    cmd += ["--output_format", "tsv_pairs", "--num_beams", "4", "--num_threads", "1", "--unit_lines", "2048"]
    run(cmd, work / "distill.log")
    return out


def export_int8(model: Path, work: Path, name: str) -> Path:
    out = work / f"{name}-onnx"
    if not (out / "onnx_manifest.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "hf_variants.commands.export_onnx",
            "--model",
            str(model),
            "--output_dir",
            str(out),
        ]
        run(cmd + ["--int8"], work / f"{name}-export.log")
    return out


def evaluate(name: str, model: Path, onnx: Path, paths: dict, work: Path, preset: str = "small") -> dict:
    """BLEU, chrF and sentences/s of the model on the test set: PyTorch fp32 and ONNX Runtime int8, one thread."""
    row = {"name": name, "label": LABELS[name].format(preset=preset)}
    for engine, flags in (
        ("torch_fp32", ["--model", str(model)]),
        ("onnx_int8", ["--model", str(onnx), "--precision", "int8"]),
    ):
        hyps, summary_path = work / f"{name}.{engine}.de", work / f"{name}.{engine}.json"
        if not summary_path.is_file():
            cmd = [sys.executable, "-m", "hf_variants.commands.translate", *flags, "--input", str(paths["test_en"])]
            cmd += ["--output", str(hyps), "--references", str(paths["test_de"]), "--num_beams", "4"]
            cmd += [
                "--length_penalty",
                "0.6",
                "--num_threads",
                "1",
                "--no_progress",
                "--results_json",
                str(summary_path),
            ]
            run(cmd, work / f"{name}.translate.log")
        summary = json.loads(summary_path.read_text())
        row[engine] = {k: summary[k] for k in ("bleu", "chrf", "sentences_per_sec", "seconds")}
        row[f"{engine}_hyps"] = str(hyps)
    row["parameters"] = parameters(model)
    return row


def parameters(model: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())


def paired_bootstrap(rows: list[dict], refs: list[str], base: str, samples: int) -> None:
    """sacreBLEU's paired bootstrap of every row's fp32 translations against `base`'s: p of BLEU and chrF."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    order = [base] + [r["name"] for r in rows if r["name"] != base]
    by_name = {r["name"]: r for r in rows}
    systems = [(n, Path(by_name[n]["torch_fp32_hyps"]).read_text(encoding="utf-8").splitlines()) for n in order]
    test = PairedTest(systems, {"BLEU": BLEU(), "chrF": CHRF()}, [refs], test_type="bs", n_samples=samples)
    _, scores = test()
    for i, name in enumerate(scores["System"]):
        by_name[name].update(bleu_ci95=scores["BLEU"][i].ci, p_bleu=scores["BLEU"][i].p_value)
        by_name[name]["p_chrf"] = scores["chrF2"][i].p_value


def table(record: dict) -> str:
    rows = record["rows"]
    teacher = next(r for r in rows if r["name"] == "teacher")
    lines = [
        f"Multi30k en→de, test_2016_flickr ({record['test_pairs']} sentences), beam 4, length penalty 0.6, one "
        f"thread; teacher {record['teacher_steps']} steps, students {record['student_steps']} steps of "
        f"{record['max_tokens']} tokens; the distilled corpus: {record['distilled_pairs']} pairs translated by the "
        f"teacher across 2 processes in {record['distill_seconds']:.0f} s. p: paired bootstrap against the "
        "original-data student (fp32).",
        "",
        "| model | parameters | BLEU fp32 | chrF fp32 | BLEU int8 | chrF int8 | sent/s fp32 | sent/s int8 | "
        "speed vs teacher fp32 | p (BLEU / chrF) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fp32, int8 = r["torch_fp32"], r["onnx_int8"]
        speed = int8["sentences_per_sec"] / teacher["torch_fp32"]["sentences_per_sec"]
        p = "—" if r.get("p_bleu") is None or r["name"] == "original" else f"{r['p_bleu']:.3f} / {r['p_chrf']:.3f}"
        ci = f" ± {r['bleu_ci95']:.1f}" if r.get("bleu_ci95") is not None else ""
        lines.append(
            f"| {r['label']} | {r['parameters'] / 1e6:.1f}M | {fp32['bleu']:.2f}{ci} | {fp32['chrf']:.2f} | "
            f"{int8['bleu']:.2f} | {int8['chrf']:.2f} | {fp32['sentences_per_sec']:.1f} | "
            f"{int8['sentences_per_sec']:.1f} | {speed:.1f}x (int8) | {p} |"
        )
    meta = record.get("metadata", {})
    lines += ["", f"Commit {meta.get('commit')}, {meta.get('date')}, {meta.get('cpu')}; `{record['command']}`."]
    return "\n".join(lines)


def recipe(args, work: Path) -> dict:
    paths = prepare_data(args, work)
    teacher_preset = "tiny" if args.smoke else "small"
    teacher = train(args, "teacher", teacher_preset, args.teacher_steps, [paths["train"]], paths, work)
    start = time.time()
    distilled = distill_corpus(teacher, paths, work)
    distill_seconds = time.time() - start
    arms = {"teacher": teacher}
    arms["student"] = train(args, "student", "tiny", args.student_steps, [distilled], paths, work)
    if args.mix:
        arms["mixed"] = train(args, "mixed", "tiny", args.student_steps, [distilled, paths["train"]], paths, work)
    arms["original"] = train(args, "original", "tiny", args.student_steps, [paths["train"]], paths, work)
    rows = [
        evaluate(name, model, export_int8(model, work, name), paths, work, teacher_preset)
        for name, model in arms.items()
    ]
    refs = paths["test_de"].read_text(encoding="utf-8").splitlines()
    paired_bootstrap(rows, refs, "original", args.bootstrap)
    return {
        "rows": rows,
        "teacher_steps": args.teacher_steps,
        "student_steps": args.student_steps,
        "max_tokens": args.max_tokens,
        "test_pairs": len(refs),
        "distilled_pairs": distilled.read_text(encoding="utf-8").count("\n") - 1,
        "distill_seconds": distill_seconds,
        "command": "python benchmarks/distill.py " + " ".join(args.argv),
    }


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher_steps", type=int, default=1100)
    p.add_argument("--student_steps", type=int, default=1100)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--max_tokens", type=int, default=4096)
    p.add_argument("--vocab_size", type=int, default=8000)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each training run")
    p.add_argument("--mix", action="store_true", help="a third student on the distilled and the original pairs")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--train_pairs", type=int)
    p.add_argument("--valid_pairs", type=int)
    p.add_argument("--test_pairs", type=int)
    p.add_argument("--run_dir", default=str(ROOT / "benchmarks" / "runs" / "distill"))
    p.add_argument("--table", action="store_true", help="only rebuild the table from benchmarks/results/distill.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes in a temporary folder: checks the script runs")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.table:
        text = table(json.loads(RESULTS.read_text()))
        write_section("distillation", text)
        print(text)
        return None
    if args.smoke:
        args.teacher_steps, args.student_steps, args.warmup, args.max_tokens = 30, 30, 5, 512
        args.vocab_size, args.train_pairs, args.valid_pairs, args.test_pairs, args.bootstrap = 800, 300, 20, 40, 50
        args.threads = 1
        with tempfile.TemporaryDirectory() as tmp:
            record = recipe(args, Path(tmp))
            print(table({**record, "metadata": run_metadata()}))
        return record
    work = Path(args.run_dir)
    work.mkdir(parents=True, exist_ok=True)
    record = recipe(args, work)
    written = write_result(RESULTS, record)
    text = table(written)
    write_section("distillation", text)
    print(text)
    return written


if __name__ == "__main__":
    main()
