#!/usr/bin/env python
"""Why can a model have a lower validation loss and a lower BLEU? Side-by-side diagnostics of quality runs (MG-SA
at the 45-minute budget: valid loss 3.096 vs the baseline's 3.142, yet -1.05 BLEU).

From test translations alone (the archive `benchmarks/results/runs/NAME.test.txt.gz`, a run folder's
`translations.test.txt`, or any file of one hypothesis per line aligned with test_2016_flickr), for every run:
BLEU with its brevity penalty, system / reference length ratio and the 1-4 gram precisions (sacreBLEU 13a, cased,
the signature of the quality tables), chrF, BLEU and length ratio per source-length bucket (source words), and the
share of empty outputs, outputs at the decoding length limit (`int(1.2 * source tokens + 10)` new tokens, the
evaluation's rule: counted with `--tokenizer`, else on words as an upper bound), and outputs that repeat a word
3-gram (references for comparison). From the archived results alone (no translations needed, so MG-SA's 45-minute
run is in it): each 45-minute run's BLEU against the least-squares line of BLEU on valid loss through the others, and
its residual in units of the others' residual spread (is "lower loss, lower BLEU" within the usual scatter?).

With `--models LABEL=DIR ...` (a trained run folder, its `model/` or any saved model with its tokenizer), on the
same model and data: greedy vs beam BLEU (beam 4, length penalty 0.6, as the tables; `--test_pairs`), and on the
whole validation set (`--valid_pairs` to cut it) per target token: the NLL without label smoothing, the
label-smoothed CE the tables report, the uniform term U = mean over the vocabulary of -log p(v), the entropy of the
predicted distribution, the mean probability of the argmax and its accuracy. F.cross_entropy's smoothing gives
LS = (1 - eps) * NLL + eps * U exactly, so a model with a flatter tail (smaller U) gets a lower smoothed loss at an
equal or higher NLL: the table splits the difference between two models into the two terms.

    python benchmarks/mgsa_analysis.py                        # the archived 45-minute runs with translations
    python benchmarks/mgsa_analysis.py --runs baseline_45min tied_45min --output benchmarks/results/mgsa_analysis.txt
    python benchmarks/mgsa_analysis.py --runs baseline_45min benchmarks/runs/mgsa_ngram_45min/translations.test.txt \\
        --models baseline=benchmarks/runs/baseline_45min mgsa=benchmarks/runs/mgsa_ngram_45min --test_pairs 300

`--check_tree DIR` runs the checks of `modeling_tests/test_mgsa_invariance.py` that decide a train/inference
mismatch (encoder alone vs batched, cached decoding vs the teacher-forced loss path, train vs eval mode) on the MG-SA
code of another source tree, e.g. the commit a run was trained with: `git archive 9f0adfb | tar -x -C ../old`.

`--tokenizer DIR` (the runs' shared BPE, `benchmarks/runs/tokenizer-en-de`, used by default when present) makes
the length-limit count exact up to batching: the limit of a batch is set by its longest source, so a hypothesis at
its own sentence's limit is counted (an upper bound of the outputs cut by the limit). The model part runs on the
CPU in a few minutes per model for the validation set (1,014 pairs) and greedy + beam decoding of 1,000 sentences.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU, CHRF
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARCHIVE = ROOT / "benchmarks" / "results" / "runs"
DATA = ROOT / "training" / "data" / "multi30k"
DEFAULT_TOKENIZER = ROOT / "benchmarks" / "runs" / "tokenizer-en-de"
# the archived runs with test translations first; a named run without them is reported as missing
DEFAULT_RUNS = ["baseline_45min", "baseline_45min_seed2", "tied_45min", "mgsa_ngram_45min", "hysan_e1_45min"]
BUCKETS = [(1, 9), (10, 11), (12, 14), (15, 10_000)]  # source words: ~250 sentences each on test_2016_flickr
MAX_LEN_A, MAX_LEN_B = 1.2, 10  # hf_variants/training/evaluation.py's length rule
LABEL_SMOOTHING = 0.1
STATS = ("nll", "uniform", "entropy", "max_prob", "correct")


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def resolve_run(spec: str) -> tuple[str, Path | None]:
    """A run name of the archive, a run folder (its `translations.test.txt`) or a translations file ->
    (label, path or None when the run has no translations)."""
    path = Path(spec)
    if path.is_dir():
        return path.name, path / "translations.test.txt" if (path / "translations.test.txt").exists() else None
    if path.is_file():
        return path.name.split(".")[0], path
    archived = ARCHIVE / f"{spec}.test.txt.gz"
    if archived.exists():
        return spec, archived
    if (ARCHIVE / f"{spec}.json").exists():
        return spec, None
    raise SystemExit(f"--runs: {spec!r} is no archived run (benchmarks/results/runs/{spec}.json), folder or file.")


# -------------------------------------------------------------------------------------------- translation metrics
def has_repeated_ngram(text: str, n: int = 3) -> bool:
    """Whether a word n-gram occurs twice in `text` (a sign of looping output)."""
    words = text.split()
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return any(count > 1 for count in grams.values())


def bleu_details(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """sacreBLEU 13a cased (the quality tables' signature) with its parts, and chrF."""
    score = BLEU().corpus_score(list(hypotheses), [list(references)])
    chrf = CHRF().corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": score.score,
        "bp": score.bp,
        "ratio": score.sys_len / max(score.ref_len, 1),
        "sys_len": score.sys_len,
        "ref_len": score.ref_len,
        "precisions": list(score.precisions),
        "chrf": chrf.score,
    }


def length_limits(sources: Sequence[str], tokenizer) -> list[int]:
    """The decoding limit of each sentence by its own length: int(1.2 * source tokens (with </s>) + 10)."""
    if tokenizer is None:
        return [int(MAX_LEN_A * (len(s.split()) + 1) + MAX_LEN_B) for s in sources]
    lengths = [len(ids) for ids in tokenizer(list(sources), add_special_tokens=True)["input_ids"]]
    return [int(MAX_LEN_A * n + MAX_LEN_B) for n in lengths]


def output_lengths(hypotheses: Sequence[str], tokenizer) -> list[int]:
    """New tokens of each hypothesis (its tokens + the closing </s>; words + 1 without a tokenizer)."""
    if tokenizer is None:
        return [len(h.split()) + 1 for h in hypotheses]
    return [len(ids) + 1 for ids in tokenizer(list(hypotheses), add_special_tokens=False)["input_ids"]]


def translation_report(hypotheses, sources, references, tokenizer, label: str = "references") -> dict:
    if len(hypotheses) != len(references):
        raise SystemExit(f"{label}: {len(hypotheses)} translations for {len(references)} test references.")
    out = bleu_details(hypotheses, references)
    words = [len(s.split()) for s in sources]
    out["buckets"] = []
    for low, high in BUCKETS:
        idx = [i for i, n in enumerate(words) if low <= n <= high]
        if not idx:
            out["buckets"].append({"range": (low, high), "count": 0, "bleu": math.nan, "ratio": math.nan})
            continue
        part = bleu_details([hypotheses[i] for i in idx], [references[i] for i in idx])
        out["buckets"].append({"range": (low, high), "count": len(idx), "bleu": part["bleu"], "ratio": part["ratio"]})
    limits = length_limits(sources, tokenizer)
    lengths = output_lengths(hypotheses, tokenizer)
    n = len(hypotheses)
    out["empty"] = sum(not h.strip() for h in hypotheses) / n
    out["at_limit"] = sum(length >= limit for length, limit in zip(lengths, limits)) / n
    out["repeated_3gram"] = sum(has_repeated_ngram(h) for h in hypotheses) / n
    out["mean_words"] = sum(len(h.split()) for h in hypotheses) / n
    return out


# ------------------------------------------------------------------------------------------------ model metrics
@dataclass
class TokenStats:
    """Per-target-token sums over a data set (eval mode, teacher forcing)."""

    tokens: int = 0
    sums: dict = field(default_factory=lambda: dict.fromkeys(STATS, 0.0))

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        keep = labels != -100
        logp = F.log_softmax(logits[keep].float(), dim=-1)  # [N, V]
        target = labels[keep]
        self.tokens += int(keep.sum())
        self.sums["nll"] += float(-logp.gather(-1, target[:, None]).sum())
        self.sums["uniform"] += float(-logp.mean(-1).sum())
        self.sums["entropy"] += float(-(logp.exp() * logp).sum())
        self.sums["max_prob"] += float(logp.max(-1).values.exp().sum())
        self.sums["correct"] += float((logp.argmax(-1) == target).sum())

    def means(self, smoothing: float = LABEL_SMOOTHING) -> dict:
        out = {name: value / max(self.tokens, 1) for name, value in self.sums.items()}
        # F.cross_entropy(label_smoothing=eps) = (1 - eps) * NLL + eps * mean_v(-log p_v)
        out["smoothed"] = (1 - smoothing) * out["nll"] + smoothing * out["uniform"]
        out["tokens"] = self.tokens
        return out


def load_model(path: Path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_variants  # noqa: F401 (registers the model types)

    model_dir = path / "model" if (path / "model" / "config.json").exists() else path
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def validation_stats(model, tokenizer, sources, targets, batch_size: int = 64) -> dict:
    """NLL, label-smoothed CE and the distribution's shape per target token, on length-sorted batches."""
    from hf_variants.training import external

    stats = TokenStats()
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = external.prepare_translation_inputs(
            model, tokenizer, [sources[i] for i in idx], text_target=[targets[i] for i in idx]
        )
        labels = batch["labels"]
        stats.add(model(**batch).logits, labels)
    return stats.means()


def model_report(model_dir: Path, args, test_sources, test_refs) -> dict:
    from hf_variants.training.evaluation import translate

    model, tokenizer = load_model(model_dir)
    src_lang, tgt_lang = args.source_lang, args.target_lang
    valid_src = read_lines(DATA / f"val.{src_lang}.gz")[: args.valid_pairs]
    valid_tgt = read_lines(DATA / f"val.{tgt_lang}.gz")[: args.valid_pairs]
    out = {"valid": validation_stats(model, tokenizer, valid_src, valid_tgt)}
    sources, refs = test_sources[: args.test_pairs], test_refs[: args.test_pairs]
    for name, beams in (("greedy", 1), ("beam", 4)):
        hyps = translate(model, tokenizer, sources, num_beams=beams, length_penalty=0.6)
        out[name] = bleu_details(hyps, refs)
    return out


# --------------------------------------------------------------------------------- the code a run was trained with
TREE_CHECK = """
import gzip, sys, torch
sys.path.insert(0, sys.argv[1])
import hf_variants
from hf_variants import MgsaConfig, MgsaForConditionalGeneration
from hf_variants.tokenization import train_tokenizer
assert hf_variants.__file__.startswith(sys.argv[1]), hf_variants.__file__
def read(lang, split, n):
    with gzip.open(f"{sys.argv[2]}/{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\\n") for line, _ in zip(f, range(n))]
tok = train_tokenizer(read("en", "train", 400) + read("de", "train", 400), vocab_size=500, languages=["en", "de"])
src = [read("en", "val", 12)[i] for i in (5, 6, 3, 11, 0)]
torch.manual_seed(0)
config = MgsaConfig.from_preset("tiny", vocab_size=len(tok), phrase_type="ngram", ngram_sizes=[2, 3, 4],
                                phrase_composition="san", phrase_interaction="on_lstm")
model = MgsaForConditionalGeneration(config).eval()
batch = tok(src, padding=True, return_tensors="pt")
with torch.no_grad():
    hidden = model.model.encoder(**batch).last_hidden_state
    alone = 0.0
    for i, text in enumerate(src):
        one = model.model.encoder(**tok([text], return_tensors="pt")).last_hidden_state[0]
        alone = max(alone, (hidden[i, batch["attention_mask"][i].bool()] - one).abs().max().item())
    out = model.generate(**batch, num_beams=1, max_new_tokens=8, min_new_tokens=8, output_logits=True,
                         return_dict_in_generate=True)
    forced = model(**batch, decoder_input_ids=out.sequences[:, :-1]).logits
    cached = (torch.stack(out.logits, 1) - forced).abs().max().item()
    trained = (model.train()(**batch, decoder_input_ids=out.sequences[:, :-1]).logits - forced).abs().max().item()
    noisy = MgsaForConditionalGeneration(MgsaConfig(**{**config.to_dict(), "dropout": 0.3, "attention_dropout": 0.3,
                                                      "activation_dropout": 0.3}))
    noisy.load_state_dict(model.state_dict())
    dropped = (noisy.eval()(**batch, decoder_input_ids=out.sequences[:, :-1]).logits - forced).abs().max().item()
print(f"encoder output, alone vs in a right-padded batch: max |diff| {alone:.2e}")
print(f"greedy cached decoding logits vs teacher-forced (loss path): max |diff| {cached:.2e}")
print(f"train mode vs eval mode (tiny preset: no dropout): max |diff| {trained:.2e}")
print(f"eval mode with dropout 0.3 vs the same weights without dropout: max |diff| {dropped:.2e}")
"""


def check_tree(tree: Path) -> str:
    """The invariance checks of `modeling_tests/test_mgsa_invariance.py` (the 45-minute runs' config, tiny dims) on the
    MG-SA code of another source tree, e.g. the commit a run was trained with (`git archive COMMIT | tar -x -C DIR`),
    in a child process (that tree's `hf_variants`, this tree's data)."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", TREE_CHECK, str(tree.resolve()), str(DATA)],
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if result.returncode:
        raise SystemExit(f"--check_tree {tree}: the check failed:\n{result.stderr[-3000:]}")
    return f"MG-SA invariances on the code of {tree.resolve()}:\n{result.stdout.strip()}"


# ------------------------------------------------------------------------------------------- loss vs BLEU, archive
def archived_rows(pattern: str = "*_45min*.json") -> dict[str, tuple[float, float]]:
    """(valid loss, BLEU) of every archived run matching `pattern` that has both (the 45-minute runs by default)."""
    rows = {}
    for path in sorted(ARCHIVE.glob(pattern)):
        record = json.loads(path.read_text(encoding="utf-8"))
        loss = (record.get("validation") or [{}])[-1].get("valid_loss")
        if loss is not None and record.get("bleu") is not None:
            rows[path.stem] = (float(loss), float(record["bleu"]))
    return rows


def leave_one_out(rows: dict[str, tuple[float, float]]) -> dict[str, dict]:
    """For each run: BLEU predicted from its valid loss by the least-squares line through the OTHER runs, its
    residual, and the residual standard deviation of the other runs about that line (n - 2 degrees of freedom)."""
    out = {}
    for name, (loss, bleu) in rows.items():
        others = [v for k, v in rows.items() if k != name]
        if len(others) < 3:
            continue
        fit = statistics.linear_regression([x for x, _ in others], [y for _, y in others])
        residuals = [y - (fit.slope * x + fit.intercept) for x, y in others]
        spread = math.sqrt(sum(r * r for r in residuals) / (len(others) - 2))
        predicted = fit.slope * loss + fit.intercept
        out[name] = {
            "loss": loss,
            "bleu": bleu,
            "predicted": predicted,
            "residual": bleu - predicted,
            "spread": spread,
            "slope": fit.slope,
        }
    return out


def loss_bleu_table(fits: dict[str, dict]) -> str:
    width = max(len(name) for name in fits)
    lines = [
        "Valid loss vs BLEU across the archived 45-minute runs (each run against the least-squares line through the"
        " others; valid loss: label-smoothed CE on the first 200 validation pairs, as archived)",
        f"{'run':<{width}}  valid loss    BLEU  predicted  residual  others' residual sd  residual / sd",
    ]
    for name, f in sorted(fits.items(), key=lambda item: item[1]["residual"]):
        lines.append(
            f"{name:<{width}}  {f['loss']:>10.3f}  {f['bleu']:>6.2f}  {f['predicted']:>9.2f}  {f['residual']:>+8.2f}"
            f"  {f['spread']:>19.2f}  {f['residual'] / f['spread']:>+13.1f}"
        )
    slopes = [f["slope"] for f in fits.values()]
    lines.append(f"Slope of the lines: {min(slopes):.1f} to {max(slopes):.1f} BLEU per nat of valid loss.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ printing
def table(title: str, labels: Sequence[str], rows: list[tuple[str, list[str]]]) -> str:
    width = max(10, *(len(label) for label in labels))
    head = max(len(name) for name, _ in rows)
    lines = [title, " " * head + "  " + "  ".join(f"{label:>{width}}" for label in labels)]
    lines += [f"{name:<{head}}  " + "  ".join(f"{v:>{width}}" for v in values) for name, values in rows]
    return "\n".join(lines)


def translation_tables(reports: dict[str, dict], references_report: dict) -> str:
    labels = list(reports)
    r = list(reports.values())

    def row(name, fmt):
        return (name, [fmt(x) for x in r])

    rows = [
        row("BLEU", lambda x: f"{x['bleu']:.2f}"),
        row("brevity penalty", lambda x: f"{x['bp']:.4f}"),
        row("sys/ref length", lambda x: f"{x['ratio']:.4f}"),
        row("sys length (13a tokens)", lambda x: f"{x['sys_len']}"),
        *[row(f"{n}-gram precision", lambda x, n=n: f"{x['precisions'][n - 1]:.2f}") for n in range(1, 5)],
        row("chrF", lambda x: f"{x['chrf']:.2f}"),
        row("mean words / output", lambda x: f"{x['mean_words']:.2f}"),
        row("empty outputs %", lambda x: f"{100 * x['empty']:.1f}"),
        row("at the length limit %", lambda x: f"{100 * x['at_limit']:.1f}"),
        row("repeated word 3-gram %", lambda x: f"{100 * x['repeated_3gram']:.1f}"),
    ]
    for k, (low, high) in enumerate(BUCKETS):
        span = f"{low}-{high}" if high < 10_000 else f">={low}"
        count = r[0]["buckets"][k]["count"]
        rows.append(row(f"BLEU, source {span} words (n={count})", lambda x, k=k: f"{x['buckets'][k]['bleu']:.2f}"))
        rows.append(row(f"  sys/ref length, {span}", lambda x, k=k: f"{x['buckets'][k]['ratio']:.4f}"))
    text = table("Test translations (test_2016_flickr, sacreBLEU 13a cased, chrF)", labels, rows)
    ref = references_report
    text += (
        f"\nReferences: {ref['mean_words']:.2f} words / sentence, repeated word 3-gram in "
        f"{100 * ref['repeated_3gram']:.1f}%."
    )
    return text


def model_tables(reports: dict[str, dict]) -> str:
    labels = list(reports)
    r = list(reports.values())
    rows = [
        ("valid target tokens", [f"{x['valid']['tokens']}" for x in r]),
        ("NLL (no smoothing)", [f"{x['valid']['nll']:.4f}" for x in r]),
        (f"label-smoothed CE (eps {LABEL_SMOOTHING})", [f"{x['valid']['smoothed']:.4f}" for x in r]),
        ("U = mean_v -log p(v)", [f"{x['valid']['uniform']:.3f}" for x in r]),
        ("entropy of p (nats)", [f"{x['valid']['entropy']:.4f}" for x in r]),
        ("mean max p", [f"{x['valid']['max_prob']:.4f}" for x in r]),
        ("argmax accuracy", [f"{x['valid']['correct']:.4f}" for x in r]),
    ]
    for name in ("greedy", "beam"):
        rows += [
            (f"{name} BLEU", [f"{x[name]['bleu']:.2f}" for x in r]),
            (f"{name} brevity penalty", [f"{x[name]['bp']:.4f}" for x in r]),
            (f"{name} sys/ref length", [f"{x[name]['ratio']:.4f}" for x in r]),
        ]
    return table("Models (validation set: teacher-forced, eval mode; test: greedy and beam 4, lp 0.6)", labels, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="archive names, run folders or files")
    parser.add_argument("--models", nargs="*", default=[], metavar="LABEL=DIR", help="trained models to measure")
    parser.add_argument(
        "--tokenizer", type=Path, help="the runs' tokenizer (default: benchmarks/runs/tokenizer-en-de)"
    )
    parser.add_argument("--source_lang", default="en")
    parser.add_argument("--target_lang", default="de")
    parser.add_argument("--valid_pairs", type=int, default=None, help="first N validation pairs (default: all)")
    parser.add_argument("--test_pairs", type=int, default=None, help="first N test sentences for greedy vs beam")
    parser.add_argument("--check_tree", type=Path, help="also run the invariance checks on another source tree")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)

    sources = read_lines(DATA / f"test_2016_flickr.{args.source_lang}.gz")
    references = read_lines(DATA / f"test_2016_flickr.{args.target_lang}.gz")
    tokenizer_dir = args.tokenizer or (DEFAULT_TOKENIZER if DEFAULT_TOKENIZER.exists() else None)
    tokenizer = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    parts = []
    reports, missing = {}, []
    for spec in args.runs:
        label, path = resolve_run(spec)
        if path is None:
            missing.append(label)
            continue
        reports[label] = translation_report(read_lines(path), sources, references, tokenizer, f"--runs {spec}")
    if reports:
        parts.append(translation_tables(reports, translation_report(references, sources, references, tokenizer)))
    limit_note = "words (no --tokenizer: an upper bound)"
    if tokenizer is not None:
        limit_note = f"tokens of the runs' tokenizer ({Path(tokenizer_dir).parent.name}/{Path(tokenizer_dir).name})"
    parts.append(f"Length limit counted in {limit_note}.")
    if missing:
        parts.append(f"No test translations archived for: {', '.join(missing)} (table fields only).")
    fits = leave_one_out(archived_rows())
    if fits:
        parts.append(loss_bleu_table(fits))
    models = {}
    for spec in args.models:
        label, sep, folder = spec.partition("=")
        if not sep or not folder:
            raise SystemExit(f"--models takes LABEL=DIR, got {spec!r}.")
        models[label] = model_report(Path(folder), args, sources, references)
    if models:
        parts.append(model_tables(models))
    if args.check_tree:
        parts.append(check_tree(args.check_tree))
    text = "\n\n".join(parts) + "\n"
    print(text, end="")
    if args.output:
        args.output.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
