"""Phrase partitions for MG-SA (Hao et al., EMNLP 2019): n-gram phrases and syntactic phrases from a parse tree.

The data side of the model, shipped with it (the modeling file imports it): pure Python and torch, no parser and
no nltk needed (an `nltk.Tree` is accepted where a parse is expected, but nltk is never imported).

- `ngram_phrase_index(attention_mask, sizes)`: non-overlapping n-grams counted on each sentence's real tokens
  (padding never joins a phrase), as a [B, G, T] tensor of phrase ids (-1 = no phrase).
- `read_bracketed(text)`: a small reader for bracketed constituency parses (Penn Treebank / Stanford parser
  output: `(ROOT (S (NP (NNP Bush)) (VP ...)))`).
- `syntactic_levels(tree, levels)`: the top-K levels of the tree as phrase partitions of its leaves, with the
  constituent label of every phrase (docs/variants-spec.md §3.2a: level 1 = children of the top clause node, ROOT and
  unary chains skipped; level k = children of the level k-1 nodes; pre-terminals carried down unchanged).
- `align_leaves(text, leaves)` / `token_leaves(...)`: the character span of every leaf in the sentence and the
  leaf of every subword token (a word's pieces share its phrase; special tokens belong to no phrase). A clear
  `ValueError` names the sentence position where a parse does not match its sentence.
- `syntactic_phrase_inputs(...)`: the model inputs `phrase_index` [B, levels, T] (-1 for padding and special
  tokens) and `phrase_tags` [B, levels, M] (-100 where there is no phrase or the label is not in the vocabulary).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


# Penn Treebank constituent labels (phrase level) and part-of-speech tags: the default tag vocabulary. Top parse
# levels hold phrases (NP, VP, ...) and, from level 2 on, pre-terminals carried down (NNP, VBD, ...).
PTB_PHRASE_LABELS = (
    "S", "SBAR", "SBARQ", "SINV", "SQ", "ADJP", "ADVP", "CONJP", "FRAG", "INTJ", "LST", "NAC", "NP", "NX", "PP",
    "PRN", "PRT", "QP", "RRC", "UCP", "VP", "WHADJP", "WHADVP", "WHNP", "WHPP", "X",
)
PTB_POS_TAGS = (
    "CC", "CD", "DT", "EX", "FW", "IN", "JJ", "JJR", "JJS", "LS", "MD", "NN", "NNS", "NNP", "NNPS", "PDT", "POS",
    "PRP", "PRP$", "RB", "RBR", "RBS", "RP", "SYM", "TO", "UH", "VB", "VBD", "VBG", "VBN", "VBP", "VBZ", "WDT", "WP",
    "WP$", "WRB", "#", "$", ".", ",", ":", "``", "''", "-LRB-", "-RRB-",
)
PTB_TAG_LABELS = PTB_PHRASE_LABELS + PTB_POS_TAGS

# Leaf escapes of the Penn Treebank / Stanford parser and the characters they stand for in the sentence.
_LEAF_ESCAPES = {
    "-LRB-": ("(",), "-RRB-": (")",), "-LSB-": ("[",), "-RSB-": ("]",), "-LCB-": ("{",), "-RCB-": ("}",),
    "``": ('"', "``", "\u201c", "'"), "''": ('"', "''", "\u201d", "'"),
}
_KEEP_LABELS = {"-LRB-", "-RRB-", "-LSB-", "-RSB-", "-LCB-", "-RCB-", "-NONE-"}


# ------------------------------------------------------------------------------------------------------- n-grams
def ngram_phrase_index(attention_mask: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Non-overlapping n-gram phrase ids [B, len(sizes), T] from a [B, T] 0/1 mask: the r-th real token of a
    sentence (r = 0, 1, ...) is in phrase r // n; padding gets -1. Counting real tokens (not positions) keeps the
    partition of a sentence independent of its padding (either side)."""
    real = attention_mask.bool()
    rank = real.long().cumsum(-1) - 1  # [B, T]
    n = torch.tensor(list(sizes), dtype=torch.long, device=rank.device)[None, :, None]
    return torch.where(real[:, None, :], rank[:, None, :] // n, torch.full_like(rank[:, None, :], -1))


# ------------------------------------------------------------------------------------------------ parse trees
@dataclass
class ParseTree:
    """A constituency tree node: `label` and `children` (subtrees or leaf strings)."""

    label: str
    children: list = field(default_factory=list)

    def leaves(self) -> list[str]:
        out: list[str] = []
        for child in self.children:
            out.extend(child.leaves() if isinstance(child, ParseTree) else [child])
        return out

    @property
    def is_preterminal(self) -> bool:
        return all(not isinstance(child, ParseTree) for child in self.children)

    def __str__(self) -> str:
        return f"({self.label} {' '.join(str(c) for c in self.children)})"


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def read_bracketed(text: str) -> ParseTree:
    """Read one bracketed parse, e.g. `(ROOT (S (NP (NNP Bush)) (VP (VBD held) ...)))`. A node without a label
    (the outer `( (S ...))` of treebank files) gets the label `""`. Raises `ValueError` on unbalanced brackets."""
    tokens = _TOKEN.findall(text)
    if not tokens or tokens[0] != "(":
        raise ValueError(f"A bracketed parse must start with '(': {text[:60]!r}")
    stack: list[ParseTree] = []
    root = None
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "(":
            label = ""
            if i + 1 < len(tokens) and tokens[i + 1] not in "()":
                label = tokens[i + 1]
                i += 1
            node = ParseTree(label)
            if stack:
                stack[-1].children.append(node)
            elif root is not None:
                raise ValueError(f"More than one tree in the parse: {text[:60]!r}")
            else:
                root = node
            stack.append(node)
        elif token == ")":
            if not stack:
                raise ValueError(f"Unbalanced ')' in the parse: {text[:60]!r}")
            stack.pop()
        else:
            if not stack:
                raise ValueError(f"Leaf {token!r} outside brackets in the parse: {text[:60]!r}")
            stack[-1].children.append(token)
        i += 1
    if stack:
        raise ValueError(f"Unbalanced '(' in the parse: {text[:60]!r}")
    return root


def as_tree(parse) -> ParseTree:
    """A `ParseTree` from a bracketed string, a `ParseTree` or an `nltk.Tree` (duck-typed: `.label()` + list)."""
    if isinstance(parse, ParseTree):
        return parse
    if isinstance(parse, str):
        return read_bracketed(parse)
    if hasattr(parse, "label") and callable(parse.label):
        return ParseTree(str(parse.label()), [as_tree(c) if not isinstance(c, str) else c for c in parse])
    raise TypeError(f"A parse must be a bracketed string, a ParseTree or an nltk.Tree, got {type(parse).__name__}.")


def base_label(label: str) -> str:
    """`NP-SBJ-1` -> `NP`, `PP=2` -> `PP` (function tags and indices dropped); `-LRB-` etc. kept."""
    if label in _KEEP_LABELS or not label:
        return label
    return re.split(r"[-=]", label, maxsplit=1)[0] or label


@dataclass
class SyntacticLevels:
    """The top-K levels of one tree: `leaves`; `leaf_phrase[k][i]` = phrase of leaf i at level k+1 (phrases
    numbered left to right from 0); `labels[k][m]` = constituent label of phrase m at level k+1 (None for a bare
    leaf)."""

    leaves: list[str]
    leaf_phrase: list[list[int]]
    labels: list[list[str | None]]


def _span(node) -> int:
    return len(node.leaves()) if isinstance(node, ParseTree) else 1


def syntactic_levels(parse, levels: int) -> SyntacticLevels:
    """Partition the leaves of `parse` by the nodes of its top `levels` levels (docs/variants-spec.md §3.2a)."""
    tree = as_tree(parse)
    top = tree
    # ROOT (or the unlabeled treebank wrapper) and unary chains are skipped down to the top clause node.
    while isinstance(top, ParseTree) and len(top.children) == 1 and isinstance(top.children[0], ParseTree):
        top = top.children[0]

    def expand(node):  # a level's node -> its nodes one level down (pre-terminals and leaves carry down)
        if not isinstance(node, ParseTree) or node.is_preterminal:
            return [node]
        return list(node.children)

    leaves = tree.leaves()
    nodes = [top]
    leaf_phrase, labels = [], []
    for _ in range(levels):
        nodes = [child for node in nodes for child in expand(node)]
        ids: list[int] = []
        for m, node in enumerate(nodes):
            ids.extend([m] * _span(node))
        leaf_phrase.append(ids)
        labels.append([base_label(n.label) if isinstance(n, ParseTree) else None for n in nodes])
    return SyntacticLevels(leaves, leaf_phrase, labels)


# ---------------------------------------------------------------------------------------------------- alignment
def _leaf_forms(leaf: str) -> tuple[str, ...]:
    forms = _LEAF_ESCAPES.get(leaf, ())
    unescaped = re.sub(r"\\([/*])", r"\1", leaf)  # PTB escapes `\/` and `\*`
    return forms + tuple(dict.fromkeys((leaf, unescaped)))


def align_leaves(text: str, leaves: Sequence[str], start: int = 0) -> list[tuple[int, int]]:
    """Character span [s, e) of every leaf in `text` (from `start`), leaves in order, separated by optional
    whitespace. Raises `ValueError` showing where the parse and the sentence disagree."""
    spans = []
    pos = start
    for i, leaf in enumerate(leaves):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        for form in _leaf_forms(leaf):
            if text.startswith(form, pos):
                spans.append((pos, pos + len(form)))
                pos += len(form)
                break
        else:
            raise ValueError(
                f"The parse does not match its sentence: leaf {i} {leaf!r} expected at character {pos} of "
                f"{text!r}, found {text[pos:pos + 20]!r}. Parse the exact source sentence (the leaves, in order, "
                f"must spell it, whitespace aside).")
    if text[pos:].strip():
        raise ValueError(f"The parse does not match its sentence: its leaves end at character {pos}, but "
                         f"{text[pos:pos + 20]!r} follows in {text!r}.")
    return spans


def token_leaves(text: str, spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]],
                 special: Sequence[int]) -> list[int]:
    """The leaf of every token (-1 for special tokens): the leaf holding the token's first non-space character,
    or, for a token of whitespace only (a lone `▁`), the leaf of the next non-space character."""
    leaf_of_char = [-1] * (len(text) + 1)
    for i, (s, e) in enumerate(spans):
        leaf_of_char[s:e] = [i] * (e - s)
    next_leaf = [-1] * (len(text) + 1)  # leaf of the first leaf character at or after each position
    for pos in range(len(text) - 1, -1, -1):
        next_leaf[pos] = leaf_of_char[pos] if leaf_of_char[pos] >= 0 else next_leaf[pos + 1]
    out = []
    for (s, e), is_special in zip(offsets, special):
        if is_special or s >= len(text):
            out.append(-1)
            continue
        out.append(next_leaf[s])
    return out


# ------------------------------------------------------------------------------------------------ model inputs
def syntactic_phrase_inputs(texts: Sequence[str], parses: Sequence, offsets: Sequence[Sequence[tuple[int, int]]],
                            special_tokens_mask: Sequence[Sequence[int]], levels: int,
                            tag_labels: Sequence[str], starts: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """`phrase_index` [B, levels, T] and `phrase_tags` [B, levels, M] for tokenized sentences.

    `offsets` / `special_tokens_mask`: the tokenizer's `offset_mapping` / `special_tokens_mask` of the padded batch
    (T tokens each); `starts[b]`: where sentence b begins in the tokenized string (after a language tag). Phrases
    are renumbered 0.. left to right over the tokens present (truncation can drop phrases). A label outside
    `tag_labels` gets tag -100 (no supervision)."""
    if len(parses) != len(texts):
        raise ValueError(f"Got {len(parses)} parses for {len(texts)} sentences.")
    tag_id = {label: i for i, label in enumerate(tag_labels)}
    starts = list(starts) if starts is not None else [0] * len(texts)
    batch, length = len(texts), len(offsets[0])
    index = torch.full((batch, levels, length), -1, dtype=torch.long)
    rows_tags: list[list[list[int]]] = []
    for b, (text, parse) in enumerate(zip(texts, parses)):
        try:
            parsed = syntactic_levels(parse, levels)
            spans = align_leaves(text, parsed.leaves, start=starts[b])
        except ValueError as error:
            raise ValueError(f"Sentence {b}: {error}") from None
        leaf_of_token = token_leaves(text, spans, offsets[b], special_tokens_mask[b])
        level_tags = []
        for k in range(levels):
            renumber: dict[int, int] = {}
            for t, leaf in enumerate(leaf_of_token):
                if leaf < 0:
                    continue
                phrase = parsed.leaf_phrase[k][leaf]
                index[b, k, t] = renumber.setdefault(phrase, len(renumber))
            labels = parsed.labels[k]
            level_tags.append([tag_id.get(labels[p], -100) if labels[p] is not None else -100 for p in renumber])
        rows_tags.append(level_tags)
    num_phrases = max([len(tags) for row in rows_tags for tags in row] + [1])
    phrase_tags = torch.full((batch, levels, num_phrases), -100, dtype=torch.long)
    for b, row in enumerate(rows_tags):
        for k, tags in enumerate(row):
            phrase_tags[b, k, : len(tags)] = torch.tensor(tags, dtype=torch.long)
    return {"phrase_index": index, "phrase_tags": phrase_tags}


__all__ = [
    "PTB_TAG_LABELS",
    "ParseTree",
    "SyntacticLevels",
    "align_leaves",
    "as_tree",
    "ngram_phrase_index",
    "read_bracketed",
    "syntactic_levels",
    "syntactic_phrase_inputs",
    "token_leaves",
]
