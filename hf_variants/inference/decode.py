"""The engine layer of the translation core: one batch of requests in, hypotheses out, on any engine.

An engine (`Engine`, the interface; `ENGINES`, the name -> class table) turns a batch of `TranslationRequest`s
into `Hypothesis` lists, counts source tokens, and scores given token sequences (teacher forcing). The
`Translator` above it does the rest (checks, defaults, empty and too-long sources, length-sorted batches, order,
streaming), so every engine gets the same behaviour:

| engine        | class                      | decodes with                                       | alignments |
|---------------|----------------------------|----------------------------------------------------|------------|
| `torch`       | `TorchEngine`              | the PyTorch model's `generate()`                    | yes        |
| `onnx`        | `OnnxEngine`               | `OrtModelForSeq2SeqLM.generate()` (ONNX Runtime)    | no         |
| `ctranslate2` | `ctranslate2_engine` module | CTranslate2's `Translator` (the `deploy` extra)    | no         |

`GenerateEngine` is the engine of any model with transformers' `generate()`: its hypotheses carry
- `text`, `tokens`, `token_ids` (the generated tokens after the decoder's start token, `</s>` included);
- `log_prob`: the sum of the tokens' log-probabilities from one teacher-forced forward over (source, hypothesis)
  (`token_log_probs`, the function the scoring of given pairs runs: a hypothesis scored later gets the same number;
  on ONNX Runtime the folder's scoring graph where it has one, else the step graph one position at a time);
- `score`: what the search ranked by: beam search's length-normalized score, `log_prob / length ** length_penalty`
  (transformers' `sequences_scores`; taken from generate() itself where a logits processor changes the chosen
  tokens' values, i.e. with `repetition_penalty`), and the same normalization for greedy search and sampling;
- `alignment` (torch only): from the same teacher-forced forward with `output_attentions=True`: the cross-attention
  of the decoder's LAST layer averaged over its heads (fairseq's default alignment layer), each target subword
  aligned to the source subword it attends to most (language tags and `</s>` left out on both sides), mapped to
  whitespace words (`word_indices`), pairs deduplicated and sorted. Each variant gives its own decoder's
  cross-attention (MIMO, Tied, ... return theirs through `output_attentions`).

Prefixes are forced fairseq-style by a logits processor (`PrefixLogitsProcessor`): at each step below a row's prefix
length every other token is masked, so positions, the cache and the other rows of the batch are untouched, and beam
scores carry the prefix tokens' real log-probabilities. The default output limit is the length rule per sentence,
defined once in the model code (`generation_transformer_nmt`): each row's own source length (its attention mask)
sets its limit, `min(a * length + b, cap, positions)` new tokens, `</s>` forced at the last one; the core passes
`generate(length_rule={"max_len_a": a, "max_len_b": b})` (a model without that argument gets the model code's
`SentenceLengthLogitsProcessor`), so a translation does not depend on its batch. Sampling draws each sentence's
samples from a generator of its own (`sampling`: seeded from `DecodeOptions.seed` and `TranslationRequest.index`),
so samples do not depend on the batch either; a sampled n-best list is scored and sorted best first.

Requests with constraints (target phrases the translation must contain) go to `translate_constrained` instead
(engines with `supports_constraints`: both generate() engines; not CTranslate2): the constrained beam search of
`constrained` over the engine's step interface (`decoder_steps`: the torch model's forward with transformers' cache,
or `OrtModelForSeq2SeqLM.forward` on the step graph), with the same length rule, prefixes, generation-config rules
and hypotheses (teacher-forced `log_prob`; `score` the search's length-normalized score), and per hypothesis
`constraints_met`.
"""

from __future__ import annotations

import importlib
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..generation_transformer_nmt import SentenceLengthLogitsProcessor, check_tokenizer_fits_model, sentence_limits
from .constrained import (
    DecoderSteps,
    OrtSteps,
    SearchSettings,
    TorchSteps,
    constrained_beam_search,
    generation_rules,
    word_continuations,
)
from .constraints import ConstraintTracker
from .requests import DecodeOptions, DecodingCancelled, Hypothesis, TranslationRequest
from .sampling import SentenceSampler, sampling_warpers, sentence_seeds

# engine name -> "module:Class" (imported when asked for: the ctranslate2 engine needs its extra)
ENGINES: dict[str, str] = {
    "torch": "hf_variants.inference.decode:TorchEngine",
    "onnx": "hf_variants.inference.decode:OnnxEngine",
    "ctranslate2": "hf_variants.inference.ctranslate2_engine:CTranslate2Engine",
}
PRECISIONS = ("fp32", "int8")
COUNT_CHUNK = 256  # sentences tokenized at a time when counting source tokens


def engine_class(name: str) -> type[Engine]:
    """The engine class registered under `name` in `ENGINES` (a ValueError naming the known ones otherwise)."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r}: expected one of {sorted(ENGINES)}")
    module_name, _, class_name = ENGINES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"engine={name!r} is not available: {error}") from error
    return getattr(module, class_name)


# ---------------------------------------------------------------------------------------------------- interface
class Engine(ABC):
    """What the `Translator` needs of an engine. A subclass sets `name` and `supports_alignments` and implements:

    - `load(path, precision, num_threads, trust_remote_code, tokenizer)`: the engine of a saved model;
    - `encode_sources(requests, max_source_length)`: each source's token ids as the model receives them (language tag
      and `</s>` included), cut to `max_source_length` tokens where given (`source_lengths`: their lengths);
    - `translate_batch(requests, options, cancelled)`: per request its `options.nbest` hypotheses, best first; the
      requests are checked, non-empty and fit the model, and are decoded from their `source_ids` where they carry
      them (tokenized once, by `encode_sources`); `options` are resolved (`Translator.resolve`: no None where the
      model has a saved choice); `cancelled()` (optional) is asked at every decoding step: once it is true the
      decoding stops and `DecodingCancelled` is raised;
    - `token_log_probs(requests, targets)`: the log-probability of each token of each target (token ids after the
      decoder's start token, `</s>` included) given its source, by teacher forcing.

    `config` (the model's `PretrainedConfig`), `tokenizer` and `generation_config` are attributes."""

    name: ClassVar[str] = ""
    supports_alignments: ClassVar[bool] = False
    # whether `translate_constrained` (lexically constrained beam search) is implemented
    supports_constraints: ClassVar[bool] = False

    config: Any
    tokenizer: Any
    generation_config: Any

    @classmethod
    @abstractmethod
    def load(
        cls,
        path: str,
        *,
        precision: str = "fp32",
        num_threads: int | None = None,
        trust_remote_code: bool = False,
        tokenizer=None,
    ) -> Engine: ...

    @abstractmethod
    def encode_sources(
        self, requests: Sequence[TranslationRequest], max_source_length: int | None = None
    ) -> list[list[int]]: ...

    def source_lengths(self, requests: Sequence[TranslationRequest]) -> list[int]:
        return [len(ids) for ids in self.encode_sources(requests)]

    @abstractmethod
    def translate_batch(
        self,
        requests: Sequence[TranslationRequest],
        options: DecodeOptions,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Hypothesis]]: ...

    @abstractmethod
    def token_log_probs(
        self, requests: Sequence[TranslationRequest], targets: Sequence[Sequence[int]], max_source_length=None
    ) -> list[list[float]]: ...

    def translate_constrained(
        self,
        requests: Sequence[TranslationRequest],
        options: DecodeOptions,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Hypothesis]]:
        """As `translate_batch`, for requests with constraints (normalized, checked), by constrained beam search
        with `options.num_beams` beams; each hypothesis' `constraints_met` set. Engines with
        `supports_constraints` implement it."""
        raise NotImplementedError(f"the {self.name} engine has no lexically constrained decoding")

    @classmethod
    def unsupported(cls, options: DecodeOptions) -> str | None:
        """Why this engine cannot decode with `options` (None: it can), in words naming the option. A class method:
        a command asks it before the model loads."""
        if options.alignments and not cls.supports_alignments:
            return (
                f"alignments: they come from the decoder's cross-attention, which the {cls.name} engine does not "
                "return (use the torch engine)"
            )
        return None

    def length_rule(self) -> tuple[float, int, int]:
        """(a, b, cap) of the model's saved length rule: at most min(a * source length + b, cap) new tokens."""
        saved = getattr(self.model, "length_rule", None) if hasattr(self, "model") else None
        if callable(saved):
            return saved()
        rule = getattr(self.generation_config, "length_rule", None)
        if isinstance(rule, Mapping):
            return float(rule["max_len_a"]), int(rule["max_len_b"]), int(rule["max_new_tokens"])
        return DEFAULT_LENGTH_RULE


def ranks_samples(options: DecodeOptions) -> bool:
    """Whether the hypotheses of a call are samples to sort by score (`nbest` > 1 with `do_sample`): the engines
    then compute every hypothesis' score, asked for or not."""
    return options.do_sample and options.nbest > 1


# a model saved without a length rule (transformers' MarianMTModel trained by the toolkit, older checkpoints)
DEFAULT_LENGTH_RULE = (2.0, 10, 256)


# ----------------------------------------------------------------------------------------------- logits processors
class PrefixLogitsProcessor:
    """Forces each row's prefix tokens: at generated position t < len(prefix), every token but prefix[t] gets -inf.
    The forced token keeps its own score (beam search adds its real log-probability). `prefixes`: one token-id list
    per sentence; rows of the search are sentences x `expand` (beams or returned sequences), in order."""

    def __init__(self, prefixes: Sequence[Sequence[int]], expand: int, start: int = 1):
        self.prefixes = [list(p) for p in prefixes]
        self.expand, self.start = expand, start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[-1] - self.start
        rows, tokens = [], []
        for row in range(input_ids.shape[0]):
            prefix = self.prefixes[row // self.expand]
            if step < len(prefix):
                rows.append(row)
                tokens.append(prefix[step])
        if not rows:
            return scores
        rows_t = torch.tensor(rows, device=scores.device)
        tokens_t = torch.tensor(tokens, device=scores.device)
        kept = scores[rows_t, tokens_t]
        scores = scores.clone()
        scores[rows_t] = -math.inf
        scores[rows_t, tokens_t] = kept
        return scores


class CancelCriteria:
    """A stopping criterion of `generate()` that ends every row once `cancelled()` is true: the caller's cancel flag,
    asked at every decoding step (transformers' loops call it; the ONNX Runtime bound search reads `cancelled`)."""

    def __init__(self, cancelled: Callable[[], bool]):
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), bool(self.cancelled()), dtype=torch.bool, device=input_ids.device)


def check_cancelled(cancelled: Callable[[], bool] | None) -> None:
    """Raise `DecodingCancelled` when `cancelled()` is true."""
    if cancelled is not None and cancelled():
        raise DecodingCancelled("the decoding was cancelled")


# ---------------------------------------------------------------------------------------------------- words
def word_indices(tokenizer, ids: Sequence[int]) -> list[int | None]:
    """For each token id, the index of the whitespace word of `tokenizer.decode(ids, skip_special_tokens=True)` it
    belongs to (None: a special token, or one that adds no visible character), read from the decoded prefixes: token
    i belongs to the last word of decode(ids[: i + 1])."""
    special = set(tokenizer.all_special_ids)
    out: list[int | None] = []
    previous = ""
    for i, token in enumerate(ids):
        if token in special:
            out.append(None)
            continue
        text = tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=True)
        if text.strip() == previous.strip() and text.split() == previous.split():
            out.append(None)
        else:
            out.append(max(0, len(text.split()) - 1))
        previous = text
    return out


def hard_alignment(
    attention: torch.Tensor, source_words: Sequence[int | None], target_words: Sequence[int | None]
) -> list[tuple[int, int]]:
    """(source word, target word) pairs: each target token (row of `attention`, [target, source]) aligned to the
    source token it attends to most among those with a word; deduplicated, sorted."""
    keep = [j for j, w in enumerate(source_words) if w is not None]
    if not keep:
        return []
    columns = attention[:, keep]
    pairs = set()
    for t, tw in enumerate(target_words):
        if tw is None or t >= attention.shape[0]:
            continue
        s = keep[int(columns[t].argmax())]
        pairs.add((source_words[s], tw))
    return sorted(pairs)


# --------------------------------------------------------------------------------------------- generate engine
def _is_tensor_batch(value, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


class GenerateEngine(Engine):
    """The engine of a model with transformers' `generate()` and (for hf_variants models) the model's own
    `prepare_translation_inputs`; see the module docstring for what its hypotheses carry."""

    name = "generate"
    supports_constraints = True

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.generation_config = model.generation_config
        self._length_rule_kwarg = _takes_length_rule(model)
        self._word_continuations: tuple[int, ...] | None = None  # read from the tokenizer on first use

    # ----------------------------------------------------------------------------------------------- inputs
    def encode(self, requests: Sequence[TranslationRequest], max_source_length: int | None = None) -> dict:
        """The model inputs of a batch: the model's `prepare_translation_inputs` (language tags, `tgt_lang_ids`,
        a variant's own inputs from the requests' annotations), or the tokenizer for a plain seq2seq model."""
        texts = [r.source for r in requests]
        names = sorted({name for r in requests for name in r.annotations})
        annotations = {name: [r.annotations.get(name) for r in requests] for name in names}
        langs = [r.tgt_lang for r in requests]
        sources = [r.src_lang for r in requests]
        prepare = getattr(self.model, "prepare_translation_inputs", None)
        if prepare is not None:
            kwargs = {"tgt_lang": langs} if any(lang is not None for lang in langs) else {}
            if any(lang is not None for lang in sources):  # M2M100 / NLLB-200: the source language's token
                kwargs["src_lang"] = sources
            return prepare(self.tokenizer, texts, max_length=max_source_length, **kwargs, **annotations)
        if annotations:
            raise ValueError(f"{type(self.model).__name__} takes no annotations, got {names}.")
        encoded = self.tokenizer(
            texts,
            padding=True,
            truncation=max_source_length is not None,
            max_length=max_source_length,
            return_tensors="pt",
        )
        device = getattr(self.model, "device", torch.device("cpu"))
        return {k: encoded[k].to(device) for k in ("input_ids", "attention_mask")}

    def encode_sources(
        self, requests: Sequence[TranslationRequest], max_source_length: int | None = None
    ) -> list[list[int]]:
        ids: list[list[int]] = []
        for start in range(0, len(requests), COUNT_CHUNK):
            inputs = self.encode(requests[start : start + COUNT_CHUNK], max_source_length)
            for row, mask in zip(inputs["input_ids"].tolist(), inputs["attention_mask"].tolist()):
                ids.append([token for token, kept in zip(row, mask) if kept])
        return ids

    def batch_inputs(self, requests: Sequence[TranslationRequest], max_source_length: int | None = None) -> dict:
        """The model inputs of a batch: from the requests' `source_ids` where every request carries them (padded as
        the tokenizer pads; a source longer than `max_source_length` encoded again, cut), else `encode`."""
        if not requests or any(r.source_ids is None or r.annotations for r in requests):
            return self.encode(requests, max_source_length)
        rows = [list(r.source_ids) for r in requests]
        if max_source_length is not None:
            long = [i for i, row in enumerate(rows) if len(row) > max_source_length]
            for i, ids in zip(long, self.encode_sources([requests[i] for i in long], max_source_length)):
                rows[i] = ids
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.config.pad_token_id
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), pad if pad is not None else 0, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        for i, row in enumerate(rows):
            span = slice(width - len(row), width) if left else slice(0, len(row))
            input_ids[i, span] = torch.tensor(row, dtype=torch.long)
            mask[i, span] = 1
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        # the target language's inputs (tgt_lang_ids); models saved before `target_language_inputs` have only
        # `_language_inputs`
        language = getattr(self.model, "target_language_inputs", None) or getattr(self.model, "_language_inputs", None)
        if callable(language) and getattr(self.model, "prepare_translation_inputs", None) is not None:
            langs = [r.tgt_lang for r in requests]
            inputs.update(language(langs if any(lang is not None for lang in langs) else None, len(rows)))
        device = getattr(self.model, "device", torch.device("cpu"))
        return {key: value.to(device) for key, value in inputs.items()}

    def prefix_ids(self, prefix: str | None) -> list[int]:
        """The token ids a prefix forces (no special tokens: `</s>` is not appended)."""
        if not prefix:
            return []
        return list(self.tokenizer(prefix, add_special_tokens=False)["input_ids"])

    # -------------------------------------------------------------------------------------------- decoding
    def generate_kwargs(self, inputs: dict, requests: Sequence[TranslationRequest], options: DecodeOptions) -> dict:
        """generate()'s arguments for `options` (resolved) on the batch `inputs` (with sampling: `sampling_inputs`,
        each sentence's rows repeated `nbest` times)."""
        beams = options.beams
        expand = beams if beams > 1 else options.nbest
        returned = 1 if options.do_sample else options.nbest  # sampling: the rows are already sentences x nbest
        kwargs: dict[str, Any] = {"num_beams": beams, "num_return_sequences": returned, "do_sample": False}
        if beams > 1:
            kwargs["length_penalty"] = options.length_penalty
        for name in ("no_repeat_ngram_size", "repetition_penalty"):
            if getattr(options, name) is not None:
                kwargs[name] = getattr(options, name)
        processors = []
        if options.max_length is not None:
            kwargs["max_length"] = options.max_length
        elif options.max_new_tokens is not None:
            kwargs["max_new_tokens"] = options.max_new_tokens
        elif self._length_rule_kwarg and not options.do_sample:  # the model applies the rule per sentence itself
            kwargs["length_rule"] = {"max_len_a": options.max_len_a, "max_len_b": options.max_len_b}
        else:  # the same rule, from the model code: a plain transformers seq2seq model, or sampling (whose sampler
            # must come after the rule's end token, as transformers' warpers come after the model's processors)
            limits = self.length_limits(inputs["attention_mask"].sum(-1).tolist(), options)
            kwargs["max_new_tokens"] = max(limits)
            processors.append(SentenceLengthLogitsProcessor(limits, self.config.eos_token_id))
        prefixes = [self.prefix_ids(r.prefix) for r in requests]
        if any(prefixes):
            processors.append(PrefixLogitsProcessor(prefixes, expand))
        if options.do_sample:  # per-sentence generators, after every other processor (`sampling`)
            processors += sampling_warpers(options, self.generation_config)
            seeds = sentence_seeds(options.seed, [r.index for r in requests])
            processors.append(SentenceSampler(seeds, options.nbest))
        if processors:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList(processors)
        if options.scores and beams > 1 and options.repetition_penalty not in (None, 1.0):
            kwargs.update(output_scores=True, return_dict_in_generate=True)
        return kwargs

    def length_limits(self, source_lengths: Sequence[int], options: DecodeOptions) -> list[int]:
        """Each sentence's new-token limit under the length rule with `options`' a and b and the saved cap
        (`sentence_limits` of the model code: min(a * length + b, cap, positions), `</s>` included)."""
        _, _, cap = self.length_rule()
        positions = getattr(self.config, "max_position_embeddings", None) or cap
        return sentence_limits((options.max_len_a, options.max_len_b, cap), source_lengths, positions)

    def _run_generate(self, inputs: dict, kwargs: dict):
        with torch.inference_mode():
            return self.model.generate(**inputs, **kwargs)

    def sampling_inputs(self, inputs: dict, nbest: int) -> dict:
        """The model inputs of a sampled batch: each sentence's rows repeated `nbest` times (its samples are rows
        of greedy search, drawn by `SentenceSampler`)."""
        batch = inputs["input_ids"].shape[0]
        if nbest == 1:
            return inputs
        return {k: (v.repeat_interleave(nbest, dim=0) if _is_tensor_batch(v, batch) else v) for k, v in inputs.items()}

    def translate_batch(
        self,
        requests: Sequence[TranslationRequest],
        options: DecodeOptions,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Hypothesis]]:
        inputs = self.batch_inputs(requests, options.max_source_length)
        search = self.sampling_inputs(inputs, options.nbest) if options.do_sample else inputs
        kwargs = self.generate_kwargs(search, requests, options)
        if cancelled is not None:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList([CancelCriteria(cancelled)])
        out = self._run_generate(search, kwargs)
        check_cancelled(cancelled)
        sequences = out.sequences if hasattr(out, "sequences") else out
        sequence_scores = getattr(out, "sequences_scores", None)
        ids = [self._hypothesis_ids(row) for row in sequences.tolist()]
        scores = sequence_scores.tolist() if sequence_scores is not None else None
        return self._hypotheses(inputs, ids, options, scores)

    def _hypotheses(
        self, inputs: dict, ids: list[list[int]], options: DecodeOptions, search_scores: list[float] | None
    ) -> list[list[Hypothesis]]:
        """The hypotheses of token id lists (`options.nbest` consecutive ones per sentence of `inputs`), with their
        teacher-forced `log_prob`, their `score` (`search_scores` where the search gave them, else `log_prob` over
        length ** length_penalty) and alignments where `options` ask for them; per sentence."""
        n = options.nbest
        hyps = [
            Hypothesis(
                text=self.tokenizer.decode(row, skip_special_tokens=True).strip(),
                tokens=self.tokenizer.convert_ids_to_tokens(row),
                token_ids=row,
            )
            for row in ids
        ]
        if options.scores or options.alignments or ranks_samples(options):
            log_probs, attentions = self._teacher_forced(inputs, ids, n, attentions=options.alignments)
            if options.scores or ranks_samples(options):
                lp = options.length_penalty if options.length_penalty is not None else 1.0
                for k, (hyp, values) in enumerate(zip(hyps, log_probs)):
                    hyp.log_prob = float(sum(values))
                    if search_scores is not None:
                        hyp.score = float(search_scores[k])
                    else:
                        hyp.score = hyp.log_prob / (max(1, len(values)) ** lp)
            if options.alignments:
                source_ids = inputs["input_ids"].repeat_interleave(n, dim=0)
                mask = inputs["attention_mask"].repeat_interleave(n, dim=0)
                for k, (hyp, attention) in enumerate(zip(hyps, attentions)):
                    src = source_ids[k][mask[k].bool()].tolist()
                    hyp.alignment = hard_alignment(
                        attention[: len(hyp.token_ids), : len(src)],
                        word_indices(self.tokenizer, src),
                        word_indices(self.tokenizer, hyp.token_ids),
                    )
        return [hyps[i * n : (i + 1) * n] for i in range(len(ids) // n)]

    # ---------------------------------------------------------------------------------------- constraints
    def constraint_ids(self, constraints: Sequence[Sequence[str]]) -> list[list[list[int]]]:
        """The token ids of each form of each constraint (normalized: tuples of forms), as the target side
        tokenizes it without special tokens. A ValueError names a form that gives no token, or a special token
        (`<unk>` for characters the vocabulary lacks, `</s>`, a language tag): the output could not show it."""
        special = set(self.tokenizer.all_special_ids)
        out = []
        for j, forms in enumerate(constraints):
            ids = []
            for a, form in enumerate(forms):
                where = f"constraints[{j}]" if len(forms) == 1 else f"constraints[{j}][{a}]"
                tokens = self.prefix_ids(form)
                if not tokens:
                    raise ValueError(f"{where}: {form!r} tokenizes to no tokens")
                bad = [t for t in tokens if t in special]
                if bad:
                    token = self.tokenizer.convert_ids_to_tokens(bad[0])
                    raise ValueError(
                        f"{where}: {form!r} tokenizes to the special token {token!r} (characters the vocabulary "
                        "lacks give <unk>): the translation could not contain it"
                    )
                ids.append(tokens)
            out.append(ids)
        return out

    def decoder_steps(self) -> DecoderSteps:
        """The step interface the constrained search drives (`constrained.TorchSteps` here)."""
        return TorchSteps(self.model)

    def search_settings(self, inputs: dict, requests: Sequence[TranslationRequest], options: DecodeOptions):
        """The constrained search's settings for a batch (`constrained.SearchSettings`): `options` (resolved; its
        beam size already the search's), the sentences' output limits (the length rule per sentence, or the fixed
        limit), the prefixes, and the rules of the model's generation config (`constrained.generation_rules`)."""
        rules = generation_rules(self.generation_config, self.config)
        forced_eos = rules.pop("forced_eos")
        if options.max_length is not None:
            limits, force = [options.max_length - 1] * len(requests), forced_eos
        elif options.max_new_tokens is not None:
            limits, force = [options.max_new_tokens] * len(requests), forced_eos
        else:
            limits, force = self.length_limits(inputs["attention_mask"].sum(-1).tolist(), options), True
        return SearchSettings(
            beams=options.num_beams,
            nbest=options.nbest,
            length_penalty=options.length_penalty if options.length_penalty is not None else 1.0,
            limits=[max(1, limit) for limit in limits],
            force_eos=force,
            prefixes=[self.prefix_ids(r.prefix) for r in requests],
            word_continuations=self.word_continuation_ids(),
            **rules,
        )

    def word_continuation_ids(self) -> tuple[int, ...]:
        """The tokenizer's word-continuing tokens (`constrained.word_continuations`), read once."""
        if self._word_continuations is None:
            self._word_continuations = word_continuations(self.tokenizer)
        return self._word_continuations

    def translate_constrained(
        self,
        requests: Sequence[TranslationRequest],
        options: DecodeOptions,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Hypothesis]]:
        inputs = self.encode(requests, options.max_source_length)
        trackers = [ConstraintTracker(self.constraint_ids(r.constraints)) for r in requests]
        settings = self.search_settings(inputs, requests, options)
        found = constrained_beam_search(self.decoder_steps(), inputs, settings, trackers, cancelled)
        flat = [f for sentence in found for f in sentence]
        hypotheses = self._hypotheses(inputs, [f.token_ids for f in flat], options, [f.score for f in flat])
        for hypothesis, f in zip((h for sentence in hypotheses for h in sentence), flat):
            hypothesis.constraints_met = list(f.met)
        return hypotheses

    @property
    def prompt_length(self) -> int:
        """The decoder's tokens before a hypothesis: its start token, and the target language's token where the
        model forces one (`config.target_language_token`: M2M100 / NLLB-200), which is no choice of the search: not
        part of the hypothesis, not scored."""
        return 2 if getattr(self.config, "target_language_token", False) else 1

    def _hypothesis_ids(self, row: list[int]) -> list[int]:
        """The generated tokens of one output row: after the decoder's prompt (`prompt_length`), up to and including
        the first `</s>`, without padding."""
        eos = self.config.eos_token_id
        pad = self.config.pad_token_id
        tokens = row[self.prompt_length :]
        if eos in tokens:
            return tokens[: tokens.index(eos) + 1]
        while tokens and tokens[-1] == pad:
            tokens.pop()
        return tokens

    # ------------------------------------------------------------------------------------------ teacher forcing
    def _forward(self, inputs: dict, decoder_input_ids: torch.Tensor, attentions: bool):
        kwargs = {"decoder_input_ids": decoder_input_ids}
        if attentions:
            kwargs["output_attentions"] = True
        with torch.inference_mode():
            return self.model(**inputs, **kwargs)

    def _prompts(self, inputs: dict, rows: int, expand: int) -> list[list[int]]:
        """Each row's decoder prompt (`prompt_length` tokens): the start token, then for a model forcing the target
        language's token (`config.target_language_token`) that token, from the batch's `tgt_lang_ids`."""
        start = self.config.decoder_start_token_id
        if self.prompt_length == 1:
            return [[start]] * rows
        ids = inputs.get("tgt_lang_ids")
        if ids is None:
            raise ValueError("This model starts each translation with the target language's token: pass tgt_lang.")
        tokens = [self.config.language_token_ids[i] for i in ids.reshape(-1).tolist()]
        return [[start, tokens[r // expand]] for r in range(rows)]

    def _teacher_inputs(
        self, inputs: dict, targets: Sequence[Sequence[int]], expand: int
    ) -> tuple[dict, torch.Tensor, torch.Tensor, int]:
        """(the source inputs repeated `expand` times per sentence, decoder inputs [rows, width]: the decoder's
        prompt (`_prompts`) then each target but its last token, labels [rows, width]: each target, -100 where
        padded and over the prompt, the position of each target's first label: `prompt_length - 1`)."""
        batch = inputs["input_ids"].shape[0]
        rows = len(targets)
        if rows != batch * expand:
            raise ValueError(f"{rows} targets for {batch} sources x {expand}.")
        expanded = {
            k: (v.repeat_interleave(expand, dim=0) if _is_tensor_batch(v, batch) else v) for k, v in inputs.items()
        }
        prompts = self._prompts(inputs, rows, expand)
        offset = self.prompt_length - 1
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        width = max(1, offset + max((len(t) for t in targets), default=1))
        device = inputs["input_ids"].device
        decoder = torch.full((rows, width), pad, dtype=torch.long, device=device)
        labels = torch.full((rows, width), -100, dtype=torch.long, device=device)
        for r, (prompt, target) in enumerate(zip(prompts, targets)):
            decoder[r, : offset + 1] = torch.tensor(prompt, device=device)
            if len(target) > 1:
                decoder[r, offset + 1 : offset + len(target)] = torch.tensor(target[:-1], device=device)
            if target:
                labels[r, offset : offset + len(target)] = torch.tensor(target, device=device)
        return expanded, decoder, labels, offset

    def _teacher_forced(
        self, inputs: dict, targets: Sequence[Sequence[int]], expand: int, attentions: bool = False
    ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
        """Per target (`expand` consecutive targets per sentence of `inputs`): each token's log-probability under
        the model given the source and the tokens before it, and with `attentions` the last decoder layer's
        cross-attention averaged over heads ([target tokens, source tokens])."""
        expanded, decoder, labels, offset = self._teacher_inputs(inputs, targets, expand)
        out = self._forward(expanded, decoder, attentions)
        log_probs = torch.log_softmax(out.logits.float(), dim=-1)
        picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        values = [picked[r, offset : offset + len(t)].tolist() for r, t in enumerate(targets)]
        maps = None
        if attentions:
            cross = out.cross_attentions[-1].float().mean(dim=1)  # [rows, target, source]: heads averaged
            maps = [cross[r, offset:] for r in range(len(targets))]
        return values, maps

    def token_log_probs(
        self, requests: Sequence[TranslationRequest], targets: Sequence[Sequence[int]], max_source_length=None
    ) -> list[list[float]]:
        inputs = self.batch_inputs(requests, max_source_length)
        values, _ = self._teacher_forced(inputs, targets, 1)
        return values


def _takes_length_rule(model) -> bool:
    """Whether `model.generate` applies a call's `length_rule=` per sentence (hf_variants models: their
    `length_rule(override)` reads it)."""
    method = getattr(model, "length_rule", None)
    try:
        return callable(method) and "override" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _load_tokenizer(path: str, tokenizer, trust_remote_code: bool):
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=trust_remote_code)


class TorchEngine(GenerateEngine):
    """A PyTorch model (`from_pretrained` of a saved folder or Hub id); `precision="int8"`: every linear layer
    quantized for the CPU (`hf_variants.deploy.int8.quantize_for_cpu`)."""

    name = "torch"
    supports_alignments = True

    @classmethod
    def load(cls, path, *, precision="fp32", num_threads=None, trust_remote_code=False, tokenizer=None):
        from transformers import AutoModelForSeq2SeqLM

        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        model = AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=trust_remote_code).eval()
        loaded = _load_tokenizer(path, tokenizer, trust_remote_code)
        check_tokenizer_fits_model(loaded, model.config, tokenizer if isinstance(tokenizer, str) else None, path)
        if precision == "int8":
            from ..deploy.int8 import quantize_for_cpu

            quantize_for_cpu(model)
        return cls(model, loaded)


class OnnxEngine(GenerateEngine):
    """An ONNX Runtime model (`OrtModelForSeq2SeqLM`, a folder written by `hf_variants.export_onnx`): decoding runs
    in transformers' generate() over the exported graphs; no attentions, so no alignments."""

    name = "onnx"
    supports_alignments = False

    @classmethod
    def load(cls, path, *, precision="fp32", num_threads=None, trust_remote_code=False, tokenizer=None):
        from ..onnx.modeling import OrtModelForSeq2SeqLM

        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
        model = OrtModelForSeq2SeqLM.from_pretrained(path, precision=precision, num_threads=num_threads)
        return cls(model, _load_tokenizer(path, tokenizer, False))

    def decoder_steps(self) -> DecoderSteps:
        return OrtSteps(self.model)

    def _forward(self, inputs: dict, decoder_input_ids: torch.Tensor, attentions: bool):
        if attentions:
            raise ValueError("the onnx engine returns no attentions (alignments need the torch engine)")
        with torch.inference_mode():
            return self.model(**inputs, decoder_input_ids=decoder_input_ids, use_cache=True)

    def _teacher_forced(self, inputs, targets, expand, attentions=False):
        """As the torch engine's, on the folder's scoring graph where it has one (`export_onnx --scoring_graph`: whole
        targets in one run), else on the step graph one position at a time; no attentions."""
        if attentions:
            raise ValueError("the onnx engine returns no attentions (alignments need the torch engine)")
        if not getattr(self.model, "has_scoring_graph", False) or not targets:
            return super()._teacher_forced(inputs, targets, expand)
        expanded, decoder, labels, offset = self._teacher_inputs(inputs, targets, expand)
        with torch.inference_mode():
            values = self.model.token_log_probs(**expanded, decoder_input_ids=decoder, labels=labels)
        return [values[r, offset : offset + len(t)].tolist() for r, t in enumerate(targets)], None


def engine_for(model, tokenizer) -> GenerateEngine:
    """The engine of an already loaded model: `OnnxEngine` for an `OrtModelForSeq2SeqLM`, else `TorchEngine`."""
    from ..onnx.modeling import OrtModelForSeq2SeqLM

    if isinstance(model, OrtModelForSeq2SeqLM):
        return OnnxEngine(model, tokenizer)
    return TorchEngine(model, tokenizer)


__all__ = [
    "DEFAULT_LENGTH_RULE",
    "ENGINES",
    "CancelCriteria",
    "Engine",
    "GenerateEngine",
    "OnnxEngine",
    "PrefixLogitsProcessor",
    "TorchEngine",
    "engine_class",
    "engine_for",
    "hard_alignment",
    "word_indices",
]
