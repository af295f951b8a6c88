"""HySAN: the Hybrid Self-Attention Network (Song, Tan, Peng, Lu, AAAI 2019) on the hf_variants backbone.

What the paper adds to the Transformer, and nothing else:
- every self-attention module computes ONE score matrix S = (Q/sqrt(d_k)) K^T per head and runs several branches
  on it, each a softmax under its own mask (global, forward j <= i, backward j >= i, local |i - j| <= k in the
  encoder; causal and causal-local 0 <= i - j <= k in the decoder), all branches in one batched tensor op;
- the branch outputs x_b (heads concatenated, [B, T, d]) are fused before the output projection: `sum`,
  `concat` (a Linear(l*d -> d) replacing W^o) or `gated_sum` (x_b * SG(x_b) summed, one squeeze gate per module).
Cross-attention, the cache, the layers, the stacks and generation are the backbone's (`modeling_transformer_nmt`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin

from .configuration_hysan import HysanConfig
from .modeling_transformer_nmt import (
    TransformerNmtAttention,
    TransformerNmtDecoder,
    TransformerNmtDecoderLayer,
    TransformerNmtEncoder,
    TransformerNmtEncoderLayer,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
    as_boolean_mask,
    attach_summary,
    masked_softmax,
    relative_key_bias,
    relative_position_index,
    relative_value_term,
)


def branch_bounds(specs: list[tuple[str, int | None]], is_decoder: bool) -> list[tuple[int, int | None]]:
    """Each branch as a band lo <= i - j <= hi on the query-key distance (None = unbounded). The diagonal is in
    every branch (eq. 9 and 11 use <=); decoder branches all have lo = 0 (nothing sees the future)."""
    bounds = []
    for kind, k in specs:
        if kind == "global":
            bounds.append((None, None))
        elif kind == "forward":
            bounds.append((0, None))
        elif kind == "backward":
            bounds.append((None, 0))
        elif kind == "local":
            bounds.append((0 if is_decoder else -k, k))
        else:
            raise ValueError(f"Unknown HySAN branch {kind!r}.")
    return bounds


def branch_masks(
    bounds: list[tuple[int | None, int | None]],
    query_length: int,
    key_length: int,
    device: torch.device,
    query_offset: int | torch.Tensor = 0,
) -> torch.Tensor:
    """[nb, Q, K] booleans (True = may attend) from absolute positions: query i sits at `query_offset + i` (the
    cache length in the decoder), key j at j, so over a KV cache the causal-local branch keeps the last k + 1 keys."""
    far = key_length + 1  # any |i - j| is smaller
    lo = torch.tensor([-far if b[0] is None else b[0] for b in bounds], device=device)[:, None, None]
    hi = torch.tensor([far if b[1] is None else b[1] for b in bounds], device=device)[:, None, None]
    i = torch.arange(query_length, device=device)[:, None] + query_offset
    j = torch.arange(key_length, device=device)[None, :]
    distance = (i - j)[None]
    return (distance >= lo) & (distance <= hi)


class HysanSqueezeGate(nn.Module):
    """SG(x) = sigmoid(W2 ReLU(W1 x)) on the concatenated heads (V = d), W1: d -> d/r, W2: d/r -> d, no biases
    [P eq. 14, Fig. 3]; one per attention module, applied to every branch."""

    def __init__(self, dim: int, reduction: int):
        super().__init__()
        self.squeeze = nn.Linear(dim, dim // reduction, bias=False)
        self.excite = nn.Linear(dim // reduction, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.excite(F.relu(self.squeeze(x))))


class HysanAttention(TransformerNmtAttention):
    """Hybrid self-attention: one QK^T, nb masked softmaxes in one op, fusion. Cross-attention is unchanged.

    Self-attention always runs this kernel (whatever `_attn_implementation` says): SDPA cannot share one score
    matrix between branches. With `fusion="concat"` the output projection `out_proj` is the paper's H (l*d -> d)."""

    def __init__(
        self,
        config: HysanConfig,
        num_heads: int,
        layer_idx: int | None = None,
        is_cross_attention: bool = False,
        is_decoder: bool = False,
    ):
        super().__init__(config, num_heads, layer_idx, is_cross_attention=is_cross_attention, is_decoder=is_decoder)
        self.hybrid = not is_cross_attention
        if not self.hybrid:
            return
        self.branches = config.branch_specs("decoder" if is_decoder else "encoder")
        self.bounds = branch_bounds(self.branches, is_decoder)
        self.fusion = config.fusion
        self.gate = HysanSqueezeGate(self.embed_dim, config.gate_reduction) if self.fusion == "gated_sum" else None
        if self.fusion == "concat":
            self.out_proj = nn.Linear(len(self.branches) * self.embed_dim, self.embed_dim)

    def branch_probabilities(self, query, key, attention_mask, query_offset=0):
        """The branches' attention probabilities [B, H, nb, Q, K] from ONE score matrix: each branch a softmax under
        its own mask ANDed with the stack's mask (any implementation's format, read as booleans). Rows with no
        allowed key (padding queries under directional/local masks) give 0, never NaN. Also returns the relative
        bucket index (None without relative positions)."""
        q_len, k_len = query.shape[-2], key.shape[-2]
        scores = torch.matmul(query, key.transpose(-1, -2)) * self.scaling  # [B, H, Q, K], computed once
        index = None
        if self.relative_positions is not None:
            index = relative_position_index(
                q_len, k_len, self.config.max_relative_positions, query.device, query_offset
            )
            scores = scores + relative_key_bias(query, self.relative_positions.embeddings.weight, index, self.scaling)
        allowed = branch_masks(self.bounds, q_len, k_len, query.device, query_offset)  # [nb, Q, K]
        padding = as_boolean_mask(attention_mask, q_len, k_len)
        if padding is not None:  # [B, 1|H, Q|1, K] padding (and decoder causal) mask
            allowed = allowed & padding[:, :, None]  # [B, 1|H, nb, Q, K]
        return masked_softmax(scores[:, :, None], allowed), index  # all branches at once

    def branch_attention(self, query, key, value, attention_mask, query_offset=0, output_attentions=False):
        """The branches before fusion: ([B, Q, nb, d] outputs with heads concatenated, [B, H, Q, K] mean of the
        branch probabilities or None)."""
        probs, index = self.branch_probabilities(query, key, attention_mask, query_offset)
        weights = None
        if output_attentions:  # per layer [B, H, Q, K]: the mean over the branches
            probs, weights = attach_summary(probs, 2)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        batch, heads, branches, q_len, k_len = probs.shape
        head_dim = value.shape[-1]
        # every branch in one [B, H, nb*Q, K] @ [B, H, K, D] product (no copy of V per branch)
        out = torch.matmul(probs.reshape(batch, heads, branches * q_len, k_len), value).view(
            batch, heads, branches, q_len, head_dim
        )
        if index is not None and self.config.relative_position_values:
            out = out + relative_value_term(probs, self.relative_positions.embeddings.weight, index)
        out = out.permute(0, 3, 2, 1, 4).reshape(batch, q_len, branches, heads * head_dim)
        return out, weights

    def fuse(self, branch_outputs: torch.Tensor) -> torch.Tensor:
        """[B, Q, nb, d] -> [B, Q, d] (sum, gated sum) or [B, Q, nb*d] (concat, the input of H)."""
        if self.fusion == "sum":
            return branch_outputs.sum(dim=2)
        if self.fusion == "gated_sum":
            return (branch_outputs * self.gate(branch_outputs)).sum(dim=2)
        return branch_outputs.flatten(2)

    def _attend(self, query, key, value, attention_mask, output_attentions=False, query_offset=0, **kwargs):
        """[B, H, Q, D] queries -> ([B, Q, H', D], [B, H, Q, K] mean branch probabilities or None, None), H' = nb*H
        for concat fusion, H otherwise."""
        if not self.hybrid:
            return super()._attend(
                query,
                key,
                value,
                attention_mask,
                output_attentions=output_attentions,
                query_offset=query_offset,
                **kwargs,
            )
        out, weights = self.branch_attention(query, key, value, attention_mask, query_offset, output_attentions)
        fused = self.fuse(out)
        return fused.view(*fused.shape[:2], -1, self.head_dim), weights, None


class HysanEncoderLayer(TransformerNmtEncoderLayer):
    attention_class = HysanAttention


class HysanDecoderLayer(TransformerNmtDecoderLayer):
    self_attention_class = HysanAttention


class HysanPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = HysanConfig
    _no_split_modules = ["HysanEncoderLayer", "HysanDecoderLayer"]


class HysanEncoder(HysanPreTrainedModel, TransformerNmtEncoder):
    layer_class = HysanEncoderLayer


class HysanDecoder(HysanPreTrainedModel, TransformerNmtDecoder):
    layer_class = HysanDecoderLayer


class HysanModel(HysanPreTrainedModel, TransformerNmtModel):
    encoder_class = HysanEncoder
    decoder_class = HysanDecoder


class HysanForConditionalGeneration(HysanPreTrainedModel, TransformerNmtForConditionalGeneration, GenerationMixin):
    base_model_class = HysanModel


__all__ = [
    "HysanPreTrainedModel",
    "HysanModel",
    "HysanForConditionalGeneration",
    "HysanAttention",
    "HysanSqueezeGate",
]
