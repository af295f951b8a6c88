"""Convert a `transformers.M2M100ForConditionalGeneration` (M2M100, and the dense NLLB-200 checkpoints, which are this
class) into `TransformerNmtForConditionalGeneration`: the same logits (fp32) and the same `generate()` outputs, greedy
and beam (tested on random models of both families, several language pairs).

What M2M100 does differently from the baseline's defaults, and the baseline field that carries it:

- pre-norm layers (a LayerNorm before each sub-layer) and a final LayerNorm on each stack: `normalize_before=True`;
- fairseq's sinusoidal positions (frequencies 10000^(-i/(d/2-1)); the k-th non-padding token at position
  `pad_token_id + k`, the "offset 2" of its table with pad = 1; padding tokens at the zero vector):
  `position_embedding_type="fairseq_sinusoidal"`;
- token embeddings times sqrt(d_model): `scale_embedding`, the same value;
- one matrix for source, target and output (`shared`, tied): `share_encoder_decoder_embeddings`,
  `tie_word_embeddings` (the same value; untied, the three matrices are separate in both);
- separate q/k/v projections: the fused `qkv_proj` / `kv_proj` (concatenated), no output bias;
- the source language's token before the source, written by its tokenizer (`src_lang`: `eng_Latn`, `__en__`): the
  original tokenizer is kept, `languages` and `language_token_ids` name the codes and their tokens;
- the target language's token forced as the first generated token (`forced_bos_token_id`):
  `target_language_token=True`, so `generate(tgt_lang=...)` and the pipeline force it with the same scores;
- the decoder starts with `</s>` (`decoder_start_token_id=2`): the same value.

`config.languages` lists the tokenizer's language codes (NLLB-200: `eng_Latn`, ...; M2M100: `en`, ... whose tokens
are `__en__`, ...), and `source_languages` / `target_languages` all of them: `generate(tgt_lang=...)`, the pipeline,
the translator and its commands take the model's own codes and refuse others. One convention differs: M2M100 takes
`inputs_embeds` already scaled (its embedding module scales them), the baseline scales `inputs_embeds` as it scales
the embeddings of `input_ids`.

Refused with a `ValueError` naming the field: NLLB-MoE (`model_type="nllb-moe"`: its expert layers have no baseline
equivalent), an odd `d_model` or no `pad_token_id` (fairseq's positions need both), and `encoder_layerdrop` /
`decoder_layerdrop` > 0 (M2M100-418M's 0.05): LayerDrop skips layers at random in training only; the baseline has
no LayerDrop, so `ignore_layerdrop=True` (`--ignore_layerdrop`) converts such a model with the same function at
inference, and fine-tuning it then runs without LayerDrop (the command says so).

    hf-variants-convert-m2m100 --m2m100 DIR --output_dir OUT [--ignore_layerdrop] [--force]

The output folder (model, generation config, the original tokenizer) is written atomically and is never the input
(`hf_variants.outputs`).

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import copy

import torch

from ..configuration_transformer_nmt import TransformerNmtConfig
from ..modeling_transformer_nmt import TransformerNmtForConditionalGeneration
from .marian import convert_state_dict as convert_marian_state_dict

COMMAND = "convert_m2m100"  # recorded in the output folder's manifest: what `--force` may replace
SOURCE_MODEL_TYPE = "m2m_100"
LAYERDROP_FIELDS = ("encoder_layerdrop", "decoder_layerdrop")


# ------------------------------------------------------------------------------------------------ languages
def tokenizer_languages(tokenizer) -> tuple[list[str], list[int]]:
    """(language codes, the vocabulary id of each code's token) of an M2M100 or NLLB tokenizer, in the tokenizer's
    order: M2M100's `lang_code_to_id` (codes `en`, tokens `__en__`), or NLLB's language tokens (its extra special
    tokens, `eng_Latn`, ...: the code is the token). A ValueError for a tokenizer with neither."""
    table = getattr(tokenizer, "lang_code_to_id", None)
    if isinstance(table, dict) and table:
        return list(table), [int(i) for i in table.values()]
    if not hasattr(tokenizer, "src_lang"):
        raise ValueError(
            f"{type(tokenizer).__name__} is neither an M2M100 nor an NLLB tokenizer (it has no `src_lang`): the "
            "language codes cannot be read from it."
        )
    standard = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])} - _extra_special_tokens(tokenizer)
    codes = [token for token in _extra_special_tokens_ordered(tokenizer) if token not in standard]
    if not codes:
        raise ValueError(f"{type(tokenizer).__name__} declares no language tokens (its extra special tokens).")
    ids = tokenizer.convert_tokens_to_ids(codes)
    unk = tokenizer.unk_token_id
    missing = [code for code, i in zip(codes, ids) if i is None or i == unk]
    if missing:
        raise ValueError(f"The tokenizer has no token for the language codes {missing[:5]}.")
    return codes, [int(i) for i in ids]


def _extra_special_tokens_ordered(tokenizer) -> list[str]:
    for name in ("extra_special_tokens", "additional_special_tokens"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, (list, tuple)) and value:
            return [str(token) for token in value]
    return []


def _extra_special_tokens(tokenizer) -> set[str]:
    return set(_extra_special_tokens_ordered(tokenizer))


# --------------------------------------------------------------------------------------------------- config
def check_convertible(m2m_config, ignore_layerdrop: bool = False) -> list[str]:
    """Raise a ValueError naming the field for what the baseline cannot represent (see the module docstring);
    returns notes on what the conversion leaves out (the LayerDrop of `ignore_layerdrop`)."""
    model_type = getattr(m2m_config, "model_type", None)
    if model_type in ("nllb-moe", "nllb_moe"):
        raise ValueError(
            f"model_type={model_type!r} (NLLB-MoE, num_experts={getattr(m2m_config, 'num_experts', '?')}): its "
            "mixture-of-experts layers have no equivalent in the baseline; convert a dense NLLB-200 checkpoint "
            "(e.g. facebook/nllb-200-distilled-600M, -1.3B, -3.3B)."
        )
    if model_type != SOURCE_MODEL_TYPE:
        raise ValueError(f"model_type={model_type!r}: expected an M2M100ForConditionalGeneration ('m2m_100').")
    if m2m_config.d_model % 2 or m2m_config.d_model < 4:
        raise ValueError(f"d_model={m2m_config.d_model}: fairseq's sinusoidal positions need an even d_model >= 4.")
    if m2m_config.pad_token_id is None:
        raise ValueError("pad_token_id=None: fairseq's positions count from the padding id.")
    notes = []
    for name in LAYERDROP_FIELDS:
        value = getattr(m2m_config, name, 0) or 0
        if value > 0 and not ignore_layerdrop:
            raise ValueError(
                f"{name}={value}: LayerDrop (layers skipped at random in training) has no equivalent in the "
                "baseline. It acts in training only: convert with --ignore_layerdrop (ignore_layerdrop=True) "
                "for the same model at inference; fine-tuning the result then runs without LayerDrop."
            )
        if value > 0:
            notes.append(f"{name}={value} left out: fine-tuning the converted model runs without LayerDrop")
    return notes


def config_from_m2m100(
    m2m_config,
    languages: list[str] | None = None,
    language_token_ids: list[int] | None = None,
    ignore_layerdrop: bool = False,
    **overrides,
) -> TransformerNmtConfig:
    """The baseline config computing what `m2m_config` does (see the module docstring); `languages` and their
    `language_token_ids` (from the tokenizer, `tokenizer_languages`) turn on the target-language token."""
    check_convertible(m2m_config, ignore_layerdrop)
    languages = list(languages or [])
    eos = m2m_config.eos_token_id
    fields = dict(
        vocab_size=m2m_config.vocab_size,
        d_model=m2m_config.d_model,
        encoder_layers=m2m_config.encoder_layers,
        decoder_layers=m2m_config.decoder_layers,
        encoder_attention_heads=m2m_config.encoder_attention_heads,
        decoder_attention_heads=m2m_config.decoder_attention_heads,
        encoder_ffn_dim=m2m_config.encoder_ffn_dim,
        decoder_ffn_dim=m2m_config.decoder_ffn_dim,
        activation_function=m2m_config.activation_function,
        dropout=m2m_config.dropout,
        attention_dropout=m2m_config.attention_dropout,
        activation_dropout=m2m_config.activation_dropout,
        max_position_embeddings=m2m_config.max_position_embeddings,
        position_embedding_type="fairseq_sinusoidal",
        normalize_before=True,
        scale_embedding=m2m_config.scale_embedding,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=m2m_config.tie_word_embeddings,
        layer_norm_eps=1e-5,  # M2M100's nn.LayerNorm default
        init_method="normal",
        init_std=m2m_config.init_std,
        pad_token_id=m2m_config.pad_token_id,
        bos_token_id=m2m_config.bos_token_id,
        eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
        decoder_start_token_id=m2m_config.decoder_start_token_id,
        languages=languages,
        source_languages=list(languages),
        target_languages=list(languages),
        language_token_ids=list(language_token_ids or []),
        target_language_token=bool(languages),
    )
    fields.update(overrides)
    return TransformerNmtConfig(**fields)


# ---------------------------------------------------------------------------------------------------- weights
def convert_state_dict(m2m_state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """M2M100 parameter names -> ours: the layer naming is Marian's (`marian.convert_state_dict`: q/k/v fused,
    fc1/fc2/final_layer_norm under `ffn`); the position table is computed, not stored. Without tied embeddings
    M2M100's `shared` matrix is used by nothing (each stack has its own): it is left out."""
    state, needs_bias = convert_marian_state_dict(m2m_state)
    if needs_bias:  # M2M100 has no output bias; a `final_logits_bias` is no M2M100 tensor
        raise ValueError("The M2M100 state dict holds a `final_logits_bias`: not an M2M100 model.")
    if not tied:
        state.pop("model.shared.weight", None)
    return state


def convert_m2m100(
    m2m_model, tokenizer=None, *, ignore_layerdrop: bool = False, **config_overrides
) -> TransformerNmtForConditionalGeneration:
    """A `TransformerNmtForConditionalGeneration` computing the same function as `m2m_model` (an
    `M2M100ForConditionalGeneration`), with its generation config. With `tokenizer` (its M2M100 or NLLB tokenizer)
    the config lists the model's languages and their tokens (`target_language_token`): `generate(tgt_lang=...)`
    then forces the target language's token as `forced_bos_token_id` does."""
    languages, token_ids = tokenizer_languages(tokenizer) if tokenizer is not None else ([], [])
    config = config_from_m2m100(m2m_model.config, languages, token_ids, ignore_layerdrop, **config_overrides)
    model = TransformerNmtForConditionalGeneration(config)
    state = convert_state_dict(m2m_model.state_dict(), config.tie_word_embeddings)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    if not config.tie_word_embeddings:
        tied = set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"Conversion mismatch: missing {sorted(set(missing) - tied)}, unexpected {unexpected}.")
    model.generation_config = copy.deepcopy(m2m_model.generation_config)
    return model.eval() if not m2m_model.training else model


__all__ = [
    "COMMAND",
    "check_convertible",
    "config_from_m2m100",
    "convert_m2m100",
    "convert_state_dict",
    "tokenizer_languages",
]
