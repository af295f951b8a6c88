"""Command-line flags generated from `DecodeOptions`' field metadata (`requests.OptionSpec`), the way fairseq builds
its flags from its dataclass configs: one definition of each decoding option (type, range, default, help) for the
translate and score commands, training's evaluation settings and the server's request schema, which cannot drift.

    add_option_flags(parser)                                         # every option, grouped as OptionSpec.group says
    add_option_flags(group, ["num_beams", "length_penalty"], defaults={"num_beams": 4})   # a subset, other defaults
    options = options_from_args(args)                                # a DecodeOptions of the parsed flags

A flag is `--<field name>`; a bool option is a switch (`--do_sample`); numbers are checked at parse time against the
option's range (argparse exits with status 2 naming the flag and the range: `argument --num_beams: expected an
integer >= 1, got '0'`). Defaults are the `DecodeOptions` defaults (None: the model's saved choice) unless given.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .requests import DecodeOptions, OptionSpec, option_specs

GROUP_TITLES = {
    "decoding": "decoding (default: the model's saved generation config)",
    "sampling": "sampling",
    "lengths": "lengths",
    "outputs": "outputs",
}


def flag_type(spec: OptionSpec) -> Callable[[str], Any]:
    """An argparse `type=` parsing a number of `spec`'s kind within its range."""

    def parse(text: str):
        try:
            value = spec.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {spec.range_text()}, got {text!r}") from None
        if spec.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if spec.problem(value):
            raise argparse.ArgumentTypeError(f"expected {spec.range_text()}, got {text!r}")
        return value

    parse.__name__ = "integer" if spec.kind is int else "number"
    return parse


def add_option_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Sequence[str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    aliases: Mapping[str, Iterable[str]] | None = None,
    helps: Mapping[str, str] | None = None,
) -> list[str]:
    """Add a flag per `DecodeOptions` field in `names` (default: all of them) to `parser`. A parser gets one argument
    group per `OptionSpec.group`; an argument group (training's "evaluation") takes them as they come. `defaults`,
    `aliases` (extra flag names) and `helps` (extra help text, appended) per field. Returns the names added."""
    specs = option_specs()
    names = list(specs) if names is None else list(names)
    unknown = [name for name in names if name not in specs]
    if unknown:
        raise ValueError(f"not DecodeOptions fields: {unknown}")
    defaults, aliases, helps = dict(defaults or {}), dict(aliases or {}), dict(helps or {})
    groups: dict[str, Any] = {}
    for name in names:
        spec = specs[name]
        target = parser
        if isinstance(parser, argparse.ArgumentParser):
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(GROUP_TITLES.get(spec.group, spec.group))
            target = groups[spec.group]
        flags = [f"--{name}", *aliases.get(name, ())]
        text = spec.help + (f"; {helps[name]}" if name in helps else "")
        default = defaults.get(name, DecodeOptions.__dataclass_fields__[name].default)
        if spec.kind is bool:
            target.add_argument(*flags, dest=name, action="store_true", default=bool(default), help=text)
        else:
            target.add_argument(*flags, dest=name, type=flag_type(spec), default=default, help=text)
    return names


def options_from_args(args: argparse.Namespace, **changes: Any) -> DecodeOptions:
    """The `DecodeOptions` of the parsed flags (fields without a flag keep their defaults), with `changes`."""
    values = {name: getattr(args, name) for name in option_specs() if hasattr(args, name)}
    values.update(changes)
    return DecodeOptions(**values)


__all__ = ["GROUP_TITLES", "add_option_flags", "flag_type", "options_from_args"]
