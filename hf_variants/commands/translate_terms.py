"""hf-variants-translate's terminology flags: `--constraints FILE` (target phrases per input line) and `--glossary
FILE` (source term -> target term, applied to every line), checked before the model loads; what each line's JSON
record adds (its constraints, those its best translation misses, the glossary's terms and whether each was found);
and the counts behind the summary (sentences with constraints, those with every constraint met, the lines where
some could not be met within the length limit, the beam sizes the constrained search used, term accuracy).

A constraints file is UTF-8 text aligned with the input, one line per input line: the line's target phrases
separated by tabs, the alternative forms of a phrase by `|` (`Kasse|Kassenbereich<TAB>Warenkorb`); an empty line
gives that input line no constraint. A glossary file: `hf_variants.inference.glossary` (source term<TAB>target term;
matching case-sensitive and on whole words unless `--glossary_ignore_case` / `--glossary_substring`). Both may be
given: a line's constraints are its own, then its glossary terms' (one that is already there is not added again).
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterator

from ..inference.constraints import format_constraint
from ..inference.decode import engine_class
from ..inference.glossary import Glossary, GlossaryError
from ..inference.requests import DecodeOptions, TranslationRequest, TranslationResult
from ..inference.translator import constrained_num_beams
from ..training.corpus import DataError
from .inputs import iter_lines, parse_line

logger = logging.getLogger("hf_variants.translate")
TERM_FLAGS = ("--constraints", "--glossary")


def add_terms_flags(p: argparse.ArgumentParser) -> None:
    """`--constraints`, `--glossary` and the glossary's matching flags."""
    g = p.add_argument_group("terminology (lexically constrained decoding)")
    g.add_argument(
        "--constraints",
        metavar="FILE",
        help="target phrases each translation must contain, one line per input line (an empty line: none): "
        "phrases separated by tabs, alternative forms of a phrase by | (Kasse|Kassenbereich<TAB>Warenkorb)",
    )
    g.add_argument(
        "--glossary",
        metavar="FILE",
        help="a glossary (UTF-8 TSV: source term<TAB>target term, forms separated by |): the terms found in a "
        "source sentence add their target terms to its constraints; JSON Lines output lists each line's terms "
        "and whether they were found, the summary gives term accuracy",
    )
    g.add_argument("--glossary_ignore_case", action="store_true", help="match glossary terms whatever their case")
    g.add_argument(
        "--glossary_substring",
        action="store_true",
        help="match glossary terms inside words too (compounding languages: 'Kasse' in 'Kassenbereich'); "
        "default: whole words only",
    )


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.constraints or args.glossary)


def flag_of(args: argparse.Namespace) -> str:
    """The terminology flag a refusal names: `--constraints FILE`, else `--glossary FILE`."""
    return f"--constraints {args.constraints}" if args.constraints else f"--glossary {args.glossary}"


def check_terms(args: argparse.Namespace, engine: str, options: DecodeOptions) -> Glossary | None:
    """Before loading: the terminology flags on their own, against the engine and the decoding flags, the
    glossary read (a DataError naming the file and line) and every line of the constraints file parsed. Returns the
    glossary (None without `--glossary`)."""
    for flag in ("glossary_ignore_case", "glossary_substring"):
        if getattr(args, flag) and not args.glossary:
            raise DataError(f"--{flag} sets how --glossary matches: pass --glossary FILE.")
    if not wanted(args):
        return None
    if not engine_class(engine).supports_constraints:
        raise DataError(
            f"{flag_of(args).split()[0]}: the {engine} engine has no lexically constrained decoding: translate "
            "with the torch or onnx engine (a model folder, or an hf-variants-export-onnx folder)."
        )
    for name in ("do_sample", "no_repeat_ngram_size", "repetition_penalty"):
        value = getattr(options, name)
        if value not in (None, False) and not (name == "repetition_penalty" and value == 1.0):
            shown = f"--{name}" if value is True else f"--{name} {value}"
            raise DataError(
                f"{flag_of(args).split()[0]}: constrained beam search does not implement {shown}: drop one of them."
            )
    if args.constraints:
        for _ in read_constraints(args.constraints):
            pass
    if not args.glossary:
        return None
    try:
        return Glossary.load(
            args.glossary, ignore_case=args.glossary_ignore_case, whole_word=not args.glossary_substring
        )
    except GlossaryError as error:
        raise DataError(f"--glossary {error}") from None
    except OSError as error:
        raise DataError(f"--glossary {args.glossary}: cannot read it ({error.strerror or error})") from None


def read_constraints(path: str) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Each line's constraints, read lazily."""
    for number, line in enumerate(iter_lines(path), 1):
        yield parse_line(line, path, number)


def with_terms(request: TranslationRequest, glossary: Glossary | None) -> TranslationRequest:
    """`request` (its constraints the line's own) with its glossary terms' constraints added."""
    return glossary.apply(request) if glossary is not None else request


# ------------------------------------------------------------------------------------------------ per line
def line_record(result: TranslationResult, glossary: Glossary | None) -> tuple[dict, list]:
    """(what the line's JSON record adds: `constraints` and `unmet_constraints` when it has any, `glossary` with
    a glossary; the glossary's checks of the line)."""
    record: dict = {}
    if result.constraints:
        record["constraints"] = [list(forms) for forms in result.constraints]
    if result.unmet_constraints:
        record["unmet_constraints"] = [list(forms) for forms in result.unmet_constraints]
    checks = glossary.check(result.source, result.text) if glossary is not None else []
    if glossary is not None:
        record["glossary"] = [check.to_dict() for check in checks]
    return record, checks


def count_line(tally, result: TranslationResult, checks: list, num_beams: int, line: int) -> None:
    """Add a line's constraints and glossary terms to the run's `Tally`, warning about unmet constraints."""
    if result.constraints and result.hypotheses:
        tally.constrained += 1
        beams = constrained_num_beams(num_beams, len(result.constraints))
        if beams not in tally.constrained_beams:
            tally.constrained_beams.append(beams)
        unmet = result.unmet_constraints
        if unmet:
            tally.unmet_constraints.append(line)
            logger.warning(
                "line %d: %d of %d constraints not met within the sentence's length limit: %s",
                line,
                len(unmet),
                len(result.constraints),
                ", ".join(repr(format_constraint(forms)) for forms in unmet),
            )
        else:
            tally.constraints_met += 1
    tally.terms += len(checks)
    tally.terms_found += sum(check.found for check in checks)
    tally.sentences_with_terms += bool(checks)


def summary(args: argparse.Namespace, glossary: Glossary | None, tally) -> dict:
    """The summary's terminology fields (none without the flags)."""
    if not wanted(args):
        return {}
    out: dict = {"constraints": args.constraints}
    if glossary is not None:
        out.update(
            glossary=args.glossary,
            glossary_terms=len(glossary),
            glossary_ignore_case=glossary.ignore_case,
            glossary_whole_word=glossary.whole_word,
        )
    out.update(
        constrained_sentences=tally.constrained,
        constraints_met_sentences=tally.constraints_met,
        unmet_constraints_sentences=len(tally.unmet_constraints),
        unmet_constraints_lines=tally.unmet_constraints,
        constrained_num_beams=sorted(set(tally.constrained_beams)),
    )
    if glossary is not None:
        out.update(
            term_accuracy=tally.terms_found / tally.terms if tally.terms else None,
            terms=tally.terms,
            terms_found=tally.terms_found,
            sentences_with_terms=tally.sentences_with_terms,
        )
    return out


def warn_unmet(tally) -> None:
    if tally.unmet_constraints:
        logger.warning(
            "%d sentences miss some constraint within their length limit (e.g. line %d; listed in the summary's "
            "unmet_constraints_lines): raise --max_len_b or --num_beams",
            len(tally.unmet_constraints),
            tally.unmet_constraints[0],
        )


_REQUEST = re.compile(r"^requests\[(\d+)\]: (.*)$", re.S)


def line_error(error: ValueError, args: argparse.Namespace, label: str, first_line: int) -> DataError | None:
    """A translation core's refusal of request k of a stream (`requests[k]: constraints: ...`, `prefix: ...`) as a
    DataError naming the input line (`label`:`first_line` + k) and the file its constraints or prefix came from;
    None for any other error."""
    found = _REQUEST.match(str(error))
    if found is None or isinstance(error, DataError):
        return None
    line, message = first_line + int(found.group(1)), found.group(2)
    message = re.sub(r"\b(max_len_b|max_new_tokens|num_beams)\b", r"--\1", message)
    if message.startswith("constraints"):
        sources = [f"--constraints {args.constraints}:{line}"] if args.constraints else []
        sources += [f"the --glossary {args.glossary} terms of line {line}"] if args.glossary else []
        return DataError(f"{label}:{line}: {message} (from {' and '.join(sources)})")
    if message.startswith("prefix") and args.prefix:
        return DataError(f"--prefix {args.prefix}:{line}: {message}")
    return DataError(f"{label}:{line}: {message}")


__all__ = [
    "add_terms_flags",
    "check_terms",
    "count_line",
    "line_error",
    "line_record",
    "summary",
    "warn_unmet",
    "with_terms",
]
