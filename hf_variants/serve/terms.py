"""Terminology in `POST /translate`: a request's `constraints` and `glossary` fields, and the server's glossary.

- `constraints`: target phrases each translation must contain (lexically constrained decoding). For a `text` that
  is one sentence, a list of constraints; for a list of sentences, a list of such lists, one per sentence (`[]` or
  null: none). A constraint is a phrase, or a list of alternative forms of which one must appear
  (`["Kasse", ["Warenkorb", "Einkaufswagen"]]`). Not with `split_sentences` (an item's sentences are not known to
  the client): send the sentences as items.
- `glossary`: source term -> target term, applied to every sentence of the request (a term found in a sentence adds
  its target term to the sentence's constraints): a list of `{"source": ..., "target": ...}` objects or one object
  `{source: target}`; a target is a string (alternative forms separated by `|`) or a list of forms. It adds to the
  server's own glossary (`--glossary FILE`), which applies to every request (LibreTranslate's included); where both
  give a source term, the request's target wins. Matching: the server's (`--glossary_ignore_case`,
  `--glossary_substring`; default case-sensitive, whole words).

Limits (each refusal names the field and the limit): `--max_constraints` per sentence (its own and its glossary
terms', 422), `--max_constraint_chars` per phrase, form or term (422), `--max_glossary_terms` per request (413).
Everything else the translation core refuses (a phrase the vocabulary cannot spell, constraints that cannot fit the
sentence's output limit, an engine without constrained decoding, sampling) is a 422 naming the item, found before
the request is queued, so a bad request never fails a batch it would share.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..inference.constraints import FORM_SEPARATOR, normalize_constraints
from ..inference.glossary import Glossary, GlossaryError
from .limits import ApiError, ServeLimits, check_sentence, limit_error

TERM_FIELDS = ("constraints", "glossary")


@dataclass(frozen=True)
class ServerTerms:
    """The server's glossary (`--glossary FILE`, None: none) and the matching of every glossary it applies."""

    glossary: Glossary | None = None
    ignore_case: bool = False
    whole_word: bool = True

    def for_request(self, pairs: list | None) -> Glossary | None:
        """The glossary of a request: the server's, with the request's own terms over it (`pairs`: as
        `parse_glossary` returned them; None: the request has no `glossary` field). A 422 names a term given twice
        with different targets."""
        if pairs is None:
            return self.glossary
        try:
            if self.glossary is not None:
                return self.glossary.with_terms(pairs)
            return Glossary(pairs, ignore_case=self.ignore_case, whole_word=self.whole_word, name="glossary")
        except GlossaryError as error:
            name = re.match(r"glossary\[\d+\]", str(error))
            field = name.group() if name else "glossary"
            raise ApiError(422, "invalid_request", str(error), field=field) from None


# ---------------------------------------------------------------------------------------------------- parsing
def _named(error: ValueError, fallback: str) -> ApiError:
    """A 422 from a ValueError whose message begins with the field it names (`constraints[1][0]: ...`)."""
    found = re.match(r"(\w+(?:\[[^\]]*\])*): (.*)$", str(error), re.S)
    if found is None:
        return ApiError(422, "invalid_request", str(error), field=fallback)
    return ApiError(422, "invalid_request", f"`{found.group(1)}`: {found.group(2)}", field=found.group(1))


def _check_phrase(form: str, name: str, limits: ServeLimits) -> None:
    check_sentence(form, name)
    if len(form) > limits.max_constraint_chars:
        raise limit_error(
            422,
            "max_constraint_chars",
            limits.max_constraint_chars,
            f"`{name}` is {len(form)} characters long; this server takes phrases and terms of at most "
            f"{limits.max_constraint_chars} characters (--max_constraint_chars)",
            field=name,
        )


def _sentence_constraints(value: Any, name: str, limits: ServeLimits) -> tuple[tuple[str, ...], ...]:
    try:
        constraints = normalize_constraints(value, name)
    except ValueError as error:
        raise _named(error, name) from None
    if len(constraints) > limits.max_constraints:
        raise limit_error(
            422,
            "max_constraints",
            limits.max_constraints,
            f"`{name}` holds {len(constraints)} constraints; this server takes at most {limits.max_constraints} a "
            "sentence (--max_constraints)",
            field=name,
        )
    items = value if isinstance(value, (list, tuple)) else []
    for j, forms in enumerate(constraints):
        for k, form in enumerate(forms):
            _check_phrase(form, f"{name}[{j}]" if isinstance(items[j], str) else f"{name}[{j}][{k}]", limits)
    return constraints


def parse_constraints(value: Any, texts: list[str], single: bool, split: bool, limits: ServeLimits) -> list | None:
    """The request's `constraints` per item (each a tuple of constraints, each the tuple of its forms), or None
    without the field; a 422 naming the item (`constraints[2][0]`)."""
    if value is None:
        return None
    if split:
        raise ApiError(
            422,
            "invalid_request",
            "`constraints` are per sentence and `split_sentences` splits the items into sentences the request does "
            "not know: send the sentences as items (a glossary applies to split items)",
            field="constraints",
        )
    if single:
        return [_sentence_constraints(value, "constraints", limits)]
    if not isinstance(value, list):
        raise ApiError(
            422,
            "invalid_request",
            f"`constraints` must be a list with one list of constraints per item of `text`, got {_kind(value)}",
            field="constraints",
        )
    if len(value) != len(texts):
        raise ApiError(
            422,
            "invalid_request",
            f"`constraints` has {len(value)} lists for the {len(texts)} items of `text`: one per item ([] for none)",
            field="constraints",
        )
    return [_sentence_constraints(item, f"constraints[{i}]", limits) for i, item in enumerate(value)]


def _kind(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _target(value: Any, name: str, limits: ServeLimits) -> tuple[str, ...]:
    forms = value.split(FORM_SEPARATOR) if isinstance(value, str) else value
    if not isinstance(forms, list) or not forms:
        raise ApiError(
            422,
            "invalid_request",
            f"`{name}` must be a target term (a string, forms separated by |, or a list of forms), got {_kind(value)}",
            field=name,
        )
    for k, form in enumerate(forms):
        where = name if isinstance(value, str) else f"{name}[{k}]"
        if not isinstance(form, str) or not form.strip():
            raise ApiError(422, "invalid_request", f"`{where}`: an empty or non-string form", field=where)
        _check_phrase(form.strip(), where, limits)
    return tuple(form.strip() for form in forms)


def parse_glossary(value: Any, limits: ServeLimits) -> list | None:
    """The request's `glossary` as (source term, target forms) pairs, or None without the field; a 422 naming the
    term (`glossary[3].target`, `glossary["checkout"]`), a 413 over `--max_glossary_terms`."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = [(f"glossary[{json.dumps(key, ensure_ascii=False)}]", key, target) for key, target in value.items()]
    elif isinstance(value, list):
        items = []
        for i, entry in enumerate(value):
            if not isinstance(entry, dict) or set(entry) != {"source", "target"}:
                raise ApiError(
                    422,
                    "invalid_request",
                    f'`glossary[{i}]` must be {{"source": ..., "target": ...}}, got {_kind(entry)}',
                    field=f"glossary[{i}]",
                )
            items.append((f"glossary[{i}]", entry["source"], entry["target"]))
    else:
        raise ApiError(
            422,
            "invalid_request",
            f'`glossary` must be a list of {{"source", "target"}} objects or an object {{source: target}}, got '
            f"{_kind(value)}",
            field="glossary",
        )
    if len(items) > limits.max_glossary_terms:
        raise limit_error(
            413,
            "max_glossary_terms",
            limits.max_glossary_terms,
            f"`glossary` holds {len(items)} terms; this server takes at most {limits.max_glossary_terms} a request "
            "(--max_glossary_terms)",
            field="glossary",
        )
    pairs = []
    for name, source, target in items:
        source_name = name if isinstance(value, dict) else f"{name}.source"
        if not isinstance(source, str) or not source.strip():
            raise ApiError(422, "invalid_request", f"`{source_name}`: an empty or non-string term", field=source_name)
        _check_phrase(source.strip(), source_name, limits)
        pairs.append((source, _target(target, name if isinstance(value, dict) else f"{name}.target", limits)))
    return pairs


# ------------------------------------------------------------------------------------------------- per sentence
def sentence_constraints(
    parsed, sentences: list[str], owners: list[int], glossary: Glossary | None, limits: ServeLimits
) -> list[tuple]:
    """Each sentence's constraints: its item's own (`parsed.constraints`), then its glossary terms' (a constraint
    already there is not added again); a 422 naming `glossary` where the terms take a sentence over
    `--max_constraints`."""
    out = []
    for sentence, owner in zip(sentences, owners):
        own = parsed.constraints[owner] if parsed.constraints is not None else ()
        if glossary is None:
            out.append(own)
            continue
        added = tuple(c for c in glossary.constraints_for(sentence) if c not in own)
        if len(own) + len(added) > limits.max_constraints:
            raise limit_error(
                422,
                "max_constraints",
                limits.max_constraints,
                f"`{item_name(parsed, owner)}`: its glossary terms make {len(own) + len(added)} constraints for one "
                f"sentence; this server takes at most {limits.max_constraints} (--max_constraints)",
                field="glossary",
            )
        out.append(own + added)
    return out


def item_name(parsed, item: int) -> str:
    return "text" if parsed.single else f"text[{item}]"


def core_refusal(error: ValueError, parsed, owners: list[int], own_counts: list[int]) -> ApiError:
    """The translation core's refusal of sentence k (`requests[k]: constraints[j]: ...`) as a 422 naming the
    request's field: `constraints[i][j]` (`constraints[j]` for one sentence) for its own constraint j, `glossary`
    for one its glossary terms added, `constraints[i]` (or `glossary`) for constraints that cannot fit together;
    an `OptionError` (the engine, sampling) names the option, else `constraints` or `glossary`."""
    message = str(error)
    found = re.match(r"requests\[(\d+)\]: constraints((?:\[\d+\])*): (.*)$", message, re.S)
    if found is None:
        names = [n for n in getattr(error, "names", ()) if n not in TERM_FIELDS]
        field = names[0] if names else "constraints" if parsed.constraints is not None else "glossary"
        if not parsed.terms:  # the constraints came from the server's glossary alone
            message += " (the server's glossary gives this request constraints: its terms apply to every request)"
        return ApiError(422, "invalid_request", message, field=field)
    k, where, rest = int(found.group(1)), found.group(2), found.group(3)
    own = own_counts[k]
    prefix = "constraints" if parsed.single else f"constraints[{owners[k]}]"
    if where:
        field = f"{prefix}{where}" if int(where[1:].split("]")[0]) < own else "glossary"
    else:
        field = prefix if own else "glossary"
    context = f" (a term's target, for `{item_name(parsed, owners[k])}`)" if field == "glossary" else ""
    return ApiError(422, "invalid_request", f"`{field}`{context}: {rest}", field=field)


def item_record(result, glossary: Glossary | None) -> dict:
    """What an item's object adds: `constraints`, `unmet_constraints` (when any) and with a glossary `glossary`."""
    record: dict = {}
    if result.constraints:
        record["constraints"] = [list(forms) for forms in result.constraints]
        record["unmet_constraints"] = [list(forms) for forms in result.unmet_constraints]
    if glossary is not None:
        record["glossary"] = [check.to_dict() for check in glossary.check(result.source, result.text)]
    return record
