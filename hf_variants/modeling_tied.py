"""Tied Transformer (Xia, He, Tan, Tian, He, Qin, "Tied Transformers: Neural Machine Translation with Shared Encoder
and Decoder", AAAI 2019) on the hf_variants backbone.

What the paper changes, and where it is here:
- ONE stack of L blocks serves both sides (eq. 2-3). The model owns one `layers` list of `TiedTransformerBlock`s
  (self-attention + FFN + cross-attention, each with its LayerNorm) and one final LayerNorm. The encoder runs each
  block's self-attention (padding mask only) and FFN and skips the cross-attention; the decoder runs the whole
  block (causal mask, cache, cross-attention). The stacks reach the blocks through plain attributes, not as
  submodules, so every tensor has one name in the state dict (`model.layers.*`) and saving/loading cannot untie
  them.
- One embedding matrix for source tokens, target tokens and the softmax (the backbone's shared embedding and tied
  `lm_head`).
- A direction (target-space) embedding added to every encoder input position after the sqrt(d) scaling (the
  authors' tensor2tensor `target_space_embedding`), indexed by the target language: the named encoder input
  `tgt_lang_ids`, filled from `tgt_lang` by `prepare_translation_inputs`, the pipeline and `generate(tgt_lang=)`.
- Two-direction training: a batch may carry both directions (per-sentence `tgt_lang`); the loss is the sum of the
  directions' token-mean losses (`config.direction_loss = "sum"`).
Causality belongs to each call, not to the shared module: the self-attention modules are non-causal, and the
decoder passes an explicit causal mask.
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
    TransformerNmtStack,
    causal_mask,
    residual_block,
)


# ------------------------------------------------------------------------------------------------------------- block
class TiedTransformerBlock(TransformerNmtDecoderLayer):
    """Block l of the tied stack: self_attn (+ LN), encoder_attn (+ LN), ffn (+ LN).

    `forward(..., encoder_path=True)` is the encoder's use (eq. 2): self-attention with the padding mask, then the
    FFN; no cross-attention, no cache. Otherwise it is the backbone's decoder layer (eq. 3)."""

    def __init__(self, config: TiedTransformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # Shared by both sides: whether a call is causal comes with its mask (the decoder passes a causal one).
        self.self_attn.is_causal = False

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, past_key_values: Cache | None = None,
                output_attentions: bool = False, use_cache: bool = False, encoder_path: bool = False, **kwargs):
        if not encoder_path:
            return super().forward(hidden_states, attention_mask=attention_mask,
                                   encoder_hidden_states=encoder_hidden_states,
                                   encoder_attention_mask=encoder_attention_mask, past_key_values=past_key_values,
                                   output_attentions=output_attentions, use_cache=use_cache, **kwargs)
        hidden_states, weights = residual_block(
            self, self.self_attn_layer_norm, hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, output_attentions=output_attentions,
                                     **kwargs),
            self.config.normalize_before, self.config.dropout)
        return self.ffn(hidden_states), weights


# ------------------------------------------------------------------------------------------------------------ stacks
def _run_shared_blocks(stack: TransformerNmtStack, layers: nn.ModuleList, layer_norm: nn.LayerNorm | None) -> None:
    """Point `stack.layers` / `stack.layer_norm` at the model's modules as plain attributes (outside `_modules`):
    the stack runs them but does not own them, so they are registered, saved and loaded once, under the model."""
    for name, module in (("layers", layers), ("layer_norm", layer_norm)):
        stack._modules.pop(name, None)  # the (empty) list and unused norm the base stack built
        object.__setattr__(stack, name, module)


class TiedTransformerEncoder(TransformerNmtEncoder):
    """The encoder path over the shared blocks, with the direction embedding on its input."""

    def __init__(self, config: TiedTransformerConfig, embed_tokens: nn.Embedding, layers: nn.ModuleList,
                 layer_norm: nn.LayerNorm | None):
        TransformerNmtStack.__init__(self, config, embed_tokens, num_layers=0)
        _run_shared_blocks(self, layers, layer_norm)
        self.target_space_embedding = (nn.Embedding(config.num_directions, config.d_model)
                                       if config.direction_embedding else None)

    def direction_embeddings(self, tgt_lang_ids: torch.Tensor | None, batch_size: int,
                             device: torch.device) -> torch.Tensor:
        """[B, 1, d]: the target-space vector of each sentence (row 0 for all when the table has one row)."""
        if tgt_lang_ids is None:
            if self.config.num_directions > 1:
                raise ValueError(
                    f"This Tied Transformer serves {self.config.num_directions} directions: pass `tgt_lang_ids` "
                    f"(or `tgt_lang=` to prepare_translation_inputs / generate / the pipeline; languages: "
                    f"{self.config.languages}).")
            tgt_lang_ids = torch.zeros(batch_size, dtype=torch.long, device=device)
        tgt_lang_ids = torch.as_tensor(tgt_lang_ids, device=device).reshape(-1)
        if tgt_lang_ids.shape[0] != batch_size:
            raise ValueError(f"`tgt_lang_ids` has {tgt_lang_ids.shape[0]} entries for a batch of {batch_size}.")
        return self.target_space_embedding(tgt_lang_ids)[:, None, :]

    def embed(self, input_ids=None, inputs_embeds=None, past_length: int = 0, tgt_lang_ids=None,
              **kwargs) -> torch.Tensor:
        """Token embeddings x sqrt(d) + direction embedding + positions, then dropout."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        if self.target_space_embedding is not None:
            inputs_embeds = inputs_embeds + self.direction_embeddings(
                tgt_lang_ids, inputs_embeds.shape[0], inputs_embeds.device).to(inputs_embeds.dtype)
        return super().embed(None, inputs_embeds, past_length, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, tgt_lang_ids=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, **kwargs):
        """`tgt_lang_ids` ([B], index into `config.languages` of each sentence's target language) is a named
        input here so that `generate` accepts it and expands it over beams."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                               output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                               return_dict=return_dict, tgt_lang_ids=tgt_lang_ids, encoder_path=True, **kwargs)


class TiedTransformerDecoder(TransformerNmtDecoder):
    """The decoder path over the shared blocks (causal self-attention with cache, cross-attention)."""

    def __init__(self, config: TiedTransformerConfig, embed_tokens: nn.Embedding, layers: nn.ModuleList,
                 layer_norm: nn.LayerNorm | None):
        TransformerNmtStack.__init__(self, config, embed_tokens, num_layers=0)
        _run_shared_blocks(self, layers, layer_norm)

    def self_attention_mask(self, attention_mask, query_length: int, key_length: int, device, query_offset=None):
        """Always an explicit causal mask (the shared self-attention module is not causal by itself)."""
        mask = super().self_attention_mask(attention_mask, query_length, key_length, device, query_offset)
        if mask is None and query_length > 1:
            mask = causal_mask(query_length, key_length, device, query_offset)[None, None]
        return mask


# ------------------------------------------------------------------------------------------------------------ models
class TiedTransformerPreTrainedModel(TransformerNmtPreTrainedModel):
    config_class = TiedTransformerConfig
    _no_split_modules = ["TiedTransformerBlock"]
    # The direction table is an nn.Embedding: the backbone's `_init_weights` gives it N(0, d^-1/2) like the tokens.


class TiedTransformerModel(TiedTransformerPreTrainedModel, TransformerNmtModel):
    """Shared embedding, ONE list of blocks and ONE final LayerNorm, run by an encoder and a decoder path."""

    encoder_class = TiedTransformerEncoder
    decoder_class = TiedTransformerDecoder

    def _make_stacks(self, config, encoder_embeddings, decoder_embeddings):
        self.layers = nn.ModuleList([TiedTransformerBlock(config, i) for i in range(config.num_blocks)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None
        return (self.encoder_class(config, encoder_embeddings, self.layers, self.layer_norm),
                self.decoder_class(config, decoder_embeddings, self.layers, self.layer_norm))


class TiedTransformerForConditionalGeneration(TiedTransformerPreTrainedModel, TransformerNmtForConditionalGeneration,
                                              GenerationMixin):
    base_model_class = TiedTransformerModel

    def _language_inputs(self, tgt_langs: list[str] | None, batch_size: int) -> dict[str, torch.Tensor]:
        """`tgt_lang_ids` (index of each target language in `config.languages`) for a direction table with several
        rows; nothing for a single-direction model (its one row applies to every sentence)."""
        if tgt_langs is None:
            if self.config.num_directions == 1:
                return {}
            raise ValueError(f"This Tied Transformer needs `tgt_lang` (one of {self.config.languages}), one code or "
                             "one per sentence, to pick the direction.")
        if not self.config.languages:  # a single-direction model without a language list: like the baseline
            return {}
        return {"tgt_lang_ids": torch.tensor([self.config.language_id(lang) for lang in tgt_langs])}

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

    def generate(self, inputs=None, *args, tgt_lang: str | list[str] | None = None, **kwargs):
        """`generate(**inputs, tgt_lang="de")` picks the direction (one code, or one per sentence); equivalent to
        passing `tgt_lang_ids`."""
        if tgt_lang is not None:
            if "tgt_lang_ids" in kwargs:
                raise ValueError("Pass either `tgt_lang` or `tgt_lang_ids`, not both.")
            source = next(x for x in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None)
            langs = [tgt_lang] * source.shape[0] if isinstance(tgt_lang, str) else list(tgt_lang)
            language_inputs = self._language_inputs(langs, source.shape[0])
            kwargs.update({key: value.to(source.device) for key, value in language_inputs.items()})
        return super().generate(inputs, *args, **kwargs)


__all__ = [
    "TiedTransformerPreTrainedModel",
    "TiedTransformerModel",
    "TiedTransformerForConditionalGeneration",
    "TiedTransformerBlock",
    "TiedTransformerEncoder",
    "TiedTransformerDecoder",
]
