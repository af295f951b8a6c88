"""Lexical constraints: target phrases a translation must contain (a request's `constraints`).

    TranslationRequest("Proceed to checkout.", constraints=("Kasse",))                  # one phrase
    TranslationRequest("Proceed to checkout.", constraints=(("Kasse", "Kassenbereich"),))  # one of two forms
    parse_constraints("Kasse|Kassenbereich\tWarenkorb")   # the file format: tab between phrases, | between forms

A request's constraints are a sequence; each item is one constraint: a phrase (str), or a tuple of alternative
forms of it (a disjunctive constraint: any one form meets it). `normalize_constraints` checks them and returns
them as a tuple of tuples of forms, which is what the translation core works with.

`ConstraintTracker` is the token-level side used by the constrained beam search (`constrained`): each form as the
subword ids it tokenizes to (without special tokens), and for any hypothesis a small hashable state: which
constraints its tokens already contain (a bit mask) and the longest end of its tokens that begins an unmet form
(the constraint in progress). `advance(state, token)` is the state after one more token (an Aho-Corasick-like
step: a form counts wherever its tokens appear contiguously, whether the search placed them or the model chose
them); `bank(state)` the number of constraint tokens met, which dynamic beam allocation splits the beam by;
`next_tokens(state)` the tokens that would bring the hypothesis closer to meeting a constraint. Transitions are
memoized per tracker (a sentence's hypotheses share few distinct states).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ConstraintTracker", "format_constraint", "normalize_constraints", "parse_constraints"]

FORM_SEPARATOR = "|"  # between the alternative forms of one constraint, in the file format
PHRASE_SEPARATOR = "\t"  # between the constraints of one line, in the file format


def _form(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: an empty phrase")
    if "\n" in value or "\r" in value:
        raise ValueError(f"{where}: one line expected (it contains a line break)")
    return value.strip()


def normalize_constraints(value: Any, field: str = "constraints") -> tuple[tuple[str, ...], ...]:
    """`value` (a request's constraints: a list or tuple whose items are phrases or tuples / lists of alternative
    forms) as a tuple of constraints, each the tuple of its forms (surrounding whitespace stripped, repeated forms
    kept once). None or empty: no constraints. A ValueError names the item at fault (`constraints[1][0]: an empty
    phrase`): not a sequence (a bare string is refused, since it would be read one character a constraint), a form
    that is not a string, empty or spans lines, a constraint without forms."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise ValueError(
            f"{field}: expected a list of phrases, got a string (one phrase is ({value!r},); alternative forms of "
            f"one constraint are a tuple of strings)"
        )
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field}: expected a list of phrases, got {type(value).__name__}")
    constraints = []
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if isinstance(item, str):
            constraints.append((_form(item, where),))
            continue
        if not isinstance(item, (list, tuple)):
            raise ValueError(f"{where}: expected a phrase or a tuple of alternative forms, got {type(item).__name__}")
        if not item:
            raise ValueError(f"{where}: a constraint without any form")
        forms = [_form(form, f"{where}[{j}]") for j, form in enumerate(item)]
        constraints.append(tuple(dict.fromkeys(forms)))
    return tuple(constraints)


def parse_constraints(line: str, where: str = "constraints") -> tuple[tuple[str, ...], ...]:
    """The constraints of one line of a constraints file: phrases separated by tabs, the alternative forms of a
    phrase by `|` (`Kasse|Kassenbereich<TAB>Warenkorb`); an empty line: none. Errors name `where` (e.g. the file
    and line) and the phrase."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return ()
    items = [tuple(part.split(FORM_SEPARATOR)) for part in line.split(PHRASE_SEPARATOR)]
    try:
        return normalize_constraints(items)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def format_constraint(forms: Sequence[str]) -> str:
    """One constraint as written in the file format and in messages: its forms joined by `|`."""
    return FORM_SEPARATOR.join(forms)


# ------------------------------------------------------------------------------------------------- token level
State = tuple[int, tuple[int, ...]]  # (bit mask of the constraints met, the tokens of the constraint in progress)


class ConstraintTracker:
    """The constraints of one sentence as token ids (`forms[j]`: the id sequences of constraint j's forms), and
    the search's per-hypothesis state (see the module docstring)."""

    def __init__(self, forms: Sequence[Sequence[Sequence[int]]]):
        self.forms = [[tuple(ids) for ids in alternatives] for alternatives in forms]
        for j, alternatives in enumerate(self.forms):
            if not alternatives or any(not ids for ids in alternatives):
                raise ValueError(f"constraints[{j}]: a form without tokens")
        self.count = len(self.forms)
        # the tokens that meet constraint j at the least (its shortest form): its weight in the banks
        self.sizes = [min(len(ids) for ids in alternatives) for alternatives in self.forms]
        self.total = sum(self.sizes)
        self.full = (1 << self.count) - 1
        self.start: State = (0, ())
        self._tokens = {token for alternatives in self.forms for ids in alternatives for token in ids}
        self._after: dict[tuple[State, int], State] = {}
        self._next: dict[State, list[int]] = {}
        self._bank: dict[State, int] = {}

    def _unmet_forms(self, met: int):
        for j, alternatives in enumerate(self.forms):
            if not met >> j & 1:
                for ids in alternatives:
                    yield j, ids

    def advance(self, state: State, token: int) -> State:
        """The state after `token`."""
        if token not in self._tokens:  # most tokens: in no form, so no constraint in progress after them
            return (state[0], ()) if state[1] else state
        key = (state, token)
        after = self._after.get(key)
        if after is None:
            after = self._advance(state, token)
            self._after[key] = after
        return after

    def _advance(self, state: State, token: int) -> State:
        met, tail = state
        window = (*tail, token)
        completed = True
        while completed:  # a form ending here meets its constraint (several may end at once)
            completed = False
            for j, ids in self._unmet_forms(met):
                if len(ids) <= len(window) and window[len(window) - len(ids) :] == ids:
                    met |= 1 << j
                    completed = True
        # the longest end of the window that begins (and is shorter than) a form of an unmet constraint
        for length in range(len(window), 0, -1):
            end = window[len(window) - length :]
            if any(len(ids) > length and ids[:length] == end for _, ids in self._unmet_forms(met)):
                return met, end
        return met, ()

    def next_tokens(self, state: State) -> list[int]:
        """The tokens that continue the constraint in progress or begin an unmet constraint."""
        tokens = self._next.get(state)
        if tokens is None:
            met, tail = state
            found = set()
            for _, ids in self._unmet_forms(met):
                found.add(ids[0])
                if tail and len(ids) > len(tail) and ids[: len(tail)] == tail:
                    found.add(ids[len(tail)])
            tokens = self._next[state] = sorted(found)
        return tokens

    def bank(self, state: State) -> int:
        """The constraint tokens a hypothesis in `state` has met: each met constraint's size (its shortest form's
        tokens) plus the tokens of the one in progress (below that constraint's size)."""
        bank = self._bank.get(state)
        if bank is None:
            met, tail = state
            bank = sum(size for j, size in enumerate(self.sizes) if met >> j & 1)
            if tail:
                bank += max(
                    min(len(tail), self.sizes[j] - 1)
                    for j, ids in self._unmet_forms(met)
                    if len(ids) > len(tail) and ids[: len(tail)] == tail
                )
            self._bank[state] = bank
        return bank

    def all_met(self, state: State) -> bool:
        return state[0] == self.full

    def met_count(self, state: State) -> int:
        return bin(state[0]).count("1")

    def met(self, state: State) -> list[bool]:
        """Per constraint, whether it is met in `state`."""
        return [bool(state[0] >> j & 1) for j in range(self.count)]

    def state_of(self, token_ids: Sequence[int]) -> State:
        """The state after `token_ids` from the start."""
        state = self.start
        for token in token_ids:
            state = self.advance(state, token)
        return state
