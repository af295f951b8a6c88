"""The Transformer backbone of hf_variants: the baseline NMT model and the extension points the variants use.

Read top to bottom: helpers (positions, masks, relative positions, the attention kernel, stacked per-unit linears
and the builders), the attention module, encoder and decoder layers, the pretrained base, the two stacks (each a
`PreTrainedModel`, as in Marian), `TransformerNmtModel` and `TransformerNmtForConditionalGeneration`. Sibling files
by concern: `loss_transformer_nmt` (the chunked losses), `generation_transformer_nmt` (the generation mixin:
language inputs, `prepare_translation_inputs`, `generate`, logits processors, cache reordering).

Conventions (transformers 5):
- Masks come from transformers' mask helpers (`create_bidirectional_mask`, `create_causal_mask`) in the format of
  `config._attn_implementation` ("sdpa": booleans or None, "eager": additive floats, "flex_attention": a BlockMask);
  a variant with per-branch or per-head patterns adds them to the scores (HySAN's branches in its own kernel,
  MG-SA's phrase heads as a score bias). Every kernel gives rows with no allowed key 0, never NaN
  (`masked_softmax`).
- One attention kernel, `attend`: relative-position biases, SDPA / flex_attention / eager through
  `ALL_ATTENTION_FUNCTIONS`, the eager path whenever probabilities are needed (attention outputs, Shaw relative
  values), and head groups (MUTE's units, MIMO's streams folded into the head axis) summarised for the outputs.
- Output flags fall back to the config (`config.output_attentions`, `config.output_hidden_states`,
  `config.return_dict`) by explicit lookups, not by transformers' output-capturing decorators: those are internal
  (`utils.generic`, `utils.output_capturing`) and record module outputs by class, which cannot express the
  per-layer summaries over branches, units and streams the variants return.
- Queries on a cache are placed at the cache length (`query_offset`), for masks, positions and relative distances.
- Attentions return (output, weights, aux), encoder layers (hidden states, weights, aux), decoder layers (hidden
  states, self-attention weights, cross-attention weights); aux: a dict of auxiliary loss SUMS, or None.

A variant overrides only what its paper changes:
- units: `num_units=n` on the attention (`TransformerNmtAttention`) and the feed-forward (`TransformerNmtFeedForward`)
  makes n independent units of them (`StackedLinear`, `StackedLayerNorm`, `build_linear`, `build_layer_norm`;
  MUTE's units, MIMO's transformations); the feed-forward's `build_layer_norm` / `layer_norm` for its own LayerNorm;
- the attention class of a layer (`TransformerNmtEncoderLayer.attention_class`, `TransformerNmtDecoderLayer.
  self_attention_class`) and its steps: `_project` (queries, keys, values, extra kernel inputs) -> `_attend` (the
  kernel call: output, weights, aux) -> `_project_out` (HySAN: `_attend`; MG-SA: `_project` and `_attend`). A
  cross-attention's memory may be a callable, run only when its keys and values are computed (MIMO's mixed memory);
  the decoder layer called with `is_causal=False` and no encoder states is an encoder layer (Tied's shared blocks);
- the layers a stack builds (`_make_layer`), how it embeds its input (`input_embeddings`), per-forward inputs of its
  layers (`layer_inputs`), and what happens before and after the layers (`enter_stack`, `exit_stack`,
  `layer_output_view`: MIMO's streams);
- the stacks of the model (`encoder_class`, `decoder_class`, `_make_stacks`) and what the decoder reads from the
  encoder (`encoder_memory`);
- the generation model's losses and hooks: `token_loss_weights` (per-token weights of the translation loss: Tied's
  per-direction sum), `auxiliary_losses` (MUTE's penalty; the stacks' aux sums), `after_optimizer_step`,
  `_after_load` (state fixed after `from_pretrained`), `_language_inputs` and `language_ids_field`. The translation
  loss itself is not a hook: both of its paths (`_translation_loss` from the logits, `_projected_translation_loss`
  without them) must stay the same loss, so variants change it through `token_loss_weights` only.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging

from .compat_transformer_nmt import accepts_cache_alias, cache_field, causal_mask, output_cache, without_hub_kernels
from .configuration_transformer_nmt import TransformerNmtConfig
from .generation_transformer_nmt import LENGTH_RULE_KEYS, TransformerNmtGenerationMixin, current_generation_scope
from .loss_transformer_nmt import projected_smoothed_cross_entropy, smoothed_cross_entropy
from .pipeline_translation import TranslationPipeline  # noqa: F401  (shipped with every model: custom_pipelines)

logger = logging.get_logger(__name__)


class TransformerNmtKwargs(TransformersKwargs, total=False):
    """Keyword arguments threaded from the stacks down to the attention kernels.

    query_offset (`int` or 0-d `torch.Tensor`): absolute position of the first query (the cache length in the
        decoder, 0 in the encoder); set by the stacks.
    is_causal (`bool`): whether a self-attention call is causal (the Tied Transformer's shared blocks run both ways).
    """

    query_offset: int | torch.Tensor


# ----------------------------------------------------------------------------------------------------------- helpers
def shift_tokens_right(labels: torch.LongTensor, pad_token_id: int, decoder_start_token_id: int) -> torch.LongTensor:
    """Decoder inputs from labels: prepend the start token, drop the last label, map -100 to padding."""
    shifted = labels.new_empty(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


def sinusoidal_positions(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal encodings of `positions` ([T]) as [T, dim]: sines in the first half, cosines in the second
    (the layout of Marian/tensor2tensor)."""
    half = dim // 2
    inv_freq = torch.pow(10000.0, -torch.arange(half, device=positions.device, dtype=torch.float32) * 2.0 / dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def fairseq_sinusoidal_positions(positions: torch.Tensor, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's sinusoidal encodings (`SinusoidalPositionalEmbedding`: M2M100, NLLB-200) of `positions` (any shape)
    as [..., dim]: sines in the first half, cosines in the second, of position x 10000^(-i/(dim/2 - 1)); position
    `padding_idx` (a padding token's) is the zero vector. The values of fairseq's and transformers' M2M100 table."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    inv_freq = torch.exp(torch.arange(half, device=positions.device, dtype=torch.int64).float() * -step)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    encodings = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    return encodings.masked_fill((positions == padding_idx).unsqueeze(-1), 0.0)


def fairseq_position_ids(input_ids: torch.Tensor, padding_idx: int, offset: int | torch.Tensor = 0) -> torch.Tensor:
    """fairseq's `make_positions` ([B, T] ids -> [B, T] positions): the k-th non-padding token of a row (k = 1, 2,
    ...) at `padding_idx + offset + k`, padding tokens at `padding_idx`. `offset`: the cache length in decoding."""
    mask = input_ids.ne(padding_idx).int()
    return ((torch.cumsum(mask, dim=1).type_as(mask) + offset) * mask).long() + padding_idx


def self_attention_cache(cache: Cache | None) -> Cache | None:
    if isinstance(cache, EncoderDecoderCache):
        return cache.self_attention_cache
    return cache


def as_boolean_mask(attention_mask, query_length: int, key_length: int) -> torch.Tensor | None:
    """Any mask the kernels receive as booleans [B|1, 1|H, Q, K] (True = may attend), or None: boolean masks as
    they are, additive float masks (0 / dtype minimum) by their sign, a flex BlockMask evaluated densely (only the
    eager fallback of a flex model needs this: attention outputs, Shaw relative values)."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, BlockMask):
        batch, heads = attention_mask.shape[:2]
        return create_mask(
            attention_mask.mask_mod, batch, heads, query_length, key_length, device=attention_mask.kv_num_blocks.device
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def real_tokens(attention_mask, length: int) -> torch.Tensor | None:
    """[B, T] booleans, True at the real (non-padding) tokens: a 2-D 0/1 padding mask as booleans, or from a
    ready-made 4-D mask the keys some query may attend to; None for no mask."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask.bool()
    return as_boolean_mask(attention_mask, length, length).any(dim=1).any(dim=1)


def attach_summary(tensor: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of `tensor` over `dim` (branches, units or streams), as returned in `attentions` / `hidden_states`
    of the variants, attached to the graph without changing any value or gradient: the summary is a leaf, added to
    `tensor` as `summary - summary.detach()` (exactly 0), so its `.grad` after a backward pass is the output's
    sensitivity to a shift shared by all the groups, and the groups' own gradients are untouched."""
    summary = tensor.detach().mean(dim)
    if torch.is_grad_enabled() and tensor.requires_grad:
        summary.requires_grad_()
        tensor = tensor + (summary - summary.detach()).unsqueeze(dim)
    return tensor, summary


# ------------------------------------------------------------------------------------------ relative positions
def relative_position_index(
    query_length: int, key_length: int, max_relative_positions: int, device, query_offset: int | torch.Tensor = 0
) -> torch.Tensor:
    """[Q, K] Shaw buckets: query i sits at position `query_offset + i`, key j at j; the distance j - i is clipped
    to [-m, m] and shifted to [0, 2m]."""
    q = torch.arange(query_length, device=device)[:, None] + query_offset
    k = torch.arange(key_length, device=device)[None, :]
    m = max_relative_positions
    return (k - q).clamp(-m, m) + m


def relative_key_bias(query: torch.Tensor, table: torch.Tensor, index: torch.Tensor, scaling: float) -> torch.Tensor:
    """q_i . r_{j-i} * scaling as [B, heads, Q, K], with O(B.heads.Q.(2m+1)) products and one gather. `table` is
    [R, D] (one table for every head) or [G, R, D] (one per head group: heads g*H' .. (g+1)*H'-1 use table g)."""
    table = table.to(query.dtype)
    if table.dim() == 2:
        logits = torch.matmul(query, table.t())
    else:
        b, heads, q, d = query.shape
        groups = table.shape[0]
        logits = torch.matmul(query.reshape(b, groups, heads // groups * q, d), table.transpose(1, 2))
        logits = logits.view(b, heads, q, -1)
    logits = logits * scaling
    return logits.gather(-1, index.expand(*logits.shape[:-1], index.shape[-1]))


def relative_value_term(probs: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """sum_j p_ij r_{j-i} as [B, heads, Q, D]: the probabilities summed per distance bucket, times the table."""
    buckets = probs.new_zeros(*probs.shape[:-1], table.shape[-2])
    buckets.scatter_add_(-1, index.expand_as(probs), probs)
    table = table.to(probs.dtype)
    if table.dim() == 2:
        return torch.matmul(buckets, table)
    b, heads, q, r = buckets.shape
    groups = table.shape[0]
    return torch.matmul(buckets.view(b, groups, heads // groups * q, r), table).view(b, heads, q, -1)


class RelativePositionEmbedding(nn.Module):
    """Shaw et al. (2018) relative positions: one table of 2m+1 vectors of size head_dim per attention module,
    used for keys (and, as in OpenNMT, for values). Distances are clipped to [-m, m]."""

    def __init__(self, max_relative_positions: int, head_dim: int):
        super().__init__()
        self.max_relative_positions = max_relative_positions
        self.embeddings = nn.Embedding(2 * max_relative_positions + 1, head_dim)


# ---------------------------------------------------------------------------------------------------- the kernel
def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of `scores` where `allowed` (booleans broadcasting to `scores`; None: all), in
    float32, returned in the scores' dtype; a row with no allowed key gives 0, never NaN."""
    if allowed is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return probs.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    scaling: float,
    dropout: float = 0.0,
    is_causal: bool = False,
    position_bias: torch.Tensor | None = None,
    value_term=None,
    head_groups: int = 1,
    output_attentions: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(QK^T * scaling + bias) V with explicit probabilities. Every mask format becomes ONE boolean mask;
    without a mask a causal call is causal top-left aligned (SDPA's `is_causal`). Rows with no allowed key give 0.
    `value_term(probs)` adds a term computed from the probabilities (Shaw relative values). With `head_groups` > 1
    the returned weights are the mean over the groups ([B, H, Q, K], `attach_summary`). Returns ([B, Q, heads, D],
    weights or None)."""
    query_length, key_length = query.shape[-2], key.shape[-2]
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    allowed = as_boolean_mask(attention_mask, query_length, key_length)
    if allowed is None and is_causal and query_length > 1:
        allowed = torch.ones(query_length, key_length, dtype=torch.bool, device=query.device).tril()
    probs = masked_softmax(scores, allowed)
    weights = None
    if output_attentions:
        if head_groups > 1:
            b, heads = probs.shape[:2]
            grouped, weights = attach_summary(probs.view(b, head_groups, heads // head_groups, *probs.shape[2:]), 1)
            probs = grouped.view_as(probs)
        else:
            weights = probs
    if module.training:
        probs = F.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs, value)
    if value_term is not None:
        out = out + value_term(probs)
    return out.transpose(1, 2).contiguous(), weights


def attend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    *,
    bias: torch.Tensor | None = None,
    relative_table: torch.Tensor | None = None,
    max_relative_positions: int = 0,
    relative_values: bool = False,
    query_offset: int | torch.Tensor = 0,
    is_causal: bool | None = None,
    head_groups: int = 1,
    output_attentions: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention kernel of every model: [B, heads, Q, D] queries and [B, heads, K, D] keys/values ->
    ([B, Q, heads, D], weights [B, heads / head_groups, Q, K] or None).

    `module` gives `config` (its `_attn_implementation` picks SDPA, flex_attention or eager), `scaling`, `dropout`,
    `is_causal` and `training`. `bias` ([B|1, heads|1, Q|1, K]) is added to the scores; `relative_table` ([R, D],
    or [G, R, D] per head group) adds Shaw relative keys (both are a position bias, which SDPA and flex take) and with
    `relative_values` the value term (probabilities needed: eager). The eager kernel also runs for
    `output_attentions`."""
    is_causal = module.is_causal if is_causal is None else is_causal
    dropout = module.dropout if module.training else 0.0
    value_term = None
    position_bias = None if bias is None else bias.expand(*query.shape[:-1], key.shape[-2])
    if relative_table is not None:
        index = relative_position_index(
            query.shape[-2], key.shape[-2], max_relative_positions, query.device, query_offset
        )
        relative_bias = relative_key_bias(query, relative_table, index, module.scaling)
        position_bias = relative_bias if position_bias is None else position_bias + relative_bias
        if relative_values:

            def value_term(probs):
                return relative_value_term(probs, relative_table, index)

    implementation = module.config._attn_implementation
    if output_attentions or value_term is not None or implementation == "eager":
        return eager_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            module.scaling,
            dropout=dropout,
            is_causal=is_causal,
            position_bias=position_bias,
            value_term=value_term,
            head_groups=head_groups,
            output_attentions=output_attentions,
        )
    if implementation == "flex_attention" and position_bias is not None:
        position_bias = position_bias.contiguous()  # flex's score_mod reads it per element; no broadcast strides
    attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    out, _ = attention_fn(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=module.scaling,
        dropout=dropout,
        is_causal=is_causal,
        position_bias=position_bias,
    )
    return out, None


# ------------------------------------------------------------------------------ units: stacked modules and builders
class StackedLinear(nn.Module):
    """n independent linear maps ("units": MUTE's units, MIMO's transformations), each an `nn.Linear` that PEFT
    (LoRA), quantization and pruning tools can target, run as ONE batched matmul while they are plain `nn.Linear`s.

    Input [n, ..., in] (unit k maps slice k) or [1, ..., in] (one input shared by every unit: one GEMM against the
    concatenated weights); output [n, ..., out]. When a unit is replaced (a LoRA wrapper, an int8 linear), every unit
    is called as a module instead, so the replacement takes effect. The stacked weights are copied from the units at
    every forward (each unit keeps its own parameter, gradient and storage), except inside
    `generation_scope()`: the scope of one `generate` call, where they are stacked once."""

    def __init__(self, num_units: int, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.num_units, self.in_features, self.out_features = num_units, in_features, out_features
        self.units = nn.ModuleList([nn.Linear(in_features, out_features, bias=bias) for _ in range(num_units)])

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The units' weights as [n, in, out] and biases as [n, 1, out] (None without biases). The weights are a
        transposed view of the stacked [n, out, in]: stacking is a plain copy, while a contiguous [n, in, out] needs a
        transposing copy that costs 10-25x as much; `bmm` reads the view as fast on most decoding shapes (up to 25%
        slower on [1024 -> 256]), which measured cheaper per `generate` call than copying once."""
        scope = None  # compiled graphs and autograd stack at every forward
        if not torch.compiler.is_compiling() and not torch.is_grad_enabled():
            scope = current_generation_scope()
        if scope is not None and self in scope:
            return scope[self]
        weight = torch.stack([unit.weight for unit in self.units]).transpose(1, 2)
        bias = torch.stack([unit.bias for unit in self.units])[:, None] if self.units[0].bias is not None else None
        if scope is not None:
            scope[self] = weight, bias
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.num_units
        if not all(type(unit) is nn.Linear for unit in self.units):  # replaced units: call each module
            return torch.stack([unit(x[k if x.shape[0] > 1 else 0]) for k, unit in enumerate(self.units)])
        weight, bias = self._stacked()
        # a shared input ([1, ...]) is expanded: n batched GEMMs measured as fast as one GEMM against the
        # concatenated weights (and 2-4% faster end to end in decoding, where the latter's output needs a transpose)
        flat = x.expand(n, *x.shape[1:]).reshape(n, -1, self.in_features)
        y = torch.bmm(flat, weight) if bias is None else torch.baddbmm(bias, flat, weight)
        return y.view(n, *x.shape[1:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"units={self.num_units}, in_features={self.in_features}, out_features={self.out_features}"


def stacked_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """n LayerNorms of [n, ..., d] units at once: unit k normalised with `weight[k]`, `bias[k]` ([n, d])."""
    shape = (weight.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return torch.addcmul(bias.view(shape), F.layer_norm(x, x.shape[-1:], eps=eps), weight.view(shape))


class StackedLayerNorm(nn.Module):
    """n LayerNorms over [n, ..., d] units (unit k uses weight[k], bias[k]): MUTE's units, MIMO's streams."""

    def __init__(self, num_units: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_units, dim))
        self.bias = nn.Parameter(torch.zeros(num_units, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stacked_layer_norm(x, self.weight, self.bias, self.eps)


def build_linear(in_features: int, out_features: int, num_units: int | None = None, bias: bool = True) -> nn.Module:
    """An `nn.Linear`, or with `num_units` a `StackedLinear` of that many (inputs and outputs [n|1, ..., features])."""
    if num_units is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return StackedLinear(num_units, in_features, out_features, bias=bias)


def build_layer_norm(config: TransformerNmtConfig, num_units: int | None = None) -> nn.Module:
    """The model's LayerNorm over d_model, or with `num_units` a `StackedLayerNorm` (one affine per unit)."""
    if num_units is None:
        return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
    return StackedLayerNorm(num_units, config.d_model, config.layer_norm_eps)


# --------------------------------------------------------------------------------------------------------- attention
class TransformerNmtAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self-attention) or fused KV projection (cross-attention),
    the transformers KV cache, Shaw relative positions, and the backbone kernel `attend`.

    With `num_units` = n (an int, 1 included) the module holds n independent attentions (MUTE's units, MIMO's
    transformations): its
    projections are `StackedLinear`s of n `nn.Linear`s, its input and output carry the unit axis first ([n|1, B, T,
    d]; [1, ...] = one input shared by the units), and the units' heads sit side by side on the head axis of ONE
    kernel call (unit k owns heads k*H .. (k+1)*H-1, its queries see only its own keys, the cache holds
    [B, n*H, T, D] per layer). Relative positions then have one table per unit (`relative_embeddings` [n, 2m+1, D]).
    Attention outputs are per layer [B, H, Q, K]: the mean over the units.

    Variants override `_attend` (the kernel call: masks, branches, fusion) and keep the projections and the cache."""

    def __init__(
        self,
        config: TransformerNmtConfig,
        num_heads: int,
        layer_idx: int | None = None,
        is_cross_attention: bool = False,
        is_decoder: bool = False,
        num_units: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.embed_dim = d = config.d_model
        self.num_units = num_units  # None: one attention, [B, T, d] in and out
        self.heads_per_unit = num_heads
        self.num_heads = (num_units or 1) * num_heads  # what the kernel sees
        self.head_dim = d // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_decoder = is_decoder
        self.is_causal = is_decoder and not is_cross_attention
        self.num_key_value_groups = 1

        if is_cross_attention:
            self.q_proj = build_linear(d, d, num_units)
            self.kv_proj = build_linear(d, 2 * d, num_units)
        else:
            self.qkv_proj = build_linear(d, 3 * d, num_units)
        self.out_proj = build_linear(d, d, num_units)
        self.relative_positions = self.relative_embeddings = None
        if config.max_relative_positions > 0 and not is_cross_attention:
            buckets = 2 * config.max_relative_positions + 1
            if num_units is None:
                self.relative_positions = RelativePositionEmbedding(config.max_relative_positions, self.head_dim)
            else:
                self.relative_embeddings = nn.Parameter(torch.empty(num_units, buckets, self.head_dim))

    def _heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """[B, T, parts*d] (or [n, B, T, parts*d] with units) -> `parts` tensors [B, heads, T, D]."""
        if self.num_units is None:
            b, t, _ = x.shape
            return x.view(b, t, parts, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        n, b, t, _ = x.shape
        x = x.reshape(n, b, t, parts, self.heads_per_unit, self.head_dim)
        return x.permute(3, 1, 0, 4, 2, 5).reshape(parts, b, self.num_heads, t, self.head_dim).unbind(0)

    def _project(self, hidden_states, key_value_states=None, cache=None, **kwargs):
        """Step 1: queries, keys, values as [B, heads, T, D], with the cache read and updated, and a dict of extra
        keyword arguments for `_attend` (nothing here; MG-SA's composed phrases). A cross-attention's
        `key_value_states` may be a zero-argument callable giving the memory: it is called only when the keys and
        values are computed, not over a filled cross-attention cache (MIMO mixes its memory per unit)."""
        if not self.is_cross_attention:
            query, key, value = self._heads(self.qkv_proj(hidden_states), 3)
            own = self_attention_cache(cache)
            if own is not None:
                key, value = own.update(key, value, self.layer_idx)
            return query, key, value, {}
        (query,) = self._heads(self.q_proj(hidden_states), 1)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return query, layer.keys, layer.values, {}
        memory = key_value_states() if callable(key_value_states) else key_value_states
        key, value = self._heads(self.kv_proj(memory), 2)
        if cache is not None:  # cross-attention keys/values are computed once per generation
            key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return query, key, value, {}

    def _attend(self, query, key, value, attention_mask, output_attentions=False, **kwargs):
        """Step 2, the kernel call: [B, heads, Q, D] queries -> ([B, Q, heads, D], weights or None, aux: a dict of
        auxiliary loss SUMS or None)."""
        table = self.relative_embeddings
        if self.relative_positions is not None:
            table = self.relative_positions.embeddings.weight
        out, weights = attend(
            self,
            query,
            key,
            value,
            attention_mask,
            relative_table=table,
            max_relative_positions=self.config.max_relative_positions,
            relative_values=self.config.relative_position_values,
            head_groups=self.num_units or 1,
            output_attentions=output_attentions,
            **kwargs,
        )
        return out, weights, None

    def _project_out(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Step 3: [B, Q, heads, D] -> [B, Q, d] (or [n, B, Q, d] with units) through `out_proj`."""
        if self.num_units is None:
            return self.out_proj(out.reshape(*out.shape[:2], -1))
        b, q = out.shape[:2]
        return self.out_proj(out.reshape(b, q, self.num_units, self.embed_dim).permute(2, 0, 1, 3))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        key_value_states=None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        **kwargs: Unpack[TransformerNmtKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """[B, Q, d] (or [n|1, B, Q, d] with units) queries and the same layout of `key_value_states` ->
        ([B, Q, d] (or [n, B, Q, d]), weights [B, H, Q, K] or None, auxiliary loss sums or None):
        `_project` -> `_attend` -> `_project_out`."""
        if self.is_cross_attention:  # no causality, positions or relative distances between target and source
            kwargs = {k: v for k, v in kwargs.items() if k not in ("query_offset", "is_causal")}
        query, key, value, extra = self._project(hidden_states, key_value_states, cache, **kwargs)
        out, weights, aux = self._attend(
            query, key, value, attention_mask, output_attentions=output_attentions, **extra, **kwargs
        )
        return self._project_out(out, hidden_states), weights, aux


# ------------------------------------------------------------------------------------------------------------ layers
class TransformerNmtFeedForward(nn.Module):
    """Position-wise FFN sub-layer with its residual connection and LayerNorm (pre- or post-norm).

    With `num_units` = n the sub-layer holds n independent FFNs (MUTE's units, MIMO's transformations): its linears
    are `StackedLinear`s, its LayerNorm a `StackedLayerNorm`, and its input and output carry the unit axis first
    ([n, B, T, d]). `normalize_before` defaults to the config's. Builders: `build_layer_norm` (a variant keeping
    its own LayerNorm parameters overrides it and `layer_norm`)."""

    def __init__(
        self,
        config: TransformerNmtConfig,
        ffn_dim: int,
        num_units: int | None = None,
        normalize_before: bool | None = None,
    ):
        super().__init__()
        self.fc1 = build_linear(config.d_model, ffn_dim, num_units)
        self.fc2 = build_linear(ffn_dim, config.d_model, num_units)
        self.final_layer_norm = self.build_layer_norm(config, num_units)
        self.activation_fn = ACT2FN[config.activation_function]
        self.dropout = config.dropout
        self.activation_dropout = config.activation_dropout
        self.normalize_before = config.normalize_before if normalize_before is None else normalize_before

    def build_layer_norm(self, config: TransformerNmtConfig, num_units: int | None) -> nn.Module | None:
        return build_layer_norm(config, num_units)

    def layer_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(hidden_states)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        if self.normalize_before:
            hidden_states = self.layer_norm(hidden_states)
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        if self.training:
            hidden_states = F.dropout(hidden_states, p=self.activation_dropout, training=True)
        hidden_states = self.fc2(hidden_states)
        if self.training:
            hidden_states = F.dropout(hidden_states, p=self.dropout, training=True)
        hidden_states = residual + hidden_states
        if not self.normalize_before:
            hidden_states = self.layer_norm(hidden_states)
        return hidden_states


def residual_block(
    module: nn.Module, layer_norm: nn.Module, hidden_states: torch.Tensor, fn, pre_norm: bool, dropout: float
) -> tuple:
    """x + Dropout(fn(LN(x))) (pre-norm) or LN(x + Dropout(fn(x))) (post-norm); fn returns (out, *extra) (an
    attention: (out, weights, aux)); returns (the block's output, *extra)."""
    residual = hidden_states
    if pre_norm:
        hidden_states = layer_norm(hidden_states)
    hidden_states, *extra = fn(hidden_states)
    if module.training:
        hidden_states = F.dropout(hidden_states, p=dropout, training=True)
    hidden_states = residual + hidden_states
    if not pre_norm:
        hidden_states = layer_norm(hidden_states)
    return hidden_states, *extra


class TransformerNmtEncoderLayer(GradientCheckpointingLayer):
    """Self-attention and FFN sub-layers. Returns (hidden_states, attention weights or None, auxiliary loss SUMS
    from the attention (a dict: MG-SA's tag loss) or None)."""

    attention_class = TransformerNmtAttention

    def __init__(self, config: TransformerNmtConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.self_attn = self.attention_class(config, config.encoder_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = TransformerNmtFeedForward(config, config.encoder_ffn_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        output_attentions: bool = False,
        **kwargs: Unpack[TransformerNmtKwargs],
    ):
        hidden_states, weights, aux = residual_block(
            self,
            self.self_attn_layer_norm,
            hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, output_attentions=output_attentions, **kwargs),
            self.config.normalize_before,
            self.config.dropout,
        )
        return self.ffn(hidden_states), weights, aux


class TransformerNmtDecoderLayer(GradientCheckpointingLayer):
    """Causal self-attention, cross-attention and FFN sub-layers. The hidden states, the self-attention mask and
    the encoder states come positionally (gradient checkpointing passes only positional tensors through). Returns
    (hidden_states, self-attention weights, cross-attention weights).

    Encoder path: called with `is_causal=False` and without encoder states and cache, the layer is an encoder
    layer (padding-masked self-attention, then the FFN) and returns (hidden_states, weights, None), an encoder
    layer's output (the Tied Transformer's encoder runs its shared blocks so)."""

    self_attention_class = TransformerNmtAttention

    def __init__(self, config: TransformerNmtConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        heads = config.decoder_attention_heads
        self.self_attn = self.self_attention_class(config, heads, layer_idx, is_decoder=True)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.encoder_attn = TransformerNmtAttention(config, heads, layer_idx, is_cross_attention=True, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = TransformerNmtFeedForward(config, config.decoder_ffn_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask=None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
        **kwargs: Unpack[TransformerNmtKwargs],
    ):
        pre, p = self.config.normalize_before, self.config.dropout
        hidden_states, self_weights, _ = residual_block(
            self,
            self.self_attn_layer_norm,
            hidden_states,
            lambda x: self.self_attn(
                x,
                attention_mask=attention_mask,
                cache=cache,
                output_attentions=output_attentions,
                **kwargs,
            ),
            pre,
            p,
        )
        cross_weights = None
        if encoder_hidden_states is not None:  # a decoder run on its own (no encoder) is a language model
            hidden_states, cross_weights, _ = residual_block(
                self,
                self.encoder_attn_layer_norm,
                hidden_states,
                lambda x: self.encoder_attn(
                    x,
                    attention_mask=encoder_attention_mask,
                    key_value_states=encoder_hidden_states,
                    cache=cache,
                    output_attentions=output_attentions,
                    **kwargs,
                ),
                pre,
                p,
            )
        return self.ffn(hidden_states), self_weights, cross_weights


# --------------------------------------------------------------------------------------------------- model outputs
@dataclass
class TransformerNmtEncoderOutput(BaseModelOutput):
    """`aux_losses`: named auxiliary loss SUMS (e.g. MG-SA's tag loss), normalised by the generation model."""

    aux_losses: dict[str, torch.Tensor] | None = None


@dataclass
class TransformerNmtSeq2SeqModelOutput(Seq2SeqModelOutput):
    aux_losses: dict[str, torch.Tensor] | None = None


@dataclass
class TransformerNmtSeq2SeqLMOutput(Seq2SeqLMOutput):
    """`loss` includes the auxiliary losses; `aux_losses` holds each one as added (for logging)."""

    aux_losses: dict[str, torch.Tensor] | None = None


# ----------------------------------------------------------------------------------------------------- pretrained
def damaged_weight_files(path, subfolder: str = "") -> list[str]:
    """The `.safetensors` files of a local model folder whose header cannot be read (empty for a Hub id: its files
    are in the cache, under names of their own)."""
    folder = os.path.join(str(path), subfolder)
    if not os.path.isdir(folder):
        return []
    damaged = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), "pt"):
                    pass
            except (SafetensorError, OSError):
                damaged.append(os.path.join(folder, name))
    return damaged


class TransformerNmtPreTrainedModel(PreTrainedModel):
    config_class = TransformerNmtConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerNmtEncoderLayer", "TransformerNmtDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False  # relative-position biases and per-head/per-branch masks of the variants
    _can_compile_fullgraph = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        xavier = config.init_method == "xavier"
        if isinstance(module, nn.Linear):
            if xavier:
                init.xavier_uniform_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=config.init_std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            std = config.d_model**-0.5 if xavier else config.init_std
            self._init_embedding(module, init.normal_, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, StackedLayerNorm)):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, TransformerNmtAttention) and module.relative_embeddings is not None:
            # per-unit relative tables, as the nn.Embedding tables of one-unit attentions
            init.normal_(module.relative_embeddings, mean=0.0, std=config.d_model**-0.5 if xavier else config.init_std)

    @staticmethod
    def _init_embedding(module: nn.Embedding, fn, **kwargs) -> None:
        """`fn(module.weight, **kwargs)`, then the padding row zeroed (unless the row was loaded)."""
        fn(module.weight, **kwargs)
        if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
            module.weight[module.padding_idx].zero_()

    # Tensor names of an older layout of this model type (hf_variants 0.1's stacked MUTE/MIMO units), which
    # `python -m hf_variants.convert_legacy` converts; found among a checkpoint's unexpected keys, they stop the load.
    _legacy_keys_pattern: str | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained` (with `use_kernels=False` unless given: `without_hub_kernels`), then: a
        checkpoint in hf_variants 0.1's stacked layout (`_legacy_keys_pattern`) raises a ValueError naming the
        conversion command, and `_after_load` runs.

        Not transformers 5's checkpoint-conversion mapping (`conversion_mapping.register_checkpoint_conversion_mapping`
        / `WeightConverter`): `save_pretrained` reverts the conversions a model was loaded with
        (`revert_weight_conversion`), so a mapping from the 0.1 layout would write every model back in that
        layout, and neither MUTE's "a loaded M counts as projected" nor MG-SA's row slice (which changes the
        config) is a conversion of tensor names and values."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **without_hub_kernels(kwargs)
            )
        except SafetensorError as error:  # names no file: the same error type, naming the damaged file(s)
            damaged = damaged_weight_files(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
            where = ", ".join(damaged) if damaged else f"a weights file of {pretrained_model_name_or_path}"
            raise SafetensorError(
                f"{where}: the weights file cannot be read ({error}): it is damaged or "
                f"incomplete (a truncated copy, a full disk?). Copy or download it "
                f"again."
            ) from error
        if cls._legacy_keys_pattern is not None:
            legacy = sorted(key for key in info["unexpected_keys"] if re.search(cls._legacy_keys_pattern, key))
            if legacy:
                raise ValueError(
                    f"{pretrained_model_name_or_path} stores {cls.__name__}'s units in the stacked layout of "
                    f"hf_variants 0.1 (e.g. {legacy[0]!r}); today every unit is an nn.Linear. Convert the folder "
                    f"once with `python -m hf_variants.convert_legacy --model {pretrained_model_name_or_path} "
                    f"--output_dir NEW_DIR` (the same values, renamed)."
                )
        model._after_load()
        return (model, info) if output_loading_info else model

    def _after_load(self) -> None:
        """Called by `from_pretrained` on the loaded model (MUTE: a stored M counts as projected; MG-SA: unused
        K/V rows of an older layout are sliced away)."""

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        """transformers' upload of `push_to_hub` / `save_pretrained(push_to_hub=True)`, with the model card of the
        folder this model was loaded from (a training run's `model/README.md`) in place of transformers'
        placeholder card, when the weights are still that folder's (a card describes the weights it was written
        for). A card the repository already has is kept, as transformers does."""
        readme = os.path.join(working_dir, "README.md")
        card = saved_model_card(self, repo_id)
        if card is not None and (not os.path.isfile(readme) or _is_placeholder_card(readme)):
            with open(readme, "w", encoding="utf-8") as f:
                f.write(card)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)

    def _output_flags(self, output_attentions, output_hidden_states, return_dict=None) -> tuple[bool, bool, bool]:
        """The forward's output flags, each falling back to the config when not given."""
        config = self.config
        return (
            bool(config.output_attentions if output_attentions is None else output_attentions),
            bool(config.output_hidden_states if output_hidden_states is None else output_hidden_states),
            bool(config.return_dict if return_dict is None else return_dict),
        )


# The usage snippet's repository id in a card written before the repository was known (model_cards.card).
CARD_PLACEHOLDER_REPO_ID = "ORG/NAME"


def _is_placeholder_card(path: str) -> bool:
    """Whether README.md at `path` is the card transformers writes for a repository without one."""
    with open(path, encoding="utf-8") as f:
        return "has been automatically generated" in f.read()


def saved_model_card(model: PreTrainedModel, repo_id: str | None = None) -> str | None:
    """The README.md of the local folder `model` was loaded from (`config.name_or_path`) when the model's weights
    equal the folder's saved ones, with the card's placeholder repository id replaced by `repo_id`; else None."""
    folder = getattr(model.config, "name_or_path", None) or ""
    readme = os.path.join(folder, "README.md")
    weights = os.path.join(folder, "model.safetensors")
    if not (os.path.isdir(folder) and os.path.isfile(readme) and os.path.isfile(weights)):
        return None
    state = model.state_dict()
    with safe_open(weights, framework="pt") as saved:
        for name in saved.keys():
            tensor = state.get(name)
            if tensor is None or not torch.equal(tensor.detach().cpu(), saved.get_tensor(name)):
                return None
    with open(readme, encoding="utf-8") as f:
        card = f.read()
    if repo_id:
        card = "\n".join(
            line for line in card.split("\n") if not line.startswith(f"Replace `{CARD_PLACEHOLDER_REPO_ID}`")
        )
        card = card.replace(f'"{CARD_PLACEHOLDER_REPO_ID}"', f'"{repo_id}"')
    return card


# ----------------------------------------------------------------------------------------------------------- stacks
class TransformerNmtStack(TransformerNmtPreTrainedModel):
    """What encoder and decoder share: embeddings (scaled tokens + positions + dropout), layers, final norm, and the
    hooks around the layer loop. Each stack owns its modules (it can be saved and loaded alone); the model ties the
    parameters it shares between stacks (`_tied_weights_keys`), as Marian does."""

    layer_class: type[nn.Module] = None

    def __init__(self, config: TransformerNmtConfig, num_layers: int = 0):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.embed_scale = config.embed_scale
        self.embed_positions = None
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([self._make_layer(config, i) for i in range(num_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None
        self._position_table = None  # a plain tensor attribute (never a buffer): `_sinusoidal_table`
        self.post_init()

    def _make_layer(self, config: TransformerNmtConfig, layer_idx: int) -> nn.Module:
        return self.layer_class(config, layer_idx)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # ---------------------------------------------------------------------------------------------- embedding
    def position_embeddings(self, length: int, offset, device, dtype, input_ids=None) -> torch.Tensor | None:
        """[length, d] encodings of positions `offset ..` (`offset`: an int, or a 0-d tensor with a static cache);
        with `fairseq_sinusoidal` and `input_ids`, [B, length, d] (padding-aware, `fairseq_position_ids`)."""
        kind = self.config.position_embedding_type
        if kind == "none":
            return None
        if kind == "fairseq_sinusoidal":
            return self._fairseq_position_embeddings(length, offset, device, dtype, input_ids)
        if kind == "sinusoidal" and not torch.compiler.is_compiling():
            end = offset + length if isinstance(offset, int) else None
            table = self._sinusoidal_table(end, device, dtype)
            if table is not None:
                return table[offset:end]
        positions = torch.arange(length, device=device) + offset
        if self.embed_positions is not None:
            return self.embed_positions(positions)
        return sinusoidal_positions(positions, self.config.d_model).to(dtype)

    def _fairseq_position_embeddings(self, length: int, offset, device, dtype, input_ids=None) -> torch.Tensor:
        """fairseq's positions (M2M100 / NLLB-200): from `input_ids` each row's non-padding tokens counted from
        `pad_token_id + 1` (+ `offset`, the cache length), padding at the zero vector ([B, T, d]); without them
        (`inputs_embeds`) every position counted ([T, d]), as transformers' M2M100 does."""
        pad = self.config.pad_token_id
        if input_ids is not None:
            positions = fairseq_position_ids(input_ids, pad, offset)
        else:
            positions = torch.arange(length, device=device) + offset + (pad + 1)
        end = offset + length + pad + 1 if isinstance(offset, int) else None
        table = None if torch.compiler.is_compiling() else self._sinusoidal_table(end, device, dtype)
        if table is None:
            return fairseq_sinusoidal_positions(positions, self.config.d_model, pad).to(dtype)
        return table[positions]

    def _sinusoidal_table(self, end: int | None, device, dtype) -> torch.Tensor | None:
        """The sinusoidal encodings of positions 0 .. n-1 (n >= `end`, a power of two up to the model's limit),
        built on first use and kept for the next calls on the same device and dtype: decoding reads one row per
        step instead of computing it again. A plain attribute, never a buffer: not saved, not built in `__init__`
        (which `from_pretrained` runs on the meta device). None (compute directly) for a tensor offset."""
        if end is None:
            return None
        table = self._position_table
        if table is None or table.device != device or table.dtype != dtype or table.shape[0] < end:
            config = self.config
            fairseq = config.position_embedding_type == "fairseq_sinusoidal"
            limit = config.max_position_embeddings + (
                config.pad_token_id + 1 if fairseq else 0
            )  # fairseq: + rows 0..pad
            size = min(max(64, 1 << (end - 1).bit_length()), max(end, limit))
            positions = torch.arange(size, device=device)
            if fairseq:
                table = fairseq_sinusoidal_positions(positions, config.d_model, config.pad_token_id).to(dtype)
            else:
                table = sinusoidal_positions(positions, config.d_model).to(dtype)
            self._position_table = table
        return table

    def input_embeddings(self, input_ids=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        """Scaled token embeddings: `embed_tokens(input_ids)` or the given `inputs_embeds`, times `embed_scale`
        (the two paths agree, as in Marian). Variants add per-sentence vectors here (Tied's direction)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return inputs_embeds * self.embed_scale

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """A ValueError naming the id and `config.vocab_size` for an id outside [0, vocab_size) (a tokenizer larger
        than the model's vocabulary), where `nn.Embedding` would raise an IndexError (CPU) or a device-side assert
        (CUDA). Reading the extremes is one host sync on an accelerator, so the check runs only where it costs
        nothing per token: every encoder forward and the decoder's first position (a training step's teacher-forced
        forward, the first decoding step of `generate`), never a later decoding step over a cache; in training on an
        accelerator (the ids come from the run's own tokenizer) and while tracing or compiling, never."""
        if (
            input_ids.numel() == 0
            or torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or (self.training and input_ids.device.type != "cpu")
        ):
            return
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()
        vocab_size = self.config.vocab_size
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise ValueError(
                f"{type(self).__name__}: input id {bad} is outside the model's vocabulary "
                f"(config.vocab_size={vocab_size}): the ids come from another tokenizer than the "
                f"model's (a larger vocabulary?)."
            )

    def embed(
        self, input_ids=None, inputs_embeds=None, query_offset: int | torch.Tensor = 0, **kwargs
    ) -> torch.Tensor:
        """Input embeddings + positions `query_offset ..` + dropout. A sequence beyond `max_position_embeddings`
        raises a ValueError naming the length and the limit; ids outside the vocabulary, one naming the id and the
        vocabulary size (`check_input_ids`)."""
        if input_ids is not None and isinstance(query_offset, int) and query_offset == 0:
            self.check_input_ids(input_ids)
        hidden_states = self.input_embeddings(input_ids, inputs_embeds, **kwargs)
        length, limit = hidden_states.shape[1], self.config.max_position_embeddings
        if isinstance(query_offset, int) and query_offset + length > limit:
            raise ValueError(
                f"{type(self).__name__}: a sequence of {query_offset + length} tokens is longer than "
                f"the model's limit, max_position_embeddings={limit}."
            )
        positions = self.position_embeddings(
            length, query_offset, hidden_states.device, hidden_states.dtype, input_ids=input_ids
        )
        if positions is not None:
            hidden_states = hidden_states + positions
        if self.training:
            hidden_states = F.dropout(hidden_states, p=self.config.dropout, training=True)
        return hidden_states

    # ---------------------------------------------------------------------------------------- around the layers
    def layer_inputs(self, attention_mask: torch.Tensor | None, hidden_states: torch.Tensor, **kwargs) -> dict:
        """Per-forward inputs of the layers, computed once from the stack's inputs (the 2-D padding mask, the
        embedded input, variant inputs in `kwargs`): MG-SA's phrase partition, MIMO's task ids. None here."""
        return {}

    def enter_stack(self, hidden_states: torch.Tensor, **layer_inputs) -> torch.Tensor:
        """What the first layer receives (MIMO: one stream shared by every transformation)."""
        return hidden_states

    def exit_stack(self, hidden_states: torch.Tensor, **layer_inputs) -> tuple[torch.Tensor, dict]:
        """The stack's output [B, T, d] from the last layer's output, and extra output fields (MIMO's streams)."""
        return hidden_states, {}

    def layer_output_view(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the next layer receives, what `hidden_states` reports): the same tensor here; MIMO reports the mean
        over its streams ([B, T, d], `attach_summary`)."""
        return hidden_states, hidden_states

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(hidden_states) if self.layer_norm is not None else hidden_states


class TransformerNmtEncoder(TransformerNmtStack):
    layer_class = TransformerNmtEncoderLayer
    output_class = TransformerNmtEncoderOutput

    def __init__(self, config: TransformerNmtConfig):
        super().__init__(config, config.encoder_layers)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformerNmtKwargs],
    ) -> TransformerNmtEncoderOutput:
        output_attentions, output_hidden_states, return_dict = self._output_flags(
            output_attentions, output_hidden_states, return_dict
        )
        kwargs.pop("query_offset", None)
        hidden_states = self.embed(input_ids, inputs_embeds, **kwargs)
        layer_inputs = self.layer_inputs(attention_mask, hidden_states, **kwargs)
        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask
        )
        hidden_states = self.enter_stack(hidden_states, **layer_inputs)
        all_hidden, all_attn, aux_losses = [], [], {}
        for layer in self.layers:
            if output_hidden_states:
                hidden_states, view = self.layer_output_view(hidden_states)
                all_hidden.append(view)
            hidden_states, weights, aux = layer(
                hidden_states, mask, output_attentions=output_attentions, **layer_inputs, **kwargs
            )
            for name, value in (aux or {}).items():
                aux_losses[name] = aux_losses[name] + value if name in aux_losses else value
            if output_attentions:
                all_attn.append(weights)
        hidden_states, extra_fields = self.exit_stack(hidden_states, **layer_inputs)
        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        output = self.output_class(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
            aux_losses=aux_losses or None,
            **extra_fields,
        )
        return output if return_dict else output.to_tuple()


class TransformerNmtDecoder(TransformerNmtStack):
    layer_class = TransformerNmtDecoderLayer

    def __init__(self, config: TransformerNmtConfig):
        super().__init__(config, config.decoder_layers)

    def self_attention_mask(self, hidden_states, attention_mask, cache):
        """The causal (+ padding) mask of the self-attention, in the implementation's format; None where SDPA's
        `is_causal` does the job, and for one query after a growing cache without a padding mask (a decoding step):
        it attends to every key, which is what the helper's mask would say (SDPA: None; eager: all zeros), without
        building it at every step. A pre-allocated (static) cache holds empty slots and flex_attention takes a
        BlockMask: the helper builds those."""
        own = self_attention_cache(cache)
        if (
            attention_mask is None
            and hidden_states.shape[1] == 1
            and own is not None
            and not getattr(own, "is_compileable", False)
            and self.config._attn_implementation in ("sdpa", "eager")
        ):
            return None
        return causal_mask(self.config, hidden_states, attention_mask, own)

    def cross_attention_mask(self, hidden_states, encoder_attention_mask, encoder_hidden_states, cache=None):
        """The padding mask of the cross-attention (transformers' `create_bidirectional_mask`). Like the
        cross-attention keys and values, it is built once per `generate` call (`generation_scope`): the next steps
        of the same cache reuse it for the same 2-D mask tensor with the same values (the same object not modified
        in place since: its version counter, or for an inference tensor, which has none, a copy of its values),
        query shape, dtype and attention implementation. Outside `generate` it is built at every call."""

        def build():
            return create_bidirectional_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )

        scope = current_generation_scope()
        if scope is None or cache is None or not isinstance(encoder_attention_mask, torch.Tensor):
            return build()
        key = (hidden_states.shape[:2], hidden_states.dtype, self.config._attn_implementation)
        memo = scope.get(self)
        if memo is not None and memo[0] is cache and memo[1] is encoder_attention_mask and memo[2] == key:
            snapshot = memo[3]
            if (
                torch.equal(snapshot, encoder_attention_mask)
                if isinstance(snapshot, torch.Tensor)
                else snapshot == encoder_attention_mask._version
            ):
                return memo[4]
        mask = build()
        snapshot = (
            encoder_attention_mask.clone()
            if encoder_attention_mask.is_inference()
            else encoder_attention_mask._version
        )
        scope[self] = (cache, encoder_attention_mask, key, snapshot, mask)
        return mask

    @accepts_cache_alias
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformerNmtKwargs],
    ):
        """`cache` (an `EncoderDecoderCache`; `past_key_values` before transformers 5.24) holds the keys and values
        of the previous positions; with `use_cache` and none given, a new one is made and returned."""
        output_attentions, output_hidden_states, return_dict = self._output_flags(
            output_attentions, output_hidden_states, return_dict
        )
        use_cache = self.config.use_cache if use_cache is None else use_cache
        checkpointed = self.training and any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers)
        if use_cache and checkpointed and torch.is_grad_enabled():
            # a checkpointed layer runs twice (forward, then again in backward): it would write its keys twice
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing: no cache is kept.")
            use_cache, cache = False, None
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        # queries sit at the cache length (a static cache's counter is a tensor that its updates advance in place)
        past_length = self_attention_cache(cache).get_seq_length() if cache is not None else 0
        if isinstance(past_length, torch.Tensor):
            past_length = past_length.clone()
        kwargs["query_offset"] = past_length
        hidden_states = self.embed(input_ids, inputs_embeds, **kwargs)
        layer_inputs = self.layer_inputs(attention_mask, hidden_states, **kwargs)
        self_mask = self.self_attention_mask(hidden_states, attention_mask, cache)
        cross_mask = self.cross_attention_mask(hidden_states, encoder_attention_mask, encoder_hidden_states, cache)
        hidden_states = self.enter_stack(hidden_states, **layer_inputs)
        all_hidden, all_self, all_cross = [], [], []
        for layer in self.layers:
            if output_hidden_states:
                hidden_states, view = self.layer_output_view(hidden_states)
                all_hidden.append(view)
            hidden_states, self_weights, cross_weights = layer(
                hidden_states,
                self_mask,
                encoder_hidden_states,
                encoder_attention_mask=cross_mask,
                cache=cache,
                output_attentions=output_attentions,
                use_cache=use_cache,
                **layer_inputs,
                **kwargs,
            )
            if output_attentions:
                all_self.append(self_weights)
                all_cross.append(cross_weights)
        hidden_states, _ = self.exit_stack(hidden_states, **layer_inputs)
        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **cache_field(cache if use_cache else None),
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()


# ------------------------------------------------------------------------------------------------------------ models
class TransformerNmtModel(TransformerNmtPreTrainedModel):
    encoder_class = TransformerNmtEncoder
    decoder_class = TransformerNmtDecoder
    # The config field counting the target-language ids the model conditions on (None: it does not).
    language_ids_field: str | None = None

    def __init__(self, config: TransformerNmtConfig):
        super().__init__(config)
        # Parameters shared between the stacks are tied by `post_init` (`_tied_weights_keys`: saved once, re-tied
        # on load), as in Marian: the source/target embedding matrix when `share_encoder_decoder_embeddings`.
        self._tied_weights_keys = {}
        self.shared = None
        if config.share_encoder_decoder_embeddings and config.tie_word_embeddings:
            self.shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
            self._tied_weights_keys = {
                "encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight",
            }
        self.encoder, self.decoder = self._make_stacks(config)
        self.post_init()

    def _make_stacks(self, config: TransformerNmtConfig) -> tuple[nn.Module, nn.Module]:
        """The encoder and decoder stacks. A variant whose stacks share parameters registers their owner on the model
        here and adds the ties to `_tied_weights_keys` (the Tied Transformer's single block list)."""
        return self.encoder_class(config), self.decoder_class(config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.shared is not None:
            self.shared = value
            self.decoder.embed_tokens = value
        self.encoder.embed_tokens = value

    def encoder_memory(self, encoder_outputs: BaseModelOutput) -> torch.Tensor:
        """What cross-attention reads from the encoder output (variants with several streams override)."""
        return encoder_outputs.last_hidden_state

    @accepts_cache_alias
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        tgt_lang_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformerNmtKwargs],
    ) -> TransformerNmtSeq2SeqModelOutput:
        """`tgt_lang_ids` ([B]): each sentence's target language (index in `config.languages`), for the models that
        condition on it (MIMO, Tied; `language_ids_field`)."""
        output_attentions, output_hidden_states, return_dict = self._output_flags(
            output_attentions, output_hidden_states, return_dict
        )
        if tgt_lang_ids is not None and self.language_ids_field is not None:
            kwargs["tgt_lang_ids"] = tgt_lang_ids
        elif tgt_lang_ids is not None and not getattr(self.config, "target_language_token", False):
            raise ValueError(
                f"{type(self).__name__} does not condition on the target language: `tgt_lang_ids` "
                "would be ignored (a multilingual baseline reads the `<2xx>` tag of its source)."
            )
        # with `target_language_token` the decoder reads the language from its first token after the start token
        # (`decoder_input_ids`, or the labels'): `tgt_lang_ids` (from `prepare_translation_inputs`) is for generate
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=True,
                **kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = self.encoder.output_class(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=self.encoder_memory(encoder_outputs),
            encoder_attention_mask=attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            cache=cache,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        output = TransformerNmtSeq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_field(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            aux_losses=getattr(encoder_outputs, "aux_losses", None),
        )
        return output if return_dict else output.to_tuple()


class TransformerNmtForConditionalGeneration(
    TransformerNmtPreTrainedModel, TransformerNmtGenerationMixin, GenerationMixin
):
    base_model_class = TransformerNmtModel
    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}

    def __init__(self, config: TransformerNmtConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.output_bias)
        source = "shared" if self.model.shared is not None else "decoder.embed_tokens"
        self._tied_weights_keys = {"lm_head.weight": f"model.{source}.weight"}
        # save_pretrained writes auto_map entries for the config and this class; add the base model's (AutoModel).
        auto_map = dict(getattr(config, "auto_map", None) or {})
        base = self.base_model_class
        auto_map.setdefault("AutoModel", f"{base.__module__.rsplit('.', 1)[-1]}.{base.__name__}")
        config.auto_map = auto_map
        self.post_init()
        # never generate padding or a second start token (fairseq masks them the same way); saved generation configs
        # override this
        never = [
            i
            for i in (config.pad_token_id, config.bos_token_id, config.decoder_start_token_id)
            if i is not None and i != config.eos_token_id
        ]
        if never and self.generation_config.suppress_tokens is None:
            self.generation_config.suppress_tokens = sorted(set(never))
        # the length rule is saved with the generation config: a max_length of 20 that a Seq2SeqTrainer evaluation
        # writes into it is then told apart from a limit (`_unchosen_max_length`)
        if getattr(self.generation_config, "length_rule", None) is None:
            self.generation_config.length_rule = dict(zip(LENGTH_RULE_KEYS, self.default_length))
            # no longer the model config's plain derivative: a config loaded with `_from_model_config` set drops
            # every field that is not a GenerationConfig argument, `length_rule` included
            self.generation_config._from_model_config = False

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    # --------------------------------------------------------------------------------------- variant hooks
    def auxiliary_losses(self, model_outputs, num_target_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weighted auxiliary losses to add to the token-mean cross-entropy. The stacks report loss SUMS
        (`aux_losses`); like the per-token CE they are divided by the number of target tokens."""
        sums = getattr(model_outputs, "aux_losses", None) or {}
        return {name: value / num_target_tokens for name, value in sums.items()}

    def token_loss_weights(self, labels: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """The weight of each target token's loss ([batch, length], float), or None for the mean over the
        labelled tokens (the default). `kwargs` are the batch's variant inputs (e.g. `tgt_lang_ids`), for variants
        that weight tokens differently (the Tied Transformer sums per-direction means)."""
        return None

    def _translation_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, **kwargs
    ) -> torch.Tensor:
        """The main loss: cross-entropy of `logits` (labels -100 ignored; label-smoothed by `label_smoothing`), each
        token weighted by `token_loss_weights` (by default the mean over the target tokens)."""
        return smoothed_cross_entropy(
            logits, labels, label_smoothing, weights=self.token_loss_weights(labels, **kwargs)
        )

    def _projected_translation_loss(
        self, hidden_states: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, **kwargs
    ) -> torch.Tensor | None:
        """`_translation_loss(lm_head(hidden_states), labels, label_smoothing)` without the logits, when the output
        projection is a plain `nn.Linear` (not quantized, not wrapped by an adapter or a hook); None otherwise (the
        caller computes the logits)."""
        head = self.lm_head
        if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks or hasattr(head, "_hf_hook"):
            return None
        return projected_smoothed_cross_entropy(
            hidden_states,
            head.weight,
            head.bias,
            labels,
            label_smoothing,
            weights=self.token_loss_weights(labels, **kwargs),
        )

    def after_optimizer_step(self) -> None:
        """Called by training loops after every optimizer step (e.g. MUTE re-projects its AutoShuffle matrices)."""

    # ------------------------------------------------------------------------------------------------ forward
    @accepts_cache_alias
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        tgt_lang_ids: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        skip_logits: bool = False,
        smoothing: float | None = None,
        **kwargs: Unpack[TransformerNmtKwargs],
    ) -> TransformerNmtSeq2SeqLMOutput:
        """`labels` (-100 = ignored) give `loss`: the cross-entropy + the variant's auxiliary losses. As in
        transformers' seq2seq models it is the plain cross-entropy; `smoothing=0.1` asks for the label-smoothed
        one (the training code passes the run's value; `config.label_smoothing` only records it; the argument's
        name has no "label" in it, which would make `Trainer` take it for a label column);
        `logits_to_keep` (an int k > 0: the last k positions; a tensor: those positions) limits the vocabulary
        projection to the positions that are read (generation without cache).

        `skip_logits=True` (training, with `labels`): `logits` is None and the loss is computed from the decoder's
        hidden states chunk by chunk (`projected_smoothed_cross_entropy`), so no [tokens, vocabulary] tensor is
        ever held: the same loss and gradients, without the step's largest tensors. `training/train.py` passes
        it; a `Trainer` user can pass it through `compute_loss`."""
        given, smoothing = smoothing, 0.0 if smoothing is None else float(smoothing)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"`smoothing` (label smoothing of the loss) must be a float in [0, 1), got {given!r}.")
        if skip_logits and labels is None:
            raise ValueError(
                "skip_logits=True computes the loss without the logits and needs `labels`; without "
                "labels there is nothing to return but the logits."
            )
        output_attentions, output_hidden_states, return_dict = self._output_flags(
            output_attentions, output_hidden_states, return_dict
        )
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            tgt_lang_ids=tgt_lang_ids,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if labels is None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            hidden_states = hidden_states[:, keep]
        logits = None if skip_logits else self.lm_head(hidden_states)
        loss = aux_losses = None
        if labels is not None:
            pad = self.config.pad_token_id
            if pad is not None and pad not in (self.config.eos_token_id, self.config.bos_token_id):
                labels = labels.masked_fill(labels == pad, -100)
            if skip_logits:
                loss = self._projected_translation_loss(hidden_states, labels, smoothing, tgt_lang_ids=tgt_lang_ids)
            if loss is None:  # the logits are needed (a quantized or adapted head; an overridden loss)
                loss = self._translation_loss(
                    self.lm_head(hidden_states) if logits is None else logits,
                    labels,
                    smoothing,
                    tgt_lang_ids=tgt_lang_ids,
                )
            aux_losses = self.auxiliary_losses(outputs, (labels != -100).sum().clamp(min=1))
            for value in aux_losses.values():
                loss = loss + value
        output = TransformerNmtSeq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **cache_field(output_cache(outputs)),
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
            aux_losses=aux_losses,
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "TransformerNmtPreTrainedModel",
    "TransformerNmtModel",
    "TransformerNmtForConditionalGeneration",
    "TransformerNmtAttention",
    "TransformerNmtEncoderLayer",
    "TransformerNmtDecoderLayer",
    "TransformerNmtEncoder",
    "TransformerNmtDecoder",
    "StackedLinear",
    "attend",
]
