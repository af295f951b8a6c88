"""Baseline Transformer: the common checks, plus Marian equivalence, presets and the pipeline registration."""

from __future__ import annotations

import pytest
import torch
from common import NmtModelTester

import hf_variants
from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration


class TestTransformerNmt(NmtModelTester):
    model_type = "transformer_nmt"

    def make_config(self, **overrides):
        return TransformerNmtConfig.from_preset("tiny", **overrides)


class TestTransformerNmtPreNormRelative(NmtModelTester):
    """Pre-norm, learned positions and Shaw relative keys+values (MUTE's setting) through the same checks."""

    model_type = "transformer_nmt"

    def make_config(self, **overrides):
        return TransformerNmtConfig.from_preset(
            "tiny", normalize_before=True, max_relative_positions=3, relative_position_values=True, **overrides
        )


# --------------------------------------------------------------------------------------------- Marian equivalence
@pytest.fixture(scope="module")
def marian_pair():
    from transformers import MarianConfig, MarianMTModel

    from hf_variants.convert.marian import convert_marian

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=120,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        scale_embedding=True,
        pad_token_id=119,
        eos_token_id=0,
        decoder_start_token_id=119,
        forced_eos_token_id=0,
        activation_function="swish",
        dropout=0.0,
    )
    marian = MarianMTModel(config).eval()
    with torch.no_grad():  # a non-zero output bias must be carried over too
        marian.final_logits_bias.normal_(0, 0.1)
    return marian, convert_marian(marian)


def _marian_batch():
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 119, (3, 10), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    attention_mask[2, 3:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 119)
    return input_ids, attention_mask


def test_marian_conversion_gives_equal_logits(marian_pair):
    marian, ours = marian_pair
    input_ids, attention_mask = _marian_batch()
    decoder_input_ids = torch.randint(1, 119, (3, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = marian(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids
        ).logits
        got = ours(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    assert ours.config.output_bias and not ours.config.normalize_before
    assert torch.allclose(expected, got, atol=1e-5), (expected - got).abs().max()


@pytest.mark.parametrize("num_beams", [1, 4])
def test_marian_conversion_gives_identical_generations(marian_pair, num_beams):
    marian, ours = marian_pair
    input_ids, attention_mask = _marian_batch()
    kwargs = dict(num_beams=num_beams, length_penalty=0.6, max_new_tokens=12, min_new_tokens=3)
    expected = marian.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    got = ours.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(expected, got)


def test_marian_parameter_count_matches(marian_pair):
    marian, ours = marian_pair
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # Marian's sinusoidal tables are (frozen) parameters; ours are computed; its output bias is a buffer.
    marian_positions = sum(p.numel() for n, p in marian.named_parameters() if "embed_positions" in n)
    assert count(ours) == count(marian) - marian_positions + marian.final_logits_bias.numel()


# ------------------------------------------------------------------------------------------- config and presets
def test_presets_match_the_papers():
    base = TransformerNmtConfig.from_preset("base")
    assert (base.d_model, base.encoder_attention_heads, base.encoder_ffn_dim, base.encoder_layers) == (512, 8, 2048, 6)
    big = TransformerNmtConfig.from_preset("big", dropout=0.1)
    assert (big.d_model, big.encoder_attention_heads, big.decoder_ffn_dim, big.dropout) == (1024, 16, 4096, 0.1)
    small = TransformerNmtConfig.from_preset("small")
    assert (small.d_model, small.encoder_attention_heads) == (256, 4)
    with pytest.raises(ValueError, match="preset"):
        TransformerNmtConfig.from_preset("huge")
    # generation cache sized from the decoder
    assert (
        TransformerNmtConfig(encoder_layers=4, decoder_layers=2).get_text_config(decoder=True).num_hidden_layers == 2
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("position_embedding_type", "rotary"),
        ("activation_function", "nope"),
        ("max_relative_positions", -1),
        ("label_smoothing", 1.0),
        ("attention_dropout", -0.1),
        ("decoder_ffn_dim", 0),
        ("init_method", "he"),
        ("pad_token_id", 10_000),
        ("languages", ["en", "en"]),
        ("decoder_attention_heads", 3),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerNmtConfig(vocab_size=100, d_model=32, encoder_attention_heads=4, **{field: value})


def test_base_parameter_count_formula():
    """Vaswani base (shared 37k vocab, tied): 63.1M with biases, as fairseq's transformer_wmt_en_de reports."""
    config = TransformerNmtConfig.from_preset("base", vocab_size=37000)
    with torch.device("meta"):
        model = TransformerNmtForConditionalGeneration(config)
    d, f, layers = 512, 2048, 6
    attention = 4 * d * d + 4 * d
    ffn = 2 * d * f + f + d
    norm = 2 * d
    expected = 37000 * d + layers * (attention + ffn + 2 * norm) + layers * (2 * attention + ffn + 3 * norm)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_translation_task_restored_narrowly():
    from transformers import pipelines

    assert "translation" not in pipelines.REMOVED_TASKS
    assert {"summarization", "text2text-generation"} <= set(pipelines.REMOVED_TASKS)
    assert pipelines.PIPELINE_REGISTRY.check_task("translation")[1]["impl"] is hf_variants.TranslationPipeline


def test_multilingual_inputs_are_validated(tokenizer):
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), languages=["en", "de", "fr", "cs"], target_language_tags=True
    )
    model = TransformerNmtForConditionalGeneration(config)
    inputs = model.prepare_translation_inputs(
        tokenizer, ["A dog runs.", "Two men."], tgt_lang=["de", "fr"], text_target=["Ein Hund rennt.", "Zwei Männer."]
    )
    assert inputs["input_ids"][0, 0] == tokenizer.convert_tokens_to_ids("<2de>")
    assert inputs["input_ids"][1, 0] == tokenizer.convert_tokens_to_ids("<2fr>")
    assert (inputs["labels"] == -100).any() and (inputs["labels"] != tokenizer.pad_token_id).all()
    with pytest.raises(ValueError, match="tgt_lang='xx' is an unknown language"):
        model.prepare_translation_inputs(tokenizer, ["A dog."], tgt_lang="xx")
    with pytest.raises(ValueError, match="needs `tgt_lang`"):
        model.prepare_translation_inputs(tokenizer, ["A dog."])


def test_generation_never_emits_padding_or_start_token():
    """Even when the model prefers them (output rows of <pad>/<s> pushed up), `generate` skips both; a saved
    generation config keeps the setting."""
    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=40, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1
    )
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(config).eval()
    assert model.generation_config.suppress_tokens == [0, 1]
    with torch.no_grad():
        model.lm_head.weight[:2] *= 50  # make <pad> and <s> the model's favourites
        source = torch.randint(3, 40, (3, 7))
        plain = model(input_ids=source, decoder_input_ids=torch.ones(3, 1, dtype=torch.long)).logits
        assert set(plain[:, -1].argmax(-1).tolist()) <= {0, 1}, "the setup should favour <pad>/<s>"
        for beams in (1, 3):
            out = model.generate(input_ids=source, num_beams=beams, max_new_tokens=6)
            generated = out[:, 1:]
            ended = torch.cumsum(generated == 2, dim=1) > 0  # after </s> comes padding
            before_end = generated.masked_select(~ended | (generated == 2))
            assert not torch.isin(before_end, torch.tensor([0, 1])).any(), out


# ------------------------------------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 23, 97])  # one chunk, or chunks of 1-2 rows (97 // 50)
def test_smoothed_cross_entropy_equals_f_cross_entropy(monkeypatch, dtype, chunk):
    """Value and gradient of the chunked loss equal F.cross_entropy's (token mean over labelled tokens, label
    smoothing), for float32 and bfloat16 logits, and with per-token weights the weighted sum of its per-token
    losses."""
    import torch.nn.functional as F

    from hf_variants import loss_transformer_nmt as backbone

    monkeypatch.setattr(backbone, "LOSS_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 7))
    labels[0, 4:] = -100
    labels[2, 6] = -100
    weights = torch.rand(3, 7)
    for smoothing in (0.0, 0.1):
        flat = logits.reshape(-1, 50).float()
        references = {
            None: F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, label_smoothing=smoothing),
            "weights": (
                F.cross_entropy(
                    flat, labels.reshape(-1), ignore_index=-100, label_smoothing=smoothing, reduction="none"
                )
                * weights.reshape(-1)
            ).sum(),
        }
        for kind, reference in references.items():
            (expected_grad,) = torch.autograd.grad(reference * 1.7, logits)
            ours = backbone.smoothed_cross_entropy(logits, labels, smoothing, weights=weights if kind else None)
            (grad,) = torch.autograd.grad(ours * 1.7, logits)
            assert grad.dtype == dtype
            assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-5), (kind, smoothing)
            # bfloat16: the gradient is rounded to bfloat16, then scaled there by the backward (two roundings)
            atol, rtol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-4, 1e-2)
            assert torch.allclose(grad.float(), expected_grad.float(), atol=atol, rtol=rtol), (kind, smoothing)


def test_smoothed_cross_entropy_edge_cases():
    """No labelled token: loss 0 and a zero gradient (F.cross_entropy gives NaN); without gradients no buffer is
    needed and the value is the same; a second backward through the same graph raises instead of returning a
    gradient scaled twice."""
    from hf_variants.loss_transformer_nmt import smoothed_cross_entropy

    logits = torch.randn(2, 5, 11, requires_grad=True)
    none = torch.full((2, 5), -100)
    loss = smoothed_cross_entropy(logits, none, 0.1)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    labels = torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        no_grad = smoothed_cross_entropy(logits, labels, 0.1)
    loss = smoothed_cross_entropy(logits, labels, 0.1)
    assert torch.equal(no_grad, loss.detach())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("chunk", [1 << 23, 97])  # one chunk, or chunks of 1-2 rows
def test_projected_loss_equals_loss_of_the_logits(monkeypatch, chunk):
    """projected_smoothed_cross_entropy(h, W, b) has the value and the gradients (hidden states, weight, bias) of
    smoothed_cross_entropy(F.linear(h, W, b)), with and without per-token weights, label smoothing and a bias; the
    chunk's logits are never larger than LOSS_CHUNK_ELEMENTS."""
    import torch.nn.functional as F

    from hf_variants import loss_transformer_nmt as backbone

    monkeypatch.setattr(backbone, "LOSS_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.5).requires_grad_()
    bias = torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, 4:] = -100
    weights = torch.rand(3, 7)
    for use_bias in (True, False):
        b = bias if use_bias else None
        params = [hidden, weight] + ([bias] if use_bias else [])
        for smoothing in (0.0, 0.1):
            for kind in (None, "weights"):
                w = weights if kind else None
                reference = backbone.smoothed_cross_entropy(F.linear(hidden, weight, b), labels, smoothing, weights=w)
                expected = torch.autograd.grad(reference * 1.7, params)
                ours = backbone.projected_smoothed_cross_entropy(hidden, weight, b, labels, smoothing, weights=w)
                grads = torch.autograd.grad(ours * 1.7, params)
                assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-6), (use_bias, smoothing, kind)
                for name, a, e in zip(("hidden", "weight", "bias"), grads, expected):
                    assert a.dtype == e.dtype and a.shape == e.shape, name
                    assert torch.allclose(a, e, atol=1e-5, rtol=1e-5), (name, use_bias, smoothing, kind)
    with torch.no_grad():  # no gradient wanted: the same value, no buffers
        value = backbone.projected_smoothed_cross_entropy(hidden, weight, bias, labels, 0.1)
    again = backbone.projected_smoothed_cross_entropy(hidden, weight, bias, labels, 0.1)
    assert torch.equal(value, again.detach())
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        again.backward()


def test_projected_loss_under_bfloat16_autocast():
    """Under autocast the chunked products run in bfloat16 as the output projection's F.linear would: the loss and
    the gradients stay within bfloat16 rounding of the logits path, and the gradients keep the parameters'
    float32 dtype."""
    import torch.nn.functional as F

    from hf_variants.loss_transformer_nmt import projected_smoothed_cross_entropy, smoothed_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(4, 9, 32, requires_grad=True)
    weight = (torch.randn(70, 32) * 0.3).requires_grad_()
    labels = torch.randint(0, 70, (4, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = smoothed_cross_entropy(F.linear(hidden, weight), labels, 0.1)
        expected = torch.autograd.grad(reference, [hidden, weight])
        ours = projected_smoothed_cross_entropy(hidden, weight, None, labels, 0.1)
        grads = torch.autograd.grad(ours, [hidden, weight])
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, reference, rtol=1e-3)
    for a, e in zip(grads, expected):
        assert a.dtype == torch.float32
        assert (a - e).abs().max() <= 1e-2 * e.abs().max()


def test_model_loss_gradients_equal_f_cross_entropy():
    """The model's training loss (chunked) gives every parameter the gradient F.cross_entropy on its logits gives."""
    import torch.nn.functional as F

    config = TransformerNmtConfig.from_preset(
        "tiny",
        vocab_size=60,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        label_smoothing=0.1,
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = TransformerNmtForConditionalGeneration(config)
    source = torch.randint(3, 60, (4, 9))
    labels = torch.randint(3, 60, (4, 6))
    labels[1, 4:] = -100
    out = model(input_ids=source, labels=labels, smoothing=0.1)
    ours = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    out = model(input_ids=source, labels=labels, smoothing=0.1)
    reference = F.cross_entropy(out.logits.reshape(-1, 60), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1)
    expected = torch.autograd.grad(reference, list(model.parameters()), allow_unused=True)
    assert torch.allclose(out.loss, reference, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), ours, expected):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name


# ------------------------------------------------------------------------------------ vocabulary and damaged weights
def _tiny_model(vocab_size):
    torch.manual_seed(0)
    return TransformerNmtForConditionalGeneration(
        TransformerNmtConfig.from_preset("tiny", vocab_size=vocab_size)
    ).eval()


def test_tokenizer_larger_than_the_vocabulary_names_both_sizes(tokenizer):
    """One check (`check_tokenizer_fits_model`) and one message wherever a tokenizer meets a model: model inputs,
    the pipeline, translate.py, the CTranslate2 vocabulary."""
    from hf_variants.deploy.ctranslate2 import vocabulary

    model = _tiny_model(len(tokenizer) - 5)
    message = rf"has {len(tokenizer)} tokens \(len\(tokenizer\)\) .* vocabulary of {len(tokenizer) - 5} "
    with pytest.raises(ValueError, match=message):
        model.prepare_translation_inputs(tokenizer, ["A man is walking."])
    with pytest.raises(ValueError, match=message):
        vocabulary(tokenizer, model.config)
    fits = _tiny_model(len(tokenizer) + 3)  # equal or larger vocabularies are fine (padded to a multiple of 8)
    fits.prepare_translation_inputs(tokenizer, ["A man is walking."])
    tokens = vocabulary(tokenizer, fits.config)
    assert len(tokens) == len(tokenizer) + 3 and len(set(tokens)) == len(tokens)


def test_input_ids_outside_the_vocabulary_raise_a_value_error():
    model = _tiny_model(50)
    good = torch.tensor([[5, 6, 7, 2]])
    with pytest.raises(ValueError, match=r"TransformerNmtEncoder: input id 50 .*vocab_size=50"):
        model.generate(input_ids=torch.tensor([[5, 50, 7, 2]]), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"TransformerNmtDecoder: input id 64 .*vocab_size=50"):
        model(input_ids=good, decoder_input_ids=torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"input id -3 "):
        model(input_ids=torch.tensor([[5, -3, 2]]), decoder_input_ids=torch.tensor([[1]]))
    model.train()  # training on the CPU checks too (no host sync to save)
    with pytest.raises(ValueError, match=r"input id 50 "):
        model(input_ids=torch.tensor([[5, 50, 2]]), labels=torch.tensor([[4, 2]]))


def test_damaged_weights_file_is_named(tmp_path):
    from safetensors import SafetensorError

    _tiny_model(50).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    for damaged in (data[: len(data) // 2], data[:5]):  # truncated: mid-tensors, inside the header length
        weights.write_bytes(damaged)
        with pytest.raises(SafetensorError, match=rf"{weights}: the weights file cannot be read .*damaged"):
            TransformerNmtForConditionalGeneration.from_pretrained(tmp_path)
