"""`Translator`: the one object every entry point translates with (the translate command, evaluation during
training, the scoring command, the HTTP server), on any engine (`decode.ENGINES`).

    translator = Translator.from_pretrained("runs/my-run/model")                 # or engine="onnx", precision="int8"
    results = translator.translate(["A dog runs.", "Two men talk."], DecodeOptions(nbest=4, scores=True))
    for result in translator.translate_stream(lines, DecodeOptions(), buffer_size=64):
        print(result.text)

It checks requests (languages against what the model was trained for, prefixes) and options (`DecodeOptions.check`,
then the model's saved defaults filled in: `resolve`), gives empty sources and sources longer than the model accepts
no hypotheses (`TranslationResult.skipped` says why) without running the model, translates the rest in
length-sorted batches (`batching`: sentences or tokens) and returns the results in input order. Each source is
tokenized once: its count and its token ids (`TranslationRequest.source_ids`) travel into the engine. A translation
does not depend on its batch: the length rule is applied per sentence (greedy search gives identical outputs at
any batch size; beam search up to float ties).

Requests with `constraints` (lexically constrained decoding) are checked (`_check_constraints`: the engine supports
them, no sampling, every form tokenizes and they fit the sentence's output limit) and translated apart from the
others, by the engine's constrained beam search (`Engine.translate_constrained`), in batches of their own; the
other requests take generate() as before, so their outputs do not change, and each sentence gets the translation it
gets alone. Greedy search (num_beams=1) becomes beam search for the sentences with constraints, with
max(`CONSTRAINED_MIN_BEAMS`, constraints + 1) beams (a logged warning says so once per translator).

A caller that batches by itself (the HTTP server) does each step once, in its own place:

    requests = translator.encode(requests)           # checked, target language filled in, tokenized (source_ids)
    options = translator.resolve(options)            # checked, the model's saved choices filled in
    results = translator.decode_batch(requests[:8], options, cancelled=lambda: client_gone)  # one batch, as given
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

from .batching import buffered, check_batching, length_sorted_batches
from .constraints import normalize_constraints
from .decode import DEFAULT_LENGTH_RULE, Engine, engine_class, engine_for, ranks_samples
from .requests import (
    SKIPPED_EMPTY,
    SKIPPED_TOO_LONG,
    DecodeOptions,
    DecodingCancelled,
    OptionError,
    TranslationRequest,
    TranslationResult,
)
from .sampling import best_first

DEFAULT_BUFFER_SIZE = 1024  # requests read ahead by translate_stream (a pipe's lines are handed on as they come)
# the least beam size of a sentence with constraints when greedy search (num_beams=1) is asked for: constrained
# decoding is a beam search (one bank a number of constraint tokens met), so greedy search becomes beam search with
# max(CONSTRAINED_MIN_BEAMS, constraints + 1) beams
CONSTRAINED_MIN_BEAMS = 4
logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------ languages
def model_languages(config) -> tuple[list[str], list[str]]:
    """(source languages, target languages) a model was trained for: the config's `translation_languages()`
    (hf_variants configs), else its `source_languages` / `target_languages` where recorded, the targets defaulting
    to all its `languages` and the sources to those that are not targets (all of them for a model translating both
    ways). Empty lists: the model records no languages."""
    method = getattr(config, "translation_languages", None)
    if callable(method):
        sources, targets = method()
        return list(sources), list(targets)
    languages = list(getattr(config, "languages", None) or [])
    recorded = list(getattr(config, "target_languages", None) or [])
    targets = recorded or languages
    sources = list(getattr(config, "source_languages", None) or [])
    sources = sources or [lang for lang in languages if lang not in recorded] or languages
    return sources, targets


def check_languages(config, src_lang: str | None = None, tgt_lang: str | None = None) -> None:
    """Raise a ValueError naming the argument and the model's languages when `src_lang` / `tgt_lang` is not a
    language the model translates from / into (`config.check_languages` where the config has it)."""
    method = getattr(config, "check_languages", None)
    if callable(method):
        method(src_lang=src_lang, tgt_lang=tgt_lang)
        return
    sources, targets = model_languages(config)
    if not targets:
        return
    direction = f"this model translates {'/'.join(sources)} -> {'/'.join(targets)}"
    if tgt_lang is not None and tgt_lang not in targets:
        raise ValueError(f"tgt_lang={tgt_lang!r}: {direction} (target languages {targets}).")
    if src_lang is not None and src_lang not in sources:
        raise ValueError(f"src_lang={src_lang!r}: {direction} (source languages {sources}).")
    if src_lang is not None and src_lang == tgt_lang:
        raise ValueError(f"src_lang and tgt_lang are both {src_lang!r}: {direction}.")


def default_target_language(config) -> str | None:
    """The target language when a request names none: the model's one target; for a two-language model saved before
    target languages were recorded (and without target-language tags), its second language; else None."""
    _, targets = model_languages(config)
    if len(targets) == 1:
        return targets[0]
    languages = list(getattr(config, "languages", None) or [])
    recorded = getattr(config, "target_languages", None)
    if not recorded and len(languages) == 2 and not getattr(config, "target_language_tags", False):
        return languages[1]
    return None


def default_source_language(config) -> str | None:
    """The source language when a request names none, for a model that marks it with a token (M2M100 / NLLB-200:
    `config.target_language_token`): its one source language; else None (other models need no source language)."""
    if not getattr(config, "target_language_token", False):
        return None
    sources, _ = model_languages(config)
    return sources[0] if len(sources) == 1 else None


def check_request_languages(config, src_lang: str | None = None, tgt_lang: str | None = None) -> None:
    """`check_languages`, and a ValueError naming `tgt_lang` when none is given to a model translating into several
    languages (a one-target model uses its own), or naming `src_lang` when none is given to a model that marks the
    source language with a token (M2M100 / NLLB-200) and has several. Needs the config only: a command runs it
    before loading weights."""
    tgt_lang = tgt_lang or default_target_language(config)
    src_lang = src_lang or default_source_language(config)
    check_languages(config, src_lang, tgt_lang)
    sources, targets = model_languages(config)
    if tgt_lang is None and len(targets) > 1:
        raise ValueError(f"tgt_lang: this model translates into several languages ({_listed(targets)}): pass one")
    if src_lang is None and getattr(config, "target_language_token", False) and len(sources) > 1:
        raise ValueError(
            f"src_lang: this model marks the source language with a token and translates from several languages "
            f"({_listed(sources)}): pass one"
        )


def _listed(languages: list[str], limit: int = 12) -> str:
    shown = ", ".join(languages[:limit])
    return shown + (f", ... ({len(languages)} in all)" if len(languages) > limit else "")


def saved_length_rule(generation_config) -> tuple[float, int, int]:
    """(a, b, cap) of `generation_config.length_rule` (at most min(a * source length + b, cap) new tokens), or
    `decode.DEFAULT_LENGTH_RULE` for a generation config saved without one."""
    rule = getattr(generation_config, "length_rule", None)
    if isinstance(rule, Mapping) and all(key in rule for key in ("max_len_a", "max_len_b", "max_new_tokens")):
        return float(rule["max_len_a"]), int(rule["max_len_b"]), int(rule["max_new_tokens"])
    return DEFAULT_LENGTH_RULE


def resolve_options(
    options: DecodeOptions | None,
    generation_config,
    length_rule: tuple[float, int, int] | None = None,
    positions: int | None = None,
) -> DecodeOptions:
    """`options` checked (`DecodeOptions.check`) with the saved choices of `generation_config` filled in where they
    are None: the beam size (1 when sampling), the length penalty, and without a fixed output limit the length
    rule's a and b (`length_rule`, default `saved_length_rule(generation_config)`); checked again (`nbest` against
    the saved beam size) and against the model's target `positions`. Needs no model: a command runs it before
    loading weights."""
    options = (options or DecodeOptions()).check()
    changes: dict = {}
    if options.do_sample:
        changes["num_beams"] = 1
    elif options.num_beams is None:
        changes["num_beams"] = int(getattr(generation_config, "num_beams", None) or 1)
    if options.length_penalty is None:
        penalty = getattr(generation_config, "length_penalty", None)
        changes["length_penalty"] = float(penalty if penalty is not None else 1.0)
    if options.max_length is None and options.max_new_tokens is None:
        a, b, _ = length_rule or saved_length_rule(generation_config)
        if options.max_len_a is None:
            changes["max_len_a"] = a
        if options.max_len_b is None:
            changes["max_len_b"] = b
    resolved = replace(options, **changes)
    try:
        resolved.check()
    except OptionError as error:
        if "num_beams" in error.names and options.num_beams is None:
            beams = f"num_beams={resolved.num_beams}"
            message = str(error).replace(beams, f"{beams} (the model's saved num_beams)", 1)
            raise OptionError(message, *error.names) from None
        raise
    for name in ("max_length", "max_new_tokens"):
        value = getattr(resolved, name)
        if positions is not None and value is not None and value > positions:
            raise OptionError(
                f"{name}={value}: more target positions than this model has (max_position_embeddings={positions})",
                name,
            )
    return resolved


def constrained_num_beams(num_beams: int, constraints: int) -> int:
    """The beam size of a sentence with `constraints` constraints under the resolved `num_beams`: num_beams, or for
    greedy search (1) max(`CONSTRAINED_MIN_BEAMS`, constraints + 1)."""
    return num_beams if num_beams != 1 else max(CONSTRAINED_MIN_BEAMS, constraints + 1)


# ----------------------------------------------------------------------------------------------------- translator
class Translator:
    """Translate requests with a model on an engine (see the module docstring). Build it from loaded objects,
    `Translator(model, tokenizer)` (an `OrtModelForSeq2SeqLM` gets the onnx engine, anything else the torch
    engine), or `Translator(engine=...)`, or from a saved folder with `from_pretrained`."""

    def __init__(self, model=None, tokenizer=None, *, engine: Engine | None = None):
        if engine is None:
            if model is None or tokenizer is None:
                raise ValueError("Translator(model, tokenizer) or Translator(engine=...)")
            engine = engine_for(model, tokenizer)
        self.engine = engine
        self._promotion_said = False  # greedy promoted to beam search for constraints: logged once

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        engine: str = "torch",
        precision: str = "fp32",
        num_threads: int | None = None,
        trust_remote_code: bool = False,
        tokenizer=None,
    ) -> Translator:
        """The translator of a saved model: `engine` "torch" (a model folder or Hub id), "onnx" (a folder written
        by `hf_variants.export_onnx`) or "ctranslate2"; `precision` "fp32" or "int8"; `tokenizer`: a folder or a
        loaded tokenizer (default: the model's folder)."""
        loaded = engine_class(engine).load(
            path,
            precision=precision,
            num_threads=num_threads,
            trust_remote_code=trust_remote_code,
            tokenizer=tokenizer,
        )
        return cls(engine=loaded)

    def fork(self, parallel: bool = False) -> Translator:
        """A translator sharing this one's model with its own copy of the tokenizer, for another thread: a fast
        tokenizer refuses concurrent calls that change its padding or truncation ("Already borrowed"); decoding
        concurrently on one model is otherwise safe (torch's inference, ONNX Runtime's runs). `parallel`: the copy
        decodes at the same time as this one (the CTranslate2 engine then gets a translator of its own, since
        CTranslate2 queues the calls of one translator beyond its `inter_threads`)."""
        import copy

        engine = copy.copy(self.engine)
        if getattr(engine, "tokenizer", None) is not None:
            engine.tokenizer = copy.deepcopy(engine.tokenizer)
        if parallel and callable(getattr(engine, "parallel_copy", None)):
            engine = engine.parallel_copy()
        return type(self)(engine=engine)

    # ----------------------------------------------------------------------------------------------- model
    @property
    def model(self):
        return getattr(self.engine, "model", None)

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def generation_config(self):
        return self.engine.generation_config

    @property
    def languages(self) -> dict[str, list[str]]:
        """{"source": [...], "target": [...]}: the languages the model translates from and into ([] where the
        model records none)."""
        sources, targets = model_languages(self.config)
        return {"source": sources, "target": targets}

    @property
    def max_source_tokens(self) -> int | None:
        """The longest source the model accepts, in tokens (language tag and `</s>` included)."""
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def default_tgt_lang(self) -> str | None:
        return default_target_language(self.config)

    # ---------------------------------------------------------------------------------------------- checks
    def resolve(self, options: DecodeOptions | None = None) -> DecodeOptions:
        """`options` checked, with the model's saved choices filled in where they are None (beam size, length
        penalty, the length rule's a and b); raises an `OptionError` naming the option (`nbest=5 > num_beams=4`,
        an option the engine cannot honour)."""
        resolved = resolve_options(options, self.generation_config, self.engine.length_rule(), self.max_source_tokens)
        why = self.engine.unsupported(resolved)
        if why:
            raise OptionError(why, why.split(":")[0])
        return resolved

    def check_request(self, request: TranslationRequest | str, options: DecodeOptions | None = None) -> None:
        """Raise a ValueError naming the field for a request this model cannot translate: a source that is no
        string, a language the model was not trained for, no target language for a model with several, a prefix
        or annotations of the wrong type."""
        request = TranslationRequest.of(request)
        if not isinstance(request.source, str):
            raise ValueError(f"source: expected a string, got {type(request.source).__name__}")
        for name in ("src_lang", "tgt_lang", "prefix"):
            value = getattr(request, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
        if not isinstance(request.annotations, dict) and not hasattr(request.annotations, "items"):
            raise ValueError(f"annotations: expected a mapping, got {type(request.annotations).__name__}")
        check_request_languages(self.config, request.src_lang, request.tgt_lang)
        if request.source_ids is not None:
            vocab = getattr(self.config, "vocab_size", None)
            ids = request.source_ids
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab or t + 1) for t in ids):
                raise ValueError(f"source_ids: expected token ids (integers in [0, {vocab})), got {list(ids)[:8]}")
        if request.prefix and "\n" in request.prefix:
            raise ValueError("prefix: one line expected (it contains a line break)")
        normalize_constraints(request.constraints)
        index = request.index
        if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            raise ValueError(f"index: expected an integer >= 0 (the sentence's position in its corpus), got {index!r}")

    def _prepared(self, request: TranslationRequest, index: int) -> TranslationRequest:
        """`request` checked (errors name `requests[index]`), its target language filled in, its constraints
        normalized (`constraints.normalize_constraints`)."""
        try:
            self.check_request(request)
        except ValueError as error:
            raise ValueError(f"requests[{index}]: {error}") from None
        if request.tgt_lang is None and self.default_tgt_lang is not None:
            request = replace(request, tgt_lang=self.default_tgt_lang)
        constraints = normalize_constraints(request.constraints)
        if constraints != request.constraints:
            request = replace(request, constraints=constraints)
        if request.src_lang is None and default_source_language(self.config) is not None:
            request = replace(request, src_lang=default_source_language(self.config))
        if request.index is None:  # what seeds its samples: its position in the call or stream
            request = replace(request, index=index)
        return request

    def count_tokens(self, requests: Sequence[TranslationRequest | str]) -> list[int]:
        """Each source's length in tokens as the model receives it (language tag and `</s>` included), before any
        truncation (a request's `source_ids` where it carries them)."""
        requests = [TranslationRequest.of(r) for r in requests]
        todo = [r for r in requests if r.source_ids is None]
        counted = iter(self.engine.source_lengths(todo) if todo else [])
        return [len(r.source_ids) if r.source_ids is not None else next(counted) for r in requests]

    def encode(self, requests: Sequence[TranslationRequest | str]) -> list[TranslationRequest]:
        """`requests` ready for `decode_batch`: each checked (a ValueError naming `requests[i]` and the field), its
        target language filled in, its source stripped and tokenized once (`source_ids`: the token ids as the model
        receives them, not truncated; their count is the source's length). Empty sources keep no ids."""
        prepared = [self._prepared(TranslationRequest.of(r), i) for i, r in enumerate(requests)]
        stripped = [replace(r, source=r.source.strip()) if r.source_ids is None else r for r in prepared]
        todo = [i for i, r in enumerate(stripped) if r.source_ids is None and r.source]
        for i, ids in zip(todo, self.engine.encode_sources([stripped[i] for i in todo]) if todo else []):
            stripped[i] = replace(stripped[i], source_ids=tuple(ids))
        return stripped

    # ------------------------------------------------------------------------------------------- translate
    def translate(
        self,
        requests: Sequence[TranslationRequest | str],
        options: DecodeOptions | None = None,
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[TranslationResult]:
        """Translate `requests` (strings or `TranslationRequest`s) in length-sorted batches of `batch_size`
        sentences or `max_tokens` tokens; one result per request, in input order. `progress(n)` is called after
        each batch with the number of sentences it held (and once with the number of empty and too-long sources,
        which need no model)."""
        options = self.resolve(options)
        check_batching(batch_size, max_tokens)
        prepared = [self._prepared(TranslationRequest.of(r), i) for i, r in enumerate(requests)]
        return self._translate(prepared, options, batch_size, max_tokens, 0, progress)

    def translate_stream(
        self,
        requests: Iterable[TranslationRequest | str],
        options: DecodeOptions | None = None,
        *,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        ready: Callable[[], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[TranslationResult]:
        """Translate an iterable of requests read `buffer_size` at a time (never all at once), yielding the results
        in input order, each buffer's as soon as it is translated. `ready()` (optional) tells whether the next
        request is available without waiting; a buffer is then cut short rather than waited for (a pipe's line is
        answered while the pipe stays open). Options and batching as in `translate`; with `options.seed`, a request
        without an `index` samples as the sentence at its position in the stream (whatever the buffers)."""
        options = self.resolve(options)
        check_batching(batch_size, max_tokens)
        return self._stream(requests, options, buffer_size, batch_size, max_tokens, ready, progress)

    def _stream(self, requests, options, buffer_size, batch_size, max_tokens, ready, progress):
        offset = 0
        for chunk in buffered(requests, buffer_size, ready):
            prepared = [self._prepared(TranslationRequest.of(r), offset + i) for i, r in enumerate(chunk)]
            yield from self._translate(prepared, options, batch_size, max_tokens, offset, progress)
            offset += len(chunk)

    def decode_batch(
        self,
        requests: Sequence[TranslationRequest],
        options: DecodeOptions,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[TranslationResult]:
        """Decode `requests` as ONE batch, as given: requests as `encode` returned them and options as `resolve`
        returned them (nothing is checked, resolved, tokenized or sorted again). Empty sources and sources longer
        than the model accepts get no hypotheses, as in `translate`. `cancelled()` (optional) is asked at every
        decoding step; once it is true the decoding stops and `DecodingCancelled` is raised (no partial results)."""
        return self._translate(list(requests), options, None, None, 0, None, one_batch=True, cancelled=cancelled)

    def _translate(
        self,
        requests: list[TranslationRequest],
        options: DecodeOptions,
        batch_size: int | None,
        max_tokens: int | None,
        offset: int,
        progress: Callable[[int], None] | None,
        one_batch: bool = False,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[TranslationResult]:
        results: list[TranslationResult | None] = [None] * len(requests)
        keep = [i for i, r in enumerate(requests) if r.source.strip()]
        for i in set(range(len(requests))) - set(keep):
            results[i] = TranslationResult(offset + i, requests[i].source, [], 0, skipped=SKIPPED_EMPTY)
        stripped = self._with_ids({i: requests[i] for i in keep})
        lengths = {i: len(stripped[i].source_ids) for i in keep}
        cut = options.max_source_length
        limit = self.max_source_tokens
        todo, effective = [], {}
        for i in keep:
            length = min(lengths[i], cut) if cut is not None else lengths[i]
            if limit is not None and length > limit:
                results[i] = TranslationResult(
                    offset + i, requests[i].source, [], lengths[i], skipped=SKIPPED_TOO_LONG
                )
            else:
                todo.append(i)
                effective[i] = length
        self._check_prefixes(stripped, todo, effective, options, offset)
        constrained = [i for i in todo if stripped[i].constraints]
        beams = self._check_constraints(stripped, constrained, effective, options, offset)
        if progress is not None and len(todo) < len(requests):
            progress(len(requests) - len(todo))  # empty and too-long sources: done without the model
        plain = [i for i in todo if not stripped[i].constraints]
        runs = [(plain, self.engine.translate_batch, options)]  # without constraints: generate(), as always
        for size in sorted(set(beams.values())):  # constrained beam search, one beam size a run
            group = [i for i in constrained if beams[i] == size]
            runs.append((group, self.engine.translate_constrained, options.replace(num_beams=size)))
        for group, decode, run_options in runs:
            batches = (
                [list(range(len(group)))]
                if one_batch
                else length_sorted_batches([effective[i] for i in group], batch_size, max_tokens)
            )
            for batch in batches if group else []:
                idx = [group[j] for j in batch]
                hypotheses = decode([stripped[i] for i in idx], run_options, cancelled)
                if ranks_samples(run_options):  # samples come in draw order: best first, as every n-best list
                    hypotheses = [best_first(hyps) for hyps in hypotheses]
                for i, hyps in zip(idx, hypotheses):
                    results[i] = TranslationResult(
                        offset + i,
                        requests[i].source,
                        hyps,
                        lengths[i],
                        truncated=cut is not None and lengths[i] > cut,
                        constraints=stripped[i].constraints,
                    )
                if progress is not None:
                    progress(len(idx))
        return results  # type: ignore[return-value]

    def check_constraints(self, requests: Sequence[TranslationRequest], options: DecodeOptions) -> dict[int, int]:
        """The checks `decode_batch` makes of the requests with constraints, before decoding (a front end that
        batches by itself refuses a request here instead of failing the batch it would share): `requests` as
        `encode` returned them, `options` as `resolve` did. Raises an `OptionError` naming the option (an engine
        without constrained decoding, sampling, ...) or a ValueError naming `requests[i]` and the constraint (a
        form that gives no token or a special one, constraints that cannot fit the sentence's output limit).
        Returns {index: beam size} of the requests with constraints (`constrained_num_beams`)."""
        requests = list(requests)
        todo = [i for i, r in enumerate(requests) if r.constraints and r.source.strip() and r.source_ids is not None]
        cut = options.max_source_length
        lengths = {i: min(len(requests[i].source_ids), cut or len(requests[i].source_ids)) for i in todo}
        limit = self.max_source_tokens
        todo = [i for i in todo if limit is None or lengths[i] <= limit]  # too long: skipped, never decoded
        return self._check_constraints(requests, todo, lengths, options, 0)

    def _output_limits(self, todo: list[int], lengths: dict, options: DecodeOptions) -> dict[int, int]:
        """Each sentence's output limit in new tokens (`</s>` included): the fixed limit, or the length rule of its
        (effective) source length."""
        if options.max_length is not None:
            return {i: options.max_length - 1 for i in todo}
        if options.max_new_tokens is not None:
            return {i: options.max_new_tokens for i in todo}
        return dict(zip(todo, self.engine.length_limits([lengths[i] for i in todo], options)))

    def _with_ids(self, requests: dict[int, TranslationRequest]) -> dict[int, TranslationRequest]:
        """`requests` (by index) with their sources stripped and tokenized once (`source_ids`) where they carry no
        ids yet."""
        todo = [i for i, r in requests.items() if r.source_ids is None]
        stripped = {i: replace(requests[i], source=requests[i].source.strip()) for i in todo}
        encoded = self.engine.encode_sources([stripped[i] for i in todo]) if todo else []
        out = dict(requests)
        for i, ids in zip(todo, encoded):
            out[i] = replace(stripped[i], source_ids=tuple(ids))
        return out

    def _check_prefixes(self, requests, todo, lengths, options: DecodeOptions, offset: int) -> None:
        """A prefix must leave room for `</s>` within the sentence's output limit."""
        prefix_ids = getattr(self.engine, "prefix_ids", None)
        with_prefix = [i for i in todo if requests[i].prefix]
        if prefix_ids is None or not with_prefix:
            return
        limits = self._output_limits(with_prefix, lengths, options)
        for i in with_prefix:
            n = len(prefix_ids(requests[i].prefix))
            if n >= limits[i]:
                raise ValueError(
                    f"requests[{offset + i}]: prefix: {n} tokens, but this sentence's output is limited to "
                    f"{limits[i]} tokens (</s> included): raise max_len_b or max_new_tokens"
                )

    def _check_constraints(self, requests, todo, lengths, options: DecodeOptions, offset: int) -> dict[int, int]:
        """Requests with constraints (`todo`) checked against the engine and the options (an `OptionError` names
        the option: an engine without constrained decoding, sampling, `no_repeat_ngram_size`,
        `repetition_penalty`), and each constraint's forms against the tokenizer and the sentence's output limit
        (a ValueError naming `requests[i]`: a form that gives no token; constraints whose shortest forms and
        `</s>` exceed the limit). Returns each request's beam size: `options.num_beams`, or for greedy search
        (num_beams=1) max(`CONSTRAINED_MIN_BEAMS`, constraints + 1), said once in a logged warning."""
        if not todo:
            return {}
        engine = self.engine
        if not getattr(engine, "supports_constraints", False):
            raise OptionError(
                f"constraints: the {engine.name} engine has no lexically constrained decoding (use the torch or "
                "onnx engine)",
                "constraints",
            )
        for name in ("do_sample", "no_repeat_ngram_size", "repetition_penalty"):
            value = getattr(options, name)
            if value not in (None, False) and not (name == "repetition_penalty" and value == 1.0):
                raise OptionError(
                    f"constraints: constrained beam search does not implement {name}={value!r} (translate the "
                    "sentences with constraints without it)",
                    "constraints",
                    name,
                )
        limits = self._output_limits(todo, lengths, options)
        for i in todo:
            try:
                ids = engine.constraint_ids(requests[i].constraints)
            except ValueError as error:
                raise ValueError(f"requests[{offset + i}]: {error}") from None
            need = sum(min(len(form) for form in forms) for forms in ids)
            if need >= limits[i]:
                raise ValueError(
                    f"requests[{offset + i}]: constraints: {need} tokens (the shortest form of each), but this "
                    f"sentence's output is limited to {limits[i]} tokens (</s> included): raise max_len_b or "
                    "max_new_tokens, or pass fewer constraints"
                )
        beams = {i: constrained_num_beams(options.num_beams, len(requests[i].constraints)) for i in todo}
        if options.num_beams != 1:
            return beams
        if not self._promotion_said:
            self._promotion_said = True
            logger.warning(
                "constraints need beam search: num_beams=1 (greedy) becomes num_beams=max(%d, constraints + 1) for "
                "the sentences with constraints (%s here); pass num_beams to choose",
                CONSTRAINED_MIN_BEAMS,
                ", ".join(str(b) for b in sorted(set(beams.values()))),
            )
        return beams


__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DecodingCancelled",
    "Translator",
    "check_languages",
    "check_request_languages",
    "constrained_num_beams",
    "default_source_language",
    "default_target_language",
    "model_languages",
    "resolve_options",
    "saved_length_rule",
]
