"""Glossaries: source terms and the target terms their translation must use, applied as lexical constraints.

    glossary = Glossary.load("glossary.tsv", ignore_case=True)   # source term <TAB> target term (forms: a|b)
    glossary.constraints_for("Proceed to Checkout.")             # (("Kasse", "Kassenbereich"),)
    request = glossary.apply(TranslationRequest("Proceed to Checkout."))  # the request with those constraints
    glossary.check("Proceed to Checkout.", "Weiter zur Kasse.")  # [TermCheck(source="checkout", found=True, ...)]

A glossary file is UTF-8 text, one term a line: the source term, a tab, the target term; several acceptable target
forms are separated by `|` (`checkout<TAB>Kasse|Kassenbereich`: one of them must appear). Blank lines are skipped;
anything else that is not such a line is refused with the file and line (`GlossaryError`): a missing or an extra
field, an empty term or form, bytes that are not UTF-8, a source term given twice with different targets (under the
glossary's matching: with `ignore_case`, "Checkout" and "checkout" are one term).

Matching (`find`, `constraints_for`, `check`): a term applies to a sentence where its text appears in it, runs of
whitespace counting as one space; `ignore_case` compares lower-cased text (default: exact case); `whole_word`
(the default) only where the match neither starts nor ends inside a word (a letter, digit or `_` on both sides of
its edge: "cat" does not apply to "category"; turn it off for compounding languages, where "Kasse" should apply
to "Kassenbereich"). Overlapping terms: the longest match at the leftmost position wins ("credit card" over
"card"), matches do not overlap. A term applies once per sentence however often it occurs, and its target term
becomes one constraint of the sentence; `check` tells per applied term whether the output contains one of its
target forms, matched the same way. The share of applied terms found is the WMT terminology task's term accuracy
(`hf_variants.training.evaluation.term_accuracy`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .constraints import FORM_SEPARATOR, normalize_constraints
from .requests import TranslationRequest

__all__ = ["Glossary", "GlossaryError", "Term", "TermCheck"]


class GlossaryError(ValueError):
    """A glossary file or term list that cannot be read: the message names the file and line (or the term)."""


@dataclass(frozen=True)
class Term:
    """One glossary entry: `source` term, its acceptable `targets` (forms, one of which must appear), and the
    `line` of its file (None: not from a file)."""

    source: str
    targets: tuple[str, ...]
    line: int | None = None


@dataclass
class TermCheck:
    """A glossary term that applied to a sentence, and whether the translation contains one of its target forms
    (`found`; `form`: the first form found, else None)."""

    source: str
    targets: tuple[str, ...]
    found: bool
    form: str | None = None

    def to_dict(self) -> dict:
        """{"source", "target" (its forms), "found"}: the JSON record of one applied term."""
        return {"source": self.source, "target": list(self.targets), "found": self.found}


# ------------------------------------------------------------------------------------------------------ matching
def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def _normalized(text: str, ignore_case: bool) -> tuple[str, list[int]]:
    """`text` with each run of whitespace as one space (and lower-cased with `ignore_case`, character by character,
    so that positions map back), and each normalized character's position in `text`."""
    chars, positions = [], []
    previous_space = False
    for i, c in enumerate(text):
        if c.isspace():
            if not previous_space:
                chars.append(" ")
                positions.append(i)
            previous_space = True
            continue
        previous_space = False
        lower = c.lower() if ignore_case else c
        chars.append(lower if len(lower) == 1 else c)
        positions.append(i)
    return "".join(chars), positions


def _key(term: str, ignore_case: bool) -> str:
    return _normalized(term.strip(), ignore_case)[0]


def _at_boundary(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] neither starts nor ends inside a word."""
    if start > 0 and _word_char(text[start - 1]) and _word_char(text[start]):
        return False
    return not (end < len(text) and _word_char(text[end - 1]) and _word_char(text[end]))


class Glossary:
    """Source terms -> target terms (see the module docstring). `terms`: `Term`s or (source, target) pairs, the
    target a string (forms separated by `|`) or a sequence of forms."""

    def __init__(self, terms: Iterable, *, ignore_case: bool = False, whole_word: bool = True, name: str = "terms"):
        self.ignore_case, self.whole_word, self.name = bool(ignore_case), bool(whole_word), name
        self.terms: list[Term] = []
        self._by_key: dict[str, Term] = {}
        self._trie: dict = {}
        self._tries: list[dict] = [self._trie]  # where `find` matches: own first (`with_terms`: then the base's)
        for i, item in enumerate(terms):
            term = item if isinstance(item, Term) else _term_of_pair(item, f"{name}[{i}]")
            self._add(term, f"{name}:{term.line}" if term.line is not None else f"{name}[{i}]")

    def _add(self, term: Term, where: str) -> None:
        key = _key(term.source, self.ignore_case)
        known = self._by_key.get(key)
        if known is not None:
            if known.targets != term.targets:
                first = f"line {known.line}" if known.line is not None else "an earlier entry"
                raise GlossaryError(
                    f"{where}: the source term {term.source!r} is given twice with different targets ({first}: "
                    f"{FORM_SEPARATOR.join(known.targets)!r}, here: {FORM_SEPARATOR.join(term.targets)!r}); give "
                    "one target per term (its acceptable forms separated by |)"
                )
            return
        self._by_key[key] = term
        self.terms.append(term)
        node = self._trie
        for c in key:
            node = node.setdefault(c, {})
        node[None] = term

    @classmethod
    def load(cls, path: str | Path, *, ignore_case: bool = False, whole_word: bool = True) -> Glossary:
        """The glossary of a TSV file (see the module docstring); a `GlossaryError` names the file and line of the
        first line it cannot read."""
        path = Path(path)
        data = path.read_bytes()
        terms = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise GlossaryError(f"{where}: not UTF-8 (byte {error.start + 1} of the line)") from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            line = line.rstrip("\r")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise GlossaryError(
                    f"{where}: expected 2 tab-separated fields (source term, target term), got {len(fields)}"
                )
            terms.append(_term_of_pair((fields[0], fields[1]), where, number))
        if not terms:
            raise GlossaryError(f"{path}: no terms (one a line: source term<TAB>target term)")
        return cls(terms, ignore_case=ignore_case, whole_word=whole_word, name=str(path))

    def with_terms(self, terms: Iterable, name: str = "glossary") -> Glossary:
        """A glossary of `terms` (as the constructor takes them) over this one, with its matching options: this
        glossary's terms apply too, but where `terms` give a source term again, their target replaces this
        glossary's (a request's own glossary over a server's). This glossary is shared, not copied: building it
        costs only `terms`."""
        overlay = Glossary(terms, ignore_case=self.ignore_case, whole_word=self.whole_word, name=name)
        overlay._tries = [overlay._trie, *self._tries]
        kept = [term for term in self.terms if _key(term.source, self.ignore_case) not in overlay._by_key]
        overlay.terms = overlay.terms + kept
        return overlay

    def __len__(self) -> int:
        return len(self.terms)

    def __iter__(self):
        return iter(self.terms)

    # ---------------------------------------------------------------------------------------------- matching
    def find(self, text: str) -> list[Term]:
        """The terms that apply to `text`, each once, in the order of their first match (leftmost-longest,
        non-overlapping matches, see the module docstring)."""
        normalized, _ = _normalized(text, self.ignore_case)
        found: dict[str, Term] = {}
        i = 0
        while i < len(normalized):
            if self.whole_word and i > 0 and _word_char(normalized[i - 1]) and _word_char(normalized[i]):
                i += 1
                continue
            longest, end = self._longest_at(normalized, i)
            if longest is None:
                i += 1
                continue
            found.setdefault(_key(longest.source, self.ignore_case), longest)
            i = end
        return list(found.values())

    def _longest_at(self, normalized: str, i: int) -> tuple[Term | None, int]:
        """The longest term matching at position i of a normalized text and the end of its match (None, i: none);
        a term of an earlier trie wins over one of equal length in a later one (`with_terms`)."""
        longest, end = None, i
        for trie in self._tries:
            node = trie
            for j in range(i, len(normalized)):
                node = node.get(normalized[j])
                if node is None:
                    break
                if None in node and j + 1 > end and (not self.whole_word or _at_boundary(normalized, i, j + 1)):
                    longest, end = node[None], j + 1
        return longest, end

    def contains(self, text: str, forms: Sequence[str]) -> str | None:
        """The first of `forms` that `text` contains under the glossary's matching, or None."""
        normalized, _ = _normalized(text, self.ignore_case)
        for form in forms:
            key = _key(form, self.ignore_case)
            start = normalized.find(key)
            while start >= 0:
                if not self.whole_word or _at_boundary(normalized, start, start + len(key)):
                    return form
                start = normalized.find(key, start + 1)
        return None

    def constraints_for(self, source: str) -> tuple[tuple[str, ...], ...]:
        """The constraints the glossary adds to a source sentence: the target forms of each term that applies."""
        return tuple(term.targets for term in self.find(source))

    def apply(self, request: TranslationRequest | str) -> TranslationRequest:
        """`request` with the glossary's constraints for its source added after its own (a constraint it already
        has is not added again)."""
        request = TranslationRequest.of(request)
        own = normalize_constraints(request.constraints)
        added = tuple(c for c in self.constraints_for(request.source) if c not in own)
        return replace(request, constraints=own + added) if added or own != request.constraints else request

    def check(self, source: str, output: str) -> list[TermCheck]:
        """Per term that applies to `source`: whether `output` (its translation) contains one of its targets."""
        checks = []
        for term in self.find(source):
            form = self.contains(output, term.targets)
            checks.append(TermCheck(term.source, term.targets, form is not None, form))
        return checks


def _term_of_pair(item, where: str, line: int | None = None) -> Term:
    """A `Term` from (source, target): the target a string (forms separated by |) or a sequence of forms."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise GlossaryError(f"{where}: expected (source term, target term), got {item!r}")
    source, target = item
    if not isinstance(source, str) or not source.strip():
        raise GlossaryError(f"{where}: an empty source term")
    if isinstance(target, str) and not target.strip():
        raise GlossaryError(f"{where}: an empty target term")
    forms = target.split(FORM_SEPARATOR) if isinstance(target, str) else target
    if not isinstance(forms, (tuple, list)) or not forms:
        raise GlossaryError(f"{where}: expected a target term (forms separated by |), got {target!r}")
    for k, form in enumerate(forms):
        if not isinstance(form, str) or not form.strip() or "\n" in form:
            raise GlossaryError(f"{where}: form {k + 1} of the target term {target!r} is empty or not one line")
    (targets,) = normalize_constraints([tuple(forms)])
    return Term(" ".join(source.split()), targets, line)
