"""Whether a model fits the machine, estimated from its config before anything is allocated.

`estimate_parameters(config)` counts the weights of a config's model from its fields alone (embeddings, positions,
the encoder and decoder layers with MUTE's units and MIMO's transformations; the Tied Transformer's one stack), in
microseconds, whatever the sizes. It counts the dominant matrices and vectors of the baseline layer (attention
projections, FFN, LayerNorms) and the variants' multipliers; the variants' small additions (gates, phrase memories,
mixing tables) are left out: the estimate is within 20% of the built model's count (tested on the tiny and small
presets; MG-SA's phrase memory and tag classifiers at d_model 32 are the largest part left out).

`check_fits(config, ...)` compares what a run would hold in memory (the weights, and for training their gradients
and the two Adam moments, plus the activations of a batch when its size is given) with the memory available now
(psutil, else /proc/meminfo, else sysconf) and raises `ModelTooLargeError` naming the fields that make the model
large; commands pass an explicit override flag to skip the check.

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import os

BYTES_PER_VALUE = 4  # float32
# weights + gradients + Adam's two moments
TRAINING_COPIES = 4
INFERENCE_COPIES = 1


class ModelTooLargeError(ValueError):
    """The model a config describes would not fit the available memory; the message names the fields."""


def _get(config, name: str, default=0) -> int:
    value = getattr(config, name, default)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0


def parameter_terms(config) -> dict[str, tuple[int, str]]:
    """The estimate by part: name -> (parameters, the fields that set it, as `field=value, ...`)."""
    d = _get(config, "d_model")
    vocab = _get(config, "vocab_size")
    enc_layers, dec_layers = _get(config, "encoder_layers"), _get(config, "decoder_layers")
    enc_ffn, dec_ffn = _get(config, "encoder_ffn_dim"), _get(config, "decoder_ffn_dim")
    units = _get(config, "num_units", 1) if getattr(config, "model_type", None) == "mute_nmt" else 1
    streams = _get(config, "num_transformations", 1) if getattr(config, "model_type", None) == "mimo_nmt" else 1
    units, streams = max(units, 1), max(streams, 1)
    tied = getattr(config, "model_type", None) == "tied_nmt" and bool(getattr(config, "tie_word_embeddings", True))
    share = bool(getattr(config, "share_encoder_decoder_embeddings", True)) or tied
    tie_output = bool(getattr(config, "tie_word_embeddings", True))

    embedding_tables = (1 if share else 2) + (0 if tie_output else 1)
    terms = {
        "embeddings": (embedding_tables * vocab * d, f"vocab_size={vocab}, d_model={d}"),
    }
    if getattr(config, "position_embedding_type", None) == "learned":
        positions = _get(config, "max_position_embeddings")
        terms["positions"] = (2 * positions * d, f"max_position_embeddings={positions}, d_model={d}")
    relative = _get(config, "max_relative_positions")
    # one encoder layer: q, k, v, out (4 d^2 + 4 d), FFN (2 d f + d + f), two LayerNorms (4 d)
    head_dim = d // max(_get(config, "encoder_attention_heads", 1), 1)
    relative_table = (2 * relative + 1) * head_dim if relative else 0
    encoder_layer = 4 * d * d + 2 * d * enc_ffn + 9 * d + enc_ffn + relative_table
    # one decoder layer: self- and cross-attention (8 d^2 + 8 d), FFN, three LayerNorms (6 d)
    decoder_layer = 8 * d * d + 2 * d * dec_ffn + 15 * d + dec_ffn
    encoder_fields = f"encoder_layers={enc_layers}, encoder_ffn_dim={enc_ffn}, d_model={d}"
    if units > 1:
        encoder_fields += f", num_units={units}"
    if streams > 1:
        encoder_fields += f", num_transformations={streams}"
    decoder_fields = f"decoder_layers={dec_layers}, decoder_ffn_dim={dec_ffn}, d_model={d}"
    if streams > 1:
        decoder_fields += f", num_transformations={streams}"
    if tied:  # one stack of decoder-shaped blocks serves both sides
        terms["blocks"] = (max(enc_layers, dec_layers) * decoder_layer, decoder_fields)
    else:
        terms["encoder"] = (enc_layers * encoder_layer * units * streams, encoder_fields)
        terms["decoder"] = (dec_layers * decoder_layer * streams, decoder_fields)
    return terms


def estimate_parameters(config) -> int:
    """The config's parameter count, estimated from its fields (no allocation)."""
    return sum(n for n, _ in parameter_terms(config).values())


def activation_values(config, tokens: int) -> int:
    """Values a training step keeps for the backward pass of a batch of `tokens` tokens (source and target each),
    estimated (about 12 d + 2 f per token and layer, float32; attention scores are left out)."""
    d = _get(config, "d_model")
    units = max(_get(config, "num_units", 1), 1) if getattr(config, "model_type", None) == "mute_nmt" else 1
    streams = (
        max(_get(config, "num_transformations", 1), 1) if getattr(config, "model_type", None) == "mimo_nmt" else 1
    )
    encoder = _get(config, "encoder_layers") * units * streams * (12 * d + 2 * _get(config, "encoder_ffn_dim"))
    decoder = _get(config, "decoder_layers") * streams * (18 * d + 2 * _get(config, "decoder_ffn_dim"))
    return max(int(tokens), 0) * (encoder + decoder + _get(config, "vocab_size"))


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (psutil, else /proc/meminfo's MemAvailable, else
    sysconf's available pages)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: no limit


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(
    config,
    *,
    training: bool = True,
    tokens: int | None = None,
    available: int | None = None,
    extra_models: int = 0,
    override_flag: str | None = None,
) -> int:
    """Raise `ModelTooLargeError` when the model of `config` would not fit the available memory: its weights (and,
    when `training`, their gradients and Adam moments, and the activations of a batch of `tokens` tokens), plus the
    weights of `extra_models` more models of the same size (e.g. a warm start's base). Returns the estimated bytes.
    The message names the fields of the largest parts and `override_flag`, the flag that skips this check."""
    terms = parameter_terms(config)
    params = sum(n for n, _ in terms.values())
    copies = TRAINING_COPIES if training else INFERENCE_COPIES
    needed = BYTES_PER_VALUE * params * (copies + extra_models)
    activations = BYTES_PER_VALUE * activation_values(config, tokens) if training and tokens else 0
    needed += activations
    available = available_memory() if available is None else available
    if needed <= available:
        return needed
    largest = sorted(terms.items(), key=lambda item: -item[1][0])
    parts = "; ".join(f"{name} {n:,} parameters ({fields})" for name, (n, fields) in largest if n)
    what = "training" if training else "loading"
    raise ModelTooLargeError(
        f"The model would not fit in memory: {params:,} parameters, about {_gib(needed)} for {what}"
        + (f" (activations of {tokens:,} tokens: {_gib(activations)})" if activations else "")
        + f", with {_gib(available)} available. Largest parts: {parts}. Make these fields smaller"
        + (f", or pass {override_flag} to build it anyway." if override_flag else ".")
    )
