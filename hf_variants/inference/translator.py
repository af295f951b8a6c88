"""`Translator`: the one object every entry point translates with (the translate command, evaluation during
training, the scoring command, the HTTP server), on any engine (`decode.ENGINES`).

    translator = Translator.from_pretrained("runs/my-run/model")                 # or engine="onnx", precision="int8"
    results = translator.translate(["A dog runs.", "Two men talk."], DecodeOptions(nbest=4, scores=True))
    for result in translator.translate_stream(lines, DecodeOptions(), buffer_size=64):
        print(result.text)

It checks requests (languages against what the model was trained for, prefixes) and options (`DecodeOptions.check`,
then the model's saved defaults filled in: `resolve`), gives empty sources and sources longer than the model accepts
no hypotheses (`TranslationResult.skipped` says why) without running the model, translates the rest in
length-sorted batches (`batching`: sentences or tokens) and returns the results in input order. A translation
does not depend on its batch: the length rule is applied per sentence (greedy search gives identical outputs at
any batch size; beam search up to float ties).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

from .batching import buffered, check_batching, length_sorted_batches
from .decode import DEFAULT_LENGTH_RULE, Engine, engine_class, engine_for, ranks_samples
from .requests import (
    SKIPPED_EMPTY,
    SKIPPED_TOO_LONG,
    DecodeOptions,
    OptionError,
    TranslationRequest,
    TranslationResult,
)
from .sampling import best_first

DEFAULT_BUFFER_SIZE = 1024  # requests read ahead by translate_stream (a pipe's lines are handed on as they come)


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


def check_request_languages(config, src_lang: str | None = None, tgt_lang: str | None = None) -> None:
    """`check_languages`, and a ValueError naming `tgt_lang` when none is given to a model translating into several
    languages (a one-target model uses its own). Needs the config only: a command runs it before loading weights."""
    tgt_lang = tgt_lang or default_target_language(config)
    check_languages(config, src_lang, tgt_lang)
    _, targets = model_languages(config)
    if tgt_lang is None and len(targets) > 1:
        raise ValueError(f"tgt_lang: this model translates into several languages ({', '.join(targets)}): pass one")


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
        if request.prefix and "\n" in request.prefix:
            raise ValueError("prefix: one line expected (it contains a line break)")
        index = request.index
        if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            raise ValueError(f"index: expected an integer >= 0 (the sentence's position in its corpus), got {index!r}")

    def _prepared(self, request: TranslationRequest, index: int) -> TranslationRequest:
        """`request` checked (errors name `requests[index]`), its target language filled in."""
        try:
            self.check_request(request)
        except ValueError as error:
            raise ValueError(f"requests[{index}]: {error}") from None
        if request.tgt_lang is None and self.default_tgt_lang is not None:
            request = replace(request, tgt_lang=self.default_tgt_lang)
        if request.index is None:  # what seeds its samples: its position in the call or stream
            request = replace(request, index=index)
        return request

    def count_tokens(self, requests: Sequence[TranslationRequest | str]) -> list[int]:
        """Each source's length in tokens as the model receives it (language tag and `</s>` included), before any
        truncation."""
        requests = [TranslationRequest.of(r) for r in requests]
        if not requests:
            return []
        return self.engine.source_lengths(requests)

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

    def _translate(
        self,
        requests: list[TranslationRequest],
        options: DecodeOptions,
        batch_size: int | None,
        max_tokens: int | None,
        offset: int,
        progress: Callable[[int], None] | None,
    ) -> list[TranslationResult]:
        results: list[TranslationResult | None] = [None] * len(requests)
        keep = [i for i, r in enumerate(requests) if r.source.strip()]
        for i in set(range(len(requests))) - set(keep):
            results[i] = TranslationResult(offset + i, requests[i].source, [], 0, skipped=SKIPPED_EMPTY)
        stripped = {i: replace(requests[i], source=requests[i].source.strip()) for i in keep}
        lengths = dict(zip(keep, self.count_tokens([stripped[i] for i in keep])))
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
        if progress is not None and len(todo) < len(requests):
            progress(len(requests) - len(todo))  # empty and too-long sources: done without the model
        for batch in length_sorted_batches([effective[i] for i in todo], batch_size, max_tokens):
            idx = [todo[j] for j in batch]
            hypotheses = self.engine.translate_batch([stripped[i] for i in idx], options)
            if ranks_samples(options):  # samples come in draw order: best first, as every n-best list
                hypotheses = [best_first(hyps) for hyps in hypotheses]
            for i, hyps in zip(idx, hypotheses):
                results[i] = TranslationResult(
                    offset + i,
                    requests[i].source,
                    hyps,
                    lengths[i],
                    truncated=cut is not None and lengths[i] > cut,
                )
            if progress is not None:
                progress(len(idx))
        return results  # type: ignore[return-value]

    def _check_prefixes(self, requests, todo, lengths, options: DecodeOptions, offset: int) -> None:
        """A prefix must leave room for `</s>` within the sentence's output limit."""
        prefix_ids = getattr(self.engine, "prefix_ids", None)
        with_prefix = [i for i in todo if requests[i].prefix]
        if prefix_ids is None or not with_prefix:
            return
        if options.max_length is not None:
            limits = {i: options.max_length - 1 for i in with_prefix}
        elif options.max_new_tokens is not None:
            limits = {i: options.max_new_tokens for i in with_prefix}
        else:
            limits = dict(zip(with_prefix, self.engine.length_limits([lengths[i] for i in with_prefix], options)))
        for i in with_prefix:
            n = len(prefix_ids(requests[i].prefix))
            if n >= limits[i]:
                raise ValueError(
                    f"requests[{offset + i}]: prefix: {n} tokens, but this sentence's output is limited to "
                    f"{limits[i]} tokens (</s> included): raise max_len_b or max_new_tokens"
                )


__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "Translator",
    "check_languages",
    "check_request_languages",
    "default_target_language",
    "model_languages",
    "resolve_options",
    "saved_length_rule",
]
