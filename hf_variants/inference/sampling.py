"""Sampling in the translation core: every sentence draws its samples from a random generator of its own, so a
sentence's samples do not depend on the batch, the buffer, the call or the process it was translated in.

**The seeding rule.** With `DecodeOptions.seed = S`, the sentence whose index is `i` (`TranslationRequest.index`:
its 0-based position in its corpus; the translate command sets it to the input line number minus 1, `Translator`
sets it to the request's position in the call or stream when the request carries none) samples from
`torch.Generator().manual_seed(sentence_seed(S, i))`, where

    sentence_seed(S, i) = int.from_bytes(sha256(f"hf_variants.sample:{S}:{i}".encode()).digest()[:8], "big") >> 1

(a 63-bit seed: the first 8 bytes of the SHA-256 digest, big-endian, shifted right by one bit). Without a seed, each
sentence's seed is drawn from torch's default generator (`torch.manual_seed` before a call makes that call
reproducible, but then the samples depend on the batches).

**How a sample is drawn.** Decoding runs transformers' greedy loop (`_sample` without `do_sample`) with these logits
processors after the model's own (repetition penalty, n-gram blocking, suppressed tokens, prefixes, the length rule),
in transformers' order for sampling: `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` (the
request's `temperature` / `top_k` / `top_p`, else the model's saved generation config: transformers' default
`top_k` is 50), then `SentenceSampler`, which draws each row's next token with `torch.multinomial` over the softmax
of the processed scores, exactly as transformers' sampling does, but from the row's sentence's generator, and leaves
only that token a finite score, so the greedy argmax takes it. The distribution is transformers' multinomial
sampling; the randomness is per sentence: the `nbest` samples of a sentence are its rows, drawn together from its
generator at every step, and a step consumes the same draws whatever else the batch holds. The ONNX Runtime engine
runs the same processors in transformers' loop over its step graph (its bound greedy and beam searches take only
the processors `onnx.decoding` maps), so torch and ONNX Runtime draw the same samples up to float rounding of the
logits. CTranslate2 samples in its own threads, which a call cannot reseed: its engine refuses `seed`.

**Order.** A sentence's `nbest` samples are returned best first, sorted by `score` (the log-probability over
length ** length_penalty, computed by teacher forcing as for every hypothesis); ties keep the draw order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

SEED_DOMAIN = "hf_variants.sample"
MAX_SEED = (1 << 63) - 1


def sentence_seed(seed: int, index: int) -> int:
    """The seed of the generator of sentence `index` under the call's `seed` (see the module docstring)."""
    digest = hashlib.sha256(f"{SEED_DOMAIN}:{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sentence_seeds(seed: int | None, indices: Sequence[int | None]) -> list[int]:
    """One generator seed per sentence: `sentence_seed(seed, index)`, a sentence without an index taking its
    position in `indices`; without `seed`, seeds drawn from torch's default generator."""
    if seed is None:
        return [int(s) for s in torch.randint(0, MAX_SEED, (len(indices),), dtype=torch.long).tolist()]
    return [sentence_seed(seed, position if index is None else index) for position, index in enumerate(indices)]


class SentenceSampler:
    """A logits processor that samples: each row's next token drawn by `torch.multinomial` from the softmax of its
    scores with its sentence's generator, every other token's score set to -inf (so greedy search picks the sample).
    Rows are sentences x `expand` (each sentence's samples consecutive), as generate() lays them out. The
    generators live on the scores' device (seeded once, on the first call)."""

    def __init__(self, seeds: Sequence[int], expand: int):
        self.seeds = [int(s) for s in seeds]
        self.expand = int(expand)
        self._generators: list[torch.Generator] | None = None

    def generators(self, device: torch.device) -> list[torch.Generator]:
        if self._generators is None:
            self._generators = [torch.Generator(device=device).manual_seed(s) for s in self.seeds]
        return self._generators

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        rows = scores.shape[0]
        if rows != len(self.seeds) * self.expand:
            raise ValueError(f"{rows} rows are not {len(self.seeds)} sentences x {self.expand} samples.")
        probs = torch.softmax(scores, dim=-1)
        chosen = torch.empty(rows, 1, dtype=torch.long, device=scores.device)
        for i, generator in enumerate(self.generators(scores.device)):
            part = slice(i * self.expand, (i + 1) * self.expand)
            chosen[part] = torch.multinomial(probs[part], 1, generator=generator)
        out = torch.full_like(scores, -math.inf)
        return out.scatter_(1, chosen, scores.gather(1, chosen))


def sampling_warpers(options, generation_config) -> list:
    """transformers' sampling warpers for `options` (resolved `DecodeOptions`), in generate()'s order: temperature,
    top-k, top-p; a value left None is the saved generation config's, as `generate(do_sample=True)` reads it."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    def value(name: str):
        given = getattr(options, name)
        return given if given is not None else getattr(generation_config, name, None)

    warpers = []
    temperature, top_k, top_p = value("temperature"), value("top_k"), value("top_p")
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


def best_first(hypotheses: list) -> list:
    """Samples sorted by `score`, best first (a stable sort: ties keep the draw order; a hypothesis without a score
    goes last)."""
    return sorted(hypotheses, key=lambda h: -h.score if h.score is not None else math.inf)


__all__ = ["SentenceSampler", "best_first", "sampling_warpers", "sentence_seed", "sentence_seeds"]
