"""Reading a translation command's input: text files (plain or .gz, or stdin) read lazily line by line, JSON Lines
rows (`{"translation": {lang: text}}`, `{"text": ...}`, `{"source": ..., "target": ...}`), and the files aligned with
the input line by line (references, prefixes, constraints, source annotations), each mismatch named with the file and
line. A line of hf-variants-translate's own n-best JSON Lines output (`{"source": ..., "hypotheses": [...]}`) is
refused where a sentence or a row is expected, naming its line.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..inference.batching import LineReader
from ..inference.constraints import parse_constraints
from ..training.corpus import DataError, check_not_nbest, nbest_error, parse_jsonl_line

STDIO = "-"
TEXT_KEYS = ("text", "source")  # JSONL rows without "translation": the source text
TARGET_KEY = "target"  # ... and an optional reference next to it


def _decode_line(raw: bytes, label: str, number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{label}: line {number} is not valid UTF-8 ({err.reason}).") from err


def _open_binary(path: str):
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from err


def iter_lines(path: str) -> Iterator[str]:
    """The lines of a text file (plain or .gz) or of stdin (`-`), read lazily, without terminators; bad UTF-8 names
    the line; a byte-order mark at the start is dropped."""
    if path == STDIO:
        try:
            yield from LineReader(sys.stdin.buffer, "stdin")
        except ValueError as err:
            raise DataError(str(err)) from None
        return
    with _open_binary(path) as f:
        try:
            for number, raw in enumerate(f, 1):
                yield _decode_line(raw, path, number)
        except (OSError, EOFError) as err:
            raise DataError(f"cannot read {path}: {err}") from err


def count_lines(path: str) -> int:
    """The number of lines of a text file (plain or .gz), counted without holding them."""
    count, last = 0, b"\n"
    with _open_binary(path) as f:
        try:
            while chunk := f.read(1 << 20):
                count += chunk.count(b"\n")
                last = chunk[-1:]
        except (OSError, EOFError) as err:
            raise DataError(f"cannot read {path}: {err}") from err
    return count + (last != b"\n")


def is_jsonl(path: str, input_format: str) -> bool:
    if input_format != "auto":
        return input_format == "jsonl"
    return path != STDIO and path.lower().removesuffix(".gz").endswith(".jsonl")


def _row_source(obj: dict, where: str, src_lang: str | None, tgt_lang: str | None):
    """(source, its language or None, reference or None) of one JSONL row."""
    if "translation" in obj:
        sides = obj["translation"]
        if not isinstance(sides, dict):
            raise DataError(f'{where}: "translation" must be an object {{lang: text}}, got {type(sides).__name__}.')
        lang = src_lang
        if lang is None:
            others = [code for code in sides if code != tgt_lang]
            if len(others) != 1:
                raise DataError(
                    f"{where}: cannot tell the source side among {sorted(sides)}: pass --src_lang"
                    f"{'' if tgt_lang else ' and --tgt_lang'}."
                )
            lang = others[0]
        if sides.get(lang) is None:
            raise DataError(f'{where}: no {lang!r} side in "translation" (it has {sorted(sides)}).')
        source, reference = sides[lang], sides.get(tgt_lang) if tgt_lang else None
    else:
        keys = [key for key in TEXT_KEYS if key in obj]
        if len(keys) != 1:
            found = 'both "text" and "source"' if keys else f"the keys {sorted(obj)}"
            raise DataError(
                f'{where}: expected {{"translation": {{lang: text}}}}, {{"text": ...}} or '
                f'{{"source": ...}}, found {found}.'
            )
        source, reference, lang = obj[keys[0]], obj.get(TARGET_KEY), src_lang
    for name, value in (("source", source), ("target", reference)):
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: the {name} is a {type(value).__name__}, expected a string.")
    if source is None:
        raise DataError(f"{where}: the source is null.")
    return source, lang, reference


def read_annotation_files(items: list[str], jsonl: bool) -> tuple[dict[str, str], list[str]]:
    """`--source_annotation` values: NAME=FILE pairs, and (JSONL input only) NAMEs read from the rows."""
    files, from_rows = {}, []
    for item in items:
        name, sep, path = item.partition("=")
        if not name:
            raise DataError(f"--source_annotation expects NAME=FILE, got {item!r}")
        if sep:
            files[name] = path
        elif jsonl:
            from_rows.append(name)
        else:
            raise DataError(f"--source_annotation expects NAME=FILE (NAME alone reads JSONL rows), got {item!r}")
    return files, from_rows


@dataclass
class InputLine:
    """One input line: its source, and what goes with it (the JSONL row's target side, its annotations, the
    reference of each --references file, the --prefix line)."""

    source: str
    row_reference: str | None = None
    annotations: dict = field(default_factory=dict)
    references: list[str] = field(default_factory=list)
    prefix: str | None = None
    constraints: tuple = ()  # the --constraints line's (`constraints.parse_constraints`)


_END = object()


def _zip_aligned(label: str, main: Iterator, others: dict[str, Iterator]) -> Iterator[tuple]:
    """(item of `main`, {name: line of each other file}) pairs; a file with fewer or more lines than `main` raises a
    DataError naming both (the counts were compared before the model loaded where the input is a file)."""
    count = 0
    for item in main:
        values = {}
        for name, lines in others.items():
            value = next(lines, _END)
            if value is _END:
                raise DataError(f"{label} has more lines than {name} ({count}); line {count + 1} has no counterpart.")
            values[name] = value
        count += 1
        yield item, values
    for name, lines in others.items():
        if next(lines, _END) is not _END:
            raise DataError(f"{label} has {count} lines but {name} has more; line {count + 1} has no counterpart.")


def _row_item(args: argparse.Namespace, plan, line: str, where: str) -> InputLine:
    """The `InputLine` of one JSONL row (its source, reference and per-row annotations)."""
    obj = parse_jsonl_line(line, where)
    if "source" in obj and isinstance(obj.get("hypotheses"), list):
        raise nbest_error(where)
    source, lang, reference = _row_source(obj, where, args.src_lang, plan.tgt_lang)
    if lang is not None:
        plan.source_langs.add(lang)
    item = InputLine(source, reference)
    for name in plan.annotations_from_rows:
        value = obj.get(name)
        if isinstance(value, dict):
            value = value.get(lang) if lang is not None else None
        if value is None and source.strip():
            raise DataError(
                f'{where}: no {name!r} for the source (expected "{name}": value or {{"{lang or "lang"}": value}}).'
            )
        item.annotations[name] = value
    return item


def parse_line(line: str, path: str, number: int) -> tuple[tuple[str, ...], ...]:
    """The constraints of line `number` of a constraints file (a DataError naming FILE:LINE and the phrase)."""
    try:
        return parse_constraints(line, f"--constraints {path}:{number}")
    except ValueError as error:
        raise DataError(str(error)) from None


def iter_input(
    args: argparse.Namespace,
    plan,
    lines: Iterator[str],
    select: Callable[[int], bool] | None = None,
    references: bool = True,
) -> Iterator[InputLine]:
    """The input lines with their references, annotations and prefixes, read lazily (see the module docstring).
    `plan`: the translate command's `Plan` (the input's kind and name, the annotation files and names, the target
    language; the JSONL rows' source languages are added to its `source_langs`). `select(index)` (0-based line
    index): only the lines it accepts are parsed and yielded, as `(index, InputLine)` pairs (the others are read past
    unparsed); `references`: False leaves the --references files unread. A line of an n-best JSON Lines output is
    refused, naming it."""
    others = {f"--prefix {args.prefix}": iter_lines(args.prefix)} if args.prefix else {}
    constraints = getattr(args, "constraints", None)
    if constraints:
        others[f"--constraints {constraints}"] = iter_lines(constraints)
    reference_files = list(args.references or []) if references else []
    for path in reference_files:
        others[f"--references {path}"] = iter_lines(path)
    for name, path in plan.annotation_files.items():
        others[f"--source_annotation {name}={path}"] = iter_lines(path)
    for number, (line, values) in enumerate(_zip_aligned(plan.input_label, lines, others), 1):
        if select is not None and not select(number - 1):
            continue
        where = f"{plan.input_label}:{number}"
        if plan.jsonl:
            item = _row_item(args, plan, line, where)
        else:
            check_not_nbest(line, where)
            item = InputLine(line)
        for name, path in plan.annotation_files.items():
            item.annotations[name] = values[f"--source_annotation {name}={path}"]
        item.references = [values[f"--references {path}"] for path in reference_files]
        if args.prefix:
            item.prefix = values[f"--prefix {args.prefix}"]
        if constraints:
            item.constraints = parse_line(values[f"--constraints {constraints}"], constraints, number)
        yield item if select is None else (number - 1, item)


def stdin_lines(reader: LineReader) -> Iterator[str]:
    """The lines of a `LineReader` over stdin, a bad line as a `DataError`."""
    try:
        yield from reader
    except ValueError as err:
        raise DataError(str(err)) from None
