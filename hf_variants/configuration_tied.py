"""Configuration of the Tied Transformer (Xia, He, Tan, Tian, He, Qin, AAAI 2019): one set of blocks serves as
both encoder and decoder, with one embedding matrix and a direction (target-space) embedding on the encoder input.

The dimensions are the baseline's fields; `encoder_layers == decoder_layers` is the number of blocks L (and the
encoder/decoder heads and FFN sizes must agree, as both sides run the same modules). The defaults are the
authors' code (tensor2tensor `transformer_base` v2): pre-norm, attention and ReLU dropout 0.1, one shared
source/target/softmax matrix. The parameter formulas of the paper's comparison are `tied_parameter_count` and
`untied_parameter_count` (the baseline of the same dimensions).
"""

from __future__ import annotations

from typing import Any, ClassVar

from .configuration_transformer_nmt import BOOL, INT, STR, TransformerNmtConfig, _check

DIRECTION_LOSSES = ("sum", "mean")


class TiedTransformerConfig(TransformerNmtConfig):
    r"""
    Configuration of [`TiedTransformerForConditionalGeneration`]. Takes every argument of [`TransformerNmtConfig`]
    (with `encoder_layers == decoder_layers` = the number of blocks), plus:

    Args:
        direction_embedding (`bool`): add a learned target-space (direction) embedding to every encoder input
            position, after the sqrt(d) scaling (tensor2tensor's `target_space_embedding`). The direction of a
            sentence is the index of its target language in `languages`; so one model serves X->Y and Y->X.
        num_directions (`int`, *optional*): rows of the direction table; defaults to `max(1, len(languages))`.
            With one row the embedding is a learned constant bias and no direction input is needed.
        direction_loss (`str`): how a batch carrying several directions is scored: `"sum"` (the paper's
            two-direction training: the sum over directions of each direction's token-mean loss) or `"mean"` (one
            token mean over the batch). Both equal the baseline loss when a batch has one direction.

    The sharing itself (one block stack for both sides, one embedding matrix for tokens and softmax) is tied by
    transformers under `tie_word_embeddings` (True, the paper); `tie_word_embeddings=False` unties everything, as
    for every transformers model, which gives the paper's untied baseline of the same dimensions.
    """

    model_type = "tied_nmt"
    FIELD_TYPES: ClassVar[dict[str, tuple]] = {
        "direction_embedding": (BOOL,),
        "num_directions": (INT,),
        "direction_loss": (STR,),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        **TransformerNmtConfig.PRESETS,
        "tiny": {**TransformerNmtConfig.PRESETS["tiny"], "attention_dropout": 0.0, "activation_dropout": 0.0},
        # The paper's IWSLT14 setting (transformer_small with 8 blocks): d 256, ff 1024, 4 heads, dropout 0.1.
        "small": dict(
            d_model=256,
            encoder_layers=8,
            decoder_layers=8,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=1024,
            decoder_ffn_dim=1024,
            dropout=0.1,
            attention_dropout=0.1,
            activation_dropout=0.1,
        ),
        # tensor2tensor transformer_base (the paper's unsupervised setting uses it with 4 or 8 blocks).
        "base": {**TransformerNmtConfig.PRESETS["base"], "attention_dropout": 0.1, "activation_dropout": 0.1},
        # The paper's WMT setting (transformer_big, residual dropout 0.2); 6 blocks (Table 4 also has 8 and 12).
        "big": dict(
            d_model=1024,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=16,
            decoder_attention_heads=16,
            encoder_ffn_dim=4096,
            decoder_ffn_dim=4096,
            dropout=0.2,
            attention_dropout=0.1,
            activation_dropout=0.1,
        ),
    }

    def __init__(
        self,
        normalize_before: bool = True,
        attention_dropout: float = 0.1,
        activation_dropout: float = 0.1,
        direction_embedding: bool = True,
        num_directions: int | None = None,
        direction_loss: str = "sum",
        **kwargs,
    ):
        super().__init__(
            normalize_before=normalize_before,
            attention_dropout=attention_dropout,
            activation_dropout=activation_dropout,
            **kwargs,
        )
        self.direction_embedding = direction_embedding
        self.num_directions = max(1, len(self.languages)) if num_directions is None else num_directions
        self.direction_loss = direction_loss
        self._validate()

    def _validate(self) -> None:
        super()._validate()
        if not hasattr(self, "direction_loss"):  # the base __init__ validates before this class sets its fields
            return
        blocks = self.encoder_layers
        # One stack of blocks runs both sides, so both sides must describe the same blocks.
        for field, value in (
            ("decoder_layers", self.decoder_layers),
            ("decoder_attention_heads", self.decoder_attention_heads),
            ("decoder_ffn_dim", self.decoder_ffn_dim),
        ):
            encoder_field = field.replace("decoder", "encoder")
            _check(
                value == getattr(self, encoder_field),
                field,
                f"equal to {encoder_field}={getattr(self, encoder_field)} (a tied model has one stack of "
                f"{blocks} blocks for both sides; set both)",
                value,
            )
        _check(isinstance(self.direction_embedding, bool), "direction_embedding", "a bool", self.direction_embedding)
        minimum = max(1, len(self.languages))
        _check(
            isinstance(self.num_directions, int)
            and not isinstance(self.num_directions, bool)
            and self.num_directions >= minimum,
            "num_directions",
            f"an integer >= {minimum} (one row per target language of `languages`)",
            self.num_directions,
        )
        _check(
            self.direction_loss in DIRECTION_LOSSES,
            "direction_loss",
            f"one of {DIRECTION_LOSSES}",
            self.direction_loss,
        )

    @classmethod
    def default_target_language_tags(cls, num_target_languages: int) -> bool:
        """Never: the direction (target-space) embedding on the encoder input is the paper's only direction signal
        (docs/variants-spec.md §5.2), also in bidirectional training. `target_language_tags=True` still adds tags."""
        return False

    @property
    def num_blocks(self) -> int:
        """L: the number of blocks, run once by the encoder and once by the decoder."""
        return self.encoder_layers


# -------------------------------------------------------------------------------------------- parameter formulas
def _attention_parameters(config: TransformerNmtConfig, heads: int, self_attention: bool) -> int:
    d = config.d_model
    count = 4 * d * d + 4 * d  # Q, K, V and output projections with biases
    if self_attention and config.max_relative_positions > 0:
        count += (2 * config.max_relative_positions + 1) * (d // heads)  # Shaw table
    return count


def _ffn_parameters(d: int, ffn_dim: int) -> int:
    return 2 * d * ffn_dim + ffn_dim + d


def _embedding_parameters(config: TransformerNmtConfig) -> int:
    """Token tables (one shared, or one per side), learned position tables, the output projection if untied."""
    v, d = config.vocab_size, config.d_model
    shared = config.share_encoder_decoder_embeddings and config.tie_word_embeddings  # ties need the latter
    count = v * d * (1 if shared else 2)
    if not config.tie_word_embeddings:
        count += v * d
    if config.output_bias:
        count += v
    if config.position_embedding_type == "learned":
        count += 2 * config.max_position_embeddings * d
    return count


def tied_parameter_count(config: TiedTransformerConfig) -> int:
    """Parameters of a tied model: L blocks, each SA + FFN + CA with their LayerNorms (2 + 1 LN), ONE final LayerNorm
    (pre-norm), the embeddings, and the direction table. For the paper's big setting with L=6 the blocks hold
    6 x 16.8M = 100.8M parameters (`untied_parameter_count`: 176.4M)."""
    d, layer_norm = config.d_model, 2 * config.d_model
    heads = config.encoder_attention_heads
    block = (
        _attention_parameters(config, heads, True)
        + _ffn_parameters(d, config.encoder_ffn_dim)
        + _attention_parameters(config, heads, False)
        + 3 * layer_norm
    )
    count = config.encoder_layers * block + (layer_norm if config.normalize_before else 0)
    count += _embedding_parameters(config)
    if getattr(config, "direction_embedding", False):
        count += config.num_directions * d
    return count


def untied_parameter_count(config: TransformerNmtConfig) -> int:
    """Parameters of the baseline Transformer of the same dimensions (`TransformerNmtForConditionalGeneration`):
    encoder layers SA + FFN + 2 LN, decoder layers SA + CA + FFN + 3 LN, a final LayerNorm per stack (pre-norm)."""
    d, layer_norm = config.d_model, 2 * config.d_model
    encoder_heads, decoder_heads = config.encoder_attention_heads, config.decoder_attention_heads
    encoder_layer = (
        _attention_parameters(config, encoder_heads, True)
        + _ffn_parameters(d, config.encoder_ffn_dim)
        + 2 * layer_norm
    )
    decoder_layer = (
        _attention_parameters(config, decoder_heads, True)
        + _attention_parameters(config, decoder_heads, False)
        + _ffn_parameters(d, config.decoder_ffn_dim)
        + 3 * layer_norm
    )
    count = config.encoder_layers * encoder_layer + config.decoder_layers * decoder_layer
    count += 2 * layer_norm if config.normalize_before else 0
    return count + _embedding_parameters(config)


__all__ = ["TiedTransformerConfig", "tied_parameter_count", "untied_parameter_count"]
