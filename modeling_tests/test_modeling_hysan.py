"""HySAN (Hybrid Self-Attention Network): the common checks, plus the paper's mechanisms one by one.

- each branch mask exactly as defined (a key outside a query's allowed set cannot change that query's branch
  output, a key inside does), in the encoder, in the decoder, and over a KV cache;
- the decoder never sees the future; cached step-by-step decoding equals the full pass (local window over the cache);
- the batched kernel equals a branch-by-branch reference for sum / concat / gated sum, with QK^T computed once and one
  softmax call for all branches;
- parameter deltas vs the baseline equal the Table-2 formulas (and the paper's numbers for small/base/big);
- sum fusion with only the global (encoder) / causal (decoder) branch IS the baseline (copied weights);
- no NaN with left and right padding in fp32 and bf16; the NoPos switch.
"""

from __future__ import annotations

import pytest
import torch
from common import NmtModelTester, equal_to_baseline
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

import hf_variants
from hf_variants import HysanConfig, HysanForConditionalGeneration, TransformerNmtConfig
from hf_variants.compat_transformer_nmt import output_cache
from hf_variants.modeling_hysan import HysanAttention
from hf_variants.modeling_transformer_nmt import TransformerNmtForConditionalGeneration

ALL_ENCODER = ["global", "forward", "backward", "local"]


def tiny(**overrides):
    """A tiny HySAN (e1 branches, windows small enough to bite on test lengths)."""
    return HysanConfig.from_preset("tiny", **{"vocab_size": 60, "local_k": 2, **overrides})


def count(model):
    return sum(p.numel() for p in model.parameters())


class TestHysan(NmtModelTester):
    """The paper's default: e1 branches, gated sum (r = 16 -> d/r = 2 at d = 32), pre-norm; k = 2."""

    model_type = "hysan_nmt"

    def make_config(self, **overrides):
        return HysanConfig.from_preset("tiny", local_k=2, **overrides)


# --------------------------------------------------------------------------------------------------- branch masks
def allowed(kind, k, i, j, decoder):
    """The paper's definitions (eq. 9, 11; decoder local ANDed with causal), diagonal included."""
    d = i - j
    if kind == "global":
        return True
    if kind == "forward":
        return d >= 0
    if kind == "backward":
        return d <= 0
    assert kind == "local"
    return 0 <= d <= k if decoder else abs(d) <= k


def test_attention_and_relu_dropout_default_to_tensor2tensor_values(tmp_path):
    """docs/variants-spec.md §2.4: tensor2tensor's attention and ReLU dropout 0.1, in the class
    defaults and every preset but the test-only `tiny`; a saved config keeps its stored values."""
    for config in [HysanConfig()] + [HysanConfig.from_preset(p) for p in ("small", "base", "big")]:
        assert (config.attention_dropout, config.activation_dropout) == (0.1, 0.1)
    assert HysanConfig.from_preset("big").dropout == 0.3  # the residual dropout stays the preset's
    tiny_config = HysanConfig.from_preset("tiny")
    assert (tiny_config.attention_dropout, tiny_config.activation_dropout) == (0.0, 0.0)
    HysanConfig(attention_dropout=0.0).save_pretrained(tmp_path)
    assert HysanConfig.from_pretrained(tmp_path).attention_dropout == 0.0
    # the attention modules and FFNs read them: in training, dropout makes two forwards differ
    model = HysanForConditionalGeneration(
        HysanConfig.from_preset("tiny", vocab_size=60, attention_dropout=0.1, activation_dropout=0.1)
    ).train()
    assert model.model.encoder.layers[0].self_attn.dropout == 0.1
    src = torch.randint(4, 60, (2, 6))
    assert not torch.equal(model(input_ids=src, labels=src).logits, model(input_ids=src, labels=src).logits)


@pytest.mark.parametrize("decoder,q_len", [(False, 7), (True, 7), (True, 2)])
def test_each_branch_mask_exactly_as_defined(decoder, q_len):
    """Per branch and per (query i, key j): perturbing value j changes query i's branch output iff j is allowed;
    perturbing key j never changes it when j is outside. q_len < k_len: queries are the last positions (a cache)."""
    config = tiny(encoder_branches=ALL_ENCODER, decoder_branches=["forward", "local", "local_3"], local_k=[1, 2])
    attention = HysanAttention(config, 4, layer_idx=0, is_decoder=decoder).eval()
    specs = attention.branches
    assert specs == (
        [("forward", None), ("local", 1), ("local", 2), ("local", 3)]
        if decoder
        else [("global", None), ("forward", None), ("backward", None), ("local", 1), ("local", 2)]
    )
    g = torch.Generator().manual_seed(0)
    k_len = 7
    q, k, v = (torch.randn(1, 4, n, 8, generator=g) for n in (q_len, k_len, k_len))
    offset = k_len - q_len  # the queries are the last positions: the cache length is their offset
    base, _ = attention.branch_attention(q, k, v, None, offset)  # [1, Q, nb, d]
    for j in range(k_len):
        v2, k2 = v.clone(), k.clone()
        v2[:, :, j] += 1.0
        k2[:, :, j] += 1.0
        by_value, _ = attention.branch_attention(q, k, v2, None, offset)
        by_key, _ = attention.branch_attention(q, k2, v, None, offset)
        for b, (kind, width) in enumerate(specs):
            for qi in range(q_len):
                i = k_len - q_len + qi  # absolute position of the query
                changed_v = not torch.allclose(by_value[0, qi, b], base[0, qi, b], atol=1e-6)
                changed_k = not torch.allclose(by_key[0, qi, b], base[0, qi, b], atol=1e-6)
                assert changed_v == allowed(kind, width, i, j, decoder), (kind, width, i, j)
                if not allowed(kind, width, i, j, decoder):
                    assert not changed_k, (kind, width, i, j)


def test_padding_is_anded_into_every_branch():
    config = tiny()
    attention = HysanAttention(config, 4, layer_idx=0).eval()
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    probs, _ = attention.branch_probabilities(q, k, mask[:, None, None, :].bool())  # [B, H, nb, Q, K]
    assert probs.shape == (2, 4, 4, 6, 6)
    assert probs[1, ..., 4:].abs().max() == 0  # no branch puts weight on a padded key
    real_rows = probs[0].sum(-1)  # full row: every branch sums to one
    assert torch.allclose(real_rows, torch.ones_like(real_rows), atol=1e-5)
    # padded queries under the backward branch have no allowed key: 0, not NaN
    assert probs[1, :, 2, 4:].abs().max() == 0 and torch.isfinite(probs).all()


def test_decoder_never_sees_the_future():
    torch.manual_seed(0)
    model = HysanForConditionalGeneration(tiny()).eval()
    src = torch.randint(4, 60, (2, 8))
    tgt = torch.randint(4, 60, (2, 9))
    with torch.no_grad():
        logits = model(input_ids=src, decoder_input_ids=tgt).logits
        for t in (3, 6):
            changed = tgt.clone()
            changed[:, t] = (changed[:, t] + 7) % 56 + 4
            other = model(input_ids=src, decoder_input_ids=changed).logits
            assert torch.equal(logits[:, :t], other[:, :t])
            assert not torch.allclose(logits[:, t:], other[:, t:], atol=1e-4)


def test_cached_steps_equal_full_pass_past_the_local_window():
    """Teacher-forced decoding token by token over the cache (12 steps >> k + 1 = 2) equals the full pass."""
    torch.manual_seed(0)
    model = HysanForConditionalGeneration(tiny(local_k=1)).eval()
    src = torch.randint(4, 60, (2, 8))
    tgt = torch.randint(4, 60, (2, 12))
    with torch.no_grad():
        full = model(input_ids=src, decoder_input_ids=tgt).logits
        encoder_outputs = model.get_encoder()(input_ids=src)
        past, steps = None, []
        for t in range(tgt.shape[1]):
            out = model(
                encoder_outputs=encoder_outputs,
                decoder_input_ids=tgt[:, t : t + 1],
                cache=past,
                use_cache=True,
            )
            past = output_cache(out)
            steps.append(out.logits)
    assert past.get_seq_length() == 12
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


# ------------------------------------------------------------------------------------------- kernel and fusion
def reference_attention(attention, q, k, v, pad):
    """Branch by branch, the textbook way: softmax(QK^T/sqrt(d) + M_b) V, heads concatenated, then f(.)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    outputs = []
    for kind, width in attention.branches:
        mask = torch.tensor(
            [
                [allowed(kind, width, k_len - q_len + i, j, attention.is_decoder) for j in range(k_len)]
                for i in range(q_len)
            ]
        )
        mask = mask & pad
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
        x = probs @ v  # [B, H, Q, D]
        outputs.append(x.transpose(1, 2).flatten(2))  # [B, Q, d]
    if attention.fusion == "sum":
        fused = sum(outputs)
    elif attention.fusion == "concat":
        fused = torch.cat(outputs, -1)
    else:
        w1, w2 = attention.gate.squeeze.weight, attention.gate.excite.weight  # [d/r, d], [d, d/r]
        fused = sum(x * torch.sigmoid(F.relu(x @ w1.t()) @ w2.t()) for x in outputs)
    return fused @ attention.out_proj.weight.t() + attention.out_proj.bias


@pytest.mark.parametrize("fusion", ["sum", "concat", "gated_sum"])
@pytest.mark.parametrize("decoder", [False, True])
def test_batched_kernel_equals_branch_by_branch_reference(fusion, decoder):
    torch.manual_seed(0)
    attention = HysanAttention(tiny(fusion=fusion), 4, layer_idx=0, is_decoder=decoder).eval()
    x = torch.randn(2, 6, 32)
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[1, ..., :2] = False  # left padding: forward/local rows of the pads are empty
    out, _, _ = attention(x, attention_mask=pad)
    q, k, v = attention._heads(attention.qkv_proj(x), 3)
    expected = reference_attention(attention, q, k, v, pad)
    assert out.shape == (2, 6, 32)
    assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()


def test_qk_computed_once_and_one_softmax_for_all_branches():
    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    for branches in (["global"], ALL_ENCODER):
        attention = HysanAttention(tiny(encoder_branches=branches, local_k=[1, 2, 5]), 4, layer_idx=0).eval()
        q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
        with Count() as counter:
            attention.branch_attention(q, k, v, torch.ones(2, 1, 1, 9, dtype=torch.bool))
        matmuls = [c for c in counter.calls if c in ("matmul", "__matmul__", "bmm", "einsum", "baddbmm")]
        assert matmuls == ["matmul", "matmul"], counter.calls  # QK^T once, P V once (all branches batched)
        assert [c for c in counter.calls if "softmax" in c] == ["softmax"]


def test_output_attentions_are_the_mean_of_the_branch_probabilities():
    torch.manual_seed(0)
    model = HysanForConditionalGeneration(tiny()).eval()
    src = torch.randint(4, 60, (1, 7))
    inputs = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, args, out, key=key: inputs.update({key: args[0]}))
        for key, layer in (("enc", model.model.encoder.layers[0]), ("dec", model.model.decoder.layers[0]))
    ]
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=src[:, :5], output_attentions=True)
    for hook in hooks:
        hook.remove()
    enc, dec = out.encoder_attentions[0], out.decoder_attentions[0]
    assert enc.shape == (1, 4, 7, 7) and dec.shape == (1, 4, 5, 5)  # [B, H, Q, K] per layer
    for key, weights, layer in (
        ("enc", enc, model.model.encoder.layers[0]),
        ("dec", dec, model.model.decoder.layers[0]),
    ):
        attention = layer.self_attn
        with torch.no_grad():
            q, k, _ = attention._heads(attention.qkv_proj(inputs[key]), 3)
            probs, _ = attention.branch_probabilities(q, k, None)  # [B, H, nb, Q, K]
        assert torch.allclose(weights, probs.mean(2), atol=1e-6)
        assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
    assert torch.equal(probs[0, :, 1].tril(-3), torch.zeros(4, 5, 5))  # decoder local k=2: i - j <= 2
    assert torch.equal(dec[0].triu(1), torch.zeros(4, 5, 5))  # no decoder branch sees the future


# ----------------------------------------------------------------------------------------- parameters / baseline
def baseline_like(config):
    keep = TransformerNmtConfig().to_dict()
    return TransformerNmtConfig(
        **{
            key: value
            for key, value in config.to_dict().items()
            if key in keep and key not in ("model_type", "architectures", "auto_map")
        }
    )


@pytest.mark.parametrize(
    "enc,dec,local_k,layers",
    [
        (ALL_ENCODER, ["forward", "local"], 2, (2, 2)),  # e1
        (ALL_ENCODER, ["forward", "local"], [1, 2, 5], (3, 1)),  # e2, unequal depths
        (["global", "local_3"], ["local"], 4, (1, 2)),
    ],
)
def test_parameter_deltas_equal_table2_formulas(enc, dec, local_k, layers):
    d, r = 64, 16
    for fusion in ("sum", "concat", "gated_sum"):
        config = tiny(
            d_model=d,
            encoder_branches=enc,
            decoder_branches=dec,
            local_k=local_k,
            fusion=fusion,
            gate_reduction=r,
            encoder_layers=layers[0],
            decoder_layers=layers[1],
        )
        with torch.device("meta"):
            hysan = HysanForConditionalGeneration(config)
            baseline = TransformerNmtForConditionalGeneration(baseline_like(config))
        l_enc, l_dec = config.num_branches("encoder"), config.num_branches("decoder")
        expected = {
            "sum": 0,
            "concat": layers[0] * (l_enc - 1) * d * d + layers[1] * (l_dec - 1) * d * d,  # H replaces W^o
            "gated_sum": (layers[0] + layers[1]) * 2 * d * (d // r),
        }[fusion]  # one SG per module
        assert count(hysan) - count(baseline) == expected, fusion


@pytest.mark.parametrize(
    "preset,concat,gated", [("small", 524_288, 32_768), ("base", 6_291_456, 393_216), ("big", 25_165_824, 1_572_864)]
)
def test_paper_parameter_deltas_of_the_presets(preset, concat, gated):
    """Table 2: concat +524K/+6.29M/+25.1M = L*4*d^2, gated +32K/+383K(sic: 393K)/+1.57M = L*d^2/4."""
    for fusion, expected in (("sum", 0), ("concat", concat), ("gated_sum", gated)):
        config = HysanConfig.from_preset(preset, vocab_size=32000, fusion=fusion)
        with torch.device("meta"):
            delta = count(HysanForConditionalGeneration(config)) - count(
                TransformerNmtForConditionalGeneration(baseline_like(config))
            )
        assert delta == expected, (preset, fusion)
    if preset == "small":  # the paper's IWSLT baseline: 11.9M parameters with a 32k shared vocabulary
        with torch.device("meta"):
            assert round(count(TransformerNmtForConditionalGeneration(baseline_like(config))) / 1e5) == 119


@pytest.mark.parametrize("fusion", ["sum", "concat"])
def test_single_plain_branch_equals_baseline(fusion):
    """Encoder {global} and decoder {forward = causal}: sum (and concat, whose H is then d -> d) IS the
    baseline with the same weights (no key renaming), on a padded batch and with decoder padding."""
    torch.manual_seed(0)
    model = HysanForConditionalGeneration(
        tiny(encoder_branches=["global"], decoder_branches=["forward"], fusion=fusion)
    ).eval()
    src = torch.randint(4, 60, (3, 9))
    mask = torch.ones_like(src)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    labels = torch.randint(4, 60, (3, 6))
    ours, theirs = equal_to_baseline(model, {"input_ids": src, "attention_mask": mask, "labels": labels})
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    # and the default hybrid model is not the baseline
    hybrid = HysanForConditionalGeneration(tiny(fusion=fusion)).eval()
    shapes = {name: tensor.shape for name, tensor in hybrid.state_dict().items()}
    hybrid.load_state_dict(
        {name: tensor for name, tensor in model.state_dict().items() if shapes[name] == tensor.shape}, strict=False
    )
    with torch.no_grad():
        assert not torch.allclose(hybrid(input_ids=src, attention_mask=mask, labels=labels).logits, ours, atol=1e-3)


# ------------------------------------------------------------------------------------------------ padding / NoPos
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_nan_with_left_and_right_padding(dtype):
    torch.manual_seed(0)
    model = HysanForConditionalGeneration(tiny(local_k=1)).to(dtype).eval()
    src = torch.randint(4, 60, (2, 8))
    mask = torch.ones_like(src)
    mask[0, 5:] = 0  # right padding: backward rows of the pads are empty
    mask[1, :4] = 0  # left padding: forward rows of the pads are empty
    tgt = torch.randint(4, 60, (2, 6))
    tgt_mask = torch.ones_like(tgt)
    tgt_mask[0, 4:] = 0
    with torch.no_grad():
        out = model(
            input_ids=src.masked_fill(mask == 0, 0),
            attention_mask=mask,
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt_mask,
            output_attentions=True,
            output_hidden_states=True,
        )
    assert all(torch.isfinite(h).all() for h in out.encoder_hidden_states + out.decoder_hidden_states)
    assert torch.isfinite(out.logits).all()
    for probs in out.encoder_attentions:
        assert torch.isfinite(probs).all()
        assert probs[0, :, 2, 5:].abs().max() == 0 and probs[1, :, 1, :4].abs().max() == 0  # empty rows give 0
    generated = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=4, num_beams=2)
    assert generated.shape == (2, 5)


def test_nopos_switch():
    config = tiny(use_positional_embeddings=False)
    assert config.position_embedding_type == "none" and not config.use_positional_embeddings
    assert tiny().use_positional_embeddings and tiny().position_embedding_type == "sinusoidal"
    assert HysanConfig(**config.to_dict()).position_embedding_type == "none"
    torch.manual_seed(0)
    src = torch.randint(4, 60, (1, 8))
    perm = torch.randperm(8)

    def encode(model, ids, mask=None):
        with torch.no_grad():
            return model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state

    global_only = HysanForConditionalGeneration(
        tiny(use_positional_embeddings=False, encoder_branches=["global"])
    ).eval()
    hybrid = HysanForConditionalGeneration(tiny(use_positional_embeddings=False)).eval()
    # NoPos + global only: the encoder cannot see order (permutation-equivariant) ...
    assert torch.allclose(encode(global_only, src)[:, perm], encode(global_only, src[:, perm]), atol=1e-5)
    # ... the directional/local branches give order information back (the paper's NoPos study)
    assert not torch.allclose(encode(hybrid, src)[:, perm], encode(hybrid, src[:, perm]), atol=1e-3)
    # without absolute positions every branch is shift-invariant: left padding changes nothing at real positions
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), src], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(src)], 1)
    assert torch.allclose(encode(hybrid, padded, mask)[:, 3:], encode(hybrid, src), atol=1e-5)


# --------------------------------------------------------------------------------------------------------- config
def test_defaults_and_presets_are_the_papers():
    config = HysanConfig()
    assert config.encoder_branches == ALL_ENCODER and config.decoder_branches == ["forward", "local"]
    assert (config.local_k, config.fusion, config.gate_reduction, config.normalize_before) == (
        5,
        "gated_sum",
        16,
        True,
    )
    small = HysanConfig.from_preset("small")
    assert (small.encoder_layers, small.decoder_layers, small.d_model, small.encoder_attention_heads) == (2, 2, 256, 4)
    base, big = HysanConfig.from_preset("base"), HysanConfig.from_preset("big", fusion="concat")
    assert (base.d_model, base.encoder_layers, base.encoder_attention_heads) == (512, 6, 8)
    assert (big.d_model, big.decoder_attention_heads, big.fusion) == (1024, 16, "concat")
    assert set(HysanConfig.PRESETS) == set(TransformerNmtConfig.PRESETS)
    assert hf_variants.CONFIG_CLASSES["hysan_nmt"] is HysanConfig
    assert tiny(local_k=[1, 2, 5]).branch_specs("decoder") == [
        ("forward", None),
        ("local", 1),
        ("local", 2),
        ("local", 5),
    ]


@pytest.mark.parametrize(
    "field,value",
    [
        ("encoder_branches", ["global", "sideways"]),
        ("encoder_branches", []),
        ("encoder_branches", ["local", "local"]),
        ("decoder_branches", ["forward", "backward"]),
        ("decoder_branches", ["global"]),
        ("decoder_branches", ["local_0"]),
        ("local_k", 0),
        ("local_k", [2, 2]),
        ("local_k", 1.5),
        ("fusion", "max"),
        ("gate_reduction", 5),
        ("gate_reduction", 0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})
