"""The Transformer backbone of hf_variants: the baseline NMT model and the extension points the variants use.

Read top to bottom: position helpers, attention (fused QKV, SDPA or eager, KV cache, Shaw relative positions),
encoder and decoder layers, the two stacks, `TransformerNmtModel` and `TransformerNmtForConditionalGeneration`.

A variant overrides only what its paper changes (see `docs` in the README):
- the attention class of a layer (`TransformerNmtEncoderLayer.attention_class`, `TransformerNmtDecoderLayer.
  self_attention_class`) or its core `_attend` / `_project_qkv`;
- the layers a stack builds (`TransformerNmtEncoder._make_layer`, `TransformerNmtDecoder._make_layer`) and how a
  stack embeds its input (`embed`);
- the stacks of the model (`TransformerNmtModel.encoder_class` / `decoder_class`) and what the decoder reads from
  the encoder (`encoder_memory`);
- the modules the model builds for its stacks (`TransformerNmtModel._make_stacks`);
- losses and hooks of the generation model (`translation_loss`, `auxiliary_losses`, `after_optimizer_step`,
  `_language_inputs`).
Masks are booleans (`True` = may attend) of shape [B, 1|H, Q, K], built once per forward by the stacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_transformer_nmt import TransformerNmtConfig, language_tag
from .pipeline_translation import TranslationPipeline  # noqa: F401  (shipped with every model: custom_pipelines)


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


def causal_mask(query_length: int, key_length: int, device: torch.device,
                query_offset: int | torch.Tensor | None = None) -> torch.Tensor:
    """[Q, K] booleans: query i (absolute position `query_offset + i`; by default the queries are the last Q of
    the K positions) sees keys j <= its position. A static cache holds more key slots than positions so far: pass
    the cache length as `query_offset` there (an int or a 0-d tensor)."""
    offset = key_length - query_length if query_offset is None else query_offset
    q = torch.arange(query_length, device=device)[:, None] + offset
    return torch.arange(key_length, device=device)[None, :] <= q


def padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A 2D 0/1 key mask as a [B, 1, 1, K] boolean mask (4D masks are returned as booleans unchanged)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        if attention_mask.is_floating_point():  # additive mask: 0 where allowed, a large negative value elsewhere
            return attention_mask > torch.finfo(attention_mask.dtype).min / 2
        return attention_mask.bool()
    return attention_mask[:, None, None, :].bool()


def self_attention_cache(past_key_values: Cache | None) -> Cache | None:
    if isinstance(past_key_values, EncoderDecoderCache):
        return past_key_values.self_attention_cache
    return past_key_values


def static_cache_length(past_key_values: Cache | None) -> int | None:
    """The number of key slots of a static (pre-allocated) self-attention cache, or None for a growing one."""
    cache = self_attention_cache(past_key_values)
    if cache is None or not len(cache.layers):
        return None
    length = cache.get_max_length()
    return length if length > 0 else None


# --------------------------------------------------------------------------------------------------------- attention
def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    is_causal: bool = False,
    position_bias: torch.Tensor | None = None,
    value_bias_fn=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QK^T * scaling + bias) V with explicit probabilities. Boolean masks become ONE additive bias; rows
    with no allowed key give 0 (never NaN). `value_bias_fn(probs)` adds a term computed from the probabilities
    (Shaw relative values). Returns ([B, Q, H, D], [B, H, Q, K])."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    allowed = attention_mask
    if allowed is None and is_causal and query.shape[-2] > 1:
        allowed = causal_mask(query.shape[-2], key.shape[-2], query.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if allowed is not None:
        probs = probs.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    weights = probs
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)
    if value_bias_fn is not None:
        out = out + value_bias_fn(probs)
    return out.transpose(1, 2).contiguous(), weights


class RelativePositionEmbedding(nn.Module):
    """Shaw et al. (2018) relative positions: one table of 2m+1 vectors of size head_dim per attention module,
    used for keys (and, as in OpenNMT, for values). Distances are clipped to [-m, m]."""

    def __init__(self, max_relative_positions: int, head_dim: int):
        super().__init__()
        self.max_relative_positions = max_relative_positions
        self.embeddings = nn.Embedding(2 * max_relative_positions + 1, head_dim)

    def index(self, query_length: int, key_length: int, device: torch.device,
              query_offset: int | torch.Tensor | None = None) -> torch.Tensor:
        """[Q, K] bucket ids; query i is at position `query_offset + i`, by default the last Q of the K positions
        (cache index = position)."""
        offset = key_length - query_length if query_offset is None else query_offset
        q = torch.arange(query_length, device=device)[:, None] + offset
        k = torch.arange(key_length, device=device)[None, :]
        m = self.max_relative_positions
        return (k - q).clamp(-m, m) + m

    def key_bias(self, query: torch.Tensor, index: torch.Tensor, scaling: float) -> torch.Tensor:
        """q_i . r_{j-i} * scaling as [B, H, Q, K]: O(B.H.Q.(2m+1)) products and one gather."""
        logits = torch.matmul(query, self.embeddings.weight.t().to(query.dtype)) * scaling  # [B, H, Q, 2m+1]
        return logits.gather(-1, index.expand(*logits.shape[:-1], index.shape[-1]))

    def value_term(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """sum_j p_ij r_{j-i}: probabilities summed per distance bucket, times the table."""
        buckets = probs.new_zeros(*probs.shape[:-1], self.embeddings.num_embeddings)
        buckets.scatter_add_(-1, index.expand_as(probs), probs)
        return torch.matmul(buckets, self.embeddings.weight.to(probs.dtype))


class TransformerNmtAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self-attention) or fused KV projection (cross-attention),
    the transformers KV cache, Shaw relative positions, and SDPA or eager kernels.

    Variants override `_attend` (the kernel: masks, branches, fusion) and keep the projections and the cache."""

    def __init__(self, config: TransformerNmtConfig, num_heads: int, layer_idx: int | None = None,
                 is_cross_attention: bool = False, is_decoder: bool = False):
        super().__init__()
        self.config = config
        self.embed_dim = config.d_model
        self.num_heads = num_heads
        self.head_dim = config.d_model // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_decoder = is_decoder
        self.is_causal = is_decoder and not is_cross_attention
        self.num_key_value_groups = 1
        if is_cross_attention:
            self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
            self.kv_proj = nn.Linear(self.embed_dim, 2 * self.embed_dim)
        else:
            self.qkv_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.relative_positions = None
        if config.max_relative_positions > 0 and not is_cross_attention:
            self.relative_positions = RelativePositionEmbedding(config.max_relative_positions, self.head_dim)

    def _heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """[B, T, parts*d] -> `parts` tensors [B, H, T, D]."""
        b, t, _ = x.shape
        return x.view(b, t, parts, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def _project_qkv(self, hidden_states, key_value_states, past_key_values):
        """Queries, keys, values as [B, H, T, D], with the cache read and updated."""
        if not self.is_cross_attention:
            query, key, value = self._heads(self.qkv_proj(hidden_states), 3)
            cache = self_attention_cache(past_key_values)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            return query, key, value
        (query,) = self._heads(self.q_proj(hidden_states), 1)
        if past_key_values is not None and past_key_values.is_updated.get(self.layer_idx):
            layer = past_key_values.cross_attention_cache.layers[self.layer_idx]
            return query, layer.keys, layer.values
        key, value = self._heads(self.kv_proj(key_value_states), 2)
        if past_key_values is not None:  # cross-attention keys/values are computed once per generation
            key, value = past_key_values.cross_attention_cache.update(key, value, self.layer_idx)
            past_key_values.is_updated[self.layer_idx] = True
        return query, key, value

    def _attend(self, query, key, value, attention_mask, output_attentions=False, **kwargs):
        """The attention kernel: [B, H, Q, D] queries -> ([B, Q, H, D], weights or None)."""
        position_bias = value_bias_fn = None
        if self.relative_positions is not None:
            index = self.relative_positions.index(query.shape[-2], key.shape[-2], query.device,
                                                  kwargs.get("query_offset"))
            position_bias = self.relative_positions.key_bias(query, index, self.scaling)
            if self.config.relative_position_values:
                value_bias_fn = lambda probs: self.relative_positions.value_term(probs, index)  # noqa: E731
        if output_attentions or value_bias_fn is not None:  # these need the probabilities
            attention_fn = eager_attention_forward
        else:
            attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                 eager_attention_forward)
        return attention_fn(self, query, key, value, attention_mask, scaling=self.scaling,
                            dropout=self.dropout if self.training else 0.0, is_causal=self.is_causal,
                            position_bias=position_bias, value_bias_fn=value_bias_fn)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                key_value_states: torch.Tensor | None = None, past_key_values: Cache | None = None,
                output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key, value = self._project_qkv(hidden_states, key_value_states, past_key_values)
        out, weights = self._attend(query, key, value, attention_mask, output_attentions=output_attentions, **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], self.embed_dim)
        return self.out_proj(out), weights


# ------------------------------------------------------------------------------------------------------------ layers
class TransformerNmtFeedForward(nn.Module):
    """Position-wise FFN sub-layer with its residual connection and LayerNorm (pre- or post-norm)."""

    def __init__(self, config: TransformerNmtConfig, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.activation_fn = ACT2FN[config.activation_function]
        self.dropout = config.dropout
        self.activation_dropout = config.activation_dropout
        self.normalize_before = config.normalize_before

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        if self.normalize_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = F.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        hidden_states = F.dropout(self.fc2(hidden_states), p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if not self.normalize_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


def residual_block(module: nn.Module, layer_norm: nn.LayerNorm, hidden_states: torch.Tensor, fn, pre_norm: bool,
                   dropout: float):
    """x + Dropout(fn(LN(x))) (pre-norm) or LN(x + Dropout(fn(x))) (post-norm); fn returns (out, extra)."""
    residual = hidden_states
    if pre_norm:
        hidden_states = layer_norm(hidden_states)
    hidden_states, extra = fn(hidden_states)
    hidden_states = residual + F.dropout(hidden_states, p=dropout, training=module.training)
    if not pre_norm:
        hidden_states = layer_norm(hidden_states)
    return hidden_states, extra


class TransformerNmtEncoderLayer(GradientCheckpointingLayer):
    attention_class = TransformerNmtAttention

    def __init__(self, config: TransformerNmtConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.self_attn = self.attention_class(config, config.encoder_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = TransformerNmtFeedForward(config, config.encoder_ffn_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden_states, weights = residual_block(
            self, self.self_attn_layer_norm, hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, output_attentions=output_attentions,
                                     **kwargs),
            self.config.normalize_before, self.config.dropout)
        return self.ffn(hidden_states), weights


class TransformerNmtDecoderLayer(GradientCheckpointingLayer):
    self_attention_class = TransformerNmtAttention
    cross_attention_class = TransformerNmtAttention

    def __init__(self, config: TransformerNmtConfig, layer_idx: int):
        super().__init__()
        self.config = config
        heads = config.decoder_attention_heads
        self.self_attn = self.self_attention_class(config, heads, layer_idx, is_decoder=True)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.encoder_attn = self.cross_attention_class(config, heads, layer_idx, is_cross_attention=True,
                                                       is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = TransformerNmtFeedForward(config, config.decoder_ffn_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, past_key_values: Cache | None = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs):
        pre, p = self.config.normalize_before, self.config.dropout
        hidden_states, self_weights = residual_block(
            self, self.self_attn_layer_norm, hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, past_key_values=past_key_values,
                                     output_attentions=output_attentions, **kwargs), pre, p)
        hidden_states, cross_weights = residual_block(
            self, self.encoder_attn_layer_norm, hidden_states,
            lambda x: self.encoder_attn(x, attention_mask=encoder_attention_mask,
                                        key_value_states=encoder_hidden_states, past_key_values=past_key_values,
                                        output_attentions=output_attentions, **kwargs), pre, p)
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
class TransformerNmtPreTrainedModel(PreTrainedModel):
    config_class = TransformerNmtConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerNmtEncoderLayer", "TransformerNmtDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False  # relative-position biases and per-head masks of the variants
    _supports_flex_attn = False

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
            init.normal_(module.weight, mean=0.0, std=config.d_model**-0.5 if xavier else config.init_std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)


# ----------------------------------------------------------------------------------------------------------- stacks
class TransformerNmtStack(nn.Module):
    """What encoder and decoder share: embeddings (scaled tokens + positions + dropout), layers, final norm."""

    layer_class: type[nn.Module] = None

    def __init__(self, config: TransformerNmtConfig, embed_tokens: nn.Embedding, num_layers: int):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.embed_scale = config.embed_scale
        self.embed_positions = None
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([self._make_layer(config, i) for i in range(num_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None

    def _make_layer(self, config: TransformerNmtConfig, layer_idx: int) -> nn.Module:
        return self.layer_class(config, layer_idx)

    def position_embeddings(self, length: int, offset: int, device, dtype) -> torch.Tensor | None:
        if self.config.position_embedding_type == "none":
            return None
        positions = torch.arange(length, device=device) + offset  # offset: an int or a 0-d tensor (static cache)
        if self.embed_positions is not None:
            return self.embed_positions(positions)
        return sinusoidal_positions(positions, self.config.d_model).to(dtype)

    def embed(self, input_ids=None, inputs_embeds=None, past_length: int = 0, **kwargs) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        positions = self.position_embeddings(inputs_embeds.shape[1], past_length, inputs_embeds.device,
                                             inputs_embeds.dtype)
        hidden_states = inputs_embeds if positions is None else inputs_embeds + positions
        return F.dropout(hidden_states, p=self.config.dropout, training=self.training)

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(hidden_states) if self.layer_norm is not None else hidden_states


class TransformerNmtEncoder(TransformerNmtStack):
    layer_class = TransformerNmtEncoderLayer

    def __init__(self, config: TransformerNmtConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens, config.encoder_layers)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=False,
                output_hidden_states=False, return_dict=True, **kwargs) -> TransformerNmtEncoderOutput:
        hidden_states = self.embed(input_ids, inputs_embeds, **kwargs)
        mask = padding_mask(attention_mask)
        all_hidden, all_attn, aux_losses = [], [], {}
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden_states)
            # A layer returns (hidden_states, weights) or (hidden_states, weights, {name: auxiliary loss SUM}).
            hidden_states, weights, *extra = layer(hidden_states, attention_mask=mask,
                                                   output_attentions=output_attentions, **kwargs)
            for name, value in (extra[0] if extra and extra[0] else {}).items():
                aux_losses[name] = aux_losses[name] + value if name in aux_losses else value
            if output_attentions:
                all_attn.append(weights)
        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        return TransformerNmtEncoderOutput(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
            aux_losses=aux_losses or None,
        )


class TransformerNmtDecoder(TransformerNmtStack):
    layer_class = TransformerNmtDecoderLayer

    def __init__(self, config: TransformerNmtConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens, config.decoder_layers)

    def self_attention_mask(self, attention_mask, query_length: int, key_length: int, device,
                            query_offset: int | torch.Tensor | None = None):
        """Causal AND decoder padding as booleans, or None when causality alone applies (SDPA's is_causal).
        `query_offset` (static caches: K slots, the queries at positions query_offset..): always a mask."""
        if attention_mask is None and query_offset is None:
            return None
        allowed = causal_mask(query_length, key_length, device, query_offset)[None, None]
        if attention_mask is None:
            return allowed
        pad = padding_mask(attention_mask)
        if pad.shape[-1] < key_length:  # a static cache's unused slots: the causal mask already excludes them
            pad = F.pad(pad, (0, key_length - pad.shape[-1]), value=True)
        return allowed & pad[..., -key_length:]

    def start_decoding(self, input_ids, inputs_embeds, attention_mask, past_key_values: Cache | None, use_cache,
                       **kwargs):
        """The start of a decoder forward, shared by the variants' decoders: the cache (created when `use_cache`
        and none is given), the embedded inputs at their absolute positions, the self-attention mask, and the
        attention kwargs (`query_offset` under a static cache, whose keys are all its pre-allocated slots)."""
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        if isinstance(past_length, torch.Tensor):  # a static cache's counter, which its updates advance in place
            past_length = past_length.clone()
        hidden_states = self.embed(input_ids, inputs_embeds, past_length=past_length, **kwargs)
        query_length = hidden_states.shape[1]
        slots = static_cache_length(past_key_values)
        key_length = past_length + query_length if slots is None else slots
        query_offset = None if slots is None else past_length
        self_mask = self.self_attention_mask(attention_mask, query_length, key_length, hidden_states.device,
                                             query_offset)
        return past_key_values, hidden_states, self_mask, {} if query_offset is None else {"query_offset": query_offset}

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, inputs_embeds=None, past_key_values: Cache | None = None,
                use_cache=None, output_attentions=False, output_hidden_states=False, return_dict=True, **kwargs):
        past_key_values, hidden_states, self_mask, attention_kwargs = self.start_decoding(
            input_ids, inputs_embeds, attention_mask, past_key_values, use_cache, **kwargs)
        kwargs.update(attention_kwargs)
        cross_mask = padding_mask(encoder_attention_mask)
        all_hidden, all_self, all_cross = [], [], []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden_states)
            hidden_states, self_weights, cross_weights = layer(
                hidden_states, attention_mask=self_mask, encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=cross_mask, past_key_values=past_key_values,
                output_attentions=output_attentions, use_cache=use_cache, **kwargs)
            if output_attentions:
                all_self.append(self_weights)
                all_cross.append(cross_weights)
        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions else None,
        )


# ------------------------------------------------------------------------------------------------------------ models
class TransformerNmtModel(TransformerNmtPreTrainedModel):
    encoder_class = TransformerNmtEncoder
    decoder_class = TransformerNmtDecoder

    def __init__(self, config: TransformerNmtConfig):
        super().__init__(config)
        pad = config.pad_token_id
        if config.share_encoder_decoder_embeddings:
            self.shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx=pad)
            encoder_embeddings = decoder_embeddings = self.shared
            # One module shared by identity; declared so that save_pretrained stores it once (as Marian does).
            self._tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                                       "decoder.embed_tokens.weight": "shared.weight"}
        else:
            encoder_embeddings = nn.Embedding(config.vocab_size, config.d_model, padding_idx=pad)
            decoder_embeddings = nn.Embedding(config.vocab_size, config.d_model, padding_idx=pad)
        self.encoder, self.decoder = self._make_stacks(config, encoder_embeddings, decoder_embeddings)
        self.post_init()

    def _make_stacks(self, config: TransformerNmtConfig, encoder_embeddings: nn.Embedding,
                     decoder_embeddings: nn.Embedding) -> tuple[nn.Module, nn.Module]:
        """The encoder and decoder stacks. A variant whose stacks run shared modules registers those on the model
        here, before building the stacks that use them (the Tied Transformer's single block list)."""
        return self.encoder_class(config, encoder_embeddings), self.decoder_class(config, decoder_embeddings)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.config.share_encoder_decoder_embeddings:
            self.shared = value
            self.decoder.embed_tokens = value
        self.encoder.embed_tokens = value

    def encoder_memory(self, encoder_outputs: BaseModelOutput) -> torch.Tensor:
        """What cross-attention reads from the encoder output (variants with several streams override)."""
        return encoder_outputs.last_hidden_state

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values: Cache | None = None, inputs_embeds=None,
                decoder_inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs) -> TransformerNmtSeq2SeqModelOutput:
        output_attentions = bool(output_attentions)
        output_hidden_states = bool(output_hidden_states)
        return_dict = return_dict if return_dict is not None else True
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = TransformerNmtEncoderOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
            encoder_hidden_states=self.encoder_memory(encoder_outputs), encoder_attention_mask=attention_mask,
            inputs_embeds=decoder_inputs_embeds, past_key_values=past_key_values, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, **kwargs)
        output = TransformerNmtSeq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            aux_losses=getattr(encoder_outputs, "aux_losses", None),
        )
        return output if return_dict else output.to_tuple()


class TransformerNmtForConditionalGeneration(TransformerNmtPreTrainedModel, GenerationMixin):
    base_model_class = TransformerNmtModel
    _tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    # Decoding defaults of the papers (beam 4, length penalty 0.6).
    default_generation = {"num_beams": 4, "length_penalty": 0.6, "max_new_tokens": 256}

    def __init__(self, config: TransformerNmtConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.output_bias)
        source = "shared" if config.share_encoder_decoder_embeddings else "decoder.embed_tokens"
        self._tied_weights_keys = {"lm_head.weight": f"model.{source}.weight"}
        # save_pretrained writes auto_map entries for the config and this class; add the base model's (AutoModel).
        auto_map = dict(getattr(config, "auto_map", None) or {})
        base = self.base_model_class
        auto_map.setdefault("AutoModel", f"{base.__module__.rsplit('.', 1)[-1]}.{base.__name__}")
        config.auto_map = auto_map
        self.post_init()
        for key, value in self.default_generation.items():
            setattr(self.generation_config, key, value)
        # never generate padding or a second start token (fairseq masks them the same way); saved generation configs
        # override this
        never = [i for i in (config.pad_token_id, config.bos_token_id, config.decoder_start_token_id)
                 if i is not None and i != config.eos_token_id]
        if never and self.generation_config.suppress_tokens is None:
            self.generation_config.suppress_tokens = sorted(set(never))

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

    def translation_loss(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """The main loss: label-smoothed cross-entropy averaged over the target tokens (labels -100 ignored).
        `kwargs` are the batch's variant inputs (e.g. `tgt_lang_ids`), for variants that weight tokens differently
        (the Tied Transformer sums per-direction means)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                               label_smoothing=self.config.label_smoothing)

    def after_optimizer_step(self) -> None:
        """Called by training loops after every optimizer step (e.g. MUTE re-projects its AutoShuffle matrices)."""

    def _language_inputs(self, tgt_langs: list[str] | None, batch_size: int) -> dict[str, torch.Tensor]:
        """Extra model inputs derived from the target languages (e.g. `tgt_lang_ids`); none for the baseline."""
        return {}

    def prepare_translation_inputs(self, tokenizer, texts: str | Sequence[str], *, src_lang: str | None = None,
                                   tgt_lang: str | Sequence[str] | None = None,
                                   text_target: str | Sequence[str] | None = None, max_length: int | None = None,
                                   **variant_kwargs) -> dict[str, torch.Tensor]:
        """Tokenize source sentences (and `text_target` as labels, padding = -100) into the model's inputs:
        target-language tags `<2xx>` when `config.target_language_tags`, and variant inputs (`_language_inputs`).
        `tgt_lang` is one code or one per sentence. Used by the pipeline, the training and the evaluation code."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if isinstance(text_target, str):
            text_target = [text_target]
        if variant_kwargs:
            raise ValueError(f"{type(self).__name__} takes no extra inputs, got {sorted(variant_kwargs)}.")
        if tgt_lang is None:
            tgt_langs = None
        elif isinstance(tgt_lang, str):
            tgt_langs = [tgt_lang] * len(texts)
        else:
            tgt_langs = list(tgt_lang)
            if len(tgt_langs) != len(texts):
                raise ValueError(f"`tgt_lang` has {len(tgt_langs)} entries for {len(texts)} sentences.")
        if self.config.languages:
            for lang in ([src_lang] if src_lang else []) + (tgt_langs or []):
                self.config.language_id(lang)  # raises on unknown languages
        if self.config.target_language_tags:
            if tgt_langs is None:
                raise ValueError(f"This multilingual model needs `tgt_lang` (one of {self.config.languages}).")
            unk = tokenizer.unk_token_id
            for lang in set(tgt_langs):
                if tokenizer.convert_tokens_to_ids(language_tag(lang)) in (None, unk):
                    raise ValueError(f"The tokenizer has no language tag {language_tag(lang)!r}.")
            texts = [f"{language_tag(lang)} {text}" for lang, text in zip(tgt_langs, texts)]
        encoded = tokenizer(texts, text_target=text_target, padding=True, truncation=max_length is not None,
                            max_length=max_length, return_tensors="pt")
        inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if text_target is not None:
            labels = encoded["labels"]
            inputs["labels"] = labels.masked_fill(labels == tokenizer.pad_token_id, -100)
        inputs.update(self._language_inputs(tgt_langs, len(texts)))
        return {key: value.to(self.device) for key, value in inputs.items()}

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values: Cache | None = None, inputs_embeds=None,
                decoder_inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs) -> TransformerNmtSeq2SeqLMOutput:
        return_dict = return_dict if return_dict is not None else True
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = aux_losses = None
        if labels is not None:
            pad = self.config.pad_token_id
            if pad is not None and pad not in (self.config.eos_token_id, self.config.bos_token_id):
                labels = labels.masked_fill(labels == pad, -100)
            loss = self.translation_loss(logits, labels, **kwargs)
            aux_losses = self.auxiliary_losses(outputs, (labels != -100).sum().clamp(min=1))
            for value in aux_losses.values():
                loss = loss + value
        output = TransformerNmtSeq2SeqLMOutput(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values,
            decoder_hidden_states=outputs.decoder_hidden_states, decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions, encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states, encoder_attentions=outputs.encoder_attentions,
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
]
