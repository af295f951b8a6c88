"""Tied Transformer (Xia, He, Tan, Tian, He, Qin, "Tied Transformers: Neural Machine Translation with Shared Encoder
and Decoder", AAAI 2019) on the hf_variants backbone.

What the paper changes, and where it is here:
- ONE stack of L blocks serves both sides (eq. 2-3). The model owns one `layers` list of `TiedTransformerBlock`s
  (self-attention + FFN + cross-attention, each with its LayerNorm) and one final LayerNorm; the encoder's and the
  decoder's blocks are tied to those parameters (`_tied_weights_keys`, as the backbone ties shared embeddings), so
  both sides train the same tensors and a checkpoint stores each once (`model.layers.*`). The encoder runs each block's self-attention (padding
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
from torch.nn import functional as F

from transformers import GenerationMixin
from transformers.cache_utils import Cache

from .configuration_tied import TiedTransformerConfig
from .modeling_transformer_nmt import (
    TransformerNmtDecoder,
    TransformerNmtDecoderLayer,
    TransformerNmtEncoder,
    TransformerNmtForConditionalGeneration,
    TransformerNmtModel,
    TransformerNmtPreTrainedModel,
    residual_block,
    resolve_language_ids,
)


# ------------------------------------------------------------------------------------------------------------- block
class TiedTransformerBlock(TransformerNmtDecoderLayer):
    """Block l of the tied stack: self_attn (+ LN), encoder_attn (+ LN), ffn (+ LN).

    `forward(..., encoder_path=True)` is the encoder's use (eq. 2): non-causal self-attention with the padding mask,
    then the FFN; no cross-attention, no cache. Otherwise it is the backbone's decoder layer (eq. 3)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask=None,
                past_key_values: Cache | None = None, output_attentions: bool = False, use_cache: bool = False,
                encoder_path: bool = False, **kwargs):
        if not encoder_path:
            return super().forward(hidden_states, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask=encoder_attention_mask, past_key_values=past_key_values,
                                   output_attentions=output_attentions, use_cache=use_cache, **kwargs)
        hidden_states, weights = residual_block(
            self, self.self_attn_layer_norm, hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, output_attentions=output_attentions,
                                     is_causal=False, **kwargs),
            self.config.normalize_before, self.config.dropout)
        return self.ffn(hidden_states), weights


# ------------------------------------------------------------------------------------------------------------ models
class TiedTransformerPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = TiedTransformerConfig
    _no_split_modules = ["TiedTransformerBlock"]
    # The direction table is an nn.Embedding: the backbone's `_init_weights` gives it N(0, d^-1/2) like the tokens.


# ------------------------------------------------------------------------------------------------------------ stacks
class TiedTransformerEncoder(TiedTransformerPreTrainedModel, TransformerNmtEncoder):
    """The encoder path over the blocks, with the direction embedding on its input. Inside the model its blocks are
    tied to the model's; saved alone it holds them itself."""

    layer_class = TiedTransformerBlock

    def __init__(self, config: TiedTransformerConfig):
        super().__init__(config)
        self.target_space_embedding = (nn.Embedding(config.num_directions, config.d_model)
                                       if config.direction_embedding else None)
        self.post_init()

    def input_embeddings(self, input_ids=None, inputs_embeds=None, tgt_lang_ids=None, **kwargs) -> torch.Tensor:
        """Token embeddings x sqrt(d) + the direction embedding of each sentence's target language."""
        embeddings = super().input_embeddings(input_ids, inputs_embeds)
        if self.target_space_embedding is None:
            return embeddings
        ids = resolve_language_ids(self.config, tgt_lang_ids, embeddings.shape[0], self.config.num_directions,
                                   embeddings.device)
        return embeddings + self.target_space_embedding(ids)[:, None, :].to(embeddings.dtype)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, tgt_lang_ids=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """`tgt_lang_ids` ([B], index into `config.languages` of each sentence's target language) is a named
        input here so that `generate` passes it to the encoder and expands it over beams."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                               output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                               return_dict=return_dict, tgt_lang_ids=tgt_lang_ids, encoder_path=True, **kwargs)


class TiedTransformerDecoder(TiedTransformerPreTrainedModel, TransformerNmtDecoder):
    """The decoder path over the blocks (causal self-attention with cache, cross-attention)."""

    layer_class = TiedTransformerBlock


class TiedTransformerModel(TiedTransformerPreTrainedModel, TransformerNmtModel):
    """Shared embedding, ONE list of blocks and ONE final LayerNorm, run by an encoder and a decoder path."""

    encoder_class = TiedTransformerEncoder
    decoder_class = TiedTransformerDecoder
    language_ids_field = "num_directions"

    def _make_stacks(self, config):
        if not config.tie_word_embeddings:  # nothing tied (transformers' convention): the untied baseline
            return self.encoder_class(config), self.decoder_class(config)
        self.layers = nn.ModuleList([TiedTransformerBlock(config, i) for i in range(config.num_blocks)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None
        for side in ("encoder", "decoder"):
            self._tied_weights_keys[rf"{side}\.layers\."] = r"layers\."
            if self.layer_norm is not None:
                self._tied_weights_keys[rf"{side}\.layer_norm\."] = r"layer_norm\."
        return self.encoder_class(config), self.decoder_class(config)


class TiedTransformerForConditionalGeneration(TiedTransformerPreTrainedModel, TransformerNmtForConditionalGeneration,
                                              GenerationMixin):
    base_model_class = TiedTransformerModel

    def translation_loss(self, logits, labels, tgt_lang_ids=None, **kwargs) -> torch.Tensor:
        """`direction_loss="sum"`: the sum over the batch's directions of each direction's token-mean loss
        (the two-direction training of the paper); one direction gives the baseline's token mean."""
        if self.config.direction_loss == "mean" or tgt_lang_ids is None:
            return super().translation_loss(logits, labels, **kwargs)
        token_losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                       ignore_index=-100, label_smoothing=self.config.label_smoothing,
                                       reduction="none").view(labels.shape)
        tokens = (labels != -100).sum(-1)
        tgt_lang_ids = tgt_lang_ids.to(labels.device).reshape(-1)
        tokens_per_direction = tokens.new_zeros(self.config.num_directions).index_add_(0, tgt_lang_ids, tokens)
        # Each token weighs 1 / (target tokens of its direction): sum of weights = number of directions present.
        row_weights = 1.0 / tokens_per_direction[tgt_lang_ids].clamp(min=1).float()
        return (token_losses.sum(-1) * row_weights).sum()


__all__ = [
    "TiedTransformerPreTrainedModel",
    "TiedTransformerModel",
    "TiedTransformerForConditionalGeneration",
    "TiedTransformerBlock",
    "TiedTransformerEncoder",
    "TiedTransformerDecoder",
]
