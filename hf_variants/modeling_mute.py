"""MUTE: the Multi-Unit Transformer (Yan, Meng, Zhou, EMNLP 2020) on the hf_variants backbone.

What the paper adds to the Transformer, and nothing else (the decoder, the cache, the stacks and generation are the
backbone's, `modeling_transformer_nmt`):
- every ENCODER layer holds I parallel units, each with its own self-attention (own Q/K/V/O projections and Shaw
  relative-position table) and its own FFN (with its own pre-LayerNorm), behind ONE attention LayerNorm shared by
  the units. Each unit's linear maps are `nn.Linear` modules (PEFT, quantization and pruning reach them) held by
  the backbone's `StackedLinear`, which runs them as batched matrix products; the units' heads sit side by side on
  the head axis of one call of the backbone kernel: no Python loop over units or tokens. Attention outputs are the
  mean over the units, [B, H, T, T] per layer;
- the bias module (training only): unit i gets `unit_types[i]` noise (identity, swap, disorder, mask) on the
  normalised layer input, switched on once per layer per batch with probability p_beta; the residual stays clean;
- the merge: `plain` (eq. 10/12) out = sum_i alpha_i F_i, or `seq` (eq. 13-16) out = sum_j alpha_j G^_j / j with
  G^_j = sum_{k<=j} G_k, G_k = sum_i M_ik F_i. Both are linear in the unit outputs, so `seq` is computed as ONE
  weighted sum with coefficients c = M w, w_k = sum_{j>=k} alpha_j / j (identical values and gradients);
- AutoShuffle: M (per layer) projected (relu, rows, columns) under no_grad once after every optimizer step that
  changed it, the Lipschitz penalty (eq. 19) summed over layers as an auxiliary loss in training, M stored
  projected by `save_pretrained`. See "When M is projected" below.

When M is projected (docs/variants-spec.md §1.4, [DECISION] "projection once per optimizer step"):
the one-step projection is not idempotent, so the rule is "project M iff it differs from its value right after its
last projection" (a content comparison, kept on the device: no host sync), checked
- after every `step()` of any `torch.optim.Optimizer` holding M: a global optimizer step post-hook
  (`torch.optim.optimizer.register_optimizer_step_post_hook`, registered once when the first `seq` layer is built).
  It covers loops that never call `after_optimizer_step()` (HF Trainer, accelerate, Lightning) and fused/foreach
  optimizers, whose in-place kernels may leave `Parameter._version` unchanged. Gradient accumulation stays exact:
  the optimizer steps once per accumulated batch, forwards and backwards of the micro-batches never project;
- by `after_optimizer_step()` (training/train.py calls it; a no-op after the hook), before `save_pretrained`;
- at the first training forward after an in-place change the hook cannot see (a hand-written update
  `p -= lr * p.grad` bumps `_version`).
A loaded M (`from_pretrained`, `load_state_dict`, a resumed checkpoint) counts as projected: it was stored so.
An optimizer outside `torch.optim` whose kernels leave `_version` unchanged (none known) needs
`model.after_optimizer_step()` after each step.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_mute import MuteConfig
from .modeling_transformer_nmt import (
    TransformerNmtAttention,
    TransformerNmtEncoder,
    TransformerNmtFeedForward,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
    real_tokens,
    stacked_layer_norm,
)


# ------------------------------------------------------------------------------------------------- AutoShuffle
def shuffle_penalty(matrix: torch.Tensor) -> torch.Tensor:
    """Lipschitz penalty of AutoShuffle (eq. 19), in fp32: sum over rows and columns of ||.||_1 - ||.||_2.
    0 exactly for permutation matrices; 2 I (1 - 1/sqrt(I)) for the uniform 1/I matrix."""
    m = matrix.float()
    return (m.abs().sum(1) - torch.linalg.vector_norm(m, dim=1)).sum() + (
        m.abs().sum(0) - torch.linalg.vector_norm(m, dim=0)
    ).sum()


@torch.no_grad()
def project_doubly_stochastic(matrix: torch.Tensor, iterations: int = 1, eps: float = 1e-6) -> torch.Tensor:
    """The authors' projection of M (eq. 17-18, their code's order): relu, then `iterations` x (rows sum to one,
    then columns sum to one). Sums are bounded below by `eps`, so a doubly stochastic M is a fixed point and a row
    emptied by the relu stays finite."""
    m = matrix.float().clamp(min=0)
    for _ in range(iterations):
        m = m / m.sum(dim=1, keepdim=True).clamp(min=eps)
        m = m / m.sum(dim=0, keepdim=True).clamp(min=eps)
    return m.to(matrix.dtype)


# ------------------------------------------------------------------------------------------------ the bias module
def compact_order(real: torch.Tensor) -> torch.Tensor:
    """[B, T] positions with the real tokens first (in order), then the padding: noise permutes compact indices
    0..len-1, so it never crosses into padding, whatever side the padding is on."""
    return torch.argsort((~real).to(torch.int8), dim=1, stable=True)


def permute_tokens(hidden_states: torch.Tensor, order: torch.Tensor, compact_perm: torch.Tensor) -> torch.Tensor:
    """Output position order[c] takes the input vector at position order[compact_perm[c]]."""
    index = torch.empty_like(order).scatter_(1, order, order.gather(1, compact_perm))
    return hidden_states.gather(1, index[..., None].expand_as(hidden_states))


def swap_permutation(lengths: torch.Tensor, seq_len: int, swap_range: int, mode: str) -> torch.Tensor:
    """[B, T] compact permutation exchanging two tokens at most `swap_range` apart, one pair per sentence.
    `clean`: first position among the real tokens, offset in {+-1, ..., +-r}, second clamped into [0, len - 1].
    `onmt_compat`: first ~ U{0..T-1} clamped to len (may be a padding position), offset in [-r, r-1]."""
    batch, device = lengths.shape[0], lengths.device
    last = (lengths - 1).clamp(min=0)
    if mode == "clean":
        first = (torch.rand(batch, device=device) * lengths.clamp(min=1)).long().clamp(max=seq_len - 1)
        first = torch.minimum(first, last)
        delta = torch.randint(0, 2 * swap_range, (batch,), device=device) - swap_range
        delta = delta + (delta >= 0).long()  # {-r..-1} U {1..r}
    else:
        first = torch.minimum(torch.randint(0, seq_len, (batch,), device=device), lengths)
        delta = torch.randint(-swap_range, swap_range, (batch,), device=device)
    second = torch.minimum((first + delta).clamp(min=0), last)
    perm = torch.arange(seq_len, device=device).expand(batch, seq_len).clone()
    perm.scatter_(1, first[:, None], second[:, None])
    return perm.scatter_(1, second[:, None], first[:, None])


def disorder_permutation(lengths: torch.Tensor, seq_len: int, window: int, mode: str) -> torch.Tensor | None:
    """[B, T] compact permutation shuffling one window of `window` consecutive tokens per sentence (randperm; the
    identity is possible, as in the authors' code). `clean`: the window lies inside the real tokens; shorter
    sentences are left alone. `onmt_compat`: start ~ U{0..T-window-1} over the padded length. None = no-op."""
    batch, device = lengths.shape[0], lengths.device
    steps = torch.arange(window, device=device)
    if mode == "clean":
        if seq_len < window:
            return None
        valid = lengths >= window
        start = (torch.rand(batch, device=device) * (lengths - window + 1).clamp(min=1)).long()
        start = torch.where(valid, start.clamp(max=seq_len - window), 0)
    else:
        if seq_len <= window:
            return None
        valid = torch.ones(batch, dtype=torch.bool, device=device)
        start = torch.randint(0, seq_len - window, (batch,), device=device)
    order = torch.rand(batch, window, device=device).argsort(dim=-1)
    order = torch.where(valid[:, None], order, steps)
    perm = torch.arange(seq_len, device=device).expand(batch, seq_len).clone()
    return perm.scatter_(1, start[:, None] + steps, start[:, None] + order)


class MuteBiasModule(nn.Module):
    """Bias_i of eq. 11: per-unit noise on the normalised layer input, in training only. Returns the unit inputs
    [I, B, T, d], or None when every unit gets the clean input (eval, switch off, or no noisy unit)."""

    def __init__(self, config: MuteConfig):
        super().__init__()
        self.config = config
        self.unit_types = list(config.unit_types)
        self.active = config.use_bias_module and any(t != "identity" for t in self.unit_types)
        # One learnable mask vector per layer, shared by the layer's mask units (the authors' `mask_tensor`).
        self.mask_embedding = nn.Parameter(torch.empty(config.d_model)) if config.has_mask_unit else None

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """`token_mask` [B, T]: True at real tokens (None: all real)."""
        config = self.config
        if not (self.training and self.active):
            return None
        # The sample-rate switch: one draw per layer per batch (CPU generator: no device sync).
        if torch.rand((), device="cpu").item() >= config.sample_rate:
            return None
        batch, seq_len, _ = hidden_states.shape
        if token_mask is None:
            real = torch.ones(batch, seq_len, dtype=torch.bool, device=hidden_states.device)
        else:
            real = token_mask.bool()
        lengths = real.sum(dim=1)
        order = compact_order(real)
        units = []
        for unit_type in self.unit_types:
            if unit_type == "swap":
                perm = swap_permutation(lengths, seq_len, config.swap_range, config.swap_mode)
                units.append(permute_tokens(hidden_states, order, perm))
            elif unit_type == "disorder":
                perm = disorder_permutation(lengths, seq_len, config.disorder_window, config.disorder_mode)
                units.append(hidden_states if perm is None else permute_tokens(hidden_states, order, perm))
            elif unit_type == "mask":
                units.append(self.mask_tokens(hidden_states, real, lengths, order))
            else:
                units.append(hidden_states)
        return torch.stack(units)

    def mask_tokens(self, hidden_states, real, lengths, order) -> torch.Tensor:
        """Replace real tokens by the mask vector: each with `mask_prob` (`token`) or one per sentence (`one`)."""
        if self.config.mask_mode == "token":
            chosen = (torch.rand(real.shape, device=real.device) < self.config.mask_prob) & real
        else:
            pick = (torch.rand(real.shape[0], device=real.device) * lengths.clamp(min=1)).long()
            pick = order.gather(1, pick.clamp(max=real.shape[1] - 1)[:, None])
            chosen = torch.zeros_like(real).scatter_(1, pick, True) & real
        return torch.where(chosen[..., None], self.mask_embedding.to(hidden_states.dtype), hidden_states)


# ------------------------------------------------------------------------------------------------------ the units
class MuteUnitFeedForward(TransformerNmtFeedForward):
    """The FFN sub-layers of the I units (own LayerNorm, W1, W2 per unit), with their residuals: the backbone's FFN
    with I units, F_i = S_i + Dropout(W2_i Dropout(act(W1_i LN_i(S_i)))) (pre-norm; post-norm: LN_i(S_i + ...)).
    The units' LayerNorms keep MUTE's parameter names, `layer_norm_weight` / `layer_norm_bias` [I, d]."""

    def __init__(self, config: MuteConfig):
        super().__init__(config, config.encoder_ffn_dim, num_units=config.num_units)

    def build_layer_norm(self, config: MuteConfig, num_units: int) -> None:
        self.layer_norm_weight = nn.Parameter(torch.empty(num_units, config.d_model))
        self.layer_norm_bias = nn.Parameter(torch.empty(num_units, config.d_model))
        self.eps = config.layer_norm_eps
        return None

    def layer_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return stacked_layer_norm(hidden_states, self.layer_norm_weight, self.layer_norm_bias, self.eps)


# ----------------------------------------------------------------------------------------- AutoShuffle step hook
_AUTOSHUFFLE_LAYERS: weakref.WeakSet = weakref.WeakSet()  # every live MuteEncoderLayer with an M
_STEP_HOOK = None


def _project_after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: project the M of every layer whose M this optimizer holds, if the step
    changed it."""
    if not _AUTOSHUFFLE_LAYERS:
        return
    layers = {id(layer.shuffle): layer for layer in list(_AUTOSHUFFLE_LAYERS) if layer.shuffle is not None}
    for group in optimizer.param_groups:
        for param in group["params"]:
            layer = layers.pop(id(param), None)
            if layer is not None and layer.shuffle is param:
                layer.project_shuffle_if_changed()


def track_autoshuffle_layer(layer: nn.Module) -> None:
    """Watch `layer.shuffle` from the optimizer step post-hook (registered once per process)."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_project_after_optimizer_step)
    _AUTOSHUFFLE_LAYERS.add(layer)


def _loaded_shuffle_is_projected(module: nn.Module, incompatible_keys) -> None:
    """`load_state_dict` post-hook: a stored M was projected before it was stored; never project it again."""
    module.mark_shuffle_projected()


class MuteEncoderLayer(GradientCheckpointingLayer):
    """One MUTE encoder layer (docs/variants-spec.md §1.2): shared attention LN -> bias module -> I units -> merge
    (alpha, M)."""

    def __init__(self, config: MuteConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        units = config.num_units
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.bias_module = MuteBiasModule(config)
        # the I units' self-attentions: the backbone attention with I units (per-unit projections and Shaw tables)
        self.self_attn = TransformerNmtAttention(config, config.encoder_attention_heads, layer_idx, num_units=units)
        self.ffn = MuteUnitFeedForward(config)
        self.alpha = nn.Parameter(torch.empty(units))  # unconstrained unit weights, init 1/I
        self.shuffle = nn.Parameter(torch.empty(units, units)) if config.merge == "seq" else None
        self.mark_shuffle_projected(False)
        if self.shuffle is not None:
            track_autoshuffle_layer(self)
            self.register_load_state_dict_post_hook(_loaded_shuffle_is_projected)

    # ------------------------------------------------------------------------------------------- merge / shuffle
    def merge_weights(self) -> torch.Tensor:
        """[I] coefficients c with out = sum_i c_i F_i. `plain`: c = alpha. `seq`: G = F M (G_k = sum_i M_ik F_i),
        out = sum_j alpha_j (sum_{k<=j} G_k) / j = sum_k w_k G_k with w_k = sum_{j>=k} alpha_j / j, so c = M w."""
        if self.shuffle is None:
            return self.alpha
        index = torch.arange(1, self.config.num_units + 1, device=self.alpha.device, dtype=self.alpha.dtype)
        w = (self.alpha / index).flip(0).cumsum(0).flip(0)
        return self.shuffle @ w.to(self.shuffle.dtype)

    @torch.no_grad()
    def mark_shuffle_projected(self, projected: bool = True) -> None:
        """Record M's current value as projected (`True`: just projected, or loaded), or forget it (`False`: the
        next check projects)."""
        shuffle = self.shuffle
        if projected and shuffle is not None:
            self._projected_value = shuffle.detach().clone()
            self._projected_version = shuffle._version
        else:
            self._projected_value = self._projected_version = None

    @torch.no_grad()
    def project_shuffle(self) -> None:
        """Project M (relu, rows, columns; no gradient), in place, unconditionally."""
        if self.shuffle is None or self.shuffle.device.type == "meta":
            return
        config = self.config
        self.shuffle.copy_(
            project_doubly_stochastic(self.shuffle, config.shuffle_sinkhorn_iterations, config.shuffle_eps)
        )
        self.mark_shuffle_projected()

    @torch.no_grad()
    def project_shuffle_if_changed(self) -> None:
        """Project M iff it differs from its value right after its last projection (or was never projected).
        The comparison and the choice run on M's device (`torch.where`), without a host sync."""
        shuffle = self.shuffle
        if shuffle is None or shuffle.device.type == "meta":
            return
        if self._projected_value is None:
            self.project_shuffle()
            return
        last = self._projected_value.to(device=shuffle.device, dtype=shuffle.dtype)
        changed = (shuffle != last).any()
        config = self.config
        projected = project_doubly_stochastic(shuffle, config.shuffle_sinkhorn_iterations, config.shuffle_eps)
        shuffle.copy_(torch.where(changed, projected, shuffle))
        self.mark_shuffle_projected()

    def shuffle_penalty(self) -> torch.Tensor | None:
        return shuffle_penalty(self.shuffle) if self.shuffle is not None else None

    # ---------------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        output_attentions: bool = False,
        token_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """`token_mask` [B, T]: the real tokens (the encoder's `layer_inputs`), where the bias module's noise acts."""
        # M must be projected before its use in every training step (docs/variants-spec.md §1.4): optimizer steps
        # are seen by the step hook; an in-place change outside torch.optim is seen here by its version counter.
        if self.training and self.shuffle is not None and self.shuffle._version != self._projected_version:
            self.project_shuffle_if_changed()
        pre = self.config.normalize_before
        unit_input = self.self_attn_layer_norm(hidden_states) if pre else hidden_states
        noisy = self.bias_module(unit_input, token_mask)  # [I, B, T, d] or None (clean input for all units)
        attn, weights, aux = self.self_attn(
            unit_input[None] if noisy is None else noisy,
            attention_mask=attention_mask,
            output_attentions=output_attentions,
            **kwargs,
        )
        # S_i = X + Dropout(A_i): the residual is the clean layer input.
        states = hidden_states + F.dropout(attn, p=self.config.dropout, training=self.training)
        if not pre:
            states = self.self_attn_layer_norm(states)
        outputs = self.ffn(states)  # [I, B, T, d]
        merged = torch.tensordot(self.merge_weights().to(outputs.dtype), outputs, dims=1)
        return merged, weights, aux


# ----------------------------------------------------------------------------------------------------- the models
class MutePreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = MuteConfig
    _no_split_modules = ["MuteEncoderLayer", "TransformerNmtDecoderLayer"]
    _legacy_keys_pattern = r"\.(self_attn\.(qkv|out)|ffn\.fc[12])_(weight|bias)$"  # 0.1: stacked [I, out, in]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # the units' nn.Linear maps as the backbone's linears
        config = self.config
        if isinstance(module, MuteUnitFeedForward):
            init.ones_(module.layer_norm_weight)
            init.zeros_(module.layer_norm_bias)
        elif isinstance(module, MuteBiasModule) and module.mask_embedding is not None:
            init.normal_(module.mask_embedding, mean=0.0, std=config.d_model**-0.5)
        elif isinstance(module, MuteEncoderLayer):
            init.constant_(module.alpha, 1.0 / config.num_units)
            if module.shuffle is not None:
                if config.shuffle_init == "uniform":
                    init.constant_(module.shuffle, 1.0 / config.num_units)
                else:
                    init.copy_(
                        module.shuffle,
                        torch.randn(
                            module.shuffle.shape, device=module.shuffle.device, dtype=module.shuffle.dtype
                        ).abs(),
                    )
            module.mark_shuffle_projected(False)

    # ------------------------------------------------------------------------------------------------ AutoShuffle
    def project_shuffle(self) -> None:
        """Project every AutoShuffle matrix M onto its normalised form (no gradient). Called before saving."""
        for module in self.modules():
            if isinstance(module, MuteEncoderLayer):
                module.project_shuffle()

    def shuffle_penalty(self) -> torch.Tensor | None:
        """The Lipschitz penalty of eq. 19 summed over the encoder layers (fp32), or None without `seq` merge."""
        penalties = [m.shuffle_penalty() for m in self.modules() if isinstance(m, MuteEncoderLayer)]
        penalties = [p for p in penalties if p is not None]
        return torch.stack(penalties).sum() if penalties else None

    def save_pretrained(self, *args, **kwargs):
        # At inference M is used as stored: store it projected if it changed since its last projection
        # (docs/variants-spec.md §1.4).
        # The projection (one Sinkhorn step) is not idempotent, so an M already projected, or as loaded, stays.
        for module in self.modules():
            if isinstance(module, MuteEncoderLayer):
                module.project_shuffle_if_changed()
        return super().save_pretrained(*args, **kwargs)

    def _after_load(self) -> None:
        for module in self.modules():  # a saved M was projected before it was saved
            if isinstance(module, MuteEncoderLayer):
                module.mark_shuffle_projected()


class MuteEncoder(MutePreTrainedModel, TransformerNmtEncoder):
    layer_class = MuteEncoderLayer

    def layer_inputs(self, attention_mask, hidden_states, **kwargs) -> dict:
        """The real tokens [B, T], where the bias module's noise may act."""
        return {"token_mask": real_tokens(attention_mask, hidden_states.shape[1])}


class MuteModel(MutePreTrainedModel, TransformerNmtModel):
    encoder_class = MuteEncoder


class MuteForConditionalGeneration(MutePreTrainedModel, TransformerNmtForConditionalGeneration, GenerationMixin):
    base_model_class = MuteModel

    def auxiliary_losses(self, model_outputs, num_target_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Adds lambda * sum_k L_p^k (eq. 20) in training with `seq` merge, divided by the number of target tokens
        under `penalty_normalization="tokens"` (the code adds it to the token-summed loss)."""
        losses = super().auxiliary_losses(model_outputs, num_target_tokens)
        config = self.config
        if self.training and config.merge == "seq" and config.shuffle_penalty_weight > 0:
            penalty = self.shuffle_penalty() * config.shuffle_penalty_weight
            if config.penalty_normalization == "tokens":
                penalty = penalty / num_target_tokens
            losses["shuffle_penalty"] = penalty
        return losses

    def after_optimizer_step(self) -> None:
        """Project M if the optimizer changed it since its last projection (a no-op when the optimizer step hook
        already did; see the module docstring)."""
        for module in self.modules():
            if isinstance(module, MuteEncoderLayer):
                module.project_shuffle_if_changed()


__all__ = [
    "MutePreTrainedModel",
    "MuteModel",
    "MuteForConditionalGeneration",
    "MuteEncoder",
    "MuteEncoderLayer",
    "MuteUnitFeedForward",
    "MuteBiasModule",
]
