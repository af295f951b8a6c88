"""The decoding fast paths give what the plain paths give:

- the merged token-suppression processor gives transformers' processors' scores, and generate's tokens and scores
  are those of the unmerged list (min-length, min-new-tokens and suppress-tokens rules, greedy and beam search);
- beam search under `torch.inference_mode()` (its expanded masks are inference tensors, without a version counter)
  equals beam search under `torch.no_grad()`, for every model type, on a padded batch of different sentences;
- the cross-attention mask kept on the cache for the next steps is rebuilt when the 2-D mask changes in place
  (a normal tensor and an inference tensor).
"""

from __future__ import annotations

import pytest
import torch
from common import assert_same_generation
from test_conformance import MODEL_TYPES, build, source_batch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_variants.generation_transformer_nmt import TokenSuppressionLogitsProcessor


def test_token_suppression_equals_transformers_processors():
    torch.manual_seed(0)
    vocab = 50
    original = LogitsProcessorList(
        [
            MinLengthLogitsProcessor(6, [2, 7]),
            MinNewTokensLengthLogitsProcessor(3, 5, 2),
            SuppressTokensLogitsProcessor([0, 1, 99]),  # 99: outside the vocabulary, ignored as isin does
            TopKLogitsWarper(5),
            SuppressTokensLogitsProcessor([4]),  # after the top-k: must stay after it
            TemperatureLogitsWarper(0.7),
        ]
    )
    merged = TokenSuppressionLogitsProcessor.merge(original)
    assert [type(p).__name__ for p in merged] == [
        "TokenSuppressionLogitsProcessor",
        "TopKLogitsWarper",
        "TokenSuppressionLogitsProcessor",
        "TemperatureLogitsWarper",
    ]
    scores = torch.randn(4, vocab)
    scores[:, 4] = 10.0  # in the top 5: suppressed after the top-k, so only 4 candidates remain
    for length in range(1, 11):  # each min-length rule active, then not
        input_ids = torch.zeros(4, length, dtype=torch.long)
        expected = original(input_ids, scores.clone())
        assert torch.equal(merged(input_ids, scores.clone()), expected)
    assert torch.isfinite(expected).sum(dim=-1).eq(4).all()
    only_min_length = TokenSuppressionLogitsProcessor.merge(LogitsProcessorList([MinLengthLogitsProcessor(3, 2)]))
    long_enough = torch.zeros(4, 3, dtype=torch.long)
    assert only_min_length(long_enough, scores) is scores  # inactive: no copy


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_merged_suppression_equals_unmerged(num_beams, monkeypatch):
    model = build("transformer_nmt")
    model.generation_config.suppress_tokens = [5, 6]
    inputs = source_batch(model)
    gen = dict(
        num_beams=num_beams,
        max_new_tokens=8,
        min_new_tokens=6,
        min_length=4,
        output_scores=True,
        return_dict_in_generate=True,
        length_penalty=0.6,
    )
    with torch.no_grad():
        fast = model.generate(**inputs, **gen)
        monkeypatch.setattr(TokenSuppressionLogitsProcessor, "merge", classmethod(lambda cls, processors: processors))
        plain = model.generate(**inputs, **gen)
    assert_same_generation(fast, plain)
    assert not torch.isin(fast.sequences[:, 1:], torch.tensor([5, 6])).any()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_beam_search_under_inference_mode_equals_no_grad(model_type):
    """Different sentences with padding in one batch: beam search reorders the self-attention cache only (the
    cross-attention rows of one sentence's beams are equal), and the cross-attention mask is kept on the cache,
    whose expanded 2-D mask is an inference tensor under inference_mode."""
    model = build(model_type)
    inputs = source_batch(model)
    gen = dict(
        num_beams=3,
        max_new_tokens=8,
        min_new_tokens=8,
        length_penalty=0.6,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        reference = model.generate(**inputs, **gen)
        uncached = model.generate(**inputs, **gen, use_cache=False)
    with torch.inference_mode():
        fast = model.generate(**inputs, **gen)
    assert_same_generation(fast, reference)
    assert torch.equal(uncached.sequences, reference.sequences)


@pytest.mark.parametrize("inference", [False, True])
def test_cross_attention_mask_follows_in_place_changes(inference):
    model = build("transformer_nmt", attn_implementation="eager")
    inputs = source_batch(model)
    context = torch.inference_mode() if inference else torch.no_grad()
    with context:
        mask = inputs["attention_mask"].clone()
        original = mask.clone()
        encoder_states = model.get_encoder()(input_ids=inputs["input_ids"], attention_mask=mask).last_hidden_state
        decoder = model.model.decoder
        start = torch.full((3, 1), model.config.decoder_start_token_id)
        cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        decoder(input_ids=start, encoder_hidden_states=encoder_states, encoder_attention_mask=mask, cache=cache)
        mask[0, 2:] = 0  # in place: the next step must see it
        step = torch.full((3, 1), 7)
        after_change = decoder(
            input_ids=step, encoder_hidden_states=encoder_states, encoder_attention_mask=mask, cache=cache
        ).last_hidden_state
        fresh = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        decoder(
            input_ids=start,
            encoder_hidden_states=encoder_states,
            encoder_attention_mask=original,
            cache=fresh,
        )
        expected = decoder(
            input_ids=step,
            encoder_hidden_states=encoder_states,
            encoder_attention_mask=mask.clone(),
            cache=fresh,
        ).last_hidden_state
    assert torch.equal(after_change, expected)
    with torch.no_grad():
        stale = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        decoder(
            input_ids=start.clone(),
            encoder_hidden_states=encoder_states.clone(),
            encoder_attention_mask=original.clone(),
            cache=stale,
        )
        stale = decoder(
            input_ids=step.clone(),
            encoder_hidden_states=encoder_states.clone(),
            encoder_attention_mask=original.clone(),
            cache=stale,
        ).last_hidden_state
    assert not torch.allclose(stale, expected, atol=1e-3)  # the change matters (the test can fail)
