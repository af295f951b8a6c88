#!/usr/bin/env python
"""Does a glossary make the translations use its terms, and what does it do to BLEU? Term accuracy (the WMT
terminology task's measure: of the glossary terms found in the test sources, the share whose target term the
translation contains) and BLEU / chrF on test_2016_flickr, translated by `hf-variants-translate` without and with
`--glossary`, side by side, with the same beam size.

The glossary comes from the Multi30k training pairs, never from the test set: the `--terms` (50) most frequent
English words whose most associated German word is a noun, each with that word as its target term. Association is
Dice's coefficient over sentence co-occurrence, 2 c(s, t) / (c(s) + c(t)), each word counted once per sentence; a
German word counts as a noun when it is capitalized in at least 90% of its occurrences after a sentence's first word
(German capitalizes nouns); English function words (`STOPWORDS`) and words under 3 letters are not candidates, nor
pairs of Dice below `--min_dice`. The glossary is written as a TSV (`--glossary_out`, default
`benchmarks/results/glossary_multi30k_en_de.tsv`: it depends on the training data alone) and applied
case-insensitively on whole words (`--glossary_ignore_case`); `--glossary FILE` takes a given one instead.

    python benchmarks/glossary_eval.py --model benchmarks/runs/ema_averaging_400-plain --num_beams 4 \\
        --threads 1 --output benchmarks/results/glossary_eval

The result: per arm BLEU, chrF, term accuracy (terms applied, found), sentences/s; for the glossary arm the
sentences with constraints, those with every constraint met and the beam sizes used; per term how often it applied
and was found without and with the glossary. The speeds are one run each, for orientation: what constraints cost is
`bench_constraints.py`'s question (interleaved, medians). A smoke run (a tiny model trained a few steps, 20 sentences):
`--train_tiny 30 --sentences 20 --output /tmp/glossary_smoke --glossary_out /tmp/glossary_smoke.tsv`.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_translation_core import DATA_DIR, load_average, train_tiny  # noqa: E402
from timing import write_result  # noqa: E402

DEFAULT_GLOSSARY = ROOT / "benchmarks" / "results" / "glossary_multi30k_en_de.tsv"
STOPWORDS = frozenset(
    """a an the and or but of in on at to from by with without for into onto over under up down out off near next
    while as is are was were be been being has have had do does did it its it's this that these those there here
    his her their our your my he she they we you i him them who which what where when some one two three four five
    other another each all both several many few very just not no front back top side while through around behind
    across along against toward towards between away together""".split()
)
WORD = re.compile(r"[^\W\d_]+(?:[-'][^\W\d_]+)*")


def read(split: str, lang: str, n: int | None = None) -> list[str]:
    with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n else lines


def words(text: str) -> list[str]:
    return WORD.findall(text)


def target_statistics(targets: list[str]):
    """(sentences holding each lower-cased German word, its occurrences after a sentence's first word, how many of
    those are capitalized, its spellings there)."""
    sentences, later, capitalized, spellings = Counter(), Counter(), Counter(), defaultdict(Counter)
    for line in targets:
        tokens = words(line)
        sentences.update({w.lower() for w in tokens})
        for w in tokens[1:]:
            key = w.lower()
            later[key] += 1
            capitalized[key] += w[0].isupper()
            spellings[key][w] += 1
    return sentences, later, capitalized, spellings


def build_glossary(sources: list[str], targets: list[str], terms: int, min_dice: float, candidates: int = 400):
    """The glossary's entries (see the module docstring), most frequent source word first: {"source", "target",
    "dice", "source_sentences", "together"}."""
    source_sentences = Counter(w for line in sources for w in {w.lower() for w in words(line)})
    target_sentences, later, capitalized, spellings = target_statistics(targets)
    pool = [w for w, _ in source_sentences.most_common() if w not in STOPWORDS and len(w) >= 3][:candidates]
    chosen = set(pool)
    together: dict[str, Counter] = defaultdict(Counter)
    for source, target in zip(sources, targets):
        present = {w.lower() for w in words(source)} & chosen
        if present:
            target_words = {w.lower() for w in words(target)}
            for w in present:
                together[w].update(target_words)
    entries = []
    for w in pool:
        if not together[w]:
            continue

        def dice(t: str, w: str = w) -> float:
            return 2 * together[w][t] / (source_sentences[w] + target_sentences[t])

        best = max(sorted(together[w]), key=dice)
        noun = later[best] >= 5 and capitalized[best] >= 0.9 * later[best]
        if noun and dice(best) >= min_dice:
            entries.append(
                {
                    "source": w,
                    "target": spellings[best].most_common(1)[0][0],
                    "dice": round(dice(best), 3),
                    "source_sentences": source_sentences[w],
                    "together": together[w][best],
                }
            )
        if len(entries) == terms:
            break
    return entries


def write_glossary(entries: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{e['source']}\t{e['target']}\n" for e in entries), encoding="utf-8")


def translate_arm(args, files: dict, name: str, glossary: Path | None) -> tuple[dict, list[str]]:
    """One arm through `hf-variants-translate` (in this process): its summary and its translations."""
    from hf_variants.commands import translate

    output = files["work"] / f"{name}.{args.tgt_lang}"
    argv = ["--model", args.model, "--input", str(files["sources"]), "--references", str(files["references"])]
    argv += ["--output", str(output), "--num_beams", str(args.num_beams), "--batch_size", str(args.batch)]
    argv += ["--num_threads", str(args.threads), "--no_progress", "--tgt_lang", args.tgt_lang]
    if glossary is not None:
        argv += ["--glossary", str(glossary), "--glossary_ignore_case"]
    summary = translate.main(argv)
    return summary, output.read_text(encoding="utf-8").splitlines()


ARM_KEYS = ("bleu", "chrf", "seconds", "sentences_per_sec")
GLOSSARY_KEYS = ("constrained_sentences", "constraints_met_sentences", "unmet_constraints_sentences")


def compare(args, files: dict, glossary_path: Path) -> dict:
    """Both arms, term accuracy of each (`evaluation.term_accuracy`) and per term."""
    from hf_variants.inference import Glossary
    from hf_variants.training.evaluation import term_accuracy

    glossary = Glossary.load(glossary_path, ignore_case=True)
    sources = files["sources"].read_text(encoding="utf-8").splitlines()
    arms, outputs = {}, {}
    for name, path in (("without_glossary", None), ("with_glossary", glossary_path)):
        summary, outputs[name] = translate_arm(args, files, name, path)
        arms[name] = {key: summary.get(key) for key in ARM_KEYS}
        arms[name].update(term_accuracy(sources, outputs[name], glossary))
        if path is not None:
            assert summary["term_accuracy"] == arms[name]["term_accuracy"], "the command's term accuracy differs"
            arms[name].update({key: summary[key] for key in GLOSSARY_KEYS})
            arms[name]["constrained_num_beams"] = summary["constrained_num_beams"]
    per_term = {term.source: {"target": "|".join(term.targets), "applied": 0} for term in glossary}
    for name, texts in outputs.items():
        for source, text in zip(sources, texts):
            for check in glossary.check(source, text):
                row = per_term[check.source]
                row["applied"] += name == "without_glossary"
                row[f"found_{name}"] = row.get(f"found_{name}", 0) + check.found
    return {"arms": arms, "per_term": per_term}


def report(record: dict) -> None:
    arms = record["comparison"]["arms"]
    print(f"{'':18s} {'BLEU':>7s} {'chrF':>7s} {'term acc.':>10s} {'terms found':>12s} {'sent/s':>8s}")
    for name, arm in arms.items():
        accuracy = arm["term_accuracy"]
        print(
            f"{name:18s} {arm['bleu']:7.2f} {arm['chrf']:7.2f} "
            f"{accuracy if accuracy is None else round(accuracy, 4)!s:>10s} "
            f"{arm['terms_found']:>5d}/{arm['terms']:<6d} {arm['sentences_per_sec']:8.1f}"
        )
    print(f"sentences with terms: {arms['with_glossary']['sentences_with_terms']} of {record['sentences']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an en -> de model folder (a run's model/)")
    p.add_argument("--train_tiny", type=int, metavar="STEPS", help="no --model: train the tiny baseline STEPS steps")
    p.add_argument("--glossary", help="use this glossary TSV instead of building one")
    p.add_argument("--glossary_out", default=str(DEFAULT_GLOSSARY), help="where the built glossary is written")
    p.add_argument("--terms", type=int, default=50, help="glossary terms to build")
    p.add_argument("--min_dice", type=float, default=0.3)
    p.add_argument("--num_beams", type=int, default=4, help="the beam size of both arms")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sentences", type=int, help="the first N test sentences (default: all 1,000)")
    p.add_argument("--tgt_lang", default="de")
    p.add_argument("--output", help="write OUTPUT.json")
    args = p.parse_args()
    if (args.model is None) == (args.train_tiny is None):
        p.error("pass --model DIR or --train_tiny STEPS")
    work = tempfile.TemporaryDirectory()
    folder = Path(work.name)
    if args.train_tiny:
        args.model = train_tiny(args.train_tiny, folder)
    record: dict = {"command": " ".join(sys.argv), "model": args.model, "load_average_before": load_average()}
    if args.glossary:
        glossary_path = Path(args.glossary)
    else:
        entries = build_glossary(read("train", "en"), read("train", "de"), args.terms, args.min_dice)
        glossary_path = Path(args.glossary_out)
        write_glossary(entries, glossary_path)
        record["glossary_entries"] = entries
        print(f"{len(entries)} terms written to {glossary_path}")
    files = {"work": folder, "sources": folder / "test.en", "references": folder / f"test.{args.tgt_lang}"}
    files["sources"].write_text("\n".join(read("test_2016_flickr", "en", args.sentences)) + "\n", encoding="utf-8")
    refs = read("test_2016_flickr", args.tgt_lang, args.sentences)
    files["references"].write_text("\n".join(refs) + "\n", encoding="utf-8")
    record.update(glossary=str(glossary_path), sentences=len(refs), num_beams=args.num_beams, threads=args.threads)
    record["comparison"] = compare(args, files, glossary_path)
    record["load_average_after"] = load_average()
    report(record)
    if args.output:
        write_result(f"{args.output}.json", record)


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"{time.time() - start:.0f} s")
