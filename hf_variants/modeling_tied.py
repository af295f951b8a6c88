"""Tied Transformer (Xia, He, Tan, Tian, He, Qin, "Tied Transformers: Neural Machine Translation with Shared Encoder
and Decoder", AAAI 2019) on the hf_variants backbone.

What the paper changes, and where it is here:
- ONE stack of L blocks serves both sides (eq. 2-3). The model owns one `layers` list of `TiedTransformerBlock`s
  (self-attention + FFN + cross-attention, each with its LayerNorm) and one final LayerNorm. The encoder and the
  decoder run those very modules, held as plain attributes, not submodules: every tensor and every module has one
  name (`model.layers.*`), so saving, loading, adapters (PEFT wraps each block once) and hooks see one stack. A stack
  saved on its own (`model.get_encoder().save_pretrained`) writes the blocks it runs as its own `layers.*`, and one
  loaded on its own builds and owns its blocks. The encoder runs each block's self-attention (padding
  mask, not causal) and FFN and skips the cross-attention; the decoder runs the whole block (causal mask, cache,
  cross-attention). Whether a call is causal comes with the call (`is_causal`), not with the shared module.
- One embedding matrix for source tokens, target tokens and the softmax (the backbone's shared embedding and tied
  `lm_head`).
- A direction (target-space) embedding added to every encoder input position after the sqrt(d) scaling (the
  authors' tensor2tensor `target_space_embedding`), indexed by the target language: the named input `tgt_lang_ids`,
  filled from `tgt_lang` by `prepare_translation_inputs`, the pipeline and `generate(tgt_lang=)` (the backbone's
  language inputs, `language_ids_field = "num_directions"`).
- Two-direction training: a batch may carry both directions (per-sentence `tgt_lang`); the loss is the sum of the
  directions' token-mean losses (`config.direction_loss = "sum"`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin

from .configuration_tied import TiedTransformerConfig
from .generation_transformer_nmt import resolve_language_ids
from .modeling_transformer_nmt import (
    TransformerNmtDecoder,
    TransformerNmtDecoderLayer,
    TransformerNmtEncoder,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
)


# ------------------------------------------------------------------------------------------------------------- block
class TiedTransformerBlock(TransformerNmtDecoderLayer):
    """Block l of the tied stack: self_attn (+ LN), encoder_attn (+ LN), ffn (+ LN): the backbone's decoder layer.

    The encoder runs it on its encoder path (eq. 2: `is_causal=False`, no encoder states, no cache: non-causal
    self-attention with the padding mask, then the FFN), the decoder as a decoder layer (eq. 3)."""


# ------------------------------------------------------------------------------------------------------------ models
class TiedTransformerPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = TiedTransformerConfig
    _no_split_modules = ["TiedTransformerBlock"]
    # The direction table is an nn.Embedding: the backbone's `_init_weights` gives it N(0, d^-1/2) like the tokens.


# ------------------------------------------------------------------------------------------------------------ stacks
class TiedBlocks:
    """What both Tied stacks do with the blocks: own them when built alone; inside the model run the model's blocks
    (`run_blocks`), kept out of the stack's submodules, and write them into a state dict taken of the stack alone."""

    def run_blocks(self, layers: nn.ModuleList, layer_norm: nn.Module | None) -> None:
        for name, module in (("layers", layers), ("layer_norm", layer_norm)):
            self._modules.pop(name, None)  # the blocks this stack built for itself are dropped
            object.__setattr__(self, name, module)
        if not getattr(self, "_blocks_hook", None):
            self._blocks_hook = self._register_state_dict_hook(TiedBlocks._blocks_in_own_state_dict)

    def _run_blocks(self):
        """The blocks this stack runs without owning them (None when it owns its own)."""
        if "layers" in self._modules:
            return []
        return [module for module in (self.layers, self.layer_norm) if module is not None]

    def train(self, mode: bool = True):
        super().train(mode)  # a stack switched on its own (get_encoder().eval()) switches the blocks it runs
        for module in self._run_blocks():
            module.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # likewise .to(), .float(), ... of a stack on its own
        for module in self._run_blocks():
            module._apply(fn, recurse)
        return self

    @staticmethod
    def _blocks_in_own_state_dict(module, state_dict, prefix, local_metadata):
        if prefix:  # part of the model's state dict: the model holds the blocks
            return
        for name in ("layers", "layer_norm"):
            owned = getattr(module, name)
            if owned is not None:
                state_dict.update(owned.state_dict(prefix=f"{name}."))


class TiedTransformerEncoder(TiedBlocks, TiedTransformerPreTrainedModel, TransformerNmtEncoder):
    """The encoder path over the blocks, with the direction embedding on its input."""

    layer_class = TiedTransformerBlock

    def __init__(self, config: TiedTransformerConfig):
        super().__init__(config)
        self.target_space_embedding = (
            nn.Embedding(config.num_directions, config.d_model) if config.direction_embedding else None
        )
        self.post_init()

    def input_embeddings(self, input_ids=None, inputs_embeds=None, tgt_lang_ids=None, **kwargs) -> torch.Tensor:
        """Token embeddings x sqrt(d) + the direction embedding of each sentence's target language."""
        embeddings = super().input_embeddings(input_ids, inputs_embeds)
        if self.target_space_embedding is None:
            return embeddings
        ids = resolve_language_ids(
            self.config, tgt_lang_ids, embeddings.shape[0], self.config.num_directions, embeddings.device
        )
        return embeddings + self.target_space_embedding(ids)[:, None, :].to(embeddings.dtype)

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
    ):
        """`tgt_lang_ids` ([B], index into `config.languages` of each sentence's target language) is a named
        input here so that `generate` passes it to the encoder and expands it over beams."""
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=return_dict,
            tgt_lang_ids=tgt_lang_ids,
            is_causal=False,
            **kwargs,
        )


class TiedTransformerDecoder(TiedBlocks, TiedTransformerPreTrainedModel, TransformerNmtDecoder):
    """The decoder path over the blocks (causal self-attention with cache, cross-attention)."""

    layer_class = TiedTransformerBlock


class TiedTransformerModel(TiedTransformerPreTrainedModel, TransformerNmtModel):
    """Shared embedding, ONE list of blocks and ONE final LayerNorm, run by an encoder and a decoder path."""

    encoder_class = TiedTransformerEncoder
    decoder_class = TiedTransformerDecoder
    language_ids_field = "num_directions"

    def _make_stacks(self, config):
        encoder, decoder = self.encoder_class(config), self.decoder_class(config)
        if config.tie_word_embeddings:  # nothing is shared without it (transformers' convention): the untied baseline
            self.layers = encoder.layers  # the blocks the encoder built, registered here, run by both stacks
            self.layer_norm = encoder.layer_norm
            for stack in (encoder, decoder):
                stack.run_blocks(self.layers, self.layer_norm)
        return encoder, decoder


class TiedTransformerForConditionalGeneration(
    TiedTransformerPreTrainedModel, TransformerNmtForConditionalGeneration, GenerationMixin
):
    base_model_class = TiedTransformerModel

    def token_loss_weights(self, labels, tgt_lang_ids=None, **kwargs) -> torch.Tensor | None:
        """`direction_loss="sum"`: the sum over the batch's directions of each direction's token-mean loss
        (the two-direction training of the paper); one direction gives the baseline's token mean."""
        if self.config.direction_loss == "mean" or tgt_lang_ids is None:
            return None
        tokens = (labels != -100).sum(-1)
        tgt_lang_ids = tgt_lang_ids.to(labels.device).reshape(-1)
        tokens_per_direction = tokens.new_zeros(self.config.num_directions).index_add_(0, tgt_lang_ids, tokens)
        # Each token weighs 1 / (target tokens of its direction): sum of weights = number of directions present.
        row_weights = 1.0 / tokens_per_direction[tgt_lang_ids].clamp(min=1).float()
        return row_weights[:, None].expand(labels.shape)


__all__ = [
    "TiedTransformerPreTrainedModel",
    "TiedTransformerModel",
    "TiedTransformerForConditionalGeneration",
    "TiedTransformerBlock",
    "TiedTransformerEncoder",
    "TiedTransformerDecoder",
]
