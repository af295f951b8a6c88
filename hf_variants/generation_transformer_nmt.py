"""Translation and generation for hf_variants' models: the mixin `TransformerNmtForConditionalGeneration` inherits
(language inputs, `prepare_translation_inputs`, `generate` with its length rule, the merged token-suppression
logits processor, beam search's cache reordering), the per-call `generation_scope`, and `resolve_language_ids`."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import GenerationMixin
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.utils import logging

from .compat_transformer_nmt import CACHE_NAME, LEGACY_CACHE_NAME, check_generation_supported
from .configuration_transformer_nmt import TransformerNmtConfig, language_tag

logger = logging.get_logger(__name__)

# The length rule's fields in a saved generation config (`generation_config.length_rule`): new tokens =
# min(max_len_a * source length + max_len_b, max_new_tokens, max_position_embeddings)
LENGTH_RULE_KEYS = ("max_len_a", "max_len_b", "max_new_tokens")
# transformers' `GenerationConfig` default `max_length`, and its defaults for assisted decoding, which no translation
# model sets: `Seq2SeqTrainer.prediction_step` writes all of them into the model's generation config
TRANSFORMERS_DEFAULT_MAX_LENGTH = 20
FILLED_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
    "assistant_lookbehind": 10,
    "target_lookbehind": 10,
}


def check_tokenizer_fits_model(
    tokenizer, config, tokenizer_name: str | None = None, model_name: str | None = None
) -> None:
    """Raise a `ValueError` naming both sizes when `tokenizer` can produce ids the model has no embedding for
    (`len(tokenizer)` > `config.vocab_size`: a tokenizer from another run or model). A smaller tokenizer is fine
    (a vocabulary padded to a multiple of 8, Marian's)."""
    size, vocab_size = len(tokenizer), getattr(config, "vocab_size", None)
    if vocab_size is None or size <= vocab_size:
        return
    tokenizer_name = tokenizer_name or getattr(tokenizer, "name_or_path", None)
    model_name = model_name or getattr(config, "_name_or_path", None)
    raise ValueError(
        f"Tokenizer/model mismatch: the tokenizer{f' ({tokenizer_name})' if tokenizer_name else ''} has {size} "
        f"tokens (len(tokenizer)) but the model{f' ({model_name})' if model_name else ''} has a vocabulary of "
        f"{vocab_size} "
        f"(config.vocab_size), so ids >= {vocab_size} have no embedding. Use the tokenizer saved with "
        f"this model (its folder), or the model trained with this tokenizer."
    )


# ------------------------------------------------------------------------------------------------ generation scope
_GENERATION_SCOPE: ContextVar[dict | None] = ContextVar("hf_variants_generation_scope", default=None)


@contextmanager
def generation_scope():
    """The scope of one `generate` call, where the weights and the source do not change: what is computed once per
    call lives in it (a dict, freed when the scope ends) instead of at every decoding step: every `StackedLinear`'s
    stacked weights (keyed by the module), the decoder's cross-attention mask (keyed by the decoder)."""
    token = _GENERATION_SCOPE.set({})
    try:
        yield
    finally:
        _GENERATION_SCOPE.reset(token)


def current_generation_scope() -> dict | None:
    """The dict of the enclosing `generation_scope()`, or None (outside one, or while compiling)."""
    return None if torch.compiler.is_compiling() else _GENERATION_SCOPE.get()


# ------------------------------------------------------------------------------------------- token suppression
class TokenSuppressionLogitsProcessor(LogitsProcessor):
    """transformers' `MinLengthLogitsProcessor`, `MinNewTokensLengthLogitsProcessor` and
    `SuppressTokensLogitsProcessor` (adjacent in a processor list) as ONE processor with the same output: the
    scores of the tokens whose rule is active set to -inf. Those processors each build a vocabulary-sized mask
    (`arange` + `isin`) and copy the scores twice (`clone` + `where`) at every step, active or not; this one copies
    them once, with `index_fill` on the few token columns, and returns them untouched when no rule is active (a
    min-length rule after the minimum length: most steps).

    `rules`: (token ids, length) pairs: the tokens are suppressed while the sequence (prompt included) is shorter
    than `length`; None: always. Ids outside the vocabulary are ignored, as `isin` over the vocabulary does."""

    def __init__(self, rules: list[tuple[torch.Tensor, int | None]]):
        self.rules = [(torch.as_tensor(ids).reshape(-1).long(), length) for ids, length in rules]
        self._ids = {}  # (active rules, vocabulary size, device) -> the ids to suppress

    @classmethod
    def merge(cls, processors: LogitsProcessorList) -> LogitsProcessorList:
        """`processors` with every run of adjacent min-length / min-new-tokens / suppress-tokens processors (exactly
        those classes: a subclass may do more) replaced by one `TokenSuppressionLogitsProcessor`. Only adjacent ones
        merge: moving a suppression across another processor (a top-k warper) could change what it sees."""
        merged, run = LogitsProcessorList(), []
        for processor in [*processors, None]:
            rule = None
            if type(processor) is MinLengthLogitsProcessor:
                rule = (processor.eos_token_id, processor.min_length)
            elif type(processor) is MinNewTokensLengthLogitsProcessor:
                rule = (processor.eos_token_id, processor.prompt_length_to_skip + processor.min_new_tokens)
            elif type(processor) is SuppressTokensLogitsProcessor:
                rule = (processor.suppress_tokens, None)
            if rule is not None:
                run.append(rule)
                continue
            if run:
                merged.append(cls(run))
                run = []
            if processor is not None:
                merged.append(processor)
        return merged

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[-1]
        active = tuple(i for i, (_, limit) in enumerate(self.rules) if limit is None or length < limit)
        if not active:
            return scores
        key = (active, scores.shape[-1], scores.device)
        ids = self._ids.get(key)
        if ids is None:
            ids = torch.cat([self.rules[i][0] for i in active]).to(scores.device).unique()
            ids = ids[(ids >= 0) & (ids < scores.shape[-1])]
            self._ids[key] = ids
        return scores.index_fill(-1, ids, -math.inf) if ids.numel() else scores


# ----------------------------------------------------------------------------------------------------- lengths
def _length_rule_values(value, where: str, base: tuple[float, int, int] | None = None) -> tuple[float, int, int]:
    """(a, b, cap) from a length rule dict (`LENGTH_RULE_KEYS`): all three keys, or with `base` any of them (the
    others from `base`); a ValueError naming `where` otherwise."""
    names = set(value) if isinstance(value, dict) else set()
    ok = isinstance(value, dict) and (
        names == set(LENGTH_RULE_KEYS) or (base is not None and names <= set(LENGTH_RULE_KEYS))
    )
    if ok:
        a, b, cap = (value.get(key, default) for key, default in zip(LENGTH_RULE_KEYS, base or (None,) * 3))
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in (a, b, cap))
        ok = ok and all(isinstance(x, int) for x in (b, cap)) and cap > 0
    if not ok:
        keys = "some of " if base is not None else ""
        raise ValueError(
            f"{where} must be a dict with {keys}{{'max_len_a': float >= 0, 'max_len_b': int >= 0, "
            f"'max_new_tokens': int > 0}} (a sentence gets at most min(a * its source length + b, max_new_tokens) "
            f"new tokens), got {value!r}."
        )
    return float(a), b, cap


def sentence_limits(rule: tuple[float, int, int], source_lengths: Sequence[int], positions: int) -> list[int]:
    """Each sentence's new-token limit under the length rule (a, b, cap): min(a * its own source length + b, cap,
    `positions`), at least 1. The limit counts the end token: a sentence that reaches it ends with EOS there."""
    a, b, cap = rule
    return [max(1, min(int(a * length + b), cap, positions)) for length in source_lengths]


class SentenceLengthLogitsProcessor(LogitsProcessor):
    """The length rule per sentence: row r (of sentence r // (rows / sentences): beams and returned sequences
    follow their sentence) must end with EOS by its `limits[r]`-th new token, so at that step every other token is
    set to -inf (fairseq forces EOS at its max length the same way). A sentence's translation then depends on its
    own source only, never on the longest source of its batch. `prompt_length`: the decoder prompt's length (new
    tokens are counted after it). No host synchronisation: the steps before the shortest limit return the scores
    untouched, the others mask on the device."""

    def __init__(self, limits: Sequence[int], eos_token_id: int, prompt_length: int = 1):
        self.limits = [int(limit) for limit in limits]
        self.eos_token_id, self.prompt_length = int(eos_token_id), int(prompt_length)
        self.first = min(self.limits) if self.limits else 0
        self._rows = {}  # (rows, device) -> the limits per row
        self._others = {}  # (vocabulary size, device) -> [1, vocabulary] True except at EOS

    def row_limits(self, rows: int, device=None) -> torch.Tensor:
        """The limit of each of `rows` rows (each sentence's repeated over its rows)."""
        key = (rows, device)
        if key not in self._rows:
            if rows % len(self.limits):
                raise ValueError(f"{rows} rows are not whole sentences of a batch of {len(self.limits)}.")
            limits = torch.tensor(self.limits, dtype=torch.long, device=device)
            self._rows[key] = limits.repeat_interleave(rows // len(self.limits))
        return self._rows[key]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[-1] - self.prompt_length + 1  # the new token chosen now is the position-th
        if position < self.first:
            return scores
        ending = (self.row_limits(scores.shape[0], scores.device) <= position)[:, None]
        key = (scores.shape[-1], scores.device)
        if key not in self._others:
            others = torch.ones(1, scores.shape[-1], dtype=torch.bool, device=scores.device)
            others[0, self.eos_token_id] = False
            self._others[key] = others
        return scores.masked_fill(ending & self._others[key], -math.inf)


class TargetLanguageLogitsProcessor(LogitsProcessor):
    """The target language's token as the first generated token, one per sentence (M2M100 / NLLB-200, config
    `target_language_token`): at the step after the decoder's start token, row r's scores become -inf except at its
    sentence's token (`token_ids[r // (rows / sentences)]`: beams and returned sequences follow their sentence),
    which gets 0. transformers' `ForcedBOSTokenLogitsProcessor` with one token per sentence: the same scores, so the
    same search, greedy or beam (the token adds 0 to a hypothesis' log-probability)."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = [int(i) for i in token_ids]
        self._rows = {}  # (rows, device) -> the token of each row

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != 1:
            return scores
        rows = scores.shape[0]
        key = (rows, scores.device)
        if key not in self._rows:
            if rows % len(self.token_ids):
                raise ValueError(f"{rows} rows are not whole sentences of a batch of {len(self.token_ids)}.")
            tokens = torch.tensor(self.token_ids, dtype=torch.long, device=scores.device)
            self._rows[key] = tokens.repeat_interleave(rows // len(self.token_ids))[:, None]
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter_(1, self._rows[key], 0.0)


def put_language_tokens(ids: torch.Tensor, real: torch.Tensor, token_ids: Sequence[int], known: set[int], what: str):
    """Write each row's language token (`token_ids[r]`) over the language token its tokenizer put at the row's first
    real position (`real`: [B, T] booleans; M2M100 / NLLB tokenizers write `[lang] tokens </s>`), in place. A
    ValueError naming `what` when that position holds no language token (`known`): a tokenizer with another layout
    (NLLB's `legacy_behaviour=True` puts the code last), or not the model's."""
    if not ids.numel():
        return
    first = real.int().argmax(dim=1, keepdim=True)
    present = ids.gather(1, first).squeeze(1).tolist()
    wrong = [i for i, token in enumerate(present) if token not in known]
    if wrong:
        raise ValueError(
            f"{what}: row {wrong[0]} starts with token id {present[wrong[0]]}, not a language token of this model "
            f"(config.language_token_ids): this model needs its own M2M100 / NLLB tokenizer, writing the language "
            f"code first (NLLB's legacy_behaviour=False)."
        )
    ids.scatter_(1, first, torch.tensor(list(token_ids), dtype=ids.dtype, device=ids.device)[:, None])


# ------------------------------------------------------------------------------------------------ language inputs
def _one_target_hint(config: TransformerNmtConfig) -> str:
    """For an error asking for the target language: how a model trained in one direction stops asking."""
    if len(config.target_languages) > 1:
        return f" (this model translates into {config.target_languages})"
    return (
        "; a model trained in one direction (e.g. into the last of its languages) can record it once, "
        f"`model.config.target_languages = [{config.languages[-1] if config.languages else 'xx'!r}]`, "
        "and be saved: then it needs none"
    )


def _short_list(items: Sequence[str], limit: int = 12) -> str:
    """`items` for a message: all of them, or the first `limit` and how many more."""
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def resolve_language_ids(
    config: TransformerNmtConfig, tgt_lang_ids, batch_size: int, num_ids: int, device, required: bool | None = None
) -> torch.Tensor:
    """Every example's target-language id ([B] long; the index in `config.languages`), checked against `num_ids`
    rows. Without ids, a single-direction model (`config.default_target_language()`) gives every example its one
    target's id, and a model that does not need them (`required`; by default: more than one row) gives every
    example 0. The range check reads the values, so it runs in eager mode only (compiled and exported graphs keep
    their inputs' values opaque)."""
    if tgt_lang_ids is None:
        default = config.default_target_language()
        if default is not None:
            return torch.full((batch_size,), config.language_id(default), dtype=torch.long, device=device)
        if num_ids > 1 if required is None else required:
            raise ValueError(
                f"This model depends on the target language: pass `tgt_lang_ids` (one id per sentence, the index in "
                f"config.languages={config.languages}), or `tgt_lang=` to `generate`, the pipeline or "
                f"`prepare_translation_inputs`{_one_target_hint(config)}."
            )
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    ids = torch.as_tensor(tgt_lang_ids, device=device).long().reshape(-1)
    if ids.shape[0] != batch_size:
        raise ValueError(f"`tgt_lang_ids` has {ids.shape[0]} entries for a batch of {batch_size}.")
    if torch.compiler.is_compiling() or not ids.numel():
        return ids
    outside = ((ids < 0) | (ids >= num_ids)).any()
    if ids.device.type != "cpu":  # an accelerator asserts on the device: no host sync per training or decoding step
        torch._assert_async(~outside, f"`tgt_lang_ids` must be in [0, {num_ids}) (config.languages)")
    elif bool(outside):  # on the CPU a read costs nothing: the error names the values
        raise ValueError(
            f"`tgt_lang_ids` must be in [0, {num_ids}) (config.languages={config.languages}), got {ids.tolist()}."
        )
    return ids


# ------------------------------------------------------------------------------------------------------------ mixin
class TransformerNmtGenerationMixin(GenerationMixin):
    """Translation and generation of `TransformerNmtForConditionalGeneration` (and so of every variant): target
    languages (`_language_inputs`, `tgt_lang=`), `prepare_translation_inputs`, `generate` (length rule, limits,
    one `generation_scope` per call), the merged token suppression and beam search's cache reordering. The model
    provides `config`, `device`, `generation_config` and `model.language_ids_field`."""

    # Without a length from the user (`max_length` / `max_new_tokens` in the call, a passed or the saved generation
    # config), `generate` stops at min(a * source length + b, cap, max_position_embeddings) new tokens: a rule of the
    # source length (Marian's max-length-factor), never stored as `max_new_tokens`, which would win over a user's
    # `max_length`. The rule is saved in the generation config as `length_rule` (`LENGTH_RULE_KEYS`: a, b, cap), set
    # on every new model; a config without it (saved before) uses `default_length`. A `max_length` of 20 in the
    # model's own generation config is transformers' default, not a choice, where the config owns a length rule or
    # carries the whole set of defaults `Seq2SeqTrainer`'s evaluation writes into it (`_unchosen_max_length`): the
    # rule applies, with a warning. A fresh model otherwise decodes with transformers' defaults (greedy); the
    # papers' decoding (`paper_decoding`: beam 4, length penalty 0.6) goes into the generation config of the models
    # training/train.py saves, as published checkpoints carry theirs.
    default_length = (2.0, 10, 256)
    paper_decoding = {"num_beams": 4, "length_penalty": 0.6}

    def length_rule(self, override: dict | None = None) -> tuple[float, int, int]:
        """(a, b, cap) of the length rule: `generation_config.length_rule` (`{"max_len_a": a, "max_len_b": b,
        "max_new_tokens": cap}`), or `default_length` for a generation config saved without one; `override` (a
        `generate(length_rule=...)` argument: some or all of the three keys) replaces the saved values it names."""
        saved = getattr(self.generation_config, "length_rule", None)
        rule = self.default_length if saved is None else _length_rule_values(saved, "generation_config.length_rule")
        if override is not None:
            rule = _length_rule_values(override, "length_rule", base=rule)
        return rule

    def _unchosen_max_length(self) -> bool:
        """Whether the model's own generation config holds a `max_length` nobody chose: transformers' default
        (`TRANSFORMERS_DEFAULT_MAX_LENGTH`, 20) without a `max_new_tokens`, in a config that owns a length rule
        (`length_rule`) or carries transformers' defaults for assisted decoding too (what `Seq2SeqTrainer`'s
        evaluation writes into the generation config of the model it saves, with every other default). A user's
        limit of 20 tokens goes into the call (`max_length=20`) or `max_new_tokens`."""
        config = self.generation_config
        if config.max_length != TRANSFORMERS_DEFAULT_MAX_LENGTH or config.max_new_tokens is not None:
            return False
        if getattr(config, "length_rule", None) is not None:
            return True
        return all(getattr(config, key, None) == value for key, value in FILLED_DEFAULTS.items())

    def _language_inputs(self, tgt_langs: list[str] | None, batch_size: int) -> dict[str, torch.Tensor]:
        """`tgt_lang_ids` (index of each target language in `config.languages`) for the models that condition on
        the target language (`language_ids_field`); nothing for the others, nor for a model with one row. Without
        `tgt_langs` a single-direction model (`config.default_target_language()`) uses its one target."""
        field = self.model.language_ids_field
        if field is None:
            return {}
        if tgt_langs is None:
            default = self.config.default_target_language()
            if default is not None:
                tgt_langs = [default] * batch_size
            elif getattr(self.config, field) > 1:
                raise ValueError(
                    f"This model needs `tgt_lang` (one of {self.config.languages}), one code or one per "
                    f"sentence, to pick the target language{_one_target_hint(self.config)}."
                )
            else:
                return {}
        if not self.config.languages:  # a single-direction model without a language list: like the baseline
            return {}
        return {"tgt_lang_ids": torch.tensor([self.config.language_id(lang) for lang in tgt_langs], dtype=torch.long)}

    def prepare_translation_inputs(
        self,
        tokenizer,
        texts: str | Sequence[str],
        *,
        src_lang: str | Sequence[str] | None = None,
        tgt_lang: str | Sequence[str] | None = None,
        text_target: str | Sequence[str] | None = None,
        max_length: int | None = None,
        **variant_kwargs,
    ) -> dict[str, torch.Tensor]:
        """Tokenize source sentences (and `text_target` as labels, padding = -100) into the model's inputs:
        target-language tags `<2xx>` when `config.target_language_tags`, language tokens when
        `config.target_language_token` (`_put_language_tokens`), and variant inputs (`_language_inputs`;
        `variant_kwargs` go to `_encode_sources`, e.g. MG-SA's `parses`). `src_lang` and `tgt_lang` are one code or
        one per sentence, checked against the model's languages. Used by the pipeline, the training and the
        evaluation code."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if isinstance(text_target, str):
            text_target = [text_target]
        check_tokenizer_fits_model(tokenizer, self.config)
        if tgt_lang is None:  # a single-direction model's one target (None: several, or none recorded)
            tgt_lang = self.config.default_target_language()
        tgt_langs = self._target_languages(tgt_lang, len(texts))
        src_langs = self._target_languages(src_lang, len(texts), "src_lang")
        pairs = zip(src_langs or [None] * len(texts), tgt_langs or [None] * len(texts))
        for source, target in dict.fromkeys(pairs):  # languages the model was not trained for are refused
            self.config.check_languages(src_lang=source, tgt_lang=target)
        if self.config.target_language_tags:
            if tgt_langs is None:
                raise ValueError(
                    f"This multilingual model needs `tgt_lang` (one of {self.config.languages})"
                    f"{_one_target_hint(self.config)}."
                )
            unk = tokenizer.unk_token_id
            for lang in set(tgt_langs):
                if tokenizer.convert_tokens_to_ids(language_tag(lang)) in (None, unk):
                    raise ValueError(f"The tokenizer has no language tag {language_tag(lang)!r}.")
        prefixes = [""] * len(texts)
        if self.config.target_language_tags:
            prefixes = [f"{language_tag(lang)} " for lang in tgt_langs]
        tokens = getattr(self.config, "target_language_token", False)
        if tokens and text_target is not None and tgt_langs and getattr(tokenizer, "tgt_lang", "") is None:
            # M2M100's tokenizer writes no labels without a `tgt_lang`: a copy with one (its token is replaced per
            # row below), the caller's tokenizer untouched (M2M100's state is plain attributes)
            tokenizer = copy.copy(tokenizer)
            tokenizer.tgt_lang = tgt_langs[0]
        inputs = self._encode_sources(tokenizer, texts, prefixes, text_target, max_length, **variant_kwargs)
        if tokens:
            self._put_language_tokens(tokenizer, inputs, src_langs, tgt_langs)
        if text_target is not None:
            labels = inputs["labels"]
            inputs["labels"] = labels.masked_fill(labels == tokenizer.pad_token_id, -100)
        inputs.update(self.target_language_inputs(tgt_langs, len(texts)))
        return {key: value.to(self.device) for key, value in inputs.items()}

    def target_language_inputs(self, tgt_langs: list[str] | None, batch_size: int) -> dict[str, torch.Tensor]:
        """The inputs naming each sentence's target language that decoding needs beside the source's token ids
        (which carry the `<2xx>` tag or the source language's token already): `tgt_lang_ids` for the models that
        condition on the target language (`_language_inputs`), and for those that force the target language's token
        first (`config.target_language_token`: `generate` reads which token from it)."""
        inputs = self._language_inputs(tgt_langs, batch_size)
        forced = getattr(self.config, "target_language_token", False)
        if forced and tgt_langs is not None and "tgt_lang_ids" not in inputs:
            ids = [self.config.language_id(lang) for lang in tgt_langs]
            inputs["tgt_lang_ids"] = torch.tensor(ids, dtype=torch.long)
        return inputs

    def _put_language_tokens(
        self, tokenizer, inputs: dict, src_langs: list[str] | None, tgt_langs: list[str] | None
    ) -> None:
        """M2M100 / NLLB-200's language tokens (`target_language_token`), in place: each source starts with its
        source language's token and each label row with its target language's (the tokenizer wrote those of its own
        `src_lang` / `tgt_lang` there, replaced here row by row: the caller's tokenizer keeps its languages, and one
        tokenizer serves mixed batches), and `tgt_lang_ids` tells `generate` which token to force first. Without
        `src_lang` a model with one source language uses it; otherwise the source language is required (the
        tokenizer's default, e.g. `eng_Latn`, would mark every source as English)."""
        config = self.config
        n = inputs["input_ids"].shape[0]
        if src_langs is None:
            default = config.default_source_language()
            if default is None:
                sources = config.translation_languages()[0]
                raise ValueError(
                    f"This model marks the source language with a token: pass `src_lang` (one code or one per "
                    f"sentence; its source languages: {_short_list(sources)})."
                )
            src_langs = [default] * n
        known = set(config.language_token_ids)
        ids = [config.language_token_id(lang) for lang in src_langs]
        put_language_tokens(inputs["input_ids"], inputs["attention_mask"].bool(), ids, known, "input_ids")
        if "labels" in inputs:
            if tgt_langs is None:
                raise ValueError(
                    "Labels of this model start with the target language's token: pass `tgt_lang` with `text_target`."
                )
            labels = inputs["labels"]
            ids = [config.language_token_id(lang) for lang in tgt_langs]
            put_language_tokens(labels, labels.ne(tokenizer.pad_token_id) & labels.ne(-100), ids, known, "labels")

    def _encode_sources(
        self,
        tokenizer,
        texts: list[str],
        prefixes: list[str],
        text_target: list[str] | None,
        max_length: int | None,
        **variant_kwargs,
    ) -> dict[str, torch.Tensor]:
        """The tokenized batch: `input_ids` and `attention_mask` of `prefix + text` per sentence (the prefix: its
        `<2xx> ` tag, or ""), `labels` of `text_target` (padding not yet -100) when given, and a variant's own
        inputs from `variant_kwargs` (MG-SA's phrases from `parses`); none here."""
        if variant_kwargs:
            raise ValueError(f"{type(self).__name__} takes no extra inputs, got {sorted(variant_kwargs)}.")
        sources = [prefix + text for prefix, text in zip(prefixes, texts)]
        encoded = tokenizer(
            sources,
            text_target=text_target,
            padding=True,
            truncation=max_length is not None,
            max_length=max_length,
            return_tensors="pt",
        )
        inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if text_target is not None:
            inputs["labels"] = encoded["labels"]
        return inputs

    @staticmethod
    def _target_languages(
        tgt_lang: str | Sequence[str] | None, batch_size: int, name: str = "tgt_lang"
    ) -> list[str] | None:
        """One language code per sentence from one code or a list (`name`: the argument, for errors)."""
        if tgt_lang is None:
            return None
        if isinstance(tgt_lang, str):
            return [tgt_lang] * batch_size
        langs = list(tgt_lang)
        if len(langs) != batch_size:
            raise ValueError(f"`{name}` has {len(langs)} entries for {batch_size} sentences.")
        if len(set(langs)) == 1 and langs[0] is None:
            return None
        return langs

    # --------------------------------------------------------------------------------------------- generate
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        *,
        tgt_lang: str | Sequence[str] | None = None,
        **kwargs,
    ):
        """`GenerationMixin.generate` with the package's conveniences:
        - `tgt_lang="de"` (or one code per sentence) sets `tgt_lang_ids` for the models that condition on the target
          language (MIMO, Tied); the source must already carry its `<2xx>` tag where the model uses tags
          (`prepare_translation_inputs` adds it);
        - a `streamer` without an explicit `num_beams` decodes greedily (streamers take one hypothesis; the saved
          default is beam 4);
        - without a length from the user, the output is limited by a rule of the source length (`length_rule`); a
          saved `max_length` of 20 that is transformers' default is no length from the user (`_unchosen_max_length`);
        - a source, or a requested output length, beyond `max_position_embeddings` raises a ValueError naming the
          length and the limit.

        The fast path (GPU decoding): `cache_implementation="static"` (pre-allocated keys and values) with
        `compile_config=transformers.CompileConfig(...)` (default: mode "reduce-overhead", i.e. CUDA graphs), in the
        call or the generation config, runs every decoding step after the first through one compiled graph, greedy
        and beam search alike (`_beam_search`), for every model type, with the tokens of the default dynamic cache.
        On CUDA a static cache alone turns the compilation on (transformers' rule)."""
        check_generation_supported()
        rule_override = kwargs.pop("length_rule", None)
        source = next(
            (x for x in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None), None
        )
        self._target_language_kwargs(tgt_lang, kwargs, source, generation_config)
        if kwargs.get("streamer") is not None and "num_beams" not in kwargs and generation_config is None:
            logger.info("A streamer decodes one hypothesis: using greedy search (pass num_beams=1 to silence this).")
            kwargs["num_beams"] = 1
        unchosen = self._unchosen_max_length()
        lengths = self._requested_lengths(source, generation_config, kwargs, unchosen)
        if rule_override is not None:
            given = [name for name in ("max_length", "max_new_tokens") if kwargs.get(name) is not None]
            if given:
                raise ValueError(f"Pass either `length_rule` or `{given[0]}` to generate, not both.")
            if source is None:
                raise ValueError("`length_rule` needs the source `input_ids` (or `inputs_embeds`) to measure.")
        if (rule_override is not None or not lengths) and source is not None:
            self._apply_length_rule(rule_override, source, kwargs, unchosen)
        if unchosen:  # transformers reads the model's config too: hide the 20 for this call
            self.generation_config.max_length = None
        try:
            with generation_scope():  # per-unit weights (MUTE, MIMO) and the cross-attention mask: once per call
                return super().generate(inputs, generation_config, **kwargs)
        finally:
            if unchosen:
                self.generation_config.max_length = TRANSFORMERS_DEFAULT_MAX_LENGTH

    def _requested_lengths(self, source, generation_config, kwargs: dict, unchosen: bool) -> dict:
        """The output lengths the call, its generation config or the saved one ask for (`max_length`,
        `max_new_tokens`), each checked against the model's positions, as is the source."""
        limit = self.config.max_position_embeddings
        if source is not None and source.shape[1] > limit:
            raise ValueError(
                f"The source has {source.shape[1]} tokens; this model's limit is max_position_embeddings={limit}."
            )
        if kwargs.get("max_length") is not None and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = None  # the call's max_length wins over a saved max_new_tokens
        saved = vars(self.generation_config)
        if unchosen:
            saved = {key: value for key, value in saved.items() if key != "max_length"}
        lengths = {}
        for name in ("max_length", "max_new_tokens"):
            for config in (kwargs, vars(generation_config) if generation_config is not None else {}, saved):
                if config.get(name) is not None:
                    lengths.setdefault(name, config[name])
        for name, value in lengths.items():
            if value > limit:
                raise ValueError(
                    f"`{name}={value}` asks for more target positions than this model has "
                    f"(max_position_embeddings={limit})."
                )
        return lengths

    def _apply_length_rule(self, rule_override, source: torch.Tensor, kwargs: dict, unchosen: bool) -> None:
        """The length rule per sentence: `max_new_tokens` up to the longest sentence's limit, and a logits processor
        that ends each sentence at its own."""
        a, b, cap = self.length_rule(rule_override)
        positions = self.config.max_position_embeddings
        limits = sentence_limits((a, b, cap), self._source_lengths(source, kwargs), positions)
        kwargs["max_new_tokens"] = max(limits)
        eos = self.generation_config.eos_token_id
        eos = self.config.eos_token_id if eos is None else eos
        prompt = kwargs.get("decoder_input_ids")
        processor = SentenceLengthLogitsProcessor(
            limits, eos[0] if isinstance(eos, (list, tuple)) else eos, 1 if prompt is None else prompt.shape[-1]
        )
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])
        if unchosen:
            logger.warning_once(
                f"generation_config.max_length={TRANSFORMERS_DEFAULT_MAX_LENGTH} is transformers' default (a "
                "Seq2SeqTrainer evaluation with predict_with_generate writes it into the generation config it "
                f"saves), not a limit: the length rule applies (at most {a:g} x source length + {b} new tokens, "
                f"up to {cap}). Pass max_length= or max_new_tokens= to generate (or set "
                "generation_config.max_new_tokens) for a fixed limit."
            )

    def _target_language_kwargs(self, tgt_lang, kwargs: dict, source, generation_config=None) -> None:
        """`generate`'s target language, into `kwargs`: `tgt_lang` (one code or one per sentence) checked, as
        `tgt_lang_ids` for the models that condition on it (MIMO, Tied); with `config.target_language_token`, the
        `TargetLanguageLogitsProcessor` forcing each sentence's language token (from `tgt_lang`, the
        `tgt_lang_ids` that `prepare_translation_inputs` gives, or the model's one target language), unless the
        call forces a first token itself (`forced_bos_token_id`, a decoder prompt)."""
        token = getattr(self.config, "target_language_token", False)
        langs = None
        if tgt_lang is not None:
            if kwargs.get("tgt_lang_ids") is not None:
                raise ValueError("Pass either `tgt_lang` or `tgt_lang_ids`, not both.")
            if self.model.language_ids_field is None and not token:
                raise ValueError(
                    f"{type(self).__name__} takes the target language as the `<2xx>` tag of its source: "
                    "pass `tgt_lang` to `prepare_translation_inputs` or the pipeline, not to generate."
                )
            if source is None:
                raise ValueError("`tgt_lang` needs the source `input_ids` to know the batch size.")
            langs = self._target_languages(tgt_lang, source.shape[0])
            for lang in dict.fromkeys(langs):
                self.config.check_languages(tgt_lang=lang)
            kwargs.update({k: v.to(source.device) for k, v in self._language_inputs(langs, len(langs)).items()})
        if token:
            self._force_target_language(kwargs, source, langs, generation_config)

    def _force_target_language(self, kwargs: dict, source, langs: list[str] | None, generation_config) -> None:
        """See `_target_language_kwargs` (`config.target_language_token`)."""
        config = self.config
        ids = kwargs.get("tgt_lang_ids")
        if self.model.language_ids_field is None:
            kwargs.pop("tgt_lang_ids", None)  # the baseline reads the language from its decoder's first token
        if any(isinstance(p, TargetLanguageLogitsProcessor) for p in kwargs.get("logits_processor") or ()):
            return  # forced already: transformers passes the processors on (an assistant model's generate)
        prompt = kwargs.get("decoder_input_ids")
        forced = (kwargs.get("forced_bos_token_id"), getattr(generation_config, "forced_bos_token_id", None))
        chosen = any(f is not None for f in forced) or (prompt is not None and prompt.shape[-1] > 1)
        saved = getattr(self.generation_config, "forced_bos_token_id", None) is not None
        if langs is not None or ids is not None:
            if chosen:
                raise ValueError(
                    "`tgt_lang` forces the first token after the decoder start token; this call forces it already "
                    "(`forced_bos_token_id`, or a `decoder_input_ids` prompt): pass one of them."
                )
            index = [config.language_id(lang) for lang in langs] if langs is not None else None
            if index is None:
                index = torch.as_tensor(ids).reshape(-1).tolist()
                if any(not 0 <= i < len(config.languages) for i in index):
                    raise ValueError(f"`tgt_lang_ids` must be in [0, {len(config.languages)}) (config.languages).")
        elif chosen or saved:  # the call's (or the saved generation config's) own first token
            return
        elif config.default_target_language() is not None:  # one token for every row
            index = [config.language_id(config.default_target_language())]
        else:
            raise ValueError(
                f"This model starts each translation with the target language's token: pass `tgt_lang` (one of "
                f"{_short_list(config.translation_languages()[1])}; one code or one per sentence), or "
                "`forced_bos_token_id`."
            )
        processor = TargetLanguageLogitsProcessor([config.language_token_ids[i] for i in index])
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])

    def _source_lengths(self, source: torch.Tensor, kwargs: dict) -> list[int]:
        """Each source's length in tokens, for the length rule: its attention mask's sum, else its tokens that are
        not padding (`input_ids` without a mask), else the padded length."""
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            return mask.sum(-1).tolist()
        pad = self.config.pad_token_id
        if source.dim() == 2 and not source.is_floating_point() and pad is not None:
            return (source != pad).sum(-1).tolist()
        return [source.shape[1]] * source.shape[0]

    def _get_logits_processor(self, *args, **kwargs) -> LogitsProcessorList:
        """transformers' processor list, with its token-suppression processors merged into one that copies the
        scores once, and not at all when inactive (`TokenSuppressionLogitsProcessor`: the same scores)."""
        return TokenSuppressionLogitsProcessor.merge(super()._get_logits_processor(*args, **kwargs))

    @staticmethod
    def _reorder_cache(cache: Cache, beam_idx: torch.LongTensor) -> Cache:
        """Beam search's cache reordering (`GenerationMixin._beam_search` calls this hook): the self-attention
        cache only. Beam search moves hypotheses within a sentence (`beam_idx` maps each row to a row of the same
        sentence), and a sentence's cross-attention keys and values are the same in all its rows (computed from its
        encoder output, which `generate` repeats per beam), so reordering them would copy equal rows."""
        own = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if getattr(own, "is_compileable", False):
            reorder_in_place(own, beam_idx)
        else:
            own.reorder_cache(beam_idx)
        return cache

    def _beam_search(
        self,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        **model_kwargs,
    ):
        """transformers' beam search, whose decoding steps run compiled like greedy search's when `generate` compiles
        (a static cache, `compile_config` or an accelerator: `_valid_auto_compile_criteria`); transformers compiles
        the steps of greedy search and sampling only. The first step (it fills the cross-attention cache) stays
        eager, as transformers' prefill does (`compiled_decoding_steps`)."""
        if not self._valid_auto_compile_criteria(model_kwargs, generation_config):
            return super()._beam_search(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **model_kwargs
            )
        with compiled_decoding_steps(self, generation_config.compile_config):
            return super()._beam_search(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **model_kwargs
            )


# ------------------------------------------------------------------------------------------ static-cache decoding
def reorder_in_place(cache: Cache, beam_idx: torch.LongTensor) -> None:
    """Beam search's reordering of a pre-allocated (static) cache, written into its own tensors: compiled steps,
    CUDA graphs above all, read the cache at fixed addresses (`torch._dynamo.mark_static_address`), which
    transformers' `reorder_cache` (a new tensor per layer and step) would move."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", True):
            continue
        index = beam_idx.to(layer.keys.device)
        layer.keys.copy_(layer.keys.index_select(0, index))
        layer.values.copy_(layer.values.index_select(0, index))


def decoding_step_ready(cache) -> bool:
    """Whether a forward call is a decoding step over filled cross-attention keys and values (every step after the
    first), the call with static shapes that a compiled step serves."""
    updated = getattr(cache, "is_updated", None)
    return bool(updated) and all(updated.values())


@contextmanager
def compiled_decoding_steps(model, compile_config=None):
    """Within the block, `model`'s forward calls on a filled cache (`decoding_step_ready`) run
    `torch.compile(model.forward, **compile_config)` (transformers' `CompileConfig`; its default: fullgraph,
    "reduce-overhead", i.e. CUDA graphs on a GPU); the other calls run eagerly. The compiled function is kept on the
    model for the next calls with the same config (`_compiled_step`)."""
    config = compile_config or model._default_compile_config()
    own = model.__dict__.get("forward")  # a forward installed on the instance (accelerate's device hooks), kept
    eager = model.forward
    cached = getattr(model, "_compiled_step", None)
    if cached is None or cached[0] != (config, own):
        cached = ((config, own), torch.compile(eager, **config.to_dict()))
        model._compiled_step = cached
    compiled = cached[1]

    def forward(*args, **kwargs):
        if decoding_step_ready(kwargs.get(CACHE_NAME, kwargs.get(LEGACY_CACHE_NAME))):
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


__all__ = [
    "TargetLanguageLogitsProcessor",
    "TransformerNmtGenerationMixin",
    "TokenSuppressionLogitsProcessor",
    "generation_scope",
    "resolve_language_ids",
]
