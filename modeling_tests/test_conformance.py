"""Conformance with transformers' conventions, for every model type, beyond the shared upstream suite:

- a decoder forward that appends several tokens to a cache (no decoder mask) equals the full forward: queries sit
  at the cache length (assisted decoding and prompt lookup take this path);
- assisted decoding and prompt lookup give greedy search's tokens on a trained tiny model;
- `config.output_attentions` / `output_hidden_states` are honoured; attentions are [B, H, Q, K] per layer;
- eager, SDPA and flex_attention give the same logits; fully masked rows give no NaN;
- `max_length` is honoured by generate and by Seq2SeqTrainer's `generation_max_length`;
- Seq2SeqTrainer keeps the `tgt_lang_ids` column of MIMO and the Tied Transformer;
- LoRA (PEFT, `target_modules="all-linear"`) wraps every linear layer, trains and merges;
- `torch.export` and `torch.compile(fullgraph=True)` run every model's forward without cache.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_variants
from hf_variants.compat_transformer_nmt import output_cache
from hf_variants.modeling_transformer_nmt import StackedLinear

LANGUAGES = ["en", "de", "fr", "cs"]
VOCAB = 48


def tiny_config(model_type: str, **overrides):
    config_class = hf_variants.MODEL_CLASSES[model_type][0]
    extra = {
        "transformer_nmt": dict(normalize_before=True, max_relative_positions=3, relative_position_values=True),
        "mute_nmt": dict(max_relative_positions=3),
        "hysan_nmt": dict(local_k=2),
        "mgsa_nmt": dict(phrase_type="ngram"),
        "mimo_nmt": dict(languages=LANGUAGES),
        "tied_nmt": dict(languages=LANGUAGES),
    }[model_type]
    return config_class.from_preset("tiny", vocab_size=VOCAB, **{**extra, **overrides})


MODEL_TYPES = list(hf_variants.MODEL_CLASSES)


def build(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return hf_variants.MODEL_CLASSES[model_type][2](tiny_config(model_type, **overrides)).eval()


def language_inputs(model, batch: int) -> dict:
    if model.model.language_ids_field is None:
        return {}
    return {"tgt_lang_ids": torch.arange(batch) % 3 + 1}


def source_batch(model, batch: int = 3, length: int = 9, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, VOCAB, (batch, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, length - 3 :] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, model.config.pad_token_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask, **language_inputs(model, batch)}


# ------------------------------------------------------------------------------------------------- cache offset
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_multi_token_cached_forward_equals_full_forward(model_type):
    model = build(model_type)
    inputs = source_batch(model)
    decoder_ids = torch.randint(4, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    decoder_ids[:, 0] = model.config.decoder_start_token_id
    with torch.no_grad():
        full = model(**inputs, decoder_input_ids=decoder_ids).logits
        first = model(**inputs, decoder_input_ids=decoder_ids[:, :3], use_cache=True)
        rest = model(**inputs, decoder_input_ids=decoder_ids[:, 3:], cache=output_cache(first), use_cache=True).logits
    assert torch.allclose(rest, full[:, 3:], atol=1e-5), (rest - full[:, 3:]).abs().max()


# ------------------------------------------------------------------------------------------ loss without logits
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_skip_logits_gives_the_same_loss_and_gradients(model_type):
    """`skip_logits=True` (what train.py passes) computes the loss from the decoder's hidden states without the
    logits: the same loss (auxiliary losses and the Tied Transformer's per-direction weights included) and the same
    gradient for every parameter, `logits` None; without labels it raises."""
    model = build(model_type, dropout=0.0, label_smoothing=0.1).train()
    inputs = source_batch(model, batch=4)
    labels = torch.randint(4, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    labels[1, 4:] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for skip in (False, True):
        torch.manual_seed(5)  # the same dropout masks (attention and variant-specific) in both passes
        out = model(**inputs, labels=labels, skip_logits=skip, smoothing=0.1)
        assert (out.logits is None) == skip
        results.append((out.loss.detach(), torch.autograd.grad(out.loss, params, allow_unused=True)))
    (loss, expected), (skipped, grads) = results
    assert torch.allclose(skipped, loss, atol=1e-6), (skipped, loss)
    for (name, _), a, e in zip(model.named_parameters(), grads, expected):
        assert (a is None) == (e is None), name
        if a is not None:
            assert torch.allclose(a, e, atol=1e-6, rtol=1e-5), (name, (a - e).abs().max())
    # a head the fused loss must not bypass (a hook here; a quantized or adapted head alike): the logits are
    # computed for the loss, still not returned, and the loss is the same
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *args: calls.append(1))
    torch.manual_seed(5)
    hooked = model(**inputs, labels=labels, skip_logits=True, smoothing=0.1)
    handle.remove()
    assert calls == [1] and hooked.logits is None and torch.allclose(hooked.loss, loss, atol=1e-6)
    with pytest.raises(ValueError, match="skip_logits=True .* needs `labels`"):
        model(**inputs, decoder_input_ids=labels.clamp(min=4), skip_logits=True)


# -------------------------------------------------------------------------------- assisted decoding, prompt lookup
def train_copy_task(model, steps: int = 120):
    """A few Adam steps on a copy task (target = source), so that greedy outputs are input-dependent."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(4, VOCAB, (16, 8), generator=g)
        ids[:, -1] = model.config.eos_token_id
        loss = model(input_ids=ids, labels=ids, **language_inputs(model, 16)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.after_optimizer_step()
    return model.eval()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_assisted_decoding_and_prompt_lookup_equal_greedy(model_type):
    model = train_copy_task(build(model_type))
    assistant = train_copy_task(build(model_type, seed=1), steps=20)  # a weaker draft model of the same type
    g = torch.Generator().manual_seed(5)
    sentences = torch.randint(4, VOCAB, (6, 8), generator=g)
    sentences[:, -1] = model.config.eos_token_id
    kwargs = dict(max_new_tokens=10, num_beams=1, do_sample=False)
    greedy_outputs = []
    for row in sentences:
        inputs = {"input_ids": row[None], **language_inputs(model, 1)}
        greedy = model.generate(**inputs, **kwargs)
        assisted = model.generate(**inputs, assistant_model=assistant, **kwargs)
        lookup = model.generate(**inputs, prompt_lookup_num_tokens=3, **kwargs)
        assert torch.equal(assisted, greedy) and torch.equal(lookup, greedy), (greedy, assisted, lookup)
        greedy_outputs.append(greedy)
    assert len({tuple(out[0].tolist()) for out in greedy_outputs}) > 1  # outputs depend on the input


# ------------------------------------------------------------------------------------------------- output flags
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_output_flags_default_from_config(model_type):
    model = build(model_type)
    model.set_attn_implementation("eager")
    model.config.output_attentions = True
    model.config.output_hidden_states = True
    inputs = source_batch(model)
    out = model(**inputs, decoder_input_ids=inputs["input_ids"][:, :5])
    config = model.config
    heads = config.decoder_attention_heads
    assert len(out.encoder_attentions) == config.encoder_layers
    assert len(out.decoder_hidden_states) == config.decoder_layers + 1
    assert out.encoder_attentions[0].shape == (3, config.encoder_attention_heads, 9, 9)
    assert out.decoder_attentions[0].shape == (3, heads, 5, 5)
    assert out.cross_attentions[0].shape == (3, heads, 5, 9)
    assert out.encoder_hidden_states[1].shape == (3, 9, config.d_model)
    # every reported attention map of a real query is a distribution over the real keys
    for attention in out.encoder_attentions + out.cross_attentions:
        real_queries = attention[0] if attention.shape[-2] == 9 else attention  # encoder row 0 has no padding
        assert torch.allclose(real_queries.sum(-1), torch.ones(()), atol=1e-5)
        assert attention[1:, ..., 6:].abs().max() == 0
    model.config.output_attentions = False
    assert model(**inputs, decoder_input_ids=inputs["input_ids"][:, :5]).encoder_attentions is None


# ------------------------------------------------------------------------------------------ attention kernels
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_eager_sdpa_flex_give_the_same_logits(model_type):
    model = build(model_type)
    inputs = source_batch(model)
    decoder_ids = inputs["input_ids"][:, :6]
    logits = {}
    for implementation in ("sdpa", "eager", "flex_attention"):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        with torch.no_grad():
            logits[implementation] = model(**inputs, decoder_input_ids=decoder_ids).logits
    assert torch.isfinite(logits["flex_attention"]).all()
    assert torch.allclose(logits["sdpa"], logits["eager"], atol=1e-5)
    assert torch.allclose(logits["sdpa"], logits["flex_attention"], atol=1e-4)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fully_masked_rows_give_no_nan(model_type, implementation):
    """A left-padded decoder mask leaves the first queries of a row with no key at all."""
    model = build(model_type)
    model.set_attn_implementation(implementation)
    inputs = source_batch(model)
    decoder_ids = inputs["input_ids"][:, :6]
    decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask[0, :3] = 0
    with torch.no_grad():
        logits = model(**inputs, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask).logits
    assert torch.isfinite(logits).all()


# --------------------------------------------------------------------------------------------------- max length
@pytest.mark.parametrize("model_type", ["transformer_nmt", "mimo_nmt"])
def test_max_length_and_max_new_tokens_are_honoured(model_type):
    model = build(model_type)
    inputs = source_batch(model)
    model.generation_config.eos_token_id = None  # never stop early: the limits alone decide the length
    assert "max_new_tokens" not in model.generation_config.to_diff_dict()
    assert model.generate(**inputs, max_length=5).shape[1] == 5
    assert model.generate(**inputs, max_new_tokens=7).shape[1] == 8
    a, b, cap = model.default_length
    assert model.generate(**inputs).shape[1] == 1 + min(int(a * 9 + b), cap)
    model.generation_config.max_new_tokens = 12  # e.g. an old saved generation config: the call still wins
    assert model.generate(**inputs, max_length=6).shape[1] == 6
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(**inputs, max_new_tokens=model.config.max_position_embeddings + 1)


# ------------------------------------------------------------------------------------------------ Seq2SeqTrainer
def seq2seq_dataset(model, rows: int = 8):
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, VOCAB, (rows, 7), generator=g)
    data = {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()}
    data.update({key: value.tolist() for key, value in language_inputs(model, rows).items()})
    return Dataset.from_dict(data)


@pytest.mark.parametrize("model_type", ["transformer_nmt", "mgsa_nmt", "mimo_nmt", "tied_nmt"])
def test_seq2seq_trainer_keeps_language_ids_and_honours_generation_max_length(model_type, tmp_path):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, default_data_collator

    model = build(model_type).train()
    model.generation_config.eos_token_id = None
    dataset = seq2seq_dataset(model)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        predict_with_generate=True,
        generation_max_length=5,
        save_strategy="no",
        remove_unused_columns=True,
        logging_strategy="no",
    )
    trainer = Seq2SeqTrainer(
        model=model, args=args, train_dataset=dataset, eval_dataset=dataset, data_collator=default_data_collator
    )
    trainer.train()  # MIMO and Tied raise without their tgt_lang_ids (several tasks/directions)
    kept = trainer._remove_unused_columns(dataset).column_names
    assert ("tgt_lang_ids" in kept) == (model.model.language_ids_field is not None)
    predictions = torch.as_tensor(trainer.predict(dataset).predictions)
    pad = model.config.pad_token_id  # never generated (suppressed); Seq2SeqTrainer pads its arrays with it
    assert (predictions[:, :5] != pad).all() and (predictions[:, 5:] == pad).all()


# ---------------------------------------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_reaches_every_linear_layer_trains_and_merges(model_type):
    peft = pytest.importorskip("peft")
    model = build(model_type)
    linears = {name for name, module in model.named_modules() if type(module) is nn.Linear and name != "lm_head"}
    units = [name for name, module in model.named_modules() if isinstance(module, StackedLinear)]
    if model_type in ("mute_nmt", "mimo_nmt"):
        assert units and all(f"{unit}.units.0" in linears for unit in units)
    inputs = {**source_batch(model), "labels": torch.randint(4, VOCAB, (3, 6))}
    with torch.no_grad():
        before = model(**inputs).logits
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    wrapped = {
        name.removeprefix("base_model.model.")
        for name, module in lora.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }
    assert wrapped == linears
    lora.train()
    optimizer = torch.optim.Adam([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora(**inputs).loss.backward()
    optimizer.step()
    lora.eval()
    with torch.no_grad():
        adapted = lora(**inputs).logits
        assert not torch.allclose(adapted, before, atol=1e-4)  # the adapters are in the forward pass
        merged = lora.merge_and_unload()
        assert torch.allclose(merged(**inputs).logits, adapted, atol=1e-4)
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())


# ------------------------------------------------------------------------------------------ export and compile
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_torch_export_and_fullgraph_compile(model_type):
    model = build(model_type)
    inputs = source_batch(model)
    inputs["decoder_input_ids"] = inputs["input_ids"][:, :6]
    with torch.no_grad():
        expected = model(**inputs, use_cache=False).logits

        class Forward(nn.Module):  # positional tensors in, logits out
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask, decoder_input_ids, tgt_lang_ids=None):
                extra = {} if tgt_lang_ids is None else {"tgt_lang_ids": tgt_lang_ids}
                return self.inner(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    decoder_input_ids=decoder_input_ids,
                    use_cache=False,
                    **extra,
                ).logits

        exported = torch.export.export(Forward(model), args=(), kwargs=inputs)
        assert torch.allclose(exported.module()(**inputs), expected, atol=1e-5)
        compiled = torch.compile(Forward(model), fullgraph=True, backend="aot_eager")
        assert torch.allclose(compiled(**inputs), expected, atol=1e-5)


# ------------------------------------------------------------------------------------------------------ streamer
def test_streamer_with_saved_beam_search_defaults():
    """A saved model decodes with beam 4 by default (training/train.py writes it into the generation config); a
    streamer takes one hypothesis: `generate(streamer=...)` then decodes greedily (and says so in the log)."""
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    model = build("transformer_nmt")
    model.generation_config.update(**model.paper_decoding)
    inputs = {k: v[:1] for k, v in source_batch(model).items()}
    streamer = Collect()
    streamed = model.generate(**inputs, streamer=streamer, max_new_tokens=6)
    assert torch.equal(streamed, model.generate(**inputs, num_beams=1, max_new_tokens=6))
    assert streamer.tokens == streamed[0].tolist() and streamer.ended
    with pytest.raises(ValueError, match="num_beams"):  # an explicit beam search with a streamer stays an error
        model.generate(**inputs, streamer=Collect(), num_beams=4, max_new_tokens=6)
