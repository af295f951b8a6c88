"""What the translation core takes and returns: a request (one source sentence), the decoding options of a call,
and per request a result holding its hypotheses.

    TranslationRequest("A dog runs.", tgt_lang="de", prefix="Ein")
    DecodeOptions(num_beams=5, nbest=5, scores=True, alignments=True).check()
    TranslationResult(index=0, source="A dog runs.", hypotheses=[Hypothesis(text="Ein Hund läuft.", ...)], ...)

Every field left `None` in `DecodeOptions` means "the model's saved choice": its generation config (beam size,
length penalty, the length rule `generation_config.length_rule`), as `model.generate()` and the pipeline decode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class TranslationRequest:
    """One sentence to translate.

    `src_lang` / `tgt_lang`: language codes (None: the model's one target language, or no check of the source);
    `prefix`: the beginning the translation must start with (its tokens are forced, then decoding continues);
    `annotations`: per-sentence model inputs a variant takes beside the text (the syntactic MG-SA's
    `{"parses": "(ROOT ...)"}`), passed to the model's `prepare_translation_inputs`;
    `constraints`: target phrases the translation must contain (lexically constrained decoding, see
    `hf_variants.inference.constrained`): each a string, or a tuple of alternative forms of which one must appear
    (`("Kasse", ("Warenkorb", "Einkaufswagen"))`); checked by `constraints.normalize_constraints`.

    `source_ids`: the source's token ids as the model receives them (language tag and `</s>` included, not
    truncated), when it was already tokenized (`Translator.encode`): the engine decodes them without tokenizing the
    text again (a request with `annotations` is encoded from its text, which the variant's inputs need).


    `index`: the sentence's 0-based position in its corpus, which seeds its samples (`DecodeOptions.seed`: the
    generator of sentence `index` is seeded with `sampling.sentence_seed(seed, index)`, so it draws the same samples
    in any batch, call or process); None: its position in the call (`Translator` fills it in). A caller translating
    a corpus in pieces passes each sentence's own index."""

    source: str
    src_lang: str | None = None
    tgt_lang: str | None = None
    prefix: str | None = None
    annotations: Mapping[str, Any] = field(default_factory=dict)
    constraints: tuple = ()
    source_ids: tuple[int, ...] | None = None
    index: int | None = None

    @classmethod
    def of(cls, item: str | TranslationRequest) -> TranslationRequest:
        """`item` as a request: a plain string is a request with the source only."""
        if isinstance(item, TranslationRequest):
            return item
        if isinstance(item, str):
            return cls(item)
        raise TypeError(f"expected a str or a TranslationRequest, got {type(item).__name__}")


class DecodingCancelled(Exception):
    """The caller's `cancelled()` turned true while a batch decoded (`Translator.decode_batch`): the decoding stopped
    at its next step and its hypotheses were dropped."""


class OptionError(ValueError):
    """A decoding option out of its range or in conflict with another: `names` are the options at fault (field
    names of `DecodeOptions`, which are the command-line flags without `--`)."""

    def __init__(self, message: str, *names: str):
        super().__init__(message)
        self.names = names


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class OptionSpec:
    """What a `DecodeOptions` field is, for every front end that exposes it: its `kind` (int, float or bool), its
    range (`minimum` / `maximum` inclusive, `above`: exclusive lower bound), its `help`, the flag `group` of the
    command lines, and whether the HTTP server's requests may set it (`server`). The command-line flags
    (`inference.flags`), the server's request schema (`serve.schema`) and `DecodeOptions.check` all read it."""

    kind: type
    help: str
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    group: str = "decoding"
    server: bool = True

    def range_text(self) -> str:
        """The allowed values as the error messages say them: `an integer >= 1`, `a number in (0, 1]`, ..."""
        what = "an integer" if self.kind is int else "a number"
        if self.above is not None and self.maximum is not None:
            return f"{what} in ({self.above:g}, {self.maximum:g}]"
        if self.above is not None:
            return f"{what} > {self.above:g}"
        if self.minimum is not None and self.maximum is not None:
            return f"{what} in [{self.minimum:g}, {self.maximum:g}]"
        if self.minimum is not None:
            return f"{what} >= {self.minimum:g}"
        return "an integer" if self.kind is int else "a finite number"

    def problem(self, value: Any) -> str | None:
        """Why `value` is not one of the allowed values (None: it is)."""
        if self.kind is bool:
            return None if isinstance(value, bool) else "expected true or false"
        if self.kind is int and not _is_int(value):
            return f"expected {self.range_text()}"
        if self.kind is float and not _is_number(value):
            return "expected a finite number"
        low_ok = (self.minimum is None or value >= self.minimum) and (self.above is None or value > self.above)
        if not low_ok or (self.maximum is not None and value > self.maximum):
            return f"expected {self.range_text()}"
        return None


def option(default: Any, kind: type, help: str, **spec: Any):
    """A `DecodeOptions` field with its `OptionSpec` (see there)."""
    return field(default=default, metadata={"option": OptionSpec(kind, help, **spec)})


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode, for every request of a call (None: the model's saved choice, see the module docstring).

    Search: `num_beams` (beam search, 1: greedy), `nbest` hypotheses per sentence (at most `num_beams`; with
    `do_sample`, `nbest` independent samples), `length_penalty` (beam scores are divided by length ** it).
    Sampling: `do_sample` with `top_k`, `top_p`, `temperature`; `seed` makes sampling reproducible sentence by
    sentence: each sentence draws from a generator seeded from `seed` and its index (`TranslationRequest.index`;
    the rule: `sampling.sentence_seed`), so its samples do not depend on its batch, buffer, call or process; the
    `nbest` samples come best first, sorted by `score`. Output length: `max_length` (the whole output, the
    decoder's start token included, as in `generate()` and the pipeline) or `max_new_tokens`; without either, the
    length rule: at most `max_len_a` x (the sentence's own source length) + `max_len_b` new tokens (None: the rule
    saved with the model). Repetition: `no_repeat_ngram_size`, `repetition_penalty`. Outputs: `scores` adds each
    hypothesis' `score` and `log_prob`, `alignments` its word alignment to the source (engines that return
    attentions only).
    Source: `max_source_length` truncates every source to that many tokens (special tokens included); the result
    says so (`truncated`).

    Each field's type, range, help and group are its metadata (`OptionSpec`, `option_specs()`): the translate and
    score commands' flags and the server's request fields are generated from them, and `check()` enforces them."""

    num_beams: int | None = option(None, int, "beam size (1: greedy)", minimum=1)
    nbest: int = option(1, int, "hypotheses per sentence (at most num_beams; with do_sample, samples)", minimum=1)
    length_penalty: float | None = option(None, float, "beam scores are divided by length ** length_penalty")
    do_sample: bool = option(
        False,
        bool,
        "sample instead of searching (back-translation): nbest independent samples per sentence, sorted by score",
        group="sampling",
    )
    top_k: int | None = option(
        None, int, "sample among the k most likely tokens (0: all)", minimum=0, group="sampling"
    )
    top_p: float | None = option(
        None, float, "nucleus sampling: the smallest set of mass p", above=0, maximum=1, group="sampling"
    )
    temperature: float | None = option(None, float, "sampling temperature", above=0, group="sampling")
    seed: int | None = option(
        None,
        int,
        "random seed of sampling: each sentence samples from a generator seeded by (seed, its 0-based line number), "
        "the same samples in any batch, buffer or process",
        minimum=0,
        group="sampling",
    )
    max_length: int | None = option(
        None,
        int,
        "a fixed output limit instead of the length rule: tokens of the whole output (the decoder's start token "
        "included), as in generate() and the pipeline",
        minimum=1,
        group="lengths",
    )
    max_new_tokens: int | None = option(None, int, "a fixed limit of generated tokens", minimum=1, group="lengths")
    max_len_a: float | None = option(
        None,
        float,
        "length rule per sentence: at most a * (its source length in tokens) + b new tokens",
        minimum=0,
        group="lengths",
    )
    max_len_b: int | None = option(None, int, "see max_len_a", minimum=0, group="lengths")
    no_repeat_ngram_size: int | None = option(None, int, "no n-gram of this size twice", minimum=0)
    repetition_penalty: float | None = option(None, float, "CTRL's repetition penalty (1: none)", above=0)
    scores: bool = option(False, bool, "add each hypothesis' score and log-probability", group="outputs")
    alignments: bool = option(
        False,
        bool,
        "add word alignments (Pharaoh `0-0 1-2`, source word - target word over whitespace words) from the last "
        "decoder layer's cross-attention averaged over heads (engines that return attentions: torch)",
        group="outputs",
    )
    max_source_length: int | None = option(
        None,
        int,
        "truncate sources to this many tokens (special tokens included); default: never (a source longer than "
        "the model accepts is skipped)",
        minimum=1,
        group="lengths",
        server=False,
    )

    def replace(self, **changes) -> DecodeOptions:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DecodeOptions:
        """Options from a mapping (a JSON request body): unknown names raise an `OptionError` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise OptionError(f"unknown decoding option(s) {unknown}; known: {sorted(known)}", *unknown)
        return cls(**values)

    @property
    def beams(self) -> int | None:
        """The beam size generate() runs: 1 when sampling, else `num_beams` (None: the saved one)."""
        return 1 if self.do_sample else self.num_beams

    def check(self, flags: bool = False) -> DecodeOptions:
        """Raise an `OptionError` naming the option (e.g. `nbest=5 > num_beams=4`) for a value out of its range
        (its `OptionSpec`) or options in conflict; returns self. `flags`: name them as command-line flags
        (`--nbest 5 > --num_beams 4`)."""

        def say(name: str, value: Any = None) -> str:
            if value is None:
                return f"--{name}" if flags else name
            return f"--{name} {value}" if flags else f"{name}={value!r}"

        for name, spec in option_specs().items():
            value = getattr(self, name)
            problem = None if value is None and spec.kind is not bool else spec.problem(value)
            if problem:
                raise OptionError(f"{say(name, value)}: {problem}", name)
        self._check_sampling(say)
        self._check_lengths(say)
        return self

    def _check_sampling(self, say) -> None:
        if self.do_sample:
            if self.num_beams is not None and self.num_beams > 1:
                raise OptionError(
                    f"{say('do_sample')} draws {say('nbest')} independent samples (greedy sampling): "
                    f"{say('num_beams', self.num_beams)} must be 1 or left out",
                    "do_sample",
                    "num_beams",
                )
            return
        for name in ("top_k", "top_p", "temperature", "seed"):
            if getattr(self, name) is not None:
                raise OptionError(f"{say(name, getattr(self, name))} needs {say('do_sample')}", name, "do_sample")
        if self.num_beams is not None and self.nbest > self.num_beams:
            raise OptionError(
                f"{say('nbest', self.nbest)} > {say('num_beams', self.num_beams)}: beam search returns at most "
                f"num_beams hypotheses",
                "nbest",
                "num_beams",
            )

    def _check_lengths(self, say) -> None:
        if self.max_length is not None and self.max_new_tokens is not None:
            raise OptionError(
                f"{say('max_length')} and {say('max_new_tokens')} both limit the output: pass one",
                "max_length",
                "max_new_tokens",
            )
        fixed = next((name for name in ("max_length", "max_new_tokens") if getattr(self, name) is not None), None)
        rule = next((name for name in ("max_len_a", "max_len_b") if getattr(self, name) is not None), None)
        if fixed and rule:
            raise OptionError(
                f"{say(fixed)} is a fixed output limit and {say(rule)} part of the length rule per sentence: "
                "pass one of them",
                fixed,
                rule,
            )
        if self.max_len_a == 0 and self.max_len_b == 0:
            raise OptionError(
                f"{say('max_len_a', 0)} {say('max_len_b', 0)} leaves no tokens to generate", "max_len_a", "max_len_b"
            )


def option_specs() -> dict[str, OptionSpec]:
    """{field name: its `OptionSpec`} of every `DecodeOptions` field, in declaration order."""
    return {f.name: f.metadata["option"] for f in fields(DecodeOptions)}


@dataclass
class Hypothesis:
    """One translation of a sentence.

    `text`: detokenized; `tokens` / `token_ids`: the generated tokens after the decoder's start token, the end of
    sentence `</s>` included where the hypothesis ended with it; `log_prob`: the sum of those tokens' log-probabilities
    under the model (teacher-forced, so the scoring of the same pair gives the same number); `score`: what the search
    ranked by, `log_prob` over length ** length_penalty (beam search's `sequences_scores`); `alignment`: (source
    word, target word) index pairs over whitespace words (Pharaoh `i-j`). `score`, `log_prob` and `alignment` are
    None unless asked for (`DecodeOptions.scores`, `.alignments`). `constraints_met`: for a request with
    constraints, per constraint (in the request's order) whether the hypothesis' tokens contain it (one of its
    forms); None without constraints."""

    text: str
    score: float | None = None
    log_prob: float | None = None
    tokens: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    alignment: list[tuple[int, int]] | None = None
    constraints_met: list[bool] | None = None

    def pharaoh(self) -> str | None:
        """The alignment as Pharaoh text (`0-0 1-2`), or None."""
        if self.alignment is None:
            return None
        return " ".join(f"{i}-{j}" for i, j in self.alignment)

    def to_dict(self, scores: bool = True, alignments: bool = False) -> dict:
        """The JSON object of the translate command's JSON Lines output."""
        record: dict[str, Any] = {"text": self.text}
        if scores:
            record.update(score=self.score, log_prob=self.log_prob)
        record["tokens"] = list(self.tokens)
        if alignments:
            record["alignment"] = self.pharaoh()
        if self.constraints_met is not None:
            record["constraints_met"] = list(self.constraints_met)
        return record


# why a request got no hypotheses
SKIPPED_EMPTY = "empty"
SKIPPED_TOO_LONG = "too long"


@dataclass
class TranslationResult:
    """The hypotheses of one request, best first (`nbest` of them; none when `skipped` says why: `"empty"`, an
    empty or whitespace-only source, or `"too long"`, a source longer than the model accepts).

    `index`: the request's position in the input; `source_tokens`: its length as the model receives it (language
    tag and `</s>` included, before truncation); `truncated`: whether `max_source_length` cut it; `constraints`:
    the request's constraints as the core read them (each a tuple of its forms; `()`: none)."""

    index: int
    source: str
    hypotheses: list[Hypothesis]
    source_tokens: int
    truncated: bool = False
    skipped: str | None = None
    constraints: tuple[tuple[str, ...], ...] = ()

    @property
    def text(self) -> str:
        """The best hypothesis' text ("" when skipped)."""
        return self.hypotheses[0].text if self.hypotheses else ""

    @property
    def unmet_constraints(self) -> list[tuple[str, ...]]:
        """The constraints the best hypothesis does not contain (each as its forms): those the search could not
        place within the sentence's length limit. Empty without constraints, and for a skipped request."""
        if not self.hypotheses or self.hypotheses[0].constraints_met is None:
            return []
        return [c for c, met in zip(self.constraints, self.hypotheses[0].constraints_met) if not met]

    @property
    def constraints_met(self) -> bool | None:
        """Whether the best hypothesis contains every constraint (None: no constraints, or skipped)."""
        if not self.constraints or not self.hypotheses:
            return None
        return not self.unmet_constraints


__all__ = [
    "DecodeOptions",
    "DecodingCancelled",
    "Hypothesis",
    "OptionError",
    "OptionSpec",
    "SKIPPED_EMPTY",
    "SKIPPED_TOO_LONG",
    "TranslationRequest",
    "TranslationResult",
    "option",
    "option_specs",
]
