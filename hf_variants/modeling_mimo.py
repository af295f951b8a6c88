"""MIMO: the multilingual Transformer with task-aware multi-input-multi-output cardinality (Xu, Liu, van Genabith,
Xiong, ACL 2021), on the hf_variants backbone.

What the paper adds to the Transformer, and where it lives here:

- Cardinality: every attention and FFN block holds n full-size "Trans" units (post-norm: LN_k(i_k +
  Dropout(f_k(i_k))), each with its own LayerNorm; `normalize_before=True` makes them pre-norm, with the final
  LayerNorm on each encoder stream and on the decoder output, for a pre-norm base such as a converted NLLB-200).
  Each unit's linear maps are `nn.Linear` modules (PEFT, quantization and pruning reach them) held by the
  backbone's `StackedLinear`, which runs the n units of a block as ONE batched matmul; the attention blocks are
  the backbone's attention with n units (`num_units`), the n units' heads side by side on the head axis of one
  kernel call.
- MIMO links (eq. 2-4, `MimoMix`): between blocks the input of unit k is a softmax-weighted sum of the previous
  block's n outputs, with logits V[task, k, :] per link, gathered per example from `tgt_lang_ids` (task = target
  language). One-to-many at the first encoder and decoder self-attention (no weights: `enter_stack` gives every
  unit the embedded input), many-to-one after the last decoder FFN (`exit_stack`, `MimoDecoder.output_mix`).
  Decoder cross-attention unit k reads its own task-aware mixture of the encoder's n output streams
  (`MimoDecoderLayer.memory_mix`), or with `mimo_memory="merge"` one merged memory.
- Ablations (`config.mimo`, `config.task_attention`): one merged (task-aware) input per block, or plain sums.
- Lipschitz-constrained initialisation (`MimoPreTrainedModel._init_weights`).

Layout inside the stacks: hidden states carry the stream axis first, [n, B, T, d] (a single shared input is
[1, B, T, d] and broadcasts), so that stacked linears are zero-copy batched matmuls. Outputs are batch-first:
encoder streams [B, n, S, d] (`MimoEncoderOutput.streams`, a top-level field so beam search expands it); the memory
the decoder reads is [B, S, n, d] (`MimoModel.encoder_memory`: sequence second, as transformers' mask helpers
expect). `attentions` and `hidden_states` report the mean over the streams, [B, H, Q, K] and [B, T, d] per layer.
KV cache: transformers' `EncoderDecoderCache`, one slot per decoder layer holding the n units' keys/values side by
side on the head axis, [B, n*H, T, D]; beam search reorders every stream with the batch axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_mimo import MimoConfig
from .generation_transformer_nmt import resolve_language_ids
from .modeling_transformer_nmt import (
    TransformerNmtAttention,
    TransformerNmtDecoder,
    TransformerNmtEncoder,
    TransformerNmtEncoderOutput,
    TransformerNmtFeedForward,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
    attach_summary,
    build_layer_norm,
    residual_block,
)


# ------------------------------------------------------------------------------------------------------- links
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


# -------------------------------------------------------------------------------------------------------- layers
class MimoEncoderLayer(GradientCheckpointingLayer):
    """Self-attention block, link, FFN block. Layer 0's self-attention is one-to-many (no link before it)."""

    def __init__(self, config: MimoConfig, layer_idx: int):
        super().__init__()
        n, outputs = config.num_transformations, config.num_transformations if config.mimo else 1
        self.config = config
        self.self_attn_mix = MimoMix(config, outputs) if layer_idx > 0 else None
        self.self_attn = TransformerNmtAttention(config, config.encoder_attention_heads, layer_idx, num_units=n)
        self.self_attn_layer_norm = build_layer_norm(config, n)
        self.ffn_mix = MimoMix(config, outputs)
        self.ffn = TransformerNmtFeedForward(config, config.encoder_ffn_dim, num_units=n)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        output_attentions: bool = False,
        task_ids: torch.Tensor | None = None,
        **kwargs,
    ):
        """[n|1, B, T, d] -> ([n, B, T, d], attention weights, None); `task_ids` [B] (the stack's `layer_inputs`)."""
        if self.self_attn_mix is not None:
            hidden_states = self.self_attn_mix(hidden_states, task_ids)
        hidden_states, weights, aux = residual_block(
            self,
            self.self_attn_layer_norm,
            hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, output_attentions=output_attentions, **kwargs),
            self.config.normalize_before,
            self.config.dropout,
        )
        return self.ffn(self.ffn_mix(hidden_states, task_ids)), weights, aux


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
        self.self_attn = TransformerNmtAttention(config, heads, layer_idx, is_decoder=True, num_units=n)
        self.self_attn_layer_norm = build_layer_norm(config, n)
        self.encoder_attn_mix = MimoMix(config, outputs)
        self.memory_mix = MimoMix(config, outputs) if config.mimo_memory == "mix" else None
        self.encoder_attn = TransformerNmtAttention(
            config, heads, layer_idx, is_cross_attention=True, is_decoder=True, num_units=n
        )
        self.encoder_attn_layer_norm = build_layer_norm(config, n)
        self.ffn_mix = MimoMix(config, outputs)
        self.ffn = TransformerNmtFeedForward(config, config.decoder_ffn_dim, num_units=n)

    def memory(self, encoder_hidden_states: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        """The memory of the n cross-attention units, [n|1, B, S, d]: each unit's task-aware mixture of the encoder
        streams [B, S, n, d], or one memory for every unit ([B, S, d] or [B, S, 1, d]). The attention calls this
        only when it computes its keys and values (not over a filled cache: once per generation)."""
        memory = encoder_hidden_states
        if memory.dim() == 3:  # [B, S, d]: one memory for every stream (the standard interface)
            memory = memory.unsqueeze(2)
        memory = memory.permute(2, 0, 1, 3)  # [n|1, B, S, d]
        if self.memory_mix is not None and memory.shape[0] > 1:  # a mixture of one stream is that stream
            memory = self.memory_mix(memory, task_ids)
        return memory

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask=None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
        task_ids: torch.Tensor | None = None,
        **kwargs,
    ):
        """[n|1, B, T, d] and the encoder memory [B, S, n|1, d] -> ([n, B, T, d], self weights, cross weights)."""
        p = self.config.dropout
        if self.self_attn_mix is not None:
            hidden_states = self.self_attn_mix(hidden_states, task_ids)
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
            self.config.normalize_before,
            p,
        )
        cross_weights = None
        if encoder_hidden_states is not None:  # a decoder run on its own (no encoder) is a language model
            hidden_states = self.encoder_attn_mix(hidden_states, task_ids)
            hidden_states, cross_weights, _ = residual_block(
                self,
                self.encoder_attn_layer_norm,
                hidden_states,
                lambda x: self.encoder_attn(
                    x,
                    attention_mask=encoder_attention_mask,
                    key_value_states=lambda: self.memory(encoder_hidden_states, task_ids),
                    cache=cache,
                    output_attentions=output_attentions,
                    **kwargs,
                ),
                self.config.normalize_before,
                p,
            )
        hidden_states = self.ffn(self.ffn_mix(hidden_states, task_ids))
        return hidden_states, self_weights, cross_weights


# -------------------------------------------------------------------------------------------------------- outputs
@dataclass
class MimoEncoderOutput(TransformerNmtEncoderOutput):
    """`streams`: the encoder's n output streams [B, n, S, d] (what cross-attention mixes; None with
    `mimo_memory="merge"`). `last_hidden_state`: their uniform mean ("mix") or the task-aware merge ("merge").
    `hidden_states` (if asked): the embeddings, then the mean over the streams after every layer but the last, then
    `last_hidden_state`, each [B, S, d]."""

    streams: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------- pretrained
class MimoPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = MimoConfig
    _no_split_modules = ["MimoEncoderLayer", "MimoDecoderLayer"]
    _legacy_keys_pattern = r"\.(qkv_proj|q_proj|kv_proj|out_proj|fc1|fc2)\.(weight|bias)$"  # 0.1: [n, in, out]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        # Lipschitz-constrained init (Neutron's init_model_params_lipschitz): matrices U(+-1/sqrt(fan_in)),
        # embeddings Xavier-uniform with gain sqrt(1/3), biases 0; LayerNorms (and without it everything) as the
        # backbone's
        if config.lipschitz_init and isinstance(module, nn.Linear):
            bound = 1.0 / math.sqrt(module.in_features)
            init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif config.lipschitz_init and isinstance(module, nn.Embedding):
            self._init_embedding(module, init.xavier_uniform_, gain=math.sqrt(1.0 / 3.0))
        else:
            super()._init_weights(module)
        if isinstance(module, MimoMix) and module.task_logits is not None:
            if config.mixing_init_std > 0:
                init.normal_(module.task_logits, mean=0.0, std=config.mixing_init_std)
            else:
                init.zeros_(module.task_logits)


# --------------------------------------------------------------------------------------------------------- stacks
class MimoStreams:
    """What MIMO's encoder and decoder do around the backbone's layer loop: resolve the task ids once, give every
    first-layer unit the embedded input (one-to-many), and report the mean over the streams per layer."""

    def layer_inputs(self, attention_mask, hidden_states, tgt_lang_ids=None, **kwargs) -> dict:
        config = self.config  # without task attention the links are plain sums: no task needed
        return {
            "task_ids": resolve_language_ids(
                config,
                tgt_lang_ids,
                hidden_states.shape[0],
                config.num_tasks,
                hidden_states.device,
                required=config.task_attention and config.num_tasks > 1,
            )
        }

    def enter_stack(self, hidden_states: torch.Tensor, **layer_inputs) -> torch.Tensor:
        return hidden_states.unsqueeze(0)  # one-to-many: layer 0's units share the embedded input

    def layer_output_view(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden_states.shape[0] == 1:  # the shared input: report it as it is (and feed the reported tensor on)
            view = hidden_states[0]
            return view.unsqueeze(0), view
        return attach_summary(hidden_states, 0)


class MimoEncoder(MimoStreams, MimoPreTrainedModel, TransformerNmtEncoder):
    layer_class = MimoEncoderLayer
    output_class = MimoEncoderOutput

    def __init__(self, config: MimoConfig):
        super().__init__(config)
        self.memory_merge = MimoMix(config, 1) if config.mimo_memory == "merge" else None
        self.post_init()

    def exit_stack(self, hidden_states: torch.Tensor, task_ids=None, **layer_inputs) -> tuple[torch.Tensor, dict]:
        if self.layer_norm is not None:  # pre-norm: the final LayerNorm on every stream the decoder reads
            hidden_states = self.layer_norm(hidden_states)
        if self.memory_merge is not None:  # mimo_memory="merge": one task-aware many-to-one at the top
            return self.memory_merge(hidden_states, task_ids)[0], {"streams": None}
        return hidden_states.mean(0), {"streams": hidden_states.transpose(0, 1)}

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states  # normalised per stream in `exit_stack` (pre-norm), or already (post-norm)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        tgt_lang_ids=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> MimoEncoderOutput:
        """`tgt_lang_ids` is named so that `generate` passes it to the encoder and expands it over beams."""
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=return_dict,
            tgt_lang_ids=tgt_lang_ids,
            **kwargs,
        )


class MimoDecoder(MimoStreams, MimoPreTrainedModel, TransformerNmtDecoder):
    """`encoder_hidden_states`: the memory [B, S, n|1, d] (`MimoModel.encoder_memory`: the n encoder streams, or
    with `mimo_memory="merge"` the merged one), or a [B, S, d] memory used by every stream (the standard interface;
    with "merge" that is the encoder's `last_hidden_state`, exactly the model's memory)."""

    layer_class = MimoDecoderLayer

    def __init__(self, config: MimoConfig):
        super().__init__(config)
        self.output_mix = MimoMix(config, 1)  # many-to-one after the last FFN block: the classifier's input
        self.post_init()

    def exit_stack(self, hidden_states: torch.Tensor, task_ids=None, **layer_inputs) -> tuple[torch.Tensor, dict]:
        # post-norm: no final LayerNorm; pre-norm: the backbone's, on the mixed output (`final_norm`)
        return self.output_mix(hidden_states, task_ids)[0], {}


# --------------------------------------------------------------------------------------------------------- models
class MimoModel(MimoPreTrainedModel, TransformerNmtModel):
    encoder_class = MimoEncoder
    decoder_class = MimoDecoder
    language_ids_field = "num_tasks"

    def encoder_memory(self, encoder_outputs) -> torch.Tensor:
        """The memory cross-attention mixes: the streams [B, S, n, d] ("mix") or the merge [B, S, 1, d] ("merge")."""
        if self.config.mimo_memory == "merge":
            return encoder_outputs.last_hidden_state.unsqueeze(2)
        streams = getattr(encoder_outputs, "streams", None)
        if streams is None:
            raise ValueError(
                "MIMO's decoder reads the encoder's n output streams: pass `encoder_outputs` as the "
                "`MimoEncoderOutput` returned by the encoder (with its `streams` field)."
            )
        return streams.transpose(1, 2)


class MimoForConditionalGeneration(MimoPreTrainedModel, TransformerNmtForConditionalGeneration, GenerationMixin):
    base_model_class = MimoModel


__all__ = [
    "MimoPreTrainedModel",
    "MimoModel",
    "MimoForConditionalGeneration",
    "MimoMix",
    "MimoEncoderLayer",
    "MimoDecoderLayer",
    "MimoEncoder",
    "MimoDecoder",
    "MimoEncoderOutput",
]
