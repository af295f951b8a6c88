"""Teacher-forced scores of given translation pairs: per pair, the log-probability of the target given the source.

    from hf_variants.inference import Translator
    from hf_variants.inference.scoring import score_pairs, summarize
    translator = Translator.from_pretrained("runs/my-run/model")         # or engine="onnx", precision="int8"
    scores = score_pairs(translator, sources, targets, tgt_lang="de", max_tokens=4000)
    # [PairScore(log_prob=-7.31, tokens=9), ...] in input order; .ppl = exp(-log_prob / tokens)
    summarize(scores).ppl                                                # the corpus perplexity

The number is the one decoding reports for a hypothesis (`log_prob` of the n-best output), computed by the same
function (the engine's `token_log_probs`): the sum over the target's tokens, end-of-sentence included, of the
log-softmax of the model's raw logits at each token. Nothing is renormalized over the tokens generation suppresses
(transformers' logits processors only set those to -inf), so the score of a decoded hypothesis is its n-best
`log_prob`, and the token-weighted mean of `-log_prob` over a set is the model's plain cross-entropy
(`model(**inputs, labels=labels).loss` without label smoothing and auxiliary losses). A target is tokenized as the
model's `prepare_translation_inputs(..., text_target=...)` tokenizes labels; an empty target scores its
end-of-sentence token alone. Sources go through the engine's `encode` (the model's `prepare_translation_inputs`:
language tags, `tgt_lang_ids`, MG-SA's phrase inputs from the `annotations`).

Pairs are scored in length-sorted batches (`batching.length_sorted_batches`: `batch_size` pairs, or `max_tokens`:
pairs x the longest of their longer sides), the results returned in input order; batches of similar lengths waste
little on padding. Engines: those of `decode` (the torch model in one forward over the whole target; ONNX Runtime,
fp32 or int8: the exported step graph over the target, one position at a time, or with a folder exported with
`--scoring_graph` its scoring graph, the whole target in one run: `token_log_probs`). A pair with a side longer
than the model's positions (`config.max_position_embeddings`, special tokens included) is not scored: its
`PairScore` has `log_prob=None` and `too_long=True`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .batching import check_batching, length_sorted_batches
from .requests import TranslationRequest

__all__ = ["PairScore", "ScoreSummary", "engine_of", "score_pairs", "summarize", "target_ids", "token_log_probs"]


@dataclass
class PairScore:
    """The score of one pair: `log_prob` (natural log, the sum over the `tokens` target tokens, end-of-sentence
    included), `token_log_probs` (each token's, when asked for) and `ppl` = exp(-log_prob / tokens). `too_long`:
    not scored (`log_prob` None), a side longer than the model's positions."""

    log_prob: float | None
    tokens: int
    token_log_probs: list[float] | None = None
    too_long: bool = False

    @property
    def ppl(self) -> float | None:
        if self.log_prob is None:
            return None
        return math.exp(-self.log_prob / self.tokens)

    def to_dict(self, token_scores: bool = False) -> dict:
        """{"log_prob", "tokens", "ppl"} (and "token_log_probs" with `token_scores`), as the score command writes
        them (null scores for a pair not scored)."""
        out = {"log_prob": self.log_prob, "tokens": self.tokens, "ppl": self.ppl}
        if token_scores:
            out["token_log_probs"] = self.token_log_probs
        return out


@dataclass
class ScoreSummary:
    """Totals over a set of scored pairs: `tokens` and `log_prob` summed over the scored pairs, the mean
    log-probability per token and the corpus perplexity (exp of the token-weighted mean cross-entropy)."""

    sentences: int
    scored: int
    tokens: int
    log_prob: float
    too_long_lines: list[int] = field(default_factory=list)  # 1-based positions of the pairs not scored

    @property
    def mean_log_prob(self) -> float | None:
        return self.log_prob / self.tokens if self.tokens else None

    @property
    def ppl(self) -> float | None:
        return math.exp(-self.log_prob / self.tokens) if self.tokens else None

    def to_dict(self) -> dict:
        return {
            "sentences": self.sentences,
            "scored": self.scored,
            "too_long": len(self.too_long_lines),
            "too_long_lines": self.too_long_lines,
            "tokens": self.tokens,
            "log_prob": self.log_prob,
            "mean_log_prob": self.mean_log_prob,
            "ppl": self.ppl,
        }


def summarize(scores: Sequence[PairScore]) -> ScoreSummary:
    """The `ScoreSummary` of `scores` (pairs not scored counted apart)."""
    scored = [s for s in scores if s.log_prob is not None]
    return ScoreSummary(
        sentences=len(scores),
        scored=len(scored),
        tokens=sum(s.tokens for s in scored),
        log_prob=math.fsum(s.log_prob for s in scored),
        too_long_lines=[i + 1 for i, s in enumerate(scores) if s.log_prob is None],
    )


def engine_of(model: Any, tokenizer=None):
    """The engine to score with: a `Translator`'s, an engine as given, or the engine of a loaded model and its
    tokenizer (`decode.engine_for`: ONNX Runtime for an `OrtModelForSeq2SeqLM`, else torch)."""
    from .decode import Engine, engine_for

    if isinstance(model, Engine):
        return model
    engine = getattr(model, "engine", None)
    if isinstance(engine, Engine):
        return engine
    if tokenizer is None:
        raise ValueError("score_pairs(model, ...) of a loaded model needs its tokenizer: tokenizer=...")
    return engine_for(model, tokenizer)


def target_ids(tokenizer, targets: Sequence[str], config=None) -> list[list[int]]:
    """Each target's token ids as the model's labels (`tokenizer(text_target=...)`: end-of-sentence included). For
    a model that forces the target language's token (`config.target_language_token`: M2M100 / NLLB-200) that
    token is the decoder's prompt, not part of the target: the text's tokens and `</s>`."""
    if not targets:
        return []
    if getattr(config, "target_language_token", False):
        eos = tokenizer.eos_token_id
        return [list(ids) + [eos] for ids in tokenizer(list(targets), add_special_tokens=False)["input_ids"]]
    return [list(ids) for ids in tokenizer(text_target=list(targets))["input_ids"]]


def token_log_probs(
    engine, requests: Sequence[TranslationRequest], targets: Sequence[Sequence[int]]
) -> list[list[float]]:
    """Each target token's log-probability given its source: the engine's `token_log_probs` (what decoding reports),
    or for an ONNX Runtime model exported with `--scoring_graph` its scoring graph (the whole target in one run
    instead of the step graph one position at a time; the same numbers in fp32, up to float rounding)."""
    model = getattr(engine, "model", None)
    if not getattr(model, "has_scoring_graph", False) or not targets:
        return engine.token_log_probs(requests, targets)
    import torch

    inputs = engine.encode(requests)
    inputs, decoder, labels, offset = engine._teacher_inputs(inputs, targets, 1)
    with torch.inference_mode():
        values = model.token_log_probs(**inputs, decoder_input_ids=decoder, labels=labels)
    return [values[r, offset : offset + len(t)].tolist() for r, t in enumerate(targets)]


def score_pairs(
    model: Any,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    tokenizer=None,
    src_lang: str | None = None,
    tgt_lang: str | Sequence[str] | None = None,
    annotations: Mapping[str, Sequence] | None = None,
    batch_size: int | None = 64,
    max_tokens: int | None = None,
    token_scores: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[PairScore]:
    """Score each (source, target) pair: a `PairScore` per pair, in input order (see the module docstring).

    `model`: a `Translator`, an engine, or a loaded model (torch or `OrtModelForSeq2SeqLM`) with `tokenizer`.
    `tgt_lang`: one code or one per pair (None: the model's one target language); `annotations`: per-pair variant
    inputs, a name -> one value per pair (the syntactic MG-SA's `parses`). `token_scores`: keep each token's
    log-probability. `progress(n)` is called after each batch with the number of pairs it held."""
    engine = engine_of(model, tokenizer)
    check_batching(batch_size, max_tokens)
    sources, targets = list(sources), list(targets)
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets.")
    annotations = dict(annotations or {})
    for name, values in annotations.items():
        if len(values) != len(sources):
            raise ValueError(f"{len(values)} values of {name!r} for {len(sources)} pairs.")
    if tgt_lang is None or isinstance(tgt_lang, str):
        tgt_langs = [tgt_lang] * len(sources)
    else:
        tgt_langs = list(tgt_lang)
        if len(tgt_langs) != len(sources):
            raise ValueError(f"{len(tgt_langs)} target languages for {len(sources)} pairs.")
    if getattr(engine.config, "target_language_token", False):  # M2M100 / NLLB-200: both languages, up front
        from .translator import check_request_languages, default_source_language

        src_lang = src_lang or default_source_language(engine.config)
        for lang in dict.fromkeys(tgt_langs):
            check_request_languages(engine.config, src_lang, lang)
    requests = [
        TranslationRequest(
            source,
            src_lang=src_lang,
            tgt_lang=tgt_langs[i],
            annotations={name: values[i] for name, values in annotations.items()},
        )
        for i, source in enumerate(sources)
    ]
    ids = target_ids(engine.tokenizer, targets, engine.config)
    source_lengths = engine.source_lengths(requests) if requests else []
    limit = getattr(engine.config, "max_position_embeddings", None)
    results: list[PairScore | None] = [None] * len(requests)
    todo = []
    for i, (n_source, target) in enumerate(zip(source_lengths, ids)):
        if limit is not None and max(n_source, len(target)) > limit:
            results[i] = PairScore(None, len(target), too_long=True)
        else:
            todo.append(i)
    # a pair's padded size is that of its longer side (fairseq's --max-tokens for pairs)
    widths = [max(source_lengths[i], len(ids[i])) for i in todo]
    for batch in length_sorted_batches(widths, batch_size, max_tokens):
        rows = [todo[j] for j in batch]
        values = token_log_probs(engine, [requests[i] for i in rows], [ids[i] for i in rows])
        for i, per_token in zip(rows, values):
            results[i] = PairScore(math.fsum(per_token), len(ids[i]), list(per_token) if token_scores else None)
        if progress is not None:
            progress(len(rows))
    return results  # type: ignore[return-value]
