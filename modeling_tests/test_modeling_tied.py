"""Tied Transformer: the common checks, plus one parameter set for both sides (state dict, checkpoint, data_ptr
after loading), the encoder path (no causal mask, no cross-attention, no cache), gradients of an encoder-only loss
reaching the decoder, the direction embedding, two-direction training, the parameter formulas, and equality with
a baseline whose encoder and decoder layers are copies of the blocks."""

from __future__ import annotations

import pytest
import torch
from common import NmtModelTester, read_sentences
from safetensors import safe_open
from torch.nn import functional as F
from transformers import pipeline

import hf_variants
from hf_variants import TiedTransformerConfig, TiedTransformerForConditionalGeneration, TransformerNmtConfig
from hf_variants.compat_transformer_nmt import output_cache
from hf_variants.configuration_tied import tied_parameter_count, untied_parameter_count

LANGUAGES = ["en", "de"]


def baseline_config(config: TiedTransformerConfig) -> TransformerNmtConfig:
    """The baseline config of the same dimensions and settings."""
    fields = TransformerNmtConfig().to_dict()
    return TransformerNmtConfig(
        **{
            k: v
            for k, v in config.to_dict().items()
            if k in fields and k not in ("model_type", "architectures", "auto_map")
        }
    )


def _num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # shared tensors counted once


class TestTiedTransformer(NmtModelTester):
    model_type = "tied_nmt"
    translation_kwargs = {"tgt_lang": "de"}

    def make_config(self, **overrides):
        return TiedTransformerConfig.from_preset("tiny", **{"languages": LANGUAGES, **overrides})

    def make_inputs(self, config, input_ids, attention_mask):
        return {"tgt_lang_ids": torch.full((input_ids.shape[0],), config.language_id("de"))}

    def mixed(self, inputs, directions=(1, 0, 1)):
        return {**inputs, "tgt_lang_ids": torch.tensor(directions[: self.batch_size])}

    # -------------------------------------------------------------------------------------- one parameter set
    def test_one_parameter_set_saved_and_loaded_tied(self, tokenizer, tmp_path):
        model = self.build(tokenizer)
        base = model.model
        assert base.encoder.layers is base.layers and base.decoder.layers is base.layers
        assert base.encoder.layer_norm is base.layer_norm and base.decoder.layer_norm is base.layer_norm
        keys = set(model.state_dict())
        assert not [k for k in keys if k.startswith(("model.encoder.layer", "model.decoder.layer"))]
        block_keys = {k for k in keys if k.startswith("model.layers.")}
        per_block = len(list(base.layers[0].state_dict()))
        assert len(block_keys) == model.config.num_blocks * per_block
        model.save_pretrained(tmp_path)
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            saved = set(f.keys())
        assert block_keys | {"model.layer_norm.weight", "model.layer_norm.bias"} <= saved
        assert not [k for k in saved if ".encoder.layer" in k or ".decoder.layer" in k]

        loaded = TiedTransformerForConditionalGeneration.from_pretrained(tmp_path).eval()
        lb = loaded.model
        assert lb.encoder.layers is lb.layers and lb.decoder.layers is lb.layers
        assert lb.encoder.layer_norm is lb.layer_norm is lb.decoder.layer_norm
        assert (
            lb.encoder.embed_tokens.weight.data_ptr()
            == lb.decoder.embed_tokens.weight.data_ptr()
            == loaded.lm_head.weight.data_ptr()
        )
        assert _num_parameters(loaded) == _num_parameters(model) == tied_parameter_count(loaded.config)
        for name, value in model.state_dict().items():
            assert torch.equal(value, loaded.state_dict()[name]), name

    def test_encoder_only_loss_updates_what_the_decoder_uses(self, tokenizer):
        model = self.build(tokenizer).train()
        config = model.config
        inputs = self.batch(config, with_labels=False)
        encoder, decoder = model.get_encoder(), model.model.decoder
        decoder_ids = inputs["input_ids"][:, :5]
        with torch.no_grad():
            memory = encoder(**inputs).last_hidden_state
            before = decoder(
                input_ids=decoder_ids, encoder_hidden_states=memory, encoder_attention_mask=inputs["attention_mask"]
            ).last_hidden_state
        direction = torch.randn(config.d_model, generator=torch.Generator().manual_seed(0))
        (encoder(**inputs).last_hidden_state @ direction).sum().backward()  # a loss of the encoder alone
        for i, block in enumerate(model.model.layers):
            for module in (
                block.self_attn.qkv_proj,
                block.self_attn.out_proj,
                block.ffn.fc1,
                block.ffn.fc2,
                block.self_attn_layer_norm,
                block.ffn.final_layer_norm,
            ):
                assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0, (i, module)
            assert all(p.grad is None for p in block.encoder_attn.parameters())  # never run by the encoder
            assert all(p.grad is None for p in block.encoder_attn_layer_norm.parameters())
        assert model.model.layer_norm.weight.grad.abs().sum() > 0
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        old = qkv.detach().clone()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert not torch.equal(decoder.layers[0].self_attn.qkv_proj.weight, old)  # the decoder sees the step
        with torch.no_grad():
            after = decoder(
                input_ids=decoder_ids, encoder_hidden_states=memory, encoder_attention_mask=inputs["attention_mask"]
            ).last_hidden_state
        assert (after - before).abs().max() > 1e-3

    # --------------------------------------------------------------------------------------------- the two paths
    def test_encoder_path_no_causal_mask_no_cross_attention_no_cache(self, tokenizer):
        model = self.build(tokenizer)
        config = model.config
        inputs = self.batch(config, with_labels=False)
        calls = {"cross": 0, "self": []}
        hooks = []
        for block in model.model.layers:  # the blocks both sides run
            hooks.append(
                block.encoder_attn.register_forward_hook(lambda *a: calls.__setitem__("cross", calls["cross"] + 1))
            )
            hooks.append(
                block.self_attn.register_forward_pre_hook(
                    lambda m, args, kwargs: calls["self"].append(
                        (
                            kwargs.get("attention_mask"),
                            kwargs.get("cache"),
                            kwargs.get("is_causal", m.is_causal),
                        )
                    ),
                    with_kwargs=True,
                )
            )
        encoder_out = model.get_encoder()(**inputs, output_attentions=True)
        assert calls["cross"] == 0 and len(calls["self"]) == config.num_blocks
        padding = inputs["attention_mask"].bool()[:, None, None, :]
        for mask, cache, is_causal in calls["self"]:
            assert cache is None and is_causal is False and torch.equal(mask, padding.expand_as(mask))
        # real tokens attend to later real tokens (eager weights)
        weights = encoder_out.attentions[0][0]  # row 0 has no padding
        assert torch.triu(weights, diagonal=1).sum() > 0.1
        changed = dict(inputs, input_ids=inputs["input_ids"].clone())
        changed["input_ids"][0, -1] = 7 if int(inputs["input_ids"][0, -1]) != 7 else 8
        first = model.get_encoder()(**changed).last_hidden_state[0, 0]
        assert (first - encoder_out.last_hidden_state[0, 0]).abs().max() > 1e-4  # position 0 sees the last token

        calls.update(cross=0, self=[])
        decoder_ids = inputs["input_ids"][:, :5]
        out = model(**inputs, decoder_input_ids=decoder_ids, use_cache=True)
        decoder_calls = calls["self"][config.num_blocks :]  # after the encoder's calls
        assert calls["cross"] == config.num_blocks and len(decoder_calls) == config.num_blocks
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        for mask, cache, is_causal in decoder_calls:  # SDPA's is_causal, or an explicit causal mask
            assert cache is output_cache(out) and is_causal is True
            assert mask is None or torch.equal(mask[0, 0], causal)
        for layer in output_cache(out).self_attention_cache.layers:
            assert layer.keys.shape[-2] == 5  # decoder positions only: the encoder never wrote to the cache
        for handle in hooks:
            handle.remove()
        later = decoder_ids.clone()
        later[:, 4] = 9 if int(later[0, 4]) != 9 else 10
        with torch.no_grad():
            moved = model(**inputs, decoder_input_ids=later).logits
        assert torch.allclose(moved[:, :4], out.logits[:, :4], atol=1e-6)  # the decoder stays causal

    # ------------------------------------------------------------------------------------------------ directions
    def test_direction_embedding_is_added_to_the_encoder_input(self, tokenizer):
        model = self.build(tokenizer)
        inputs = self.batch(model.config)
        encoder = model.get_encoder()
        ids = inputs["input_ids"]
        to_en, to_de = torch.zeros(self.batch_size, dtype=torch.long), torch.ones(self.batch_size, dtype=torch.long)
        table = encoder.target_space_embedding.weight
        difference = encoder.embed(ids, tgt_lang_ids=to_de) - encoder.embed(ids, tgt_lang_ids=to_en)
        assert torch.allclose(difference, (table[1] - table[0]).expand_as(difference), atol=1e-6)
        with torch.no_grad():
            de = model(**inputs).logits
            en = model(**{**inputs, "tgt_lang_ids": to_en}).logits
        assert (de - en).abs().max() > 1e-3
        with pytest.raises(ValueError, match="tgt_lang_ids"):
            model(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"})
        # without the table, the direction input changes nothing
        plain = self.build(tokenizer, direction_embedding=False)
        assert not [k for k in plain.state_dict() if "target_space" in k]
        with torch.no_grad():
            assert torch.equal(plain(**inputs).logits, plain(**{**inputs, "tgt_lang_ids": to_en}).logits)
        # one direction (no languages): a constant learned bias, no direction input needed
        single = self.build(tokenizer, languages=[])
        assert single.config.num_directions == 1 and single.model.encoder.target_space_embedding.num_embeddings == 1
        no_direction = {k: v for k, v in inputs.items() if k != "tgt_lang_ids"}
        with torch.no_grad():
            implicit = single(**no_direction).logits
            explicit = single(**no_direction, tgt_lang_ids=torch.zeros(self.batch_size, dtype=torch.long)).logits
        assert torch.equal(implicit, explicit)

    def test_mixed_direction_batch_equals_one_by_one(self, tokenizer):
        """Per-sentence directions survive beam expansion: a batch mixing both equals each sentence alone."""
        model = self.build(tokenizer)
        inputs = self.mixed(self.batch(model.config, with_labels=False))
        kwargs = dict(num_beams=3, max_new_tokens=5, min_new_tokens=5)
        batched = model.generate(**inputs, **kwargs)
        for row in range(self.batch_size):
            single = model.generate(**self.rows(inputs, row), **kwargs)
            assert torch.equal(single[0], batched[row, : single.shape[1]]), row
        by_code = model.generate(
            **{k: v for k, v in inputs.items() if k != "tgt_lang_ids"},
            tgt_lang=["de", "en", "de"][: self.batch_size],
            **kwargs,
        )
        assert torch.equal(by_code, batched)

    def test_pipeline_and_generate_pick_the_direction(self, tokenizer):
        model = self.build(tokenizer)
        translator = pipeline("translation", model=model, tokenizer=tokenizer)
        sentences = read_sentences("en", "val", n=2) + read_sentences("de", "val", n=1, start=5)
        gen = dict(num_beams=2, max_new_tokens=5)
        mixed = translator(sentences, tgt_lang=["de", "de", "en"], **gen)
        assert mixed[:2] == translator(sentences[:2], tgt_lang="de", **gen)
        assert mixed[2] == translator(sentences[2], tgt_lang="en", **gen)[0]
        inputs = model.prepare_translation_inputs(tokenizer, sentences[:2], tgt_lang="de")
        assert torch.equal(inputs["tgt_lang_ids"], torch.tensor([1, 1]))
        plain = {k: v for k, v in inputs.items() if k != "tgt_lang_ids"}
        assert torch.equal(model.generate(**plain, tgt_lang="de", **gen), model.generate(**inputs, **gen))
        with pytest.raises(ValueError, match="tgt_lang"):
            model.prepare_translation_inputs(tokenizer, sentences[:2])

    def test_two_direction_loss_is_the_sum_of_both_directions(self, tokenizer):
        model = self.build(tokenizer)
        en, de = read_sentences("en", "val", n=3), read_sentences("de", "val", n=3)
        both = model.prepare_translation_inputs(
            tokenizer, en + de, tgt_lang=["de"] * 3 + ["en"] * 3, text_target=de + en
        )
        en_de = model.prepare_translation_inputs(tokenizer, en, tgt_lang="de", text_target=de)
        de_en = model.prepare_translation_inputs(tokenizer, de, tgt_lang="en", text_target=en)
        with torch.no_grad():
            joint = model(**both)
            separate = model(**en_de).loss + model(**de_en).loss
        assert torch.allclose(joint.loss, separate, atol=1e-5)
        logits, labels = joint.logits, both["labels"]
        token_mean = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            label_smoothing=model.config.label_smoothing,
        )
        assert not torch.allclose(joint.loss, token_mean, atol=1e-2)  # the sum, not a mean over both
        mean_model = self.build(tokenizer, direction_loss="mean")
        with torch.no_grad():
            mean_out = mean_model(**both)
        expected = F.cross_entropy(
            mean_out.logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            label_smoothing=model.config.label_smoothing,
        )
        assert torch.allclose(mean_out.loss, expected, atol=1e-6)

    # ------------------------------------------------------------------------------------------- against baseline
    @pytest.mark.parametrize("normalize_before", [True, False])
    def test_equals_baseline_with_blocks_copied_to_both_stacks(self, tokenizer, normalize_before):
        model = self.build(tokenizer, normalize_before=normalize_before)
        with torch.no_grad():
            model.model.encoder.target_space_embedding.weight.zero_()  # the baseline has no direction input
        baseline = hf_variants.TransformerNmtForConditionalGeneration(baseline_config(model.config)).eval()
        state = model.state_dict()
        mapped, sources = {}, set()
        for name in baseline.state_dict():
            source = name
            for side in ("encoder", "decoder"):
                source = source.replace(f"model.{side}.layers.", "model.layers.")
                source = source.replace(f"model.{side}.layer_norm.", "model.layer_norm.")
            source = {
                "model.encoder.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embed_tokens.weight": "model.shared.weight",
                "lm_head.weight": "model.shared.weight",
            }.get(source, source)
            mapped[name] = state[source]
            sources.add(source)
        baseline.load_state_dict(mapped, strict=True)
        aliases = {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
        assert sources == set(state) - aliases - {"model.encoder.target_space_embedding.weight"}  # all used
        inputs = self.batch(model.config)
        with torch.no_grad():
            tied = model(**inputs).logits
            base = baseline(**{k: v for k, v in inputs.items() if k != "tgt_lang_ids"}).logits
        assert torch.allclose(tied, base, atol=1e-5)

    # ------------------------------------------------------------------------------------------ parameter count
    @pytest.mark.parametrize(
        "overrides",
        [
            {},
            {
                "normalize_before": False,
                "position_embedding_type": "learned",
                "max_relative_positions": 2,
                "output_bias": True,
            },
        ],
    )
    def test_parameter_formulas_match_the_models(self, tokenizer, overrides):
        model = self.build(tokenizer, **overrides)
        assert _num_parameters(model) == tied_parameter_count(model.config)
        config = baseline_config(model.config)
        baseline = hf_variants.TransformerNmtForConditionalGeneration(config)
        assert _num_parameters(baseline) == untied_parameter_count(model.config) == untied_parameter_count(config)

    def test_parameter_counts_of_the_paper(self):
        # blocks only (3-token vocabulary, no direction table): the spec's 100.8M vs 176.4M for big, L=6
        blocks = TiedTransformerConfig.from_preset("big", vocab_size=3, direction_embedding=False)
        embedding, final_norm = 3 * 1024, 2 * 1024
        assert round((tied_parameter_count(blocks) - embedding - final_norm) / 1e6, 1) == 100.8
        assert round((untied_parameter_count(blocks) - embedding - 2 * final_norm) / 1e6, 1) == 176.4
        big = TiedTransformerConfig.from_preset("big", vocab_size=32000, languages=LANGUAGES)
        assert 0.5 < tied_parameter_count(big) / untied_parameter_count(big) < 0.7  # "about half"
        # "a 12-block tied model has about the parameters of a 6-block baseline" (P 4.3)
        twelve = TiedTransformerConfig.from_preset(
            "big", vocab_size=32000, languages=LANGUAGES, encoder_layers=12, decoder_layers=12
        )
        assert abs(tied_parameter_count(twelve) / untied_parameter_count(big) - 1) < 0.15

    # ---------------------------------------------------------------------------------------------------- config
    def test_presets_and_tied_validation(self):
        small = TiedTransformerConfig.from_preset("small")
        assert (
            small.num_blocks,
            small.d_model,
            small.encoder_ffn_dim,
            small.encoder_attention_heads,
            small.dropout,
            small.normalize_before,
        ) == (8, 256, 1024, 4, 0.1, True)
        big = TiedTransformerConfig.from_preset("big")
        assert (big.num_blocks, big.d_model, big.encoder_ffn_dim, big.encoder_attention_heads, big.dropout) == (
            6,
            1024,
            4096,
            16,
            0.2,
        )
        assert TiedTransformerConfig(languages=["en", "de", "fr"]).num_directions == 3
        for field, value in (("decoder_layers", 3), ("decoder_attention_heads", 4), ("decoder_ffn_dim", 64)):
            with pytest.raises(ValueError, match=field):
                TiedTransformerConfig(**{field: value})
        with pytest.raises(ValueError, match="num_directions"):
            TiedTransformerConfig(languages=["en", "de"], num_directions=1)
        with pytest.raises(ValueError, match="direction_loss"):
            TiedTransformerConfig(direction_loss="max")


def test_target_language_tags_auto_is_off_for_tied():
    """`--target_language_tags auto` gives tags to a run with two target languages (e.g.
    --bidirectional) except for the Tied Transformer, whose direction embedding is the signal; an explicit value
    wins."""
    import importlib

    train = importlib.import_module("hf_variants.training.train")
    assert TiedTransformerConfig.default_target_language_tags(2) is False
    assert TransformerNmtConfig.default_target_language_tags(2) is True
    assert TransformerNmtConfig.default_target_language_tags(1) is False
    for model_type, flag, targets, expected in [
        ("tied_nmt", "auto", 2, False),
        ("tied_nmt", "true", 2, True),
        ("tied_nmt", "auto", 1, False),
        ("transformer_nmt", "auto", 2, True),
        ("mimo_nmt", "auto", 3, True),
        ("hysan_nmt", "false", 2, False),
        ("marian", "auto", 2, True),
    ]:
        args = train.parse_args(["--data_dir", "x", "--model_type", model_type, "--target_language_tags", flag])
        assert train.resolve_target_language_tags(args, targets) is expected, (model_type, flag, targets)
