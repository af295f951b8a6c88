"""Rerank n-best lists with more scores than the search had: noisy-channel reranking (Yee et al. 2019; fairseq's
examples/noisychannel), where a model of the reverse direction scores how well each hypothesis explains the source.

    hf-variants-translate --model runs/en-fr/model --input dev.en --output dev.nbest.jsonl --nbest 8 --num_beams 8
    hf-variants-score --model runs/fr-en/model --nbest_input dev.nbest.jsonl --reverse --output dev.reverse.jsonl
    hf-variants-rerank --nbest_input dev.nbest.jsonl --features reverse=dev.reverse.jsonl --references dev.fr \\
        --tune --weights_out weights.json --output dev.reranked.fr
    hf-variants-rerank --nbest_input test.nbest.jsonl --features reverse=test.reverse.jsonl --weights weights.json \\
        --output test.reranked.fr

Each hypothesis of an n-best line (hf-variants-translate's JSON Lines with `score` and `log_prob`) gets the score
`sum_f weight_f * feature_f` over these features, and the best one is written (one line per input line, input
order; a line without hypotheses gives an empty line):
  forward           the n-best's `score`: what the search ranked by (log_prob / length ** length_penalty); weight 1
  forward_log_prob  the n-best's `log_prob`
  length            the hypothesis' tokens (`</s>` included): a word bonus
  NAME              the `log_prob` of each `--features NAME=FILE` (hf-variants-score --nbest_input output, its lines
                    and hypotheses those of --nbest_input, texts checked)
Every weight but `forward`'s is 0 unless given (`--weight NAME=VALUE`, `--weights FILE.json`): with no other weight
the 1-best of the n-best list is the answer, whatever the features.

`--tune` with `--references` chooses the weights that maximize corpus BLEU (sacreBLEU) on that set by coordinate
ascent: each weight in turn set to the best value of `--grid` (the others fixed), rounds until no weight changes
(at most `--rounds`), starting from 0 (the 1-best) and moving only for a strictly higher BLEU, so the tuned BLEU is
never below the 1-best's. Tune on a development set, then rerank the test set with the saved weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

from ..outputs import atomic_write_file, check_output_files, int_in_range
from ..training.corpus import DataError, parse_jsonl_line, read_lines
from .common import UsageError, command_parser, exits_on_refusal
from .inputs import iter_lines

logger = logging.getLogger("hf_variants.rerank")
FIXED_FEATURES = ("forward", "forward_log_prob", "length")
DEFAULT_GRID = [round(-2 + 0.1 * i, 1) for i in range(41)]


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("hf-variants-rerank", __doc__, epilog_from=2)
    p.add_argument(
        "--nbest_input", required=True, metavar="FILE.jsonl", help="hf-variants-translate's n-best JSON Lines (scores)"
    )
    p.add_argument(
        "--features",
        nargs="+",
        default=[],
        metavar="NAME=FILE",
        help="more scores of the same hypotheses: hf-variants-score --nbest_input outputs (NAME: the feature)",
    )
    p.add_argument("--weight", nargs="+", default=[], metavar="NAME=VALUE", help="feature weights (default 0)")
    p.add_argument("--weights", metavar="FILE.json", help="weights saved by --tune --weights_out")
    p.add_argument("--references", help="reference translations (one a line): BLEU before and after; --tune")
    p.add_argument("--tune", action="store_true", help="choose the weights maximizing BLEU on --references")
    p.add_argument("--grid", nargs="+", type=float, default=DEFAULT_GRID, help="the values --tune tries")
    p.add_argument("--rounds", type=int_in_range(1), default=3, help="--tune's rounds over the weights")
    p.add_argument("--weights_out", help="write the weights (tuned or given) here, as JSON")
    p.add_argument("--output", required=True, help="the chosen translation of each line; '-' writes stdout")
    p.add_argument("--results_json", help="write the summary here")
    p.add_argument("--bleu_tokenize", default="13a", help="sacreBLEU's BLEU tokenizer")
    return p


# ---------------------------------------------------------------------------------------------------- reading
def read_nbest(path: str) -> list[list[dict]]:
    """Per line, its hypotheses' features: forward (score), forward_log_prob, length, and the text."""
    rows = []
    for number, line in enumerate(iter_lines(path), 1):
        where = f"{path}:{number}"
        obj = parse_jsonl_line(line, where)
        hypotheses = obj.get("hypotheses")
        if not isinstance(hypotheses, list) or not isinstance(obj.get("source"), str):
            raise DataError(
                f'{where}: expected hf-variants-translate\'s n-best JSON Lines ({{"source", "hypotheses"}}).'
            )
        row = []
        for k, h in enumerate(hypotheses, 1):
            if not isinstance(h, dict) or not all(isinstance(h.get(n), (int, float)) for n in ("score", "log_prob")):
                raise DataError(
                    f"{where}: hypothesis {k} has no score and log_prob: translate with --scores (or --nbest > 1)."
                )
            row.append(
                {"text": h.get("text", ""), "forward": h["score"], "forward_log_prob": h["log_prob"]}
                | {"length": len(h.get("tokens") or [])}
            )
        rows.append(row)
    return rows


def add_feature(rows: list[list[dict]], name: str, path: str) -> None:
    """The `log_prob` of each hypothesis in an hf-variants-score --nbest_input output, as feature `name` (its lines,
    hypotheses and texts must be those of the n-best list). A hypothesis not scored (too long) gets -inf."""
    count = 0
    for number, line in enumerate(iter_lines(path), 1):
        where = f"{path}:{number}"
        if number > len(rows):
            raise DataError(f"{where}: --features {name} has more lines than --nbest_input ({len(rows)}).")
        hypotheses = parse_jsonl_line(line, where).get("hypotheses")
        row = rows[number - 1]
        if not isinstance(hypotheses, list) or len(hypotheses) != len(row):
            got = len(hypotheses) if isinstance(hypotheses, list) else "no"
            raise DataError(f"{where}: {got} hypotheses, the n-best line has {len(row)}.")
        for k, (h, mine) in enumerate(zip(hypotheses, row), 1):
            if not isinstance(h, dict) or h.get("text") != mine["text"]:
                raise DataError(f"{where}: hypothesis {k} is not the n-best list's ({mine['text']!r}).")
            value = h.get("log_prob")
            mine[name] = float(value) if isinstance(value, (int, float)) else -math.inf
        count = number
    if count != len(rows):
        raise DataError(f"--features {name}={path} has {count} lines, --nbest_input has {len(rows)}.")


def parse_weights(args: argparse.Namespace, names: list[str]) -> dict[str, float]:
    """The weights: 1 for forward, 0 for the others, then --weights FILE, then --weight NAME=VALUE."""
    weights = {name: 0.0 for name in names}
    weights["forward"] = 1.0
    given: dict = {}
    if args.weights:
        try:
            given.update(json.loads(Path(args.weights).read_text(encoding="utf-8"))["weights"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise UsageError(f"--weights {args.weights}: not a weights file of --weights_out ({error}).") from None
    for item in args.weight:
        name, sep, value = item.partition("=")
        try:
            given[name] = float(value) if sep else None
        except ValueError:
            given[name] = None
        if given[name] is None:
            raise UsageError(f"--weight expects NAME=NUMBER, got {item!r}.")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise UsageError(f"weights for unknown features {unknown}; the features are {names}.")
    weights.update({name: float(value) for name, value in given.items()})
    return weights


# --------------------------------------------------------------------------------------------------- reranking
def choose(rows: list[list[dict]], weights: dict[str, float]) -> list[str]:
    """Each line's best hypothesis' text under `weights` (ties: the earlier hypothesis; a hypothesis with a feature
    that is not finite and weighted, e.g. not scored, ranks last; no hypotheses: "")."""
    out = []
    for row in rows:
        best, best_score = "", None
        for h in row:
            terms = [w * h[name] for name, w in weights.items() if w]
            value = math.fsum(terms) if all(math.isfinite(t) for t in terms) else -math.inf
            if best_score is None or value > best_score:
                best, best_score = h["text"], value
        out.append(best)
    return out


def bleu(hyps: list[str], refs: list[str], tokenize: str) -> float:
    import sacrebleu

    return sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize).score


def tune(rows, refs, weights: dict[str, float], grid: list[float], rounds: int, tokenize: str) -> tuple[dict, list]:
    """Coordinate ascent on BLEU (see the module docstring); returns the weights and the steps taken."""
    weights = dict(weights)
    best = bleu(choose(rows, weights), refs, tokenize)
    steps = [{"round": 0, "weights": dict(weights), "bleu": best}]
    for round_ in range(1, rounds + 1):
        changed = False
        for name in [n for n in weights if n != "forward"]:
            for value in grid:
                trial = dict(weights, **{name: value})
                score = bleu(choose(rows, trial), refs, tokenize)
                if score > best + 1e-9:
                    weights, best, changed = trial, score, True
            steps.append({"round": round_, "feature": name, "weights": dict(weights), "bleu": best})
        if not changed:
            break
    return weights, steps


@exits_on_refusal("hf-variants-rerank")
def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    if args.tune and not args.references:
        raise UsageError("--tune chooses the weights by BLEU against --references: give them.")
    outputs = {"--output": None if args.output == "-" else args.output, "--results_json": args.results_json}
    outputs["--weights_out"] = args.weights_out
    inputs = {"--nbest_input": args.nbest_input, "--references": args.references, "--weights": args.weights}
    inputs["--features"] = [item.partition("=")[2] for item in args.features]
    check_output_files(outputs, inputs)
    rows = read_nbest(args.nbest_input)
    names = list(FIXED_FEATURES)
    for item in args.features:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in names:
            raise UsageError(f"--features expects NAME=FILE with a new NAME (not {names}), got {item!r}.")
        add_feature(rows, name, path)
        names.append(name)
    weights = parse_weights(args, names)
    refs = read_lines(args.references) if args.references else None
    if refs is not None and len(refs) != len(rows):
        raise DataError(f"--references {args.references} has {len(refs)} lines, --nbest_input has {len(rows)}.")
    result: dict = {"nbest_input": args.nbest_input, "lines": len(rows), "features": names}
    if args.tune:
        weights, result["tuning"] = tune(rows, refs, weights, args.grid, args.rounds, args.bleu_tokenize)
    chosen = choose(rows, weights)
    result["weights"] = weights
    if refs is not None:
        first = [row[0]["text"] if row else "" for row in rows]
        result["bleu_1best"] = bleu(first, refs, args.bleu_tokenize)
        result["bleu_reranked"] = bleu(chosen, refs, args.bleu_tokenize)
    text = "".join(line.replace("\n", " ") + "\n" for line in chosen)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        atomic_write_file(args.output, text)
    for path, data in ((args.weights_out, {"weights": weights, "features": names}), (args.results_json, result)):
        if path:
            atomic_write_file(path, json.dumps(data, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "tuning"}, indent=2), file=sys.stderr)
    return result


def cli() -> None:
    """The command line (`hf-variants-rerank`, `python -m hf_variants.commands.rerank`)."""
    main()


if __name__ == "__main__":
    cli()
