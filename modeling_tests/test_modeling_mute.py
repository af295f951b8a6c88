"""MUTE (Multi-Unit Transformer): the common checks, plus the paper's mechanisms one by one.

- parameter count = baseline + (I-1) x layers x the per-unit size of docs/variants-spec.md §1.6 (+ alpha, M, mask
  vector per layer);
- I=1, no bias, plain merge IS the baseline (copied weights; pre- and post-norm); each unit of a 3-unit layer is a
  baseline encoder layer with that unit's weights (the batched/folded computation does not mix units);
- the `seq` merge equals eq. 13-16 computed literally (permute by M^T, cumulative sums / index, alpha-weighted);
- noise: active in train and absent in eval; swap/disorder keep the multiset of real tokens and never touch padding
  (right or left padding), the compat modes reproduce the authors' code; mask vectors only on real tokens; the
  sample-rate switch; gradients reach the mask vector;
- AutoShuffle: projection (relu, rows, columns) keeps M doubly stochastic; M is projected after every optimizer
  step whatever the optimizer (SGD, Adam for-loop / foreach / fused) without `after_optimizer_step()`, once, never
  between accumulated micro-batches, never again when already projected or loaded; penalty 0 for a
  permutation and 4 per layer at the uniform init, added to the loss only in training; alpha and M get gradients;
  `save_pretrained` stores M projected.
"""

from __future__ import annotations

import pytest
import torch
from common import NmtModelTester

from hf_variants import MuteConfig, MuteForConditionalGeneration, TransformerNmtConfig
from hf_variants.configuration_mute import MUTE_MODELS
from hf_variants.modeling_mute import (
    MuteBiasModule,
    disorder_permutation,
    permute_tokens,
    project_doubly_stochastic,
    shuffle_penalty,
    swap_permutation,
)
from hf_variants.modeling_transformer_nmt import TransformerNmtEncoderLayer, TransformerNmtForConditionalGeneration


def tiny(**overrides):
    """A tiny MUTE (full model: 4 units [identity, swap, mask, disorder], seq merge), relative clip 3."""
    return MuteConfig.from_preset("tiny", **{"vocab_size": 60, "max_relative_positions": 3, **overrides})


def count(model):
    return sum(p.numel() for p in model.parameters())


def batch(vocab=60, lengths=(9, 6, 3), seed=1):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (len(lengths), max(lengths)), generator=g)
    attention_mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    labels = torch.randint(4, vocab, (len(lengths), 5), generator=g)
    return {
        "input_ids": input_ids.masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask,
        "labels": labels,
    }


class TestMute(NmtModelTester):
    """The paper's full model (bias + seq, 4 units) through every generic check."""

    model_type = "mute_nmt"

    def make_config(self, **overrides):
        return MuteConfig.from_preset("tiny", max_relative_positions=3, **overrides)


# -------------------------------------------------------------------------------------------- config and counts
def test_defaults_are_the_papers_base_setting():
    config = MuteConfig()
    assert (config.d_model, config.encoder_layers, config.decoder_layers, config.encoder_attention_heads) == (
        512,
        6,
        6,
        8,
    )
    assert (config.num_units, config.merge, config.use_bias_module) == (4, "seq", True)
    assert config.unit_types == ["identity", "swap", "mask", "disorder"]
    assert (config.sample_rate, config.swap_range, config.disorder_window, config.mask_prob) == (0.85, 3, 3, 0.1)
    assert (config.max_relative_positions, config.relative_position_values, config.normalize_before) == (
        16,
        True,
        True,
    )
    assert config.position_embedding_type == "sinusoidal" and config.shuffle_penalty_weight == 1.0
    small = MuteConfig.from_preset("small")
    assert (small.d_model, small.encoder_layers, small.num_units, small.max_relative_positions) == (256, 3, 4, 16)
    assert MuteConfig(num_units=6).unit_types == ["identity", "swap", "mask", "disorder", "swap", "mask"]
    plain = MuteConfig.from_preset("base", **MUTE_MODELS["mute"])
    assert (plain.use_bias_module, plain.merge, plain.has_mask_unit) == (False, "plain", False)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_units", 0),
        ("merge", "concat"),
        ("unit_types", ["identity", "shuffle", "mask", "disorder"]),
        ("unit_types", ["identity"]),
        ("sample_rate", 1.5),
        ("swap_range", 0),
        ("disorder_window", 1),
        ("mask_prob", -0.1),
        ("swap_mode", "fairseq"),
        ("disorder_mode", "x"),
        ("mask_mode", "all"),
        ("shuffle_init", "zeros"),
        ("shuffle_sinkhorn_iterations", 0),
        ("shuffle_eps", 0.0),
        ("shuffle_penalty_weight", -1.0),
        ("penalty_normalization", "sentences"),
        ("use_bias_module", "yes"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_base_parameter_count_is_baseline_plus_units():
    """Spec §1.6: per extra unit and layer 4d^2+4d (attention) + 33*64 (relative table) + 2*d*f+f+d (FFN) + 2d
    (FFN LayerNorm) = 3,153,472 at d=512; plus per layer alpha (I), M (I^2) and the mask vector (d)."""
    vocab, d, f, layers, units, head_dim = 37000, 512, 2048, 6, 4, 64
    per_unit = (4 * d * d + 4 * d) + 33 * head_dim + (2 * d * f + f + d) + 2 * d
    assert per_unit == 3_153_472
    with torch.device("meta"):
        mute = MuteForConditionalGeneration(MuteConfig.from_preset("base", vocab_size=vocab))
        baseline = TransformerNmtForConditionalGeneration(
            TransformerNmtConfig.from_preset(
                "base",
                vocab_size=vocab,
                normalize_before=True,
                max_relative_positions=16,
                relative_position_values=True,
            )
        )
        plain = MuteForConditionalGeneration(MuteConfig.from_preset("base", vocab_size=vocab, **MUTE_MODELS["mute"]))
    assert count(mute) - count(baseline) == (units - 1) * layers * per_unit + layers * (units + units**2 + d)
    assert count(plain) - count(baseline) == (units - 1) * layers * per_unit + layers * units
    assert round((units - 1) * layers * per_unit / 1e6, 1) == 56.8  # "+56.8M"


# ------------------------------------------------------------------------------------------ baseline equivalence
def baseline_state(mute, unit=0):
    """The baseline's state dict from MUTE's, with `unit` of every encoder layer under the baseline's names."""
    stacked = {
        "self_attn.relative_embeddings": "self_attn.relative_positions.embeddings.weight",
        "ffn.layer_norm_weight": "ffn.final_layer_norm.weight",
        "ffn.layer_norm_bias": "ffn.final_layer_norm.bias",
    }
    state = {}
    for name, tensor in mute.state_dict().items():
        prefix, _, rest = name.partition("encoder.layers.")
        if not rest:
            state[name] = tensor
            continue
        index, _, local = rest.partition(".")
        module, _, kind = local.rpartition(".units.")  # e.g. self_attn.qkv_proj.units.2.weight
        if module:
            if kind.split(".")[0] == str(unit):
                state[f"{prefix}encoder.layers.{index}.{module}.{kind.split('.')[1]}"] = tensor
        elif local in stacked:
            state[f"{prefix}encoder.layers.{index}.{stacked[local]}"] = tensor[unit]
        elif local.startswith("self_attn_layer_norm."):
            state[name] = tensor
        else:
            assert local in ("alpha", "shuffle", "bias_module.mask_embedding"), local
    return state


def baseline_config(mute_config):
    base = TransformerNmtConfig().to_dict()
    return TransformerNmtConfig(
        **{
            k: v
            for k, v in mute_config.to_dict().items()
            if k in base and k not in ("model_type", "architectures", "auto_map")
        }
    )


@pytest.mark.parametrize("normalize_before", [True, False])
def test_one_unit_without_bias_and_seq_is_the_baseline(normalize_before):
    torch.manual_seed(0)
    mute = MuteForConditionalGeneration(
        tiny(num_units=1, use_bias_module=False, merge="plain", normalize_before=normalize_before)
    ).eval()
    baseline = TransformerNmtForConditionalGeneration(baseline_config(mute.config)).eval()
    baseline.load_state_dict(baseline_state(mute), strict=True)
    inputs = batch()
    with torch.no_grad():
        a, b = mute(**inputs), baseline(**inputs)
    assert torch.allclose(a.logits, b.logits, atol=1e-5), (a.logits - b.logits).abs().max()
    assert torch.allclose(a.loss, b.loss, atol=1e-5)
    if normalize_before:
        gen = dict(num_beams=3, max_new_tokens=6, min_new_tokens=6)
        ids = {k: v for k, v in inputs.items() if k != "labels"}
        assert torch.equal(mute.generate(**ids, **gen), baseline.generate(**ids, **gen))


def test_each_unit_is_a_baseline_encoder_layer():
    """In a 3-unit layer (clean inputs), unit i's output F_i equals a baseline layer holding unit i's weights."""
    torch.manual_seed(0)
    mute = MuteForConditionalGeneration(tiny(num_units=3)).eval()
    layer = mute.model.encoder.layers[1]
    baseline = TransformerNmtForConditionalGeneration(baseline_config(mute.config)).eval()
    inputs = batch()
    x = torch.randn(3, 9, mute.config.d_model)
    mask = inputs["attention_mask"][:, None, None, :].bool()  # a ready-made boolean padding mask [B, 1, 1, K]
    with torch.no_grad():
        attn, _, _ = layer.self_attn(layer.self_attn_layer_norm(x)[None], mask)
        unit_outputs = layer.ffn(x + attn)  # [I, B, T, d]
        for unit in range(3):
            baseline.load_state_dict(baseline_state(mute, unit), strict=True)
            ref_layer = baseline.model.encoder.layers[1]
            assert isinstance(ref_layer, TransformerNmtEncoderLayer)
            expected, _, _ = ref_layer(x, attention_mask=mask)
            assert torch.allclose(unit_outputs[unit], expected, atol=1e-5), unit


@pytest.mark.parametrize("max_relative_positions", [0, 3])
def test_sdpa_units_equal_eager_without_relative_values(max_relative_positions):
    """Without relative values the folded units go through SDPA (with the relative key bias as a float mask)."""
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(
        tiny(max_relative_positions=max_relative_positions, relative_position_values=False)
    ).eval()
    assert model.config._attn_implementation == "sdpa"
    inputs = batch()
    with torch.no_grad():
        sdpa = model(**inputs).logits
        model.set_attn_implementation("eager")
        eager = model(**inputs).logits
    assert torch.allclose(sdpa, eager, atol=1e-5)


def test_encoder_attentions_are_the_mean_over_the_units():
    torch.manual_seed(0)
    config = tiny(num_units=3)
    model = MuteForConditionalGeneration(config).eval()
    inputs = batch()
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    heads = config.encoder_attention_heads
    weights = out.encoder_attentions[0]
    assert weights.shape == (3, heads, 9, 9)  # [B, H, Q, K]
    assert torch.allclose(weights.sum(-1), torch.ones(3, heads, 9), atol=1e-5)
    pad = (inputs["attention_mask"] == 0)[:, None, None, :].expand_as(weights)
    assert weights[pad].abs().max() == 0
    # the units' own maps, from the eager kernel on the folded heads [B, I*H, Q, K], averaged over the units
    layer = model.model.encoder.layers[0]
    captured = {}
    hook = layer.self_attn.register_forward_hook(lambda module, args, output: captured.update(inputs=args))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    units_input = captured["inputs"][0]
    qkv = layer.self_attn.qkv_proj(units_input)
    b, t = qkv.shape[1:3]
    q, k, _ = qkv.view(3, b, t, 3, heads, -1).permute(3, 1, 0, 4, 2, 5).reshape(3, b, 3 * heads, t, -1).unbind(0)
    from hf_variants.modeling_transformer_nmt import relative_key_bias, relative_position_index

    scale = layer.self_attn.scaling
    index = relative_position_index(t, t, config.max_relative_positions, q.device)
    scores = q @ k.transpose(-1, -2) * scale + relative_key_bias(q, layer.self_attn.relative_embeddings, index, scale)
    scores = scores.masked_fill(inputs["attention_mask"][:, None, None, :] == 0, float("-inf"))
    per_unit = scores.softmax(-1).view(b, 3, heads, t, t)
    assert torch.allclose(weights, per_unit.mean(1), atol=1e-5)
    assert not torch.allclose(per_unit[:, 0], per_unit[:, 1])  # units differ


def test_seq_merge_equals_equations_13_to_16():
    torch.manual_seed(0)
    mute = MuteForConditionalGeneration(tiny(num_units=4)).eval()
    layer = mute.model.encoder.layers[0]
    with torch.no_grad():  # a non-trivial M and alpha
        layer.shuffle.copy_(project_doubly_stochastic(torch.rand(4, 4), iterations=20))
        layer.alpha.copy_(torch.tensor([0.1, -0.3, 0.7, 0.45]))
    x = torch.randn(2, 5, mute.config.d_model)
    with torch.no_grad():
        attn, _, _ = layer.self_attn(layer.self_attn_layer_norm(x)[None], None)
        f = layer.ffn(x + attn)  # [I, B, T, d]
        g = torch.einsum("ij,ibtd->jbtd", layer.shuffle, f)  # eq. 16: [..G_j..] = M^T [..F_i..]
        g_hat = g.cumsum(0)  # eq. 14
        expected = sum(layer.alpha[j] * g_hat[j] / (j + 1) for j in range(4))  # eq. 15
        got, _, _ = layer(x)
        plain = MuteForConditionalGeneration(tiny(num_units=4, merge="plain")).eval().model.encoder.layers[0]
        plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "shuffle"})
        got_plain, _, _ = plain(x)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(got_plain, torch.einsum("i,ibtd->btd", layer.alpha, f), atol=1e-5)  # eq. 10


# -------------------------------------------------------------------------------------------------------- noise
def test_noise_only_in_training():
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny(sample_rate=1.0, mask_prob=0.5))
    inputs = batch()
    ids = {k: inputs[k] for k in ("input_ids", "attention_mask")}

    def encode(seed):
        torch.manual_seed(seed)
        return model.model.encoder(**ids).last_hidden_state

    model.eval()
    clean = encode(0)
    assert torch.equal(clean, encode(1))  # eval: deterministic
    model.train()
    a, b, a_again = encode(0), encode(1), encode(0)
    assert not torch.allclose(a, b, atol=1e-4) and not torch.allclose(a, clean, atol=1e-4)  # varies with the seed
    assert torch.equal(a, a_again)
    model.config.sample_rate = 0.0  # switch off: training output is the clean one (dropout is 0)
    assert torch.allclose(encode(2), clean, atol=1e-6)


def real_mask(lengths, seq_len, left=False):
    positions = torch.arange(seq_len)[None, :]
    lengths = torch.as_tensor(lengths)[:, None]
    return positions >= seq_len - lengths if left else positions < lengths


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("kind", ["swap", "disorder"])
def test_swap_and_disorder_permute_real_tokens_only(kind, left):
    """Token ids as vectors: real tokens keep their multiset, padding never moves, the change is local."""
    torch.manual_seed(0)
    lengths, seq_len, reach = [12, 7, 3, 2, 1, 5, 4], 12, 3
    real = real_mask(lengths, seq_len, left)
    tokens = torch.arange(1, seq_len + 1, dtype=torch.float)[None, :].repeat(len(lengths), 1)
    tokens = tokens.masked_fill(~real, -1.0)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
    moved_rows = 0
    for _ in range(200):
        if kind == "swap":
            perm = swap_permutation(real.sum(1), seq_len, reach, "clean")
        else:
            perm = disorder_permutation(real.sum(1), seq_len, reach, "clean")
        out = permute_tokens(tokens[..., None], order, perm)[..., 0]
        assert torch.equal(out[~real], tokens[~real])  # padding untouched
        for row in range(len(lengths)):
            assert sorted(out[row][real[row]].tolist()) == sorted(tokens[row][real[row]].tolist())
            changed = (out[row] != tokens[row]).nonzero().flatten()
            if len(changed):
                moved_rows += 1
                assert changed.max() - changed.min() <= (reach if kind == "swap" else reach - 1)
                if kind == "swap":
                    assert len(changed) == 2
                else:
                    assert lengths[row] >= reach and len(changed) <= reach
    assert moved_rows > 0


def test_compat_modes_reproduce_the_authors_padding_bug():
    """`onmt_compat`: the first swap position is drawn over the padded length and clamped to len, so short
    sentences swap a real token with padding; the disorder window can cover padding. `clean` never does."""
    torch.manual_seed(0)
    lengths, seq_len = torch.tensor([3, 4]), 10
    real = real_mask(lengths, seq_len)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
    tokens = (
        torch.arange(1, seq_len + 1, dtype=torch.float)[None, :, None]
        .repeat(2, 1, 1)
        .masked_fill(~real[..., None], -1.0)
    )
    swap_hits = disorder_hits = 0
    for _ in range(100):
        out = permute_tokens(tokens, order, swap_permutation(lengths, seq_len, 3, "onmt_compat"))
        swap_hits += int((out[~real] != -1).any())
        out = permute_tokens(tokens, order, disorder_permutation(lengths, seq_len, 3, "onmt_compat"))
        disorder_hits += int((out[~real] != -1).any())
    assert swap_hits > 20 and disorder_hits > 5


def test_mask_unit_and_sample_rate():
    torch.manual_seed(0)
    config = tiny(unit_types=["identity", "mask", "mask", "swap"], mask_prob=0.3, sample_rate=1.0)
    module = MuteBiasModule(config).train()
    with torch.no_grad():
        module.mask_embedding.normal_()
    hidden = torch.randn(64, 12, config.d_model)
    real = real_mask(torch.randint(1, 13, (64,)), 12)
    mask = real  # the real tokens [B, T] (the encoder's `token_mask`)
    units = module(hidden, mask)
    assert units.shape == (4, 64, 12, config.d_model) and torch.equal(units[0], hidden)
    replaced = (units[1:3] == module.mask_embedding).all(-1)  # [2, B, T]
    kept = (units[1:3] == hidden).all(-1)
    assert torch.equal(replaced | kept, torch.ones_like(kept)) and not (replaced & ~real).any()
    rate = replaced.sum() / (2 * real.sum())
    assert 0.24 < rate < 0.36, rate  # per-token probability 0.3 over ~800 real tokens
    assert not torch.equal(replaced[0], replaced[1])  # independent draws per unit
    module.config.mask_mode = "one"
    replaced = (module(hidden, mask)[1] == module.mask_embedding).all(-1)
    assert torch.equal(replaced.sum(1), torch.ones(64, dtype=torch.long)) and not (replaced & ~real).any()
    # the switch: one draw per call (layer and batch), noise with probability p_beta, never in eval
    module.config.sample_rate = 0.85
    draws = [module(hidden[:2], mask[:2]) is not None for _ in range(400)]
    assert 0.79 < sum(draws) / 400 < 0.91
    assert module.eval()(hidden, mask) is None


# -------------------------------------------------------------------------------------------------- AutoShuffle
def test_projection_keeps_m_doubly_stochastic():
    torch.manual_seed(0)
    uniform = torch.full((4, 4), 0.25)
    assert torch.equal(project_doubly_stochastic(uniform), uniform)  # a fixed point
    permutation = torch.eye(4)[[2, 0, 3, 1]]
    assert torch.equal(project_doubly_stochastic(permutation), permutation)
    for _ in range(20):  # one projection after an optimizer-sized step stays (near) doubly stochastic
        stepped = uniform + 0.05 * torch.randn(4, 4)
        projected = project_doubly_stochastic(stepped)
        assert (projected >= 0).all()
        assert torch.allclose(projected.sum(0), torch.ones(4), atol=1e-6)
        assert torch.allclose(projected.sum(1), torch.ones(4), atol=0.05)
        many = project_doubly_stochastic(stepped, iterations=200)
        assert torch.allclose(many.sum(1), torch.ones(4), atol=1e-4)
    emptied = torch.tensor([[-1.0, -2.0], [0.5, 0.5]])  # a row emptied by the relu stays finite
    assert torch.isfinite(project_doubly_stochastic(emptied)).all()


def test_penalty_values_and_loss():
    assert shuffle_penalty(torch.eye(4)[[1, 3, 0, 2]]) == 0
    assert torch.isclose(shuffle_penalty(torch.full((4, 4), 0.25)), torch.tensor(4.0))
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny())
    layers = model.config.encoder_layers
    assert torch.isclose(model.shuffle_penalty(), torch.tensor(4.0 * layers))  # 4 per layer at uniform init
    inputs = batch()
    tokens = (inputs["labels"] != -100).sum()
    assert model.eval()(**inputs).aux_losses == {}  # training only
    out = model.train()(**inputs)
    assert torch.isclose(out.aux_losses["shuffle_penalty"], 4.0 * layers / tokens)
    model.config.penalty_normalization, model.config.shuffle_penalty_weight = "none", 0.5
    assert torch.isclose(model(**inputs).aux_losses["shuffle_penalty"], torch.tensor(0.5 * 4.0 * layers))
    plain = MuteForConditionalGeneration(tiny(merge="plain")).train()
    assert plain.shuffle_penalty() is None and "shuffle_penalty" not in plain(**inputs).aux_losses


def test_alpha_m_and_mask_vector_receive_gradients():
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny(sample_rate=1.0, mask_prob=0.5)).train()
    model(**batch()).loss.backward()
    for layer in model.model.encoder.layers:
        assert layer.alpha.grad is not None and layer.alpha.grad.abs().sum() > 0
        assert layer.shuffle.grad is not None and layer.shuffle.grad.abs().sum() > 0
        assert layer.bias_module.mask_embedding.grad.abs().sum() > 0


def shuffles(model):
    return [layer.shuffle.detach().clone() for layer in model.model.encoder.layers]


def record_raw_steps(optimizer, model):
    """Every M right after each raw optimizer update, before any projection (instance post-hooks run before
    the global ones)."""
    raw = []
    optimizer.register_step_post_hook(lambda *args: raw.append(shuffles(model)))
    return raw


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05, foreach=False),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=0.05, foreach=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.05, fused=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_m_projected_after_every_optimizer_step_whatever_the_optimizer(name):
    """Fused Adam leaves `_version` unchanged; M must still be projected after every step,
    without `after_optimizer_step()` (HF Trainer / accelerate loops do not call it), exactly once."""
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny()).train()
    optimizer = OPTIMIZERS[name](model.parameters())
    raw = record_raw_steps(optimizer, model)
    inputs = batch()
    for step in range(3):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert not torch.allclose(raw[step][0].sum(0), torch.ones(4), atol=1e-3)  # the step moved M
        for m, stepped in zip(shuffles(model), raw[step]):
            assert torch.equal(m, project_doubly_stochastic(stepped))
            assert torch.allclose(m.sum(0), torch.ones(4), atol=1e-6) and (m >= 0).all()
            assert torch.allclose(m.sum(1), torch.ones(4), atol=0.05)
    projected = shuffles(model)
    model(**inputs)  # neither a training forward nor the explicit hook projects it again
    model.after_optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(shuffles(model), projected))


def test_m_not_projected_between_accumulated_micro_batches():
    """Gradient accumulation through accelerate: the wrapped optimizer steps once per two micro-batches;
    M changes (and is projected, once) only then."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny()).train()
    inner = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    raw = record_raw_steps(inner, model)
    try:
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
        prepared, optimizer = accelerator.prepare(model, inner)
        before = shuffles(model)
        for micro in range(4):
            with accelerator.accumulate(prepared):
                accelerator.backward(prepared(**batch(seed=micro)).loss)
                optimizer.step()
                optimizer.zero_grad()
            if micro % 2 == 0:  # inside an accumulation: M untouched, by the step and by the forward
                assert len(raw) == micro // 2
                assert all(torch.equal(a, b) for a, b in zip(shuffles(model), before))
            else:
                assert len(raw) == micro // 2 + 1
                assert all(torch.equal(m, project_doubly_stochastic(r)) for m, r in zip(shuffles(model), raw[-1]))
                before = shuffles(model)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_m_projected_after_a_hand_written_update_once():
    """No torch.optim optimizer (a hand-written SGD step): the first training forward projects, once."""
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny()).train()
    inputs = batch()
    layer = model.model.encoder.layers[0]
    model(**inputs).loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.5 * param.grad
    stepped = layer.shuffle.detach().clone()
    assert not torch.allclose(stepped.sum(0), torch.ones(4), atol=1e-4)
    model(**inputs)  # the first training forward after the step projects M ...
    assert torch.equal(layer.shuffle.detach(), project_doubly_stochastic(stepped))
    model(**inputs)  # ... and only once
    model.after_optimizer_step()
    assert torch.equal(layer.shuffle.detach(), project_doubly_stochastic(stepped))


def test_a_step_that_leaves_m_unchanged_does_not_reproject_it():
    """A projected M is never projected again (the one-step projection is not idempotent): a zero learning rate
    (warm-up from 0) leaves it exactly as it is."""
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny()).train()
    with torch.no_grad():
        for layer in model.model.encoder.layers:
            layer.shuffle.add_(0.2 * torch.rand(4, 4))
    model.project_shuffle()
    projected = shuffles(model)
    assert not torch.equal(project_doubly_stochastic(projected[0]), projected[0])  # not a fixed point
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, fused=True)
    model(**batch()).loss.backward()
    optimizer.step()
    model.after_optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(shuffles(model), projected))


def test_m_stored_projected_and_never_reprojected_after_loading(tmp_path):
    torch.manual_seed(0)
    model = MuteForConditionalGeneration(tiny()).eval()
    layer = model.model.encoder.layers[0]
    with torch.no_grad():  # an M changed outside any optimizer: save_pretrained stores it projected
        layer.shuffle.add_(0.1 * torch.rand(4, 4))
    expected = project_doubly_stochastic(layer.shuffle.detach())
    model.save_pretrained(tmp_path / "a")
    assert torch.equal(layer.shuffle.detach(), expected)
    model.save_pretrained(tmp_path / "b")  # saving again does not project again
    loaded = MuteForConditionalGeneration.from_pretrained(tmp_path / "b")
    assert torch.equal(loaded.model.encoder.layers[0].shuffle.detach(), expected)
    loaded.train()(**batch())  # a loaded M is used as stored, by training forwards, the hook and saving
    loaded.after_optimizer_step()
    loaded.save_pretrained(tmp_path / "c")
    again = MuteForConditionalGeneration.from_pretrained(tmp_path / "c")
    assert torch.equal(again.model.encoder.layers[0].shuffle.detach(), expected)
    # load_state_dict (an accelerate resume) marks the loaded M as projected too
    fresh = MuteForConditionalGeneration(tiny()).train()
    fresh.load_state_dict(model.state_dict())
    fresh(**batch())
    fresh.after_optimizer_step()
    assert torch.equal(fresh.model.encoder.layers[0].shuffle.detach(), expected)
