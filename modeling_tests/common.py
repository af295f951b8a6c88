"""The common tester every hf_variants model reuses.

Subclass `NmtModelTester` in a `Test...` class and define:
- `model_type`: the registered model type (e.g. "mute_nmt");
- `make_config(self, **overrides)`: a TINY config of the variant (d_model <= 64), with dropout 0; `overrides`
  always carries `vocab_size` (the shared test tokenizer's);
- optionally `make_inputs(self, config, input_ids, attention_mask) -> dict` for extra model inputs (e.g.
  `tgt_lang_ids`), and `translation_kwargs` (e.g. `{"tgt_lang": "de"}`) for `prepare_translation_inputs` and the
  pipeline.
Every check compares numbers or tokens between two paths that must agree.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_sentences, run_without_package
from torch.nn import functional as F
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, pipeline

import hf_variants  # noqa: F401  (registers the models and the translation task)
from hf_variants.compat_transformer_nmt import output_cache


def _allclose(a, b, atol=1e-5):
    return torch.allclose(a, b, atol=atol, rtol=1e-4)


def assert_same_generation(a, b) -> None:
    """Two `generate(..., output_scores=True, return_dict_in_generate=True)` results: the same tokens, and the
    same step scores (-inf where one has -inf, within 1e-4 elsewhere)."""
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores, strict=True):
        finite = torch.isfinite(x)
        assert torch.equal(finite, torch.isfinite(y)) and _allclose(x[finite], y[finite], atol=1e-4)


class NmtModelTester:
    model_type: str = None
    translation_kwargs: dict = {}
    batch_size = 3
    src_len = 9
    tgt_len = 7

    # ------------------------------------------------------------------------------------------------ to define
    def make_config(self, **overrides):
        raise NotImplementedError

    def make_inputs(self, config, input_ids, attention_mask) -> dict:
        return {}

    # ------------------------------------------------------------------------------------------------- helpers
    @property
    def model_class(self):
        return hf_variants.MODEL_CLASSES[self.model_type][2]

    def build(self, tokenizer, seed=0, **overrides):
        torch.manual_seed(seed)
        config = self.make_config(vocab_size=len(tokenizer), **overrides)
        return self.model_class(config).eval()

    def batch(self, config, seed=1, with_labels=True):
        """Right-padded random source batch (lengths differ per row) and labels."""
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(4, config.vocab_size, (self.batch_size, self.src_len), generator=g)
        attention_mask = torch.ones_like(input_ids)
        for row, length in enumerate(range(self.src_len, 0, -3)[: self.batch_size]):
            attention_mask[row, length:] = 0
        input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id)
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            **self.make_inputs(config, input_ids, attention_mask),
        }
        if with_labels:
            labels = torch.randint(4, config.vocab_size, (self.batch_size, self.tgt_len), generator=g)
            labels[0, -2:] = -100
            inputs["labels"] = labels
        return inputs

    @staticmethod
    def rows(inputs: dict, index: int) -> dict:
        """Row `index` of every batch tensor, with the row's padding removed."""
        length = int(inputs["attention_mask"][index].sum())
        out = {}
        for key, value in inputs.items():
            if key in ("input_ids", "attention_mask"):
                out[key] = value[index : index + 1, :length]
            elif torch.is_tensor(value):
                out[key] = value[index : index + 1]
        return out

    # ---------------------------------------------------------------------------------------------- the checks
    def test_forward_shapes_and_loss(self, tokenizer):
        model = self.build(tokenizer)
        inputs = self.batch(model.config)
        out = model(**inputs)
        assert out.logits.shape == (self.batch_size, self.tgt_len, model.config.vocab_size)
        labels = inputs["labels"].masked_fill(inputs["labels"] == model.config.pad_token_id, -100)
        expected = F.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            label_smoothing=model.config.label_smoothing,
        )
        aux = sum((v for v in (out.aux_losses or {}).values()), torch.tensor(0.0))
        assert torch.isfinite(out.loss)
        assert _allclose(out.loss, expected + aux, atol=1e-5)
        tuple_out = model(**inputs, return_dict=False)
        assert _allclose(tuple_out[0], out.loss) and _allclose(tuple_out[1], out.logits)

    def test_output_attentions_and_hidden_states(self, tokenizer):
        model = self.build(tokenizer)
        config = model.config
        out = model(**self.batch(config), output_attentions=True, output_hidden_states=True)
        assert len(out.encoder_hidden_states) == config.encoder_layers + 1
        assert len(out.decoder_hidden_states) == config.decoder_layers + 1
        assert out.decoder_hidden_states[-1].shape == (self.batch_size, self.tgt_len, config.d_model)
        assert len(out.cross_attentions) == config.decoder_layers
        cross = out.cross_attentions[0]
        assert cross.shape[-2:] == (self.tgt_len, self.src_len)
        # attention rows over real keys sum to one, padded keys get no weight
        pad = (self.batch(config)["attention_mask"] == 0)[:, None, None, :]
        assert _allclose(cross.sum(-1), torch.ones_like(cross.sum(-1)), atol=1e-4)
        assert cross.masked_select(pad.expand_as(cross)).abs().max() == 0

    def test_training_reduces_loss(self, tokenizer):
        model = self.build(tokenizer).train()
        inputs = self.batch(model.config)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(25):
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.after_optimizer_step()
            losses.append(loss.item())
        assert losses[-1] < 0.6 * losses[0], losses

    def test_save_load_identical(self, tokenizer, tmp_path):
        model = self.build(tokenizer)
        inputs = self.batch(model.config)
        model.save_pretrained(tmp_path)
        loaded = self.model_class.from_pretrained(tmp_path).eval()
        assert type(loaded) is type(model)
        state, loaded_state = model.state_dict(), loaded.state_dict()
        assert state.keys() == loaded_state.keys()
        assert all(torch.equal(state[k], loaded_state[k]) for k in state)
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)
        gen = {k: v for k, v in inputs.items() if k != "labels"}
        assert torch.equal(model.generate(**gen, max_new_tokens=6), loaded.generate(**gen, max_new_tokens=6))

    @pytest.mark.parametrize("num_beams", [1, 3])
    def test_cached_equals_uncached(self, tokenizer, num_beams):
        model = self.build(tokenizer)
        inputs = self.batch(model.config, with_labels=False)
        kwargs = dict(num_beams=num_beams, max_new_tokens=8, min_new_tokens=8, length_penalty=0.6)
        cached = model.generate(**inputs, use_cache=True, **kwargs, output_scores=True, return_dict_in_generate=True)
        uncached = model.generate(
            **inputs, use_cache=False, **kwargs, output_scores=True, return_dict_in_generate=True
        )
        assert_same_generation(cached, uncached)

    @pytest.mark.parametrize("num_beams", [1, 3])
    def test_static_cache_equals_dynamic_cache(self, tokenizer, num_beams):
        """`cache_implementation="static"` (pre-allocated key slots, the torch.compile path): the same tokens and
        scores as the growing cache, positions (and relative distances) taken from the cache length."""
        model = self.build(tokenizer)
        inputs = self.batch(model.config, with_labels=False)
        kwargs = dict(
            num_beams=num_beams,
            max_new_tokens=8,
            min_new_tokens=8,
            length_penalty=0.6,
            output_scores=True,
            return_dict_in_generate=True,
        )
        dynamic = model.generate(**inputs, **kwargs)
        static = model.generate(**inputs, cache_implementation="static", **kwargs)
        assert type(output_cache(static).self_attention_cache).__name__ == "StaticCache"
        assert_same_generation(dynamic, static)

    @pytest.mark.parametrize("num_beams", [1, 3])
    def test_padded_batch_equals_one_by_one(self, tokenizer, num_beams):
        model = self.build(tokenizer)
        inputs = self.batch(model.config, with_labels=False)
        kwargs = dict(num_beams=num_beams, max_new_tokens=8, min_new_tokens=8)
        batched = model.generate(**inputs, **kwargs)
        for row in range(self.batch_size):
            single = model.generate(**self.rows(inputs, row), **kwargs)
            assert torch.equal(single[0], batched[row, : single.shape[1]]), row

    def test_padding_does_not_change_real_positions(self, tokenizer):
        model = self.build(tokenizer)
        inputs = self.batch(model.config)
        changed = dict(inputs)
        pad = inputs["attention_mask"] == 0
        changed["input_ids"] = inputs["input_ids"].masked_fill(pad, 5)  # other tokens under the mask
        a, b = model(**inputs), model(**changed)
        real = ~pad
        assert _allclose(a.encoder_last_hidden_state[real], b.encoder_last_hidden_state[real])
        assert _allclose(a.logits, b.logits)

    def test_sdpa_equals_eager(self, tokenizer):
        model = self.build(tokenizer)
        assert model.config._attn_implementation == "sdpa"
        inputs = self.batch(model.config)
        sdpa = model(**inputs).logits
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"
        eager = model(**inputs).logits
        assert _allclose(sdpa, eager, atol=1e-5)

    def test_gradient_checkpointing_equal_gradients(self, tokenizer):
        model = self.build(tokenizer).train()
        inputs = self.batch(model.config)
        torch.manual_seed(0)
        model(**inputs).loss.backward()
        plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        model.activation_checkpointing_enable()
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        torch.manual_seed(0)
        model(**inputs).loss.backward()
        checkpointed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert plain.keys() == checkpointed.keys() and len(plain) > 0
        for name in plain:
            assert _allclose(plain[name], checkpointed[name], atol=1e-6), name

    def test_bf16_forward_has_no_nan(self, tokenizer):
        model = self.build(tokenizer).to(torch.bfloat16)
        inputs = self.batch(model.config)
        out = model(**inputs)
        assert out.logits.dtype == torch.bfloat16
        assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
        generated = model.generate(**{k: v for k, v in inputs.items() if k != "labels"}, max_new_tokens=4)
        assert generated.shape[0] == self.batch_size

    def test_auto_classes(self, tokenizer, tmp_path):
        model = self.build(tokenizer)
        config = AutoConfig.for_model(
            self.model_type, **{k: v for k, v in model.config.to_diff_dict().items() if k != "model_type"}
        )
        assert config.to_dict() == {**model.config.to_dict(), "architectures": config.architectures}
        assert type(config) is type(model.config)
        assert type(AutoModelForSeq2SeqLM.from_config(model.config)) is self.model_class
        model.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        assert set(saved["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"}
        assert saved["custom_pipelines"]["translation"]["impl"] == "pipeline_translation.TranslationPipeline"
        base = AutoModel.from_pretrained(tmp_path)
        assert type(base) is hf_variants.MODEL_CLASSES[self.model_type][1]
        inputs = self.batch(model.config, with_labels=False)
        assert _allclose(
            base(**inputs, decoder_input_ids=inputs["input_ids"][:, :4]).last_hidden_state,
            model.model(**inputs, decoder_input_ids=inputs["input_ids"][:, :4]).last_hidden_state,
        )

    def test_pipeline_with_objects(self, tokenizer):
        model = self.build(tokenizer)
        translator = pipeline("translation", model=model, tokenizer=tokenizer)
        sentences = read_sentences("en", "val", n=3)
        gen = dict(num_beams=2, max_new_tokens=6)
        single = translator(sentences[0], **self.translation_kwargs, **gen)
        batch = translator(sentences, batch_size=2, **self.translation_kwargs, **gen)
        assert isinstance(single, list) and set(single[0]) == {"translation_text"}
        assert len(batch) == 3 and batch[0] == single[0]
        inputs = model.prepare_translation_inputs(tokenizer, sentences[:1], **self.translation_kwargs)
        direct = tokenizer.decode(model.generate(**inputs, **gen)[0], skip_special_tokens=True)
        assert single[0]["translation_text"] == direct

    def test_trust_remote_code_in_fresh_process(self, tokenizer, tmp_path):
        """Saved folder -> fresh process without hf_variants: Auto classes and the pipeline give our outputs."""
        model = self.build(tokenizer)
        model.save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
        code = {path.name for path in tmp_path.glob("*.py")}  # the model's module and its siblings, by split concern
        assert {
            "modeling_transformer_nmt.py",
            "generation_transformer_nmt.py",
            "loss_transformer_nmt.py",
            type(model).__module__.rsplit(".", 1)[-1] + ".py",
        } <= code, code
        sentences = read_sentences("en", "val", n=2)
        gen = dict(num_beams=3, max_new_tokens=6)
        inputs = model.prepare_translation_inputs(tokenizer, sentences, **self.translation_kwargs)
        expected_ids = model.generate(**inputs, **gen).tolist()
        expected_text = pipeline("translation", model=model, tokenizer=tokenizer)(
            sentences, **gen, **self.translation_kwargs
        )
        code = f"""
            import json, torch
            from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
            d = {str(tmp_path)!r}
            model = AutoModelForSeq2SeqLM.from_pretrained(d, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
            inputs = model.prepare_translation_inputs(tok, {sentences!r}, **{self.translation_kwargs!r})
            ids = model.generate(**inputs, **{gen!r}).tolist()
            texts = pipeline("translation", model=d, trust_remote_code=True)({sentences!r}, **{gen!r},
                                                                             **{self.translation_kwargs!r})
            print(json.dumps({{"ids": ids, "texts": texts}}))
        """
        result = json.loads(run_without_package(code).strip().splitlines()[-1])
        assert result["ids"] == expected_ids
        assert result["texts"] == expected_text

    def test_config_validation(self, tokenizer):
        with pytest.raises(ValueError, match="encoder_attention_heads"):
            self.make_config(vocab_size=len(tokenizer), encoder_attention_heads=5)
        with pytest.raises(ValueError, match="dropout"):
            self.make_config(vocab_size=len(tokenizer), dropout=1.5)
        with pytest.raises(ValueError, match="vocab_size"):
            self.make_config(vocab_size=0)


def equal_to_baseline(variant, inputs: dict, state_map=None, atol=1e-5):
    """Copy `variant`'s weights (renamed by `state_map(name) -> baseline name or None`) into a baseline of the same
    dimensions and return (variant logits, baseline logits)."""
    config = hf_variants.TransformerNmtConfig(
        **{
            k: v
            for k, v in variant.config.to_dict().items()
            if k in hf_variants.TransformerNmtConfig().to_dict()
            and k not in ("model_type", "architectures", "auto_map")
        }
    )
    baseline = hf_variants.TransformerNmtForConditionalGeneration(config).eval()
    mapped = {}
    for name, tensor in variant.state_dict().items():
        target = state_map(name) if state_map else name
        if target is not None:
            mapped[target] = tensor
    missing, unexpected = baseline.load_state_dict(mapped, strict=False)
    tied = {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    assert not [k for k in missing if k not in tied], missing
    assert not unexpected, unexpected
    with torch.no_grad():
        return variant(**inputs).logits, baseline(
            **{k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "labels")}
        ).logits


__all__ = ["NmtModelTester", "equal_to_baseline"]
