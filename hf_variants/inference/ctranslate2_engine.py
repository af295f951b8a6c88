"""The CTranslate2 engine of the translation core (`engine="ctranslate2"`; the `deploy` extra): a folder written by
`hf_variants.export_ctranslate2` (the `transformer_nmt` baseline, the only model type CTranslate2 expresses),
decoded by CTranslate2's `Translator` behind the core's `Engine` interface, so the translate command, the server
and `Translator.translate` use it as they use the torch and ONNX engines.

What it does like the generate() engines: sources tokenized by the export's tokenizer (target-language tags for a
multilingual baseline, `</s>` included; truncation to `max_source_length`), the saved suppressed tokens, the length
rule applied per sentence (a batch is decoded in one call up to its longest limit: a greedy output past its own
limit is cut there, a beam search redone at it; `</s>` closes a hypothesis that reaches its limit, as the torch
engine forces it), prefixes (`target_prefix`), sampling (top-k, top-p, temperature; not
`seed`: CTranslate2 samples in its own threads, which a call cannot reseed), `no_repeat_ngram_size`,
`repetition_penalty`, n-best. Its `log_prob` is the teacher-forced sum of the hypothesis' token log-probabilities
(`score_batch`, `</s>` included) and its `score` that over length ** length_penalty, the definitions of the other
engines. Greedy search gives the torch engine's tokens (the export is token-exact); beam search may differ where
CTranslate2's search does (it stops when `num_beams` hypotheses have ended). No alignments (`return_attention`
gives one head of one layer, not the core's average).

`precision="int8"` runs CTranslate2's int8 compute type (weights quantized at load when the export is float32);
`num_threads` its `intra_threads`. An export made before the manifest recorded the model's config is refused with
the command that re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..configuration_transformer_nmt import TransformerNmtConfig, language_tag
from ..deploy.ctranslate2 import read_export_manifest
from ..generation_transformer_nmt import sentence_limits
from .decode import PRECISIONS, Engine, check_cancelled, ranks_samples
from .requests import DecodeOptions, Hypothesis, TranslationRequest

COMPUTE_TYPES = {"fp32": "float32", "int8": "int8"}


class CTranslate2Engine(Engine):
    """CTranslate2's `Translator` over an export folder (see the module docstring)."""

    name = "ctranslate2"
    supports_alignments = False

    def __init__(self, translator, tokenizer, config, generation_config, suppress_sequences: list[list[str]]):
        self.translator = translator
        self.tokenizer = tokenizer
        self.config = config
        self.generation_config = generation_config
        self.suppress_sequences = suppress_sequences
        self.translator_args: dict | None = None  # how `translator` was made (`parallel_copy`)

    def parallel_copy(self) -> CTranslate2Engine:
        """A copy with a CTranslate2 translator of its own (the same folder and settings: another copy of the
        weights in memory), to decode at the same time as this engine (`Translator.fork(parallel=True)`)."""
        import copy

        import ctranslate2

        other = copy.copy(self)
        if self.translator_args is not None:
            other.translator = ctranslate2.Translator(**self.translator_args)
        return other

    @classmethod
    def load(cls, path, *, precision="fp32", num_threads=None, trust_remote_code=False, tokenizer=None):
        try:
            import ctranslate2
        except ImportError as error:
            raise ImportError(
                f"the ctranslate2 engine needs the ctranslate2 package: pip install 'hf-variants[deploy]' ({error})"
            ) from error
        from transformers import AutoTokenizer, GenerationConfig

        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
        folder = Path(path)
        manifest = read_export_manifest(folder)
        if "model_config" not in manifest:
            raise ValueError(
                f"{folder} was exported before the export recorded the model's config: export it again with "
                "`python -m hf_variants.export_ctranslate2 --model MODEL_DIR --output_dir OUT`"
            )
        config = TransformerNmtConfig.from_dict(manifest["model_config"])
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or folder)
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = GenerationConfig.from_model_config(config)
        arguments = dict(
            model_path=str(folder),
            device="cpu",
            compute_type=COMPUTE_TYPES[precision],
            intra_threads=num_threads or 0,
            inter_threads=1,
        )
        engine = cls(
            ctranslate2.Translator(**arguments), tokenizer, config, generation_config, manifest["suppress_sequences"]
        )
        engine.translator_args = arguments
        return engine

    # -------------------------------------------------------------------------------------------------- inputs
    def _target_language(self, request: TranslationRequest) -> str | None:
        return request.tgt_lang or self.config.default_target_language()

    def encode_ids(
        self, requests: Sequence[TranslationRequest], max_source_length: int | None = None
    ) -> list[list[int]]:
        """Each source's token ids as the model receives it: `<2xx> ` tag for a model with target-language tags,
        `</s>` appended by the tokenizer, cut to `max_source_length`."""
        sources = []
        for request in requests:
            prefix = ""
            if self.config.target_language_tags:
                lang = self._target_language(request)
                if lang is None:
                    raise ValueError(f"This multilingual model needs `tgt_lang` (one of {self.config.languages}).")
                prefix = f"{language_tag(lang)} "
            sources.append(prefix + request.source)
        encoded = self.tokenizer(
            sources, truncation=max_source_length is not None, max_length=max_source_length, padding=False
        )
        return [list(ids) for ids in encoded["input_ids"]]

    def encode_sources(
        self, requests: Sequence[TranslationRequest], max_source_length: int | None = None
    ) -> list[list[int]]:
        return self.encode_ids(requests, max_source_length)

    def source_ids(self, requests: Sequence[TranslationRequest], max_source_length: int | None = None):
        """Each request's token ids: its `source_ids` where it carries them (a source longer than
        `max_source_length` encoded again, cut), else `encode_ids`."""
        ids = [list(r.source_ids) if r.source_ids is not None else None for r in requests]
        again = [
            i
            for i, row in enumerate(ids)
            if row is None or (max_source_length is not None and len(row) > max_source_length)
        ]
        if again:
            for i, row in zip(again, self.encode_ids([requests[i] for i in again], max_source_length)):
                ids[i] = row
        return ids

    def prefix_ids(self, prefix: str | None) -> list[int]:
        if not prefix:
            return []
        return list(self.tokenizer(prefix, add_special_tokens=False)["input_ids"])

    def length_limits(self, source_lengths: Sequence[int], options: DecodeOptions) -> list[int]:
        """Each sentence's new-token limit under the length rule (the model code's `sentence_limits`, as the
        generate() engines apply it)."""
        _, _, cap = self.length_rule()
        positions = getattr(self.config, "max_position_embeddings", None) or cap
        return sentence_limits((options.max_len_a, options.max_len_b, cap), source_lengths, positions)

    # ------------------------------------------------------------------------------------------------ decoding
    @classmethod
    def unsupported(cls, options: DecodeOptions) -> str | None:
        if options.seed is not None:
            return (
                "seed: CTranslate2 samples in its own threads, which a call cannot reseed, so its samples cannot be "
                "reproduced sentence by sentence (use the torch or onnx engine for seeded sampling)"
            )
        return super().unsupported(options)

    def translate_batch(
        self,
        requests: Sequence[TranslationRequest],
        options: DecodeOptions,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[list[Hypothesis]]:
        ids = self.source_ids(requests, options.max_source_length)
        if options.max_length is not None:
            steps, force_eos = [options.max_length - 1] * len(ids), False
        elif options.max_new_tokens is not None:
            steps, force_eos = [options.max_new_tokens] * len(ids), False
        else:  # the length rule: `</s>` is the last of a sentence's limit (its L-th token), as torch forces it
            steps, force_eos = [limit - 1 for limit in self.length_limits([len(x) for x in ids], options)], True
        eos = self.tokenizer.convert_ids_to_tokens(self.config.eos_token_id)

        def body(tokens: list[str]) -> list[str]:
            return tokens[:-1] if tokens and tokens[-1] == eos else tokens

        # one call up to the longest limit; a sentence whose output passed its own limit: greedy (and sampling)
        # tokens before the limit do not depend on it, so it is cut there; beam search is redone at its limit
        raw = self._decode(ids, requests, max(steps, default=0), options, cancelled)
        redo: dict[int, list[int]] = {}
        for i, hyps in enumerate(raw):
            if any(len(body(tokens)) > steps[i] for tokens in hyps):
                if options.beams == 1:
                    raw[i] = [body(tokens)[: steps[i]] if len(body(tokens)) > steps[i] else tokens for tokens in hyps]
                else:
                    redo.setdefault(steps[i], []).append(i)
        for limit, rows in redo.items():
            for i, hyps in zip(
                rows, self._decode([ids[i] for i in rows], [requests[i] for i in rows], limit, options, cancelled)
            ):
                raw[i] = hyps
        out = []
        for hyps in raw:
            sentence = []
            for tokens in hyps:
                if force_eos and (not tokens or tokens[-1] != eos):
                    tokens = [*tokens, eos]  # the length rule's limit: `</s>` closes it
                token_ids = self.tokenizer.convert_tokens_to_ids(tokens)
                text = self.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
                sentence.append(Hypothesis(text=text, tokens=tokens, token_ids=token_ids))
            out.append(sentence)
        if options.scores or ranks_samples(options):  # sampled n-best lists are sorted by score
            self._score(ids, out, options)
        return out

    def _decode(self, sources, requests, steps: int, options: DecodeOptions, cancelled=None) -> list[list[list[str]]]:
        """CTranslate2's tokens of `options.nbest` hypotheses per source, at most `steps` tokens before `</s>`.
        `cancelled`: asked at every generated token of a greedy search (CTranslate2's `callback`, which stops the
        batch); a beam search cannot be stopped inside CTranslate2's call, so it is asked before and after it."""
        check_cancelled(cancelled)
        source_tokens = [self.tokenizer.convert_ids_to_tokens(x) for x in sources]
        prefixes = [self.tokenizer.convert_ids_to_tokens(self.prefix_ids(r.prefix)) for r in requests]
        kwargs = {
            "beam_size": options.beams,
            "num_hypotheses": options.nbest,
            "length_penalty": options.length_penalty if options.length_penalty is not None else 1.0,
            "max_decoding_length": max(0, steps),
            "max_input_length": 0,  # sources are cut by the tokenizer (max_source_length), never here
            "suppress_sequences": self.suppress_sequences or None,
            "return_end_token": True,
        }
        if options.do_sample:
            top_k = options.top_k if options.top_k is not None else getattr(self.generation_config, "top_k", None)
            kwargs.update(
                sampling_topk=top_k or 0,  # generate()'s default where the request names none (transformers': 50)
                sampling_topp=options.top_p if options.top_p is not None else 1.0,
                sampling_temperature=options.temperature if options.temperature is not None else 1.0,
            )
        if options.no_repeat_ngram_size:
            kwargs["no_repeat_ngram_size"] = options.no_repeat_ngram_size
        if options.repetition_penalty is not None:
            kwargs["repetition_penalty"] = options.repetition_penalty
        if any(prefixes):
            kwargs["target_prefix"] = [p or None for p in prefixes]
        if cancelled is not None and options.beams == 1:
            kwargs["callback"] = lambda step: bool(cancelled())
        results = self.translator.translate_batch(source_tokens, **kwargs)
        check_cancelled(cancelled)
        return [[list(tokens) for tokens in result.hypotheses[: options.nbest]] for result in results]

    def _score(self, sources: list[list[int]], hypotheses: list[list[Hypothesis]], options: DecodeOptions) -> None:
        pairs = [(s, h) for s, hyps in zip(sources, hypotheses) for h in hyps]
        values = self.token_log_probs_of_ids([s for s, _ in pairs], [h.token_ids for _, h in pairs])
        penalty = options.length_penalty if options.length_penalty is not None else 1.0
        for (_, hyp), logs in zip(pairs, values):
            hyp.log_prob = float(sum(logs))
            hyp.score = hyp.log_prob / (max(1, len(logs)) ** penalty)

    # ---------------------------------------------------------------------------------------- teacher forcing
    def token_log_probs_of_ids(self, sources: list[list[int]], targets: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per target (token ids after the decoder's start token, `</s>` included where it ends with it) the
        log-probability of each of its tokens given its source (CTranslate2's `score_batch`)."""
        eos = self.config.eos_token_id
        source_tokens = [self.tokenizer.convert_ids_to_tokens(s) for s in sources]
        bodies = [list(t[:-1]) if t and t[-1] == eos else list(t) for t in targets]
        target_tokens = [self.tokenizer.convert_ids_to_tokens(b) for b in bodies]
        results = self.translator.score_batch(source_tokens, target_tokens, max_input_length=0)
        values = []
        for target, result in zip(targets, results):
            logs = list(result.log_probs)  # the body's tokens, then `</s>`
            values.append(logs if target and target[-1] == eos else logs[:-1])
        return values

    def token_log_probs(
        self, requests: Sequence[TranslationRequest], targets: Sequence[Sequence[int]], max_source_length=None
    ) -> list[list[float]]:
        return self.token_log_probs_of_ids(self.source_ids(requests, max_source_length), targets)


__all__ = ["CTranslate2Engine"]
