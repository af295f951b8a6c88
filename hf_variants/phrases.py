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
- `align_leaves(text, leaves)`: the character span of every leaf in the sentence. A clear `ValueError` names the
  sentence position where a parse does not match its sentence.
- `encode_by_leaves(tokenizer, texts, parses, ...)`: the source tokenized so that every leaf keeps tokens of its
  own (docs/variants-spec.md §3.2a, [DECISION] "tokens never cross a leaf boundary"): the text is cut at leaf
  boundaries and each piece is tokenized by the tokenizer's own pipeline (a piece inside the sentence gets no
  word-start marker it does not carry), so a token never spans two leaves and a leaf such as the final "." of
  "runs." keeps its phrase and tag whatever the tokenizer merged. Where no pre-token crosses a leaf boundary (the
  tokenizers of `tokenization.py`, which isolate punctuation, on Penn-Treebank-tokenized parses) the ids equal
  `tokenizer(text)`. A language-tag prefix and the special tokens belong to no phrase.
- `phrase_inputs_from_leaves(...)` / `syntactic_phrase_inputs(...)`: the model inputs `phrase_index`
  [B, levels, T] (-1 for padding and special tokens) and `phrase_tags` [B, levels, M] (-100 where there is no
  phrase or the label is not in the vocabulary), from the leaf of every token (or from a tokenizer's offsets).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Penn Treebank constituent labels (phrase level) and part-of-speech tags: the default tag vocabulary. Top parse
# levels hold phrases (NP, VP, ...) and, from level 2 on, pre-terminals carried down (NNP, VBD, ...).
PTB_PHRASE_LABELS = (
    "S",
    "SBAR",
    "SBARQ",
    "SINV",
    "SQ",
    "ADJP",
    "ADVP",
    "CONJP",
    "FRAG",
    "INTJ",
    "LST",
    "NAC",
    "NP",
    "NX",
    "PP",
    "PRN",
    "PRT",
    "QP",
    "RRC",
    "UCP",
    "VP",
    "WHADJP",
    "WHADVP",
    "WHNP",
    "WHPP",
    "X",
)
PTB_POS_TAGS = (
    "CC",
    "CD",
    "DT",
    "EX",
    "FW",
    "IN",
    "JJ",
    "JJR",
    "JJS",
    "LS",
    "MD",
    "NN",
    "NNS",
    "NNP",
    "NNPS",
    "PDT",
    "POS",
    "PRP",
    "PRP$",
    "RB",
    "RBR",
    "RBS",
    "RP",
    "SYM",
    "TO",
    "UH",
    "VB",
    "VBD",
    "VBG",
    "VBN",
    "VBP",
    "VBZ",
    "WDT",
    "WP",
    "WP$",
    "WRB",
    "#",
    "$",
    ".",
    ",",
    ":",
    "``",
    "''",
    "-LRB-",
    "-RRB-",
)
PTB_TAG_LABELS = PTB_PHRASE_LABELS + PTB_POS_TAGS

# Penn Chinese Treebank (Xue et al. 2005; the bracketing and POS guidelines of CTB 5-9): the labels of the Stanford
# parser's Chinese models, for Chinese sources such as the paper's NIST Zh-En setting. Phrase labels (verb
# compounds VCD ... VSB included) and the 33 POS tags.
CTB_PHRASE_LABELS = (
    "ADJP",
    "ADVP",
    "CLP",
    "CP",
    "DNP",
    "DP",
    "DVP",
    "FRAG",
    "INTJ",
    "IP",
    "LCP",
    "LST",
    "NP",
    "PP",
    "PRN",
    "QP",
    "UCP",
    "VP",
    "VCD",
    "VCP",
    "VNV",
    "VPT",
    "VRD",
    "VSB",
    "WHNP",
    "WHPP",
)
CTB_POS_TAGS = (
    "AD",
    "AS",
    "BA",
    "CC",
    "CD",
    "CS",
    "DEC",
    "DEG",
    "DER",
    "DEV",
    "DT",
    "ETC",
    "FW",
    "IJ",
    "JJ",
    "LB",
    "LC",
    "M",
    "MSP",
    "NN",
    "NR",
    "NT",
    "OD",
    "ON",
    "P",
    "PN",
    "PU",
    "SB",
    "SP",
    "VA",
    "VC",
    "VE",
    "VV",
)
CTB_TAG_LABELS = CTB_PHRASE_LABELS + CTB_POS_TAGS

# The built-in tag vocabularies, by the names `MgsaConfig(phrase_tag_labels=...)` accepts.
TAG_LABEL_SETS = {"ptb": PTB_TAG_LABELS, "ctb": CTB_TAG_LABELS}

# Leaf escapes of the Penn Treebank / Stanford parser and the characters they stand for in the sentence.
_LEAF_ESCAPES = {
    "-LRB-": ("(",),
    "-RRB-": (")",),
    "-LSB-": ("[",),
    "-RSB-": ("]",),
    "-LCB-": ("{",),
    "-RCB-": ("}",),
    "``": ('"', "``", "\u201c", "'"),
    "''": ('"', "''", "\u201d", "'"),
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
                f"{text!r}, found {text[pos : pos + 20]!r}. Parse the exact source sentence (the leaves, in order, "
                f"must spell it, whitespace aside)."
            )
    if text[pos:].strip():
        raise ValueError(
            f"The parse does not match its sentence: its leaves end at character {pos}, but "
            f"{text[pos : pos + 20]!r} follows in {text!r}."
        )
    return spans


def token_leaves(
    text: str,
    spans: Sequence[tuple[int, int]],
    offsets: Sequence[tuple[int, int]],
    special: Sequence[int],
    start: int = 0,
) -> list[int]:
    """The leaf of every token (-1 for special tokens and for tokens before `start`, e.g. a `<2xx>` tag): the leaf
    holding the token's first non-space character, or, for a token of whitespace only (a lone `▁`), the leaf of the
    next non-space character. A token spanning two leaves counts for the first; `encode_by_leaves` avoids such
    tokens."""
    leaf_of_char = [-1] * (len(text) + 1)
    for i, (s, e) in enumerate(spans):
        leaf_of_char[s:e] = [i] * (e - s)
    next_leaf = [-1] * (len(text) + 1)  # leaf of the first leaf character at or after each position
    for pos in range(len(text) - 1, -1, -1):
        next_leaf[pos] = leaf_of_char[pos] if leaf_of_char[pos] >= 0 else next_leaf[pos + 1]
    out = []
    for (s, e), is_special in zip(offsets, special):
        if is_special or s >= len(text) or e <= start:
            out.append(-1)
            continue
        out.append(next_leaf[s])
    return out


# ------------------------------------------------------------------------------------- leaf-aligned tokenization
_PIECE_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _no_word_start(node) -> None:
    """In a tokenizers JSON spec: no pre-tokenizer or normalizer adds a word-start marker to a piece's start."""
    if isinstance(node, list):
        for item in node:
            _no_word_start(item)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "Metaspace":
        node["prepend_scheme"] = "never"
        if "add_prefix_space" in node:
            node["add_prefix_space"] = False
    elif kind == "ByteLevel" and "add_prefix_space" in node:
        node["add_prefix_space"] = False
    elif kind == "Prepend":  # SentencePiece-style normalizers prepend "▁" to the whole input
        node["prepend"] = ""
    for value in node.values():
        _no_word_start(value)


def _piece_tokenizers(tokenizer):
    """Two copies of a fast tokenizer's backend (tokenizers.Tokenizer): as it is (for a sentence's first piece, the
    language tag and the special tokens) and without word-start markers (for the pieces that continue a
    sentence); cached per tokenizer."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("Syntactic MG-SA inputs need a fast tokenizer (a `tokenizers` backend).")
    key = backend.to_str()
    cached = _PIECE_TOKENIZERS.get(tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    spec = json.loads(key)
    spec["truncation"] = spec["padding"] = None
    first = Tokenizer.from_str(json.dumps(spec))
    for part in ("normalizer", "pre_tokenizer"):
        _no_word_start(spec.get(part))
    rest = Tokenizer.from_str(json.dumps(spec))
    try:
        _PIECE_TOKENIZERS[tokenizer] = (key, first, rest)
    except TypeError:  # an unhashable tokenizer: no cache
        pass
    return first, rest


def leaf_pieces(text: str, spans: Sequence[tuple[int, int]], start: int = 0) -> list[str]:
    """`text[start:]` cut at leaf boundaries: piece i ends where leaf i ends and holds the whitespace before it;
    whatever follows the last leaf stays on the last piece. The pieces concatenate to `text[start:]`."""
    pieces, position = [], start
    for i, (_, end) in enumerate(spans):
        if i == len(spans) - 1:
            end = len(text)
        pieces.append(text[position:end])
        position = end
    return pieces


def aligned_parses(texts: Sequence[str], parses: Sequence, starts: Sequence[int] | None = None):
    """(sentence index, its parse as a tree, the character span of every leaf) for every sentence, the leaves
    aligned from `starts[b]` (after a language-tag prefix); a parse count that differs from the sentences', or a
    parse that does not spell its sentence, raises a `ValueError` naming the sentence."""
    if len(parses) != len(texts):
        raise ValueError(f"Got {len(parses)} parses for {len(texts)} sentences.")
    starts = list(starts) if starts is not None else [0] * len(texts)
    for b, (text, parse) in enumerate(zip(texts, parses)):
        try:
            tree = as_tree(parse)
            spans = align_leaves(text, tree.leaves(), start=starts[b])
        except ValueError as error:
            raise ValueError(f"Sentence {b}: {error}") from None
        yield b, tree, spans


def encode_by_leaves(
    tokenizer,
    texts: Sequence[str],
    parses: Sequence,
    starts: Sequence[int] | None = None,
    max_length: int | None = None,
) -> tuple[list[list[int]], list[list[int]], list]:
    """Token ids of every sentence (special tokens included, not padded) and the leaf of every token (-1: the
    language-tag prefix `texts[b][:starts[b]]` and the special tokens), with no token spanning two leaves; plus
    the parses read as `SyntacticLevels` (levels filled in by the caller). `max_length` truncates as
    `tokenizer(..., truncation=True, max_length=...)` does (the tokenizer's `truncation_side`), special tokens
    kept. A parse that does not spell its sentence raises a `ValueError` naming the sentence."""
    from tokenizers import Encoding

    first, rest = _piece_tokenizers(tokenizer)
    starts = list(starts) if starts is not None else [0] * len(texts)
    side = getattr(tokenizer, "truncation_side", "right")
    if max_length is not None:
        first.enable_truncation(max_length, direction=side)
    else:
        first.no_truncation()
    all_ids, all_leaves, trees = [], [], []
    for b, tree, spans in aligned_parses(texts, parses, starts):
        text = texts[b]
        trees.append(tree)
        encodings, leaves = [], []
        prefix = text[: starts[b]].strip()
        if prefix:  # the target-language tag: its own token(s), no phrase
            encodings.append(first.encode(prefix, add_special_tokens=False))
            leaves += [-1] * len(encodings[-1].ids)
        for i, piece in enumerate(leaf_pieces(text, spans, starts[b])):
            encoding = (first if i == 0 else rest).encode(piece, add_special_tokens=False)
            encodings.append(encoding)
            leaves += [i] * len(encoding.ids)
        merged = Encoding.merge(encodings, growing_offsets=True) if len(encodings) > 1 else encodings[0]
        final = first.post_process(merged, None, True)  # truncation, then the special tokens (</s>)
        kept = sum(1 for special in final.special_tokens_mask if not special)
        leaves = leaves[:kept] if side == "right" else leaves[len(leaves) - kept :]
        iterator = iter(leaves)
        all_ids.append(list(final.ids))
        all_leaves.append([-1 if special else next(iterator) for special in final.special_tokens_mask])
    return all_ids, all_leaves, trees


# ------------------------------------------------------------------------------------------------ model inputs
def phrase_inputs_from_leaves(
    trees: Sequence, leaf_of_token: Sequence[Sequence[int]], levels: int, tag_labels: Sequence[str]
) -> dict[str, torch.Tensor]:
    """`phrase_index` [B, levels, T] and `phrase_tags` [B, levels, M] from the leaf of every token of the (padded)
    batch (-1: no leaf: padding, special tokens, a language tag). Phrases are renumbered 0.. left to right over the
    tokens present (truncation can drop phrases). A label outside `tag_labels` gets tag -100 (no supervision)."""
    tag_id = {label: i for i, label in enumerate(tag_labels)}
    batch, length = len(trees), len(leaf_of_token[0]) if leaf_of_token else 0
    index = torch.full((batch, levels, length), -1, dtype=torch.long)
    rows_tags: list[list[list[int]]] = []
    for b, tree in enumerate(trees):
        parsed = syntactic_levels(tree, levels)
        level_tags = []
        for k in range(levels):
            renumber: dict[int, int] = {}
            for t, leaf in enumerate(leaf_of_token[b]):
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


def syntactic_phrase_inputs(
    texts: Sequence[str],
    parses: Sequence,
    offsets: Sequence[Sequence[tuple[int, int]]],
    special_tokens_mask: Sequence[Sequence[int]],
    levels: int,
    tag_labels: Sequence[str],
    starts: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """`phrase_index` [B, levels, T] and `phrase_tags` [B, levels, M] for sentences tokenized as they are.

    `offsets` / `special_tokens_mask`: the tokenizer's `offset_mapping` / `special_tokens_mask` of the padded batch
    (T tokens each); `starts[b]`: where sentence b begins in the tokenized string (after a language tag, which
    belongs to no phrase). A token spanning two leaves counts for the first, so a leaf can lose its phrase:
    `MgsaForConditionalGeneration.prepare_translation_inputs` tokenizes with `encode_by_leaves` instead."""
    starts = list(starts) if starts is not None else [0] * len(texts)
    trees, leaves = [], []
    for b, tree, spans in aligned_parses(texts, parses, starts):
        trees.append(tree)
        leaves.append(token_leaves(texts[b], spans, offsets[b], special_tokens_mask[b], start=starts[b]))
    return phrase_inputs_from_leaves(trees, leaves, levels, tag_labels)


__all__ = [
    "CTB_TAG_LABELS",
    "PTB_TAG_LABELS",
    "TAG_LABEL_SETS",
    "ParseTree",
    "SyntacticLevels",
    "align_leaves",
    "as_tree",
    "encode_by_leaves",
    "leaf_pieces",
    "ngram_phrase_index",
    "phrase_inputs_from_leaves",
    "read_bracketed",
    "syntactic_levels",
    "syntactic_phrase_inputs",
    "token_leaves",
]
