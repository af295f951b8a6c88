"""Export a `transformer_nmt` model to CTranslate2 (fast CPU/GPU inference, int8 included).

    python -m hf_variants.export_ctranslate2 --model DIR --output_dir OUT [--quantization int8] [--force]

`DIR` is a saved model folder (with its tokenizer, or pass `--tokenizer`). The export builds CTranslate2's
Transformer spec directly from our weights (`ctranslate2.specs.TransformerSpec`): CTranslate2's Marian loader does
not fit, because Marian's decoder starts from a zero `<pad>` embedding where ours starts from the
`decoder_start_token_id` token's embedding (`<s>`).

What exports: the baseline Transformer in every configuration CTranslate2 can express: post-norm or pre-norm (with
the final LayerNorms), sinusoidal, learned or no absolute positions, Shaw relative positions (keys, or keys and
values; without absolute positions, as OpenNMT), shared or separate source/target embeddings, tied or separate
output projection, with or without output bias, scaled or unscaled embeddings, the activations CTranslate2 has
(relu, gelu, gelu_new / gelu_pytorch_tanh, silu / swish, sigmoid, tanh), any layer/head/FFN sizes. Anything else
raises a `ValueError` naming the config field (the variants' layers have no CTranslate2 equivalent).

Using the export (source tokens are the tokenizer's, `</s>` included; suppress what our `generate` suppresses):

    import ctranslate2, transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(OUT)          # the export copies the tokenizer
    translator = ctranslate2.Translator(OUT, device="cpu", compute_type="int8")
    source = [tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids) for text in texts]
    results = translator.translate_batch(source, beam_size=4, suppress_sequences=[["<pad>"], ["<s>"]])
    texts = [tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results]

`--quantization` stores the weights quantized (`int8`, `int8_float32`, `int16`, `float16`, `bfloat16`, ...);
CTranslate2 can also quantize a float32 export when loading (`compute_type="int8"`). Needs `pip install
"hf-variants[deploy]"` (the `ctranslate2` package). (Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..generation_transformer_nmt import check_tokenizer_fits_model
from ..modeling_transformer_nmt import fairseq_sinusoidal_positions, sinusoidal_positions
from ..outputs import atomic_output_dir, check_not_an_input, check_output_dir, read_json_object

COMMAND = "export_ctranslate2"  # recorded in the output folder's manifest: what `--force` may replace
MANIFEST = "hf_variants_export.json"  # what translate_batch needs to decode like our generate
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")

# our `activation_function` -> CTranslate2's Activation enum name
ACTIVATIONS = {
    "relu": "RELU",
    "gelu": "GELU",
    "gelu_new": "GELUTanh",
    "gelu_pytorch_tanh": "GELUTanh",
    "silu": "SWISH",
    "swish": "SWISH",
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
}

# why CTranslate2's Transformer cannot express each variant
UNSUPPORTED_MODEL_TYPES = {
    "mute_nmt": "MUTE's encoder layers run several attention/FFN units merged by learned weights",
    "hysan_nmt": "HySAN's attention has masked branches merged per head",
    "mgsa_nmt": "MG-SA's encoder has phrase heads over composed phrase memories",
    "mimo_nmt": "MIMO runs n stacked transformations mixed per task",
    "tied_nmt": "the Tied Transformer runs one block stack for both sides, with a direction embedding",
}


def check_exportable(config) -> None:
    """Raise a ValueError naming the config field when CTranslate2's Transformer cannot express `config`."""
    model_type = getattr(config, "model_type", None)
    if model_type != "transformer_nmt":
        why = UNSUPPORTED_MODEL_TYPES.get(model_type, "it is not the transformer_nmt baseline")
        raise ValueError(
            f"CTranslate2 cannot express model_type={model_type!r}: {why}. Only transformer_nmt "
            "models export; use hf_variants.quantize_for_cpu for int8 CPU inference of the variants."
        )
    if config.activation_function not in ACTIVATIONS:
        raise ValueError(
            f"CTranslate2 has no activation_function={config.activation_function!r}; it has {sorted(ACTIVATIONS)}."
        )
    if config.max_relative_positions > 0 and config.position_embedding_type != "none":
        raise ValueError(
            f"CTranslate2 uses relative positions (max_relative_positions="
            f"{config.max_relative_positions}) without absolute ones: position_embedding_type must be "
            f"'none', got {config.position_embedding_type!r}."
        )
    for name in ("decoder_start_token_id", "eos_token_id"):
        if getattr(config, name) is None:
            raise ValueError(f"CTranslate2 needs `{name}` (a token id), got None.")
    if getattr(config, "target_language_token", False):
        raise ValueError(
            "target_language_token=True (a converted M2M100 / NLLB-200: the target language's token forced after "
            "the start token): the CTranslate2 engine of this package does not force it; export to ONNX "
            "(hf-variants-export-onnx), or convert the original checkpoint with CTranslate2's own converter."
        )


def vocabulary(tokenizer, config) -> list[str]:
    """Token strings by id, `config.vocab_size` of them (ids the tokenizer does not have get unique placeholders);
    a tokenizer larger than the model's vocabulary raises (`check_tokenizer_fits_model`)."""
    check_tokenizer_fits_model(tokenizer, config)
    vocab_size = config.vocab_size
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tokens += [f"<ct2_unused_{i}>" for i in range(len(tokens), vocab_size)]
    seen = {}
    for i, token in enumerate(tokens):
        if token is None or token in seen:
            raise ValueError(
                f"Token id {i} of the tokenizer is {token!r}, "
                + (f"the same string as id {seen[token]}" if token in seen else "not a string")
                + ": CTranslate2 needs one distinct string per id."
            )
        seen[token] = i
    return tokens


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy().copy()


def _linear(spec, module) -> None:
    spec.weight = _array(module.weight)
    if module.bias is not None:
        spec.bias = _array(module.bias)


def _norm(spec, module) -> None:
    spec.gamma = _array(module.weight)
    spec.beta = _array(module.bias)


def _relative(spec, attention) -> None:
    table = _array(attention.relative_positions.embeddings.weight)
    spec.relative_position_keys = table
    # ours adds the value term with the same table, or none: a zero table adds nothing
    spec.relative_position_values = table.copy() if attention.config.relative_position_values else np.zeros_like(table)


def _positions(stack, config) -> np.ndarray:
    if config.position_embedding_type == "learned":
        return _array(stack.embed_positions.weight)
    if config.position_embedding_type == "sinusoidal":
        return _array(sinusoidal_positions(torch.arange(config.max_position_embeddings), config.d_model))
    if config.position_embedding_type == "fairseq_sinusoidal":  # CTranslate2 counts from 0: fairseq from pad + 1
        first = config.pad_token_id + 1
        positions = torch.arange(first, first + config.max_position_embeddings)
        return _array(fairseq_sinusoidal_positions(positions, config.d_model, config.pad_token_id))
    return np.zeros((config.max_position_embeddings, config.d_model), dtype=np.float32)  # "none"


def _stack(spec, stack, config) -> None:
    spec.scale_embeddings = bool(config.scale_embedding)
    if config.max_relative_positions == 0:
        spec.position_encodings.encodings = _positions(stack, config)
    if config.normalize_before:
        _norm(spec.layer_norm, stack.layer_norm)


def build_spec(model, tokenizer):
    """CTranslate2's `TransformerSpec` holding `model`'s weights and `tokenizer`'s vocabulary."""
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    check_exportable(config)
    relative = config.max_relative_positions > 0
    activation = getattr(common_spec.Activation, ACTIVATIONS[config.activation_function])
    encoder = transformer_spec.TransformerEncoderSpec(
        config.encoder_layers,
        config.encoder_attention_heads,
        pre_norm=config.normalize_before,
        activation=activation,
        relative_position=relative,
    )
    decoder = transformer_spec.TransformerDecoderSpec(
        config.decoder_layers,
        config.decoder_attention_heads,
        pre_norm=config.normalize_before,
        activation=activation,
        relative_position=relative,
    )
    ours = model.model
    encoder.embeddings[0].weight = _array(ours.encoder.embed_tokens.weight)
    _stack(encoder, ours.encoder, config)
    for spec, layer in zip(encoder.layer, ours.encoder.layers, strict=True):
        _norm(spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        _linear(spec.self_attention.linear[0], layer.self_attn.qkv_proj)  # fused q, k, v: CTranslate2's layout
        _linear(spec.self_attention.linear[1], layer.self_attn.out_proj)
        if relative:
            _relative(spec.self_attention, layer.self_attn)
        _norm(spec.ffn.layer_norm, layer.ffn.final_layer_norm)
        _linear(spec.ffn.linear_0, layer.ffn.fc1)
        _linear(spec.ffn.linear_1, layer.ffn.fc2)
    decoder.embeddings.weight = _array(ours.decoder.embed_tokens.weight)
    decoder.start_from_zero_embedding = False  # ours starts from the decoder_start_token_id embedding
    _stack(decoder, ours.decoder, config)
    for spec, layer in zip(decoder.layer, ours.decoder.layers, strict=True):
        _norm(spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        _linear(spec.self_attention.linear[0], layer.self_attn.qkv_proj)
        _linear(spec.self_attention.linear[1], layer.self_attn.out_proj)
        if relative:
            _relative(spec.self_attention, layer.self_attn)
        _norm(spec.attention.layer_norm, layer.encoder_attn_layer_norm)
        _linear(spec.attention.linear[0], layer.encoder_attn.q_proj)
        _linear(spec.attention.linear[1], layer.encoder_attn.kv_proj)  # fused k, v
        _linear(spec.attention.linear[2], layer.encoder_attn.out_proj)
        _norm(spec.ffn.layer_norm, layer.ffn.final_layer_norm)
        _linear(spec.ffn.linear_0, layer.ffn.fc1)
        _linear(spec.ffn.linear_1, layer.ffn.fc2)
    _linear(decoder.projection, model.lm_head)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    tokens = vocabulary(tokenizer, config)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    unk = tokenizer.unk_token if tokenizer.unk_token in tokens else tokens[config.pad_token_id or 0]
    spec.config.unk_token = unk
    spec.config.bos_token = tokens[
        config.bos_token_id if config.bos_token_id is not None else config.decoder_start_token_id
    ]
    spec.config.eos_token = tokens[config.eos_token_id]
    spec.config.decoder_start_token = tokens[config.decoder_start_token_id]
    spec.config.layer_norm_epsilon = float(config.layer_norm_eps)
    return spec


def export(model, tokenizer, output_dir: str | Path, quantization: str | None = None, force: bool = False) -> Path:
    """Write `model` (a transformer_nmt model) as a CTranslate2 model folder, with the tokenizer and the
    generation config next to it. Returns the folder. The folder is written atomically (a temporary sibling,
    renamed when complete); it may not be, hold or lie inside the folder the model was loaded from, and a non-empty
    one is replaced only with `force` and only when this export wrote it (`hf_variants.outputs`)."""
    output_dir = Path(output_dir)
    check_not_an_input(output_dir, {"the model's folder": getattr(model, "name_or_path", None) or None})
    check_output_dir(output_dir, command=COMMAND, force=force)
    spec = build_spec(model.eval(), tokenizer)
    spec.validate()
    spec.optimize(quantization=quantization)
    with atomic_output_dir(output_dir, command=COMMAND, force=force) as staging:
        spec.save(str(staging))
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokens = vocabulary(tokenizer, model.config)
        suppress = [[tokens[i]] for i in (model.generation_config.suppress_tokens or [])]
        (staging / MANIFEST).write_text(
            json.dumps(
                {
                    "source_model_type": model.config.model_type,
                    "quantization": quantization or "float32",
                    "suppress_sequences": suppress,
                    # the model's config (languages, positions, special tokens): what a translator over the
                    # export needs beside CTranslate2's own config.json (`hf_variants.inference.ctranslate2_engine`)
                    "model_config": json.loads(model.config.to_json_string(use_diff=False)),
                },
                indent=2,
            )
            + "\n"
        )
    return output_dir


def read_export_manifest(folder: str | os.PathLike) -> dict:
    """The export's `hf_variants_export.json`, read as untrusted input: a ValueError naming the file and the field
    when it is not JSON, a field has the wrong type, or the file is a link leaving the folder. `model_config` (the
    exported model's config as a dict) is there for exports that recorded it."""
    path = Path(folder) / MANIFEST
    data = read_json_object(folder, MANIFEST, 64 * 1024 * 1024, "an export manifest", "export_ctranslate2")
    for name in ("source_model_type", "quantization"):
        if not isinstance(data.get(name), str):
            raise ValueError(f"{path}: `{name}` must be a string, got {type(data.get(name)).__name__}.")
    if data["quantization"] not in QUANTIZATIONS:
        raise ValueError(f"{path}: `quantization` must be one of {list(QUANTIZATIONS)}, got {data['quantization']!r}.")
    suppress = data.get("suppress_sequences")
    if not (
        isinstance(suppress, list)
        and all(isinstance(seq, list) and seq and all(isinstance(t, str) for t in seq) for seq in suppress)
    ):
        raise ValueError(f"{path}: `suppress_sequences` must be a list of non-empty lists of token strings.")
    manifest = {k: data[k] for k in ("source_model_type", "quantization", "suppress_sequences")}
    if "model_config" in data:  # exports since the serve engine (older ones lack it)
        config = data["model_config"]
        if not isinstance(config, dict) or config.get("model_type") != data["source_model_type"]:
            raise ValueError(f"{path}: `model_config` must be the config of the exported {data['source_model_type']}.")
        manifest["model_config"] = config
    return manifest
