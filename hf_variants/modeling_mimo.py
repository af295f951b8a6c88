"""MIMO: the multilingual Transformer with task-aware multi-input-multi-output cardinality (Xu, Liu, van Genabith,
Xiong, ACL 2021), on the hf_variants backbone.

What the paper adds to the Transformer, and where it lives here:

- Cardinality: every attention and FFN block holds n full-size "Trans" units (post-norm: LN_k(i_k +
  Dropout(f_k(i_k))), each with its own LayerNorm). The n units of a block run as ONE batched computation over
  stacked weights (`MimoLinear`, [n, in, out]; attention folds the n units' heads into the head axis of one kernel
  call), so n units cost one layer's worth of kernel launches.
- MIMO links (eq. 2-4, `MimoMix`): between blocks the input of unit k is a softmax-weighted sum of the previous
  block's n outputs, with logits V[task, k, :] per link, gathered per example from `tgt_lang_ids` (task = target
  language). One-to-many at the first encoder and decoder self-attention (no weights), many-to-one after the last
  decoder FFN (`MimoDecoder.output_mix`). Decoder cross-attention unit k reads its own task-aware mixture of the
  encoder's n output streams (`MimoDecoderLayer.memory_mix`), or with `mimo_memory="merge"` one merged memory.
- Ablations (`config.mimo`, `config.task_attention`): one merged (task-aware) input per block, or plain sums.
- Lipschitz-constrained initialisation (`MimoPreTrainedModel._init_weights`).

Layout inside the stacks: hidden states carry the stream axis first, [n, B, T, d] (a single shared input is
[1, B, T, d] and broadcasts), so that stacked linears are zero-copy batched matmuls. Outputs are batch-first:
encoder streams [B, n, S, d] (`MimoEncoderOutput.streams`, a top-level field so beam search expands it).
KV cache: transformers' `EncoderDecoderCache`, one slot per decoder layer holding the n units' keys/values side by
side on the head axis, [B, n*H, T, D]; beam search reorders every stream with the batch axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from transformers import GenerationMixin
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from .configuration_mimo import MimoConfig
from .modeling_transformer_nmt import (
    TransformerNmtAttention,
    TransformerNmtDecoder,
    TransformerNmtEncoder,
    TransformerNmtEncoderOutput,
    TransformerNmtFeedForward,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
    padding_mask,
    residual_block,
)


# ----------------------------------------------------------------------------------------------- stacked modules
class MimoLinear(nn.Module):
    """n independent linear maps, one per transformation, as one batched matmul.

    `weight` is [n, in, out] (transformation k computes x @ weight[k] + bias[k]; the [in, out] layout makes the
    weight gradient of the batched matmul land in the parameter's layout without a transposing copy), `bias`
    [n, out]. Input [n, ..., in] (stream k goes through map k) or [1, ..., in] (one input shared by all n maps).
    Output [n, ..., out]."""

    def __init__(self, num_transformations: int, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.num_transformations = num_transformations
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(num_transformations, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(num_transformations, out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.num_transformations
        shape = (n,) + x.shape[1:-1]
        flat = x.expand(*shape, x.shape[-1]).reshape(n, -1, x.shape[-1])
        if self.bias is None:
            y = torch.bmm(flat, self.weight)
        else:
            y = torch.baddbmm(self.bias.unsqueeze(1), flat, self.weight)
        return y.view(*shape, self.out_features)

    def extra_repr(self) -> str:
        return f"n={self.num_transformations}, in_features={self.in_features}, out_features={self.out_features}"


class MimoLayerNorm(nn.Module):
    """n LayerNorms over [n, ..., d] streams (stream k uses weight[k], bias[k])."""

    def __init__(self, num_transformations: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_transformations, dim))
        self.bias = nn.Parameter(torch.zeros(num_transformations, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.weight.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        return torch.addcmul(self.bias.view(shape), F.layer_norm(x, x.shape[-1:], eps=self.eps),
                             self.weight.view(shape))


class MimoMix(nn.Module):
    """A task-aware link between two blocks (eq. 2-4): output k = sum_m softmax(V[task, k, :])_m * stream m.

    `num_outputs` = n (MIMO link), or 1 (a task-aware merge: many-to-one, or every link of the "-MIMO" ablation).
    The logits V ([num_tasks, num_outputs, n]) are gathered per example. Without task attention
    (`config.task_attention=False`) the link has no parameters and returns the plain sum of the streams (eq. 1)."""

    def __init__(self, config: MimoConfig, num_outputs: int):
        super().__init__()
        self.num_inputs = config.num_transformations
        self.num_outputs = num_outputs
        self.task_logits = None
        if config.task_attention:
            self.task_logits = nn.Parameter(torch.zeros(config.num_tasks, num_outputs, self.num_inputs))

    def probabilities(self, task_ids: torch.Tensor) -> torch.Tensor | None:
        """[B] task ids -> [B, num_outputs, n] mixing weights (None for the plain sum)."""
        if self.task_logits is None:
            return None
        return torch.softmax(self.task_logits[task_ids].float(), dim=-1)

    def forward(self, streams: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        """[n, B, T, d] -> [num_outputs, B, T, d] ([1, B, T, d] for the plain sum)."""
        if self.task_logits is None:
            return streams.sum(0, keepdim=True)
        weights = self.probabilities(task_ids).to(streams.dtype)
        return torch.einsum("bkm,mbtd->kbtd", weights, streams)

    def extra_repr(self) -> str:
        kind = "task-aware" if self.task_logits is not None else "plain sum"
        return f"{self.num_inputs} -> {self.num_outputs}, {kind}"


def resolve_task_ids(config: MimoConfig, tgt_lang_ids, batch_size: int, device) -> torch.Tensor:
    """The task id of every example ([B] long). Without ids, only a single-task model (or one without task
    attention) can run: every example then gets task 0."""
    if tgt_lang_ids is None:
        if config.task_attention and config.num_tasks > 1:
            raise ValueError(
                f"MIMO mixes its transformations per target language: pass `tgt_lang_ids` (one id per sentence, "
                f"the index in config.languages={config.languages}), or `tgt_lang=` to `generate` / "
                f"`prepare_translation_inputs`.")
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    ids = torch.as_tensor(tgt_lang_ids, device=device).long().reshape(-1)
    if ids.shape[0] != batch_size:
        raise ValueError(f"`tgt_lang_ids` has {ids.shape[0]} entries for a batch of {batch_size}.")
    return ids


def batch_first(streams: torch.Tensor) -> torch.Tensor:
    """[n, B, T, d] streams -> [B, n, T, d] (a single shared stream -> [B, T, d])."""
    return streams[0] if streams.shape[0] == 1 else streams.transpose(0, 1)


# ----------------------------------------------------------------------------------------------- transformations
class MimoAttention(TransformerNmtAttention):
    """The n attention transformations of a block, as one kernel call with the n units' heads side by side.

    Unit k has its own Q/K/V/O projections (`MimoLinear` slices); its queries attend only to its own keys: stream
    k's heads are heads k*H .. (k+1)*H-1 of a [B, n*H, T, D] tensor. The backbone's cache handling (`_project_qkv`)
    and kernels (`_attend`: SDPA or eager, NaN guard) are reused unchanged; so is the cache layout [B, heads, T, D]."""

    def __init__(self, config: MimoConfig, num_heads: int, layer_idx: int | None = None,
                 is_cross_attention: bool = False, is_decoder: bool = False):
        nn.Module.__init__(self)  # the backbone's __init__ builds single-unit projections; these are stacked
        n, d = config.num_transformations, config.d_model
        self.config = config
        self.num_transformations = n
        self.embed_dim = d
        self.heads_per_transformation = num_heads
        self.num_heads = n * num_heads  # what the kernel sees
        self.head_dim = d // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_decoder = is_decoder
        self.is_causal = is_decoder and not is_cross_attention
        self.num_key_value_groups = 1
        self.relative_positions = None
        if is_cross_attention:
            self.q_proj = MimoLinear(n, d, d)
            self.kv_proj = MimoLinear(n, d, 2 * d)
        else:
            self.qkv_proj = MimoLinear(n, d, 3 * d)
        self.out_proj = MimoLinear(n, d, d)

    def _heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """[n, B, T, parts*d] -> `parts` tensors [B, n*H, T, D]."""
        n, b, t, _ = x.shape
        x = x.reshape(n, b, t, parts, self.heads_per_transformation, self.head_dim)
        return x.permute(3, 1, 0, 4, 2, 5).reshape(parts, b, self.num_heads, t, self.head_dim).unbind(0)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                key_value_states: torch.Tensor | None = None, past_key_values: Cache | None = None,
                output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n|1, B, Q, d] queries (and [n|1, B, S, d] memory) -> ([n, B, Q, d], [B, n*H, Q, K] weights or None)."""
        query, key, value = self._project_qkv(hidden_states, key_value_states, past_key_values)
        out, weights = self._attend(query, key, value, attention_mask, output_attentions=output_attentions, **kwargs)
        b, q = out.shape[:2]
        out = out.reshape(b, q, self.num_transformations, self.embed_dim).permute(2, 0, 1, 3)
        return self.out_proj(out), weights


class MimoFeedForward(TransformerNmtFeedForward):
    """The n FFN transformations of a block (post-norm, own LayerNorms); the backbone's forward runs unchanged on
    the stacked modules."""

    def __init__(self, config: MimoConfig, ffn_dim: int):
        nn.Module.__init__(self)
        n, d = config.num_transformations, config.d_model
        self.fc1 = MimoLinear(n, d, ffn_dim)
        self.fc2 = MimoLinear(n, ffn_dim, d)
        self.final_layer_norm = MimoLayerNorm(n, d, config.layer_norm_eps)
        self.activation_fn = ACT2FN[config.activation_function]
        self.dropout = config.dropout
        self.activation_dropout = config.activation_dropout
        self.normalize_before = False


# -------------------------------------------------------------------------------------------------------- layers
class MimoEncoderLayer(GradientCheckpointingLayer):
    """Self-attention block, link, FFN block. Layer 0's self-attention is one-to-many (no link before it)."""

    def __init__(self, config: MimoConfig, layer_idx: int):
        super().__init__()
        n, outputs = config.num_transformations, config.num_transformations if config.mimo else 1
        self.config = config
        self.self_attn_mix = MimoMix(config, outputs) if layer_idx > 0 else None
        self.self_attn = MimoAttention(config, config.encoder_attention_heads, layer_idx)
        self.self_attn_layer_norm = MimoLayerNorm(n, config.d_model, config.layer_norm_eps)
        self.ffn_mix = MimoMix(config, outputs)
        self.ffn = MimoFeedForward(config, config.encoder_ffn_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False, tgt_lang_ids: torch.Tensor | None = None, **kwargs):
        """[n|1, B, T, d] -> ([n, B, T, d], attention weights); `tgt_lang_ids` are resolved task ids [B]."""
        if self.self_attn_mix is not None:
            hidden_states = self.self_attn_mix(hidden_states, tgt_lang_ids)
        hidden_states, weights = residual_block(
            self, self.self_attn_layer_norm, hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, output_attentions=output_attentions),
            False, self.config.dropout)
        return self.ffn(self.ffn_mix(hidden_states, tgt_lang_ids)), weights


class MimoDecoderLayer(GradientCheckpointingLayer):
    """Self-attention block, link, cross-attention block (memory: a task-aware mixture of the encoder streams per
    unit), link, FFN block. Layer 0's self-attention is one-to-many."""

    def __init__(self, config: MimoConfig, layer_idx: int):
        super().__init__()
        n, outputs = config.num_transformations, config.num_transformations if config.mimo else 1
        heads = config.decoder_attention_heads
        self.config = config
        self.layer_idx = layer_idx
        self.self_attn_mix = MimoMix(config, outputs) if layer_idx > 0 else None
        self.self_attn = MimoAttention(config, heads, layer_idx, is_decoder=True)
        self.self_attn_layer_norm = MimoLayerNorm(n, config.d_model, config.layer_norm_eps)
        self.encoder_attn_mix = MimoMix(config, outputs)
        self.memory_mix = MimoMix(config, outputs) if config.mimo_memory == "mix" else None
        self.encoder_attn = MimoAttention(config, heads, layer_idx, is_cross_attention=True, is_decoder=True)
        self.encoder_attn_layer_norm = MimoLayerNorm(n, config.d_model, config.layer_norm_eps)
        self.ffn_mix = MimoMix(config, outputs)
        self.ffn = MimoFeedForward(config, config.decoder_ffn_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, past_key_values: Cache | None = None,
                output_attentions: bool = False, use_cache: bool = False,
                tgt_lang_ids: torch.Tensor | None = None, **kwargs):
        """[n|1, B, T, d] and encoder streams [n|1, B, S, d] -> ([n, B, T, d], self weights, cross weights)."""
        p = self.config.dropout
        if self.self_attn_mix is not None:
            hidden_states = self.self_attn_mix(hidden_states, tgt_lang_ids)
        hidden_states, self_weights = residual_block(
            self, self.self_attn_layer_norm, hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, past_key_values=past_key_values,
                                     output_attentions=output_attentions), False, p)
        hidden_states = self.encoder_attn_mix(hidden_states, tgt_lang_ids)
        memory = None  # cross-attention keys/values are computed once per generation: mix only when needed
        if past_key_values is None or not getattr(past_key_values, "is_updated", {}).get(self.layer_idx):
            memory = encoder_hidden_states
            if self.memory_mix is not None:
                memory = self.memory_mix(encoder_hidden_states, tgt_lang_ids)
        hidden_states, cross_weights = residual_block(
            self, self.encoder_attn_layer_norm, hidden_states,
            lambda x: self.encoder_attn(x, attention_mask=encoder_attention_mask, key_value_states=memory,
                                        past_key_values=past_key_values, output_attentions=output_attentions),
            False, p)
        hidden_states = self.ffn(self.ffn_mix(hidden_states, tgt_lang_ids))
        return hidden_states, self_weights, cross_weights


# -------------------------------------------------------------------------------------------------------- outputs
@dataclass
class MimoEncoderOutput(TransformerNmtEncoderOutput):
    """`streams`: the encoder's n output streams [B, n, S, d] (what cross-attention mixes; None with
    `mimo_memory="merge"`). `last_hidden_state`: their uniform mean ("mix") or the task-aware merge ("merge").
    `hidden_states` (if asked): the embeddings [B, S, d], the streams [B, n, S, d] after every layer but the last,
    then `last_hidden_state`."""

    streams: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------- pretrained
class MimoPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = MimoConfig
    _no_split_modules = ["MimoEncoderLayer", "MimoDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        if not config.lipschitz_init:
            super()._init_weights(module)
            if isinstance(module, MimoLinear):
                if config.init_method == "xavier":
                    bound = math.sqrt(6.0 / (module.in_features + module.out_features))
                    init.uniform_(module.weight, -bound, bound)
                else:
                    init.normal_(module.weight, mean=0.0, std=config.init_std)
                if module.bias is not None:
                    init.zeros_(module.bias)
        # Lipschitz-constrained init (Neutron's init_model_params_lipschitz): matrices U(+-1/sqrt(fan_in)),
        # embeddings Xavier-uniform with gain sqrt(1/3), biases 0, LayerNorms 1/0.
        elif isinstance(module, (nn.Linear, MimoLinear)):
            bound = 1.0 / math.sqrt(module.in_features)
            init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.xavier_uniform_(module.weight, gain=math.sqrt(1.0 / 3.0))
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        if isinstance(module, MimoLayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, MimoMix) and module.task_logits is not None:
            if config.mixing_init_std > 0:
                init.normal_(module.task_logits, mean=0.0, std=config.mixing_init_std)
            else:
                init.zeros_(module.task_logits)


# --------------------------------------------------------------------------------------------------------- stacks
class MimoEncoder(TransformerNmtEncoder):
    layer_class = MimoEncoderLayer

    def __init__(self, config: MimoConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens)
        self.memory_merge = MimoMix(config, 1) if config.mimo_memory == "merge" else None

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, tgt_lang_ids=None,
                output_attentions=False, output_hidden_states=False, return_dict=True,
                **kwargs) -> MimoEncoderOutput:
        hidden_states = self.embed(input_ids, inputs_embeds, **kwargs)
        task_ids = resolve_task_ids(self.config, tgt_lang_ids, hidden_states.shape[0], hidden_states.device)
        if tgt_lang_ids is not None and ((task_ids < 0) | (task_ids >= self.config.num_tasks)).any():
            raise ValueError(f"`tgt_lang_ids` must be in [0, {self.config.num_tasks}) (config.languages="
                             f"{self.config.languages}), got {task_ids.tolist()}.")
        mask = padding_mask(attention_mask)
        streams = hidden_states.unsqueeze(0)  # one-to-many: layer 0's units share the embedded input
        all_hidden, all_attn = [], []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(batch_first(streams))
            streams, weights = layer(streams, attention_mask=mask, output_attentions=output_attentions,
                                     tgt_lang_ids=task_ids, **kwargs)
            if output_attentions:
                all_attn.append(weights)
        if self.memory_merge is not None:  # mimo_memory="merge": one task-aware many-to-one at the top
            last_hidden_state, streams = self.memory_merge(streams, task_ids)[0], None
        else:
            last_hidden_state, streams = streams.mean(0), streams.transpose(0, 1)
        if output_hidden_states:
            all_hidden.append(last_hidden_state)
        return MimoEncoderOutput(
            last_hidden_state=last_hidden_state,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
            streams=streams,
        )


class MimoDecoder(TransformerNmtDecoder):
    layer_class = MimoDecoderLayer

    def __init__(self, config: MimoConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens)
        self.output_mix = MimoMix(config, 1)  # many-to-one after the last FFN block: the classifier's input

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, inputs_embeds=None, past_key_values: Cache | None = None,
                use_cache=None, output_attentions=False, output_hidden_states=False, return_dict=True,
                tgt_lang_ids=None, **kwargs):
        """`encoder_hidden_states`: the memory streams [B, n|1, S, d] (`MimoModel.encoder_memory`)."""
        past_key_values, hidden_states, self_mask, attention_kwargs = self.start_decoding(
            input_ids, inputs_embeds, attention_mask, past_key_values, use_cache, **kwargs)
        kwargs.update(attention_kwargs)
        task_ids = resolve_task_ids(self.config, tgt_lang_ids, hidden_states.shape[0], hidden_states.device)
        cross_mask = padding_mask(encoder_attention_mask)
        memory = encoder_hidden_states.transpose(0, 1) if encoder_hidden_states is not None else None
        streams = hidden_states.unsqueeze(0)  # one-to-many
        all_hidden, all_self, all_cross = [], [], []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(batch_first(streams))
            streams, self_weights, cross_weights = layer(
                streams, attention_mask=self_mask, encoder_hidden_states=memory, encoder_attention_mask=cross_mask,
                past_key_values=past_key_values, output_attentions=output_attentions, use_cache=use_cache,
                tgt_lang_ids=task_ids, **kwargs)
            if output_attentions:
                all_self.append(self_weights)
                all_cross.append(cross_weights)
        hidden_states = self.output_mix(streams, task_ids)[0]  # many-to-one; post-norm: no final LayerNorm
        if output_hidden_states:
            all_hidden.append(hidden_states)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions else None,
        )


# --------------------------------------------------------------------------------------------------------- models
class MimoModel(MimoPreTrainedModel, TransformerNmtModel):
    encoder_class = MimoEncoder
    decoder_class = MimoDecoder

    def encoder_memory(self, encoder_outputs) -> torch.Tensor:
        """The memory streams cross-attention mixes: [B, n, S, d] ("mix") or [B, 1, S, d] ("merge")."""
        if self.config.mimo_memory == "merge":
            return encoder_outputs.last_hidden_state.unsqueeze(1)
        streams = getattr(encoder_outputs, "streams", None)
        if streams is None:
            raise ValueError("MIMO's decoder reads the encoder's n output streams: pass `encoder_outputs` as the "
                             "`MimoEncoderOutput` returned by the encoder (with its `streams` field).")
        return streams


class MimoForConditionalGeneration(MimoPreTrainedModel, TransformerNmtForConditionalGeneration, GenerationMixin):
    base_model_class = MimoModel

    def _language_inputs(self, tgt_langs: list[str] | None, batch_size: int) -> dict[str, torch.Tensor]:
        """`tgt_lang_ids`: the task id (index in `config.languages`) of every sentence's target language."""
        if tgt_langs is None:
            return {}
        return {"tgt_lang_ids": torch.tensor([self.config.language_id(lang) for lang in tgt_langs],
                                             dtype=torch.long)}

    def generate(self, *args, tgt_lang: str | list[str] | None = None, **kwargs):
        """`generate(..., tgt_lang="de")` (or one code per sentence) sets `tgt_lang_ids`, the task of the mixing
        weights. The source must carry the `<2xx>` tag already (`prepare_translation_inputs` adds it)."""
        if tgt_lang is not None:
            if kwargs.get("tgt_lang_ids") is not None:
                raise ValueError("Pass either `tgt_lang` or `tgt_lang_ids`, not both.")
            inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
            if inputs is None:
                raise ValueError("`tgt_lang` needs the source `input_ids` to know the batch size.")
            langs = [tgt_lang] * inputs.shape[0] if isinstance(tgt_lang, str) else list(tgt_lang)
            if len(langs) != inputs.shape[0]:
                raise ValueError(f"`tgt_lang` has {len(langs)} entries for {inputs.shape[0]} sentences.")
            kwargs["tgt_lang_ids"] = self._language_inputs(langs, len(langs))["tgt_lang_ids"].to(inputs.device)
        return super().generate(*args, **kwargs)


__all__ = [
    "MimoPreTrainedModel",
    "MimoModel",
    "MimoForConditionalGeneration",
    "MimoAttention",
    "MimoLinear",
    "MimoLayerNorm",
    "MimoMix",
    "MimoEncoderLayer",
    "MimoDecoderLayer",
    "MimoEncoder",
    "MimoDecoder",
    "MimoEncoderOutput",
]
