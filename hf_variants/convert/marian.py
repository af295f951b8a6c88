"""Convert a `transformers.MarianMTModel` (e.g. an opus-mt checkpoint) into `TransformerNmtForConditionalGeneration`.

Marian is a post-norm Transformer with sinusoidal positions and scaled embeddings: the baseline with
`normalize_before=False`, `position_embedding_type="sinusoidal"`. Separate q/k/v projections become the fused
`qkv_proj` (self-attention) and `kv_proj` (cross-attention); `final_logits_bias` becomes the output bias.

    python -m hf_variants.convert_marian --marian DIR --output_dir OUT [--force]

The output folder is written atomically and is never the input (`hf_variants.outputs`): it may not be, hold or lie
inside `--marian`; `--force` replaces only a folder an earlier conversion wrote.

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import torch

from ..configuration_transformer_nmt import TransformerNmtConfig
from ..modeling_transformer_nmt import TransformerNmtForConditionalGeneration

COMMAND = "convert_marian"  # recorded in the output folder's manifest: what `--force` may replace


def config_from_marian(marian_config, **overrides) -> TransformerNmtConfig:
    if not marian_config.share_encoder_decoder_embeddings or (
        marian_config.decoder_vocab_size not in (None, marian_config.vocab_size)
    ):
        raise ValueError("Only Marian models with shared encoder/decoder embeddings can be converted.")
    if getattr(marian_config, "encoder_layerdrop", 0) or getattr(marian_config, "decoder_layerdrop", 0):
        raise ValueError("Marian layerdrop has no equivalent here; set it to 0 before converting.")
    fields = dict(
        vocab_size=marian_config.vocab_size,
        d_model=marian_config.d_model,
        encoder_layers=marian_config.encoder_layers,
        decoder_layers=marian_config.decoder_layers,
        encoder_attention_heads=marian_config.encoder_attention_heads,
        decoder_attention_heads=marian_config.decoder_attention_heads,
        encoder_ffn_dim=marian_config.encoder_ffn_dim,
        decoder_ffn_dim=marian_config.decoder_ffn_dim,
        activation_function=marian_config.activation_function,
        dropout=marian_config.dropout,
        attention_dropout=marian_config.attention_dropout,
        activation_dropout=marian_config.activation_dropout,
        max_position_embeddings=marian_config.max_position_embeddings,
        position_embedding_type="sinusoidal",
        normalize_before=False,
        scale_embedding=marian_config.scale_embedding,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=marian_config.tie_word_embeddings,
        init_method="normal",
        init_std=marian_config.init_std,
        pad_token_id=marian_config.pad_token_id,
        bos_token_id=marian_config.bos_token_id,
        eos_token_id=marian_config.eos_token_id,
        decoder_start_token_id=marian_config.decoder_start_token_id,
    )
    fields.update(overrides)
    return TransformerNmtConfig(**fields)


def convert_state_dict(marian_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Marian parameter names -> ours; returns (state dict, whether an output bias is needed)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in marian_state.items():
        if "embed_positions" in name or name.endswith(
            (".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias")
        ):
            continue
        if name.endswith((".q_proj.weight", ".q_proj.bias")):
            prefix, kind = name.rsplit(".q_proj.", 1)
            parts = [marian_state[f"{prefix}.{p}_proj.{kind}"] for p in ("q", "k", "v")]
            if prefix.endswith("encoder_attn"):
                state[f"{prefix}.q_proj.{kind}"] = parts[0]
                state[f"{prefix}.kv_proj.{kind}"] = torch.cat(parts[1:], dim=0)
            else:
                state[f"{prefix}.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
            continue
        if name == "final_logits_bias":
            continue
        # Marian's layer: fc1/fc2/final_layer_norm directly under the layer; ours group them in `ffn`.
        for sub in ("fc1", "fc2", "final_layer_norm"):
            marker = f".{sub}."
            if ".layers." in name and marker in name:
                name = name.replace(marker, f".ffn.{sub}.")
                break
        state[name] = tensor
    bias = marian_state.get("final_logits_bias")
    needs_bias = bias is not None and bool(bias.abs().sum() > 0)
    if needs_bias:
        state["lm_head.bias"] = bias.reshape(-1)
    return state, needs_bias


def convert_marian(marian_model, **config_overrides) -> TransformerNmtForConditionalGeneration:
    """A `TransformerNmtForConditionalGeneration` computing the same function as `marian_model`."""
    state, needs_bias = convert_state_dict(marian_model.state_dict())
    config = config_from_marian(marian_model.config, output_bias=needs_bias, **config_overrides)
    model = TransformerNmtForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    if unexpected or set(missing) - tied:
        raise ValueError(f"Conversion mismatch: missing {sorted(set(missing) - tied)}, unexpected {unexpected}.")
    model.generation_config = marian_model.generation_config.__class__.from_dict(
        marian_model.generation_config.to_dict()
    )
    return model.eval() if not marian_model.training else model
