"""Cut a baseline model's vocabulary (a converted NLLB-200 or M2M100 above all: 256k and 128k tokens, whose
embeddings and output projection dominate a decoding step on a CPU) to the languages and the text a user needs, the
model and its tokenizer together.

    hf-variants-prune-vocabulary --model nllb-600M --output_dir nllb-600M-en-fr-de \\
        --keep_languages eng_Latn,fra_Latn,deu_Latn --keep_tokens_from train.eng_Latn train.fra_Latn train.deu_Latn

What stays (`kept_token_ids`), in the old order (so the special tokens keep their ids):
- every token of every line of the `--keep_tokens_from` files, as the model's tokenizer splits them;
- the special tokens (`<s>`, `<pad>`, `</s>`, `<unk>`, `<mask>`, ...) and the kept languages' tokens; the other
  languages' tokens go, except with M2M100, whose tokenizer numbers its 100 language tokens after its vocabulary:
  all of them stay (100 rows), while the model's languages become the kept ones;
- with a BPE tokenizer (NLLB-200's), every token a kept token is merged from (its merges need them);
- with `--with_translations`, every token of the full model's translations of each file whose name ends in a kept
  language (`train.eng_Latn`, `train.eng_Latn.gz`: the training data's layout) into every other kept language.

The model: the embedding matrices and the output projection (and its bias) keep the rows of the kept tokens;
`vocab_size`, the special token ids, `language_token_ids`, the generation config's ids and `languages` /
`source_languages` / `target_languages` (the kept languages) follow. The tokenizer is rewritten consistently:
- NLLB-200 (`tokenizers` BPE, tokenizer.json): the kept pieces, the merges between kept pieces, the kept added
  tokens, renumbered;
- M2M100 (SentencePiece model + vocab.json): vocab.json cut and renumbered, the SentencePiece model unchanged.

Every line of the files splits into the same tokens as before (checked: `tokenization_mismatches`, 0), so on that
text the pruned model computes the full model's logits for every kept token. A sentence with a token outside the
kept set is translated, never refused: NLLB's tokenizer splits an unseen word into kept pieces (a character no kept
piece covers becomes `<unk>`); M2M100's maps a piece outside the kept set to `<unk>`.

Same translations: greedy search picks the same token wherever the full model's choice is a kept token, so with
`--with_translations` the greedy translations of the files are the full model's (the comparison is run and
counted: `translations` in the report). Beam search compares hypotheses by log-probabilities normalised over the
kept tokens only (the probability mass of the cut tokens is gone), which may reorder close hypotheses: the
report counts the lines that differ. Only the baseline (`transformer_nmt`) is pruned: warm-start a variant from
the pruned folder.

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..configuration_transformer_nmt import apply_config_overrides

COMMAND = "prune_vocabulary"  # recorded in the output folder's manifest: what `--force` may replace
REPORT_FILE = "prune.json"
# the state-dict tensors with one row per vocabulary entry
VOCAB_TENSORS = ("shared.weight", "embed_tokens.weight", "lm_head.weight", "lm_head.bias")
# generation config fields holding token ids
GENERATION_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
GENERATION_OPTIONAL_IDS = ("forced_bos_token_id", "forced_eos_token_id")
GENERATION_ID_LISTS = ("suppress_tokens", "begin_suppress_tokens")
TOKEN_BATCH = 512  # lines tokenized at a time


@dataclass
class PruneReport:
    """What a pruning kept and checked: sizes, where the kept tokens come from, the text's lines whose tokens
    changed (0), and per translated direction the lines whose translation differs from the full model's."""

    languages: list[str]
    vocab_size_before: int
    vocab_size_after: int
    lines: int = 0
    from_text: int = 0
    from_translations: int = 0
    special_tokens: int = 0
    language_tokens: int = 0
    merge_parents: int = 0
    tokenization_mismatches: int = 0
    translations: dict = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"vocabulary {self.vocab_size_before} -> {self.vocab_size_after} tokens "
            f"({100.0 * self.vocab_size_after / max(1, self.vocab_size_before):.1f}%), languages "
            f"{', '.join(self.languages) or 'none'}",
            f"  kept: {self.from_text} tokens of {self.lines} lines of text, {self.from_translations} more from "
            f"translations, {self.special_tokens} special, {self.language_tokens} language tokens, "
            f"{self.merge_parents} merge parents",
            f"  lines of the text tokenized differently after pruning: {self.tokenization_mismatches}",
        ]
        for direction, result in self.translations.items():
            lines.append(
                f"  {direction}: {result['differing']} of {result['lines']} translations differ from the full "
                f"model's ({result['search']})"
            )
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- the text
def read_text_lines(paths: Iterable[str | os.PathLike]) -> dict[str, list[str]]:
    """The non-empty lines of each file (plain or .gz UTF-8), by path."""
    from ..tokenization import read_lines

    return {str(path): [line for line in read_lines(path) if line.strip()] for path in paths}


def file_language(path: str | os.PathLike, languages: Sequence[str]) -> str | None:
    """The language a file's name ends in (`train.eng_Latn`, `train.eng_Latn.gz`) when it is one of `languages`."""
    name = Path(path).name.removesuffix(".gz")
    suffix = name.rsplit(".", 1)[-1] if "." in name else None
    return suffix if suffix in languages else None


def text_token_ids(tokenizer, lines: Sequence[str]) -> list[list[int]]:
    """Each line's token ids without special tokens."""
    ids: list[list[int]] = []
    for start in range(0, len(lines), TOKEN_BATCH):
        ids += tokenizer(list(lines[start : start + TOKEN_BATCH]), add_special_tokens=False)["input_ids"]
    return ids


# ----------------------------------------------------------------------------------------------- the kept ids
def _language_table(config) -> dict[str, int]:
    return dict(zip(config.languages, config.language_token_ids)) if config.language_token_ids else {}


def check_languages_to_keep(config, languages: Sequence[str]) -> list[str]:
    """`languages` checked against the model's (a ValueError naming the unknown ones), in the model's order."""
    known = list(config.languages or [])
    unknown = [lang for lang in languages if lang not in known]
    if unknown:
        shown = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
        raise ValueError(f"--keep_languages: {unknown} are not languages of this model ({shown or 'none'}).")
    if known and not languages:
        raise ValueError("--keep_languages: name the languages to keep (at least one).")
    return [lang for lang in known if lang in languages]


def special_token_ids(tokenizer, config, languages: Sequence[str]) -> tuple[set[int], set[int]]:
    """(special token ids to keep, language token ids to keep): the tokenizer's special tokens and the model's
    special ids, without the tokens of the languages not kept; M2M100 keeps every language token (its tokenizer
    numbers them after its vocabulary)."""
    table = _language_table(config)
    m2m100 = isinstance(getattr(tokenizer, "lang_code_to_id", None), dict)
    keep_languages = set(table.values()) if m2m100 else {table[lang] for lang in languages}
    dropped = set(table.values()) - keep_languages
    specials = set(tokenizer.all_special_ids) - dropped
    specials |= {i for i in (config.pad_token_id, config.bos_token_id, config.eos_token_id) if i is not None}
    specials.add(config.decoder_start_token_id)
    return specials - keep_languages, keep_languages


def _backend_json(tokenizer) -> dict | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else None


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]


def merge_parents(tokenizer, kept: set[int]) -> set[int]:
    """BPE: the ids of every token a kept token is merged from, transitively (empty for other tokenizers)."""
    data = _backend_json(tokenizer)
    if data is None or data["model"].get("type") != "BPE":
        return set()
    vocab = data["model"]["vocab"]
    pieces = {i: p for p, i in vocab.items()}
    made_from: dict[str, list[tuple[str, str]]] = {}
    for left, right in _merge_pairs(data["model"].get("merges", [])):
        made_from.setdefault(left + right, []).append((left, right))
    todo = [pieces[i] for i in kept if i in pieces]
    seen = set(todo)
    while todo:
        for pair in made_from.get(todo.pop(), ()):
            for part in pair:
                if part in vocab and part not in seen:
                    seen.add(part)
                    todo.append(part)
    return {vocab[p] for p in seen} - kept


def kept_token_ids(tokenizer, config, languages: Sequence[str], text_ids: set[int], report: PruneReport) -> list[int]:
    """The sorted ids that stay (see the module docstring), counted in `report`."""
    specials, language_ids = special_token_ids(tokenizer, config, languages)
    kept = set(text_ids) | specials | language_ids
    parents = merge_parents(tokenizer, kept)
    report.special_tokens = len(specials - language_ids)
    report.language_tokens = len(language_ids)
    report.merge_parents = len(parents)
    kept |= parents
    outside = sorted(i for i in kept if not 0 <= i < config.vocab_size)
    if outside:
        raise ValueError(f"Token ids {outside[:5]} are outside the model's vocabulary ({config.vocab_size}).")
    return sorted(kept)


# ---------------------------------------------------------------------------------------------------- model
def _remap_generation_config(generation_config, old_to_new: dict[int, int]):
    config = copy.deepcopy(generation_config)

    def one(value, name):
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            return [one(v, name) for v in value]
        if value not in old_to_new:
            raise ValueError(f"generation_config.{name}={value}: that token is not kept.")
        return old_to_new[value]

    for name in GENERATION_ID_FIELDS + GENERATION_OPTIONAL_IDS:
        if getattr(config, name, None) is not None:
            setattr(config, name, one(getattr(config, name), name))
    for name in GENERATION_ID_LISTS:  # suppressing a token that is gone is moot
        value = getattr(config, name, None)
        if value:
            setattr(config, name, [old_to_new[i] for i in value if i in old_to_new] or None)
    if getattr(config, "bad_words_ids", None):
        kept = [[old_to_new[i] for i in seq] for seq in config.bad_words_ids if all(i in old_to_new for i in seq)]
        config.bad_words_ids = kept or None
    return config


def prune_model(model, kept: Sequence[int], languages: Sequence[str]):
    """A new model of `model`'s class with the vocabulary rows of `kept` (old ids, in order) and `languages`."""
    config = model.config
    if config.model_type != "transformer_nmt":
        raise ValueError(
            f"model_type={config.model_type!r}: prune the baseline (transformer_nmt, e.g. a converted NLLB-200 or "
            "M2M100), then warm-start the variant from the pruned folder."
        )
    old_to_new = {old: new for new, old in enumerate(kept)}
    table = _language_table(config)
    overrides = {
        "vocab_size": len(kept),
        **{
            name: old_to_new[getattr(config, name)]
            for name in GENERATION_ID_FIELDS
            if getattr(config, name) is not None
        },
    }
    if table:
        overrides.update(
            languages=list(languages),
            language_token_ids=[old_to_new[table[lang]] for lang in languages],
            source_languages=[lang for lang in config.translation_languages()[0] if lang in languages],
            target_languages=[lang for lang in config.translation_languages()[1] if lang in languages],
        )
    new_config = apply_config_overrides(config, overrides)
    index = torch.tensor(list(kept), dtype=torch.long)
    state = {
        key: value.index_select(0, index)
        if key.endswith(VOCAB_TENSORS) and value.shape[0] == config.vocab_size
        else value
        for key, value in model.state_dict().items()
    }
    pruned = type(model)(new_config)
    missing, unexpected = pruned.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    if unexpected or set(missing) - tied:
        raise ValueError(f"Pruning mismatch: missing {sorted(set(missing) - tied)}, unexpected {unexpected}.")
    pruned.generation_config = _remap_generation_config(model.generation_config, old_to_new)
    return pruned.eval()


# ------------------------------------------------------------------------------------------------ tokenizer
def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _edit_tokenizer_config(folder: Path, old_to_new: dict[int, int], tokens_kept: set[str], language: str | None):
    """tokenizer_config.json: the added tokens renumbered (or dropped), the special token lists and the source /
    target languages of the tokenizer restricted to kept tokens."""

    def edit(data):
        decoder = data.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            data["added_tokens_decoder"] = {
                str(old_to_new[int(i)]): token for i, token in decoder.items() if int(i) in old_to_new
            }
        for name in ("extra_special_tokens", "additional_special_tokens"):
            if isinstance(data.get(name), list):
                data[name] = [t for t in data[name] if (t if isinstance(t, str) else t.get("content")) in tokens_kept]
        for name in ("src_lang", "tgt_lang"):
            if data.get(name) is not None and language is not None:
                data[name] = data[name] if _code_kept(data[name], tokens_kept) else language

    _edit_json(folder / "tokenizer_config.json", edit)


def _code_kept(code: str, tokens_kept: set[str]) -> bool:
    return code in tokens_kept or f"__{code}__" in tokens_kept


def _write_bpe_json(folder: Path, old_to_new: dict[int, int]) -> None:
    """tokenizer.json of a `tokenizers` BPE tokenizer (NLLB-200's): kept pieces, merges and added tokens."""

    def edit(data):
        model = data["model"]
        if model.get("type") != "BPE":
            raise ValueError(
                f"A {model.get('type')} tokenizer.json: only BPE vocabularies (NLLB-200's) and M2M100's SentencePiece "
                "vocabulary can be cut."
            )
        vocab = {piece: old_to_new[i] for piece, i in model["vocab"].items() if i in old_to_new}
        model["vocab"] = vocab
        merges = [
            pair for pair in _merge_pairs(model.get("merges", [])) if all(p in vocab for p in (*pair, "".join(pair)))
        ]
        model["merges"] = [list(pair) for pair in merges]
        data["added_tokens"] = [dict(t, id=old_to_new[t["id"]]) for t in data["added_tokens"] if t["id"] in old_to_new]
        data["post_processor"] = None  # the tokenizer builds it from its `src_lang`

    _edit_json(folder / "tokenizer.json", edit)


def _write_m2m100_vocab(folder: Path, old_to_new: dict[int, int], tokenizer) -> None:
    """M2M100's vocab.json: the kept pieces, renumbered; its language tokens follow the vocabulary (all kept)."""
    size = tokenizer.encoder_size
    languages = sorted(tokenizer.lang_code_to_id.values())
    if [old_to_new[i] for i in languages] != list(range(len(old_to_new) - len(languages), len(old_to_new))):
        raise ValueError("M2M100's language tokens must be the last kept ids (they follow its vocabulary).")
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    kept = {piece: old_to_new[i] for piece, i in vocab.items() if i in old_to_new and i < size}
    (folder / "vocab.json").write_text(json.dumps(kept, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def prune_tokenizer(tokenizer, kept: Sequence[int], languages: Sequence[str], folder: str | os.PathLike):
    """The tokenizer with the vocabulary `kept` (old ids, in order), written to `folder` and loaded from it; every
    kept token checked to sit at its new id."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    old_to_new = {old: new for new, old in enumerate(kept)}
    tokenizer.save_pretrained(folder)
    tokens_kept = set(tokenizer.convert_ids_to_tokens(list(kept)))
    if isinstance(getattr(tokenizer, "lang_code_to_id", None), dict):
        _write_m2m100_vocab(folder, old_to_new, tokenizer)
    elif (folder / "tokenizer.json").is_file():
        _write_bpe_json(folder, old_to_new)
    else:
        raise ValueError(f"{type(tokenizer).__name__}: only NLLB-200 (tokenizer.json) and M2M100 tokenizers are cut.")
    _edit_tokenizer_config(folder, old_to_new, tokens_kept, languages[0] if languages else None)
    pruned = AutoTokenizer.from_pretrained(folder)
    check_pruned_tokenizer(tokenizer, pruned, kept)
    return pruned


def check_pruned_tokenizer(tokenizer, pruned, kept: Sequence[int]) -> None:
    """Every kept token of `tokenizer` at its new id in `pruned`, and `pruned` no larger than the kept set."""
    tokens = tokenizer.convert_ids_to_tokens(list(kept))
    ids = pruned.convert_tokens_to_ids(tokens)
    wrong = [(token, new, got) for new, (token, got) in enumerate(zip(tokens, ids)) if got != new]
    if wrong:
        raise ValueError(
            f"The pruned tokenizer numbers tokens otherwise than the model: {wrong[:5]} (token, expected, got)."
        )
    if len(pruned) > len(kept):
        raise ValueError(f"The pruned tokenizer has {len(pruned)} tokens for {len(kept)} kept rows.")


# ---------------------------------------------------------------------------------------------- translations
def translate_ids(model, tokenizer, lines: Sequence[str], src_lang, tgt_lang, batch_size: int, **generate_kwargs):
    """The generated token ids of each line (after the decoder's prompt, up to `</s>`), in batches."""
    prompt = 2 if getattr(model.config, "target_language_token", False) else 1
    eos, out = model.config.eos_token_id, []
    for start in range(0, len(lines), batch_size):
        batch = list(lines[start : start + batch_size])
        inputs = model.prepare_translation_inputs(tokenizer, batch, src_lang=src_lang, tgt_lang=tgt_lang)
        with torch.inference_mode():
            rows = model.generate(**inputs, **generate_kwargs).tolist()
        for row in rows:
            row = row[prompt:]
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def _directions(files: dict[str, list[str]], languages: Sequence[str]) -> list[tuple[str, str, str]]:
    """(path, source language, target language) for every file named after a kept language, into the others."""
    directions = []
    for path in files:
        source = file_language(path, languages)
        if source is None:
            raise ValueError(
                f"--with_translations: {path} does not end in a kept language ({', '.join(languages)}): name the "
                "files as the training data, PREFIX.LANG[.gz]."
            )
        directions += [(path, source, target) for target in languages if target != source]
    return directions


def compare_translations(full, pruned, pruned_tok, kept, reference, batch_size, **generate_kwargs) -> dict:
    """Translate every direction with the pruned model and count the lines whose tokens (mapped back to the full
    vocabulary) differ from the full model's `reference` ({(path, src, tgt): (lines, token ids)})."""
    results = {}
    for (path, source, target), (lines, expected) in reference.items():
        got = translate_ids(pruned, pruned_tok, lines, source, target, batch_size, **generate_kwargs)
        got = [[kept[i] for i in row] for row in got]
        differing = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
        key = f"{Path(path).name}: {source}->{target}"
        previous = results.get(key, {"lines": 0, "differing": 0})
        search = f"beam {generate_kwargs.get('num_beams') or full.generation_config.num_beams or 1}"
        results[key] = {
            "lines": previous["lines"] + len(lines),
            "differing": previous["differing"] + len(differing),
            "differing_lines": [i + 1 for i in differing][:20],
            "search": search,
        }
    return results


# ------------------------------------------------------------------------------------------------ the function
def prune_vocabulary(
    model,
    tokenizer,
    keep_languages: Sequence[str],
    files: Iterable[str | os.PathLike] = (),
    *,
    texts: Sequence[str] = (),
    with_translations: bool = False,
    batch_size: int = 32,
    generate_kwargs: dict | None = None,
) -> tuple:
    """(pruned model, pruned tokenizer, `PruneReport`): the vocabulary of `model` / `tokenizer` cut to
    `keep_languages` and the tokens of `files` (and `texts`); see the module docstring."""
    config = model.config
    languages = check_languages_to_keep(config, keep_languages)
    file_lines = read_text_lines(files)
    lines = [line for group in file_lines.values() for line in group] + list(texts)
    report = PruneReport(
        languages=languages, vocab_size_before=config.vocab_size, vocab_size_after=0, lines=len(lines)
    )
    line_ids = text_token_ids(tokenizer, lines)
    text_ids = {i for row in line_ids for i in row}
    report.from_text = len(text_ids)
    generate_kwargs = dict(generate_kwargs or {})
    reference = {}
    if with_translations:
        for path, source, target in _directions(file_lines, languages):
            ids = translate_ids(model, tokenizer, file_lines[path], source, target, batch_size, **generate_kwargs)
            reference[(path, source, target)] = (file_lines[path], ids)
        translated = {i for _, rows in reference.values() for row in rows for i in row}
        report.from_translations = len(translated - text_ids)
        text_ids |= translated
    kept = kept_token_ids(tokenizer, config, languages, text_ids, report)
    report.vocab_size_after = len(kept)
    pruned = prune_model(model, kept, languages)
    with tempfile.TemporaryDirectory() as folder:
        pruned_tok = prune_tokenizer(tokenizer, kept, languages, folder)
        old_to_new = {old: new for new, old in enumerate(kept)}
        new_ids = text_token_ids(pruned_tok, lines)
        report.tokenization_mismatches = sum(
            [old_to_new.get(i) for i in old] != new for old, new in zip(line_ids, new_ids)
        )
        if reference:
            report.translations = compare_translations(
                model, pruned, pruned_tok, kept, reference, batch_size, **generate_kwargs
            )
    return pruned, pruned_tok, report


def write_report(folder: str | os.PathLike, report: PruneReport) -> None:
    (Path(folder) / REPORT_FILE).write_text(json.dumps(asdict(report), indent=1) + "\n", encoding="utf-8")


__all__ = [
    "COMMAND",
    "PruneReport",
    "check_pruned_tokenizer",
    "compare_translations",
    "kept_token_ids",
    "prune_model",
    "prune_tokenizer",
    "prune_vocabulary",
    "translate_ids",
    "write_report",
]
