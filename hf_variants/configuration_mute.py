"""Configuration of MUTE, the Multi-Unit Transformer (Yan, Meng, Zhou, EMNLP 2020).

Every encoder layer holds `num_units` parallel units (own self-attention with its own Shaw relative-position table,
own FFN with its own pre-LayerNorm) behind one shared attention LayerNorm; their outputs are merged by learnable
weights alpha. The three models of the paper are three settings of two switches:

| model (paper)         | `use_bias_module` | `merge`  |
|-----------------------|-------------------|----------|
| MUTE                  | False             | "plain"  |
| MUTE + Bias           | True              | "plain"  |
| MUTE + Bias + Seq     | True              | "seq"    |

(`MUTE_MODELS` holds these as override dicts: `MuteConfig.from_preset("base", **MUTE_MODELS["bias"])`.)
The defaults are the paper's best model in its base setting as resolved in `docs/variants-spec.md` §1: d 512, 6 + 6
layers, 8 heads, 4 units [identity, swap, mask, disorder], p_beta 0.85, AutoShuffle with the Lipschitz penalty
(weight 1 on the token-summed loss), pre-norm, sinusoidal positions plus Shaw relative keys and values (clip 16).
"""

from __future__ import annotations

from typing import Any, ClassVar

from .configuration_transformer_nmt import BOOL, FLOAT, INT, STR, STR_LIST, TransformerNmtConfig, _as_list, _check

UNIT_TYPES = ("identity", "swap", "mask", "disorder")
MERGE_MODES = ("plain", "seq")
NOISE_MODES = ("clean", "onmt_compat")
MASK_MODES = ("token", "one")
PENALTY_NORMALIZATIONS = ("tokens", "none")
SHUFFLE_INITS = ("uniform", "abs_normal")
# The authors' unit order for biased models (`boost_str 'd1 a3'`, adv methods [swap, mask, reorder]).
DEFAULT_UNIT_TYPES = ["identity", "swap", "mask", "disorder"]

# The three models of the paper, as overrides of the (full-model) defaults.
MUTE_MODELS: dict[str, dict[str, Any]] = {
    "mute": dict(use_bias_module=False, merge="plain"),
    "bias": dict(use_bias_module=True, merge="plain"),
    "bias_seq": dict(use_bias_module=True, merge="seq"),
}

# MUTE's backbone settings (OpenNMT, the authors' README), shared by every preset.
MUTE_BACKBONE = dict(
    normalize_before=True,
    max_relative_positions=16,
    relative_position_values=True,
    position_embedding_type="sinusoidal",
    attention_dropout=0.0,
)


def default_unit_types(num_units: int) -> list[str]:
    """[identity, swap, mask, disorder] cut or cycled to `num_units` (the first unit is always the identity)."""
    noisy = DEFAULT_UNIT_TYPES[1:]
    return ["identity"] + [noisy[i % len(noisy)] for i in range(num_units - 1)]


class MuteConfig(TransformerNmtConfig):
    r"""
    Configuration of [`MuteForConditionalGeneration`]. Takes every argument of [`TransformerNmtConfig`] plus:

    Args:
        num_units (`int`): I, the parallel units of every encoder layer (1 = a plain Transformer encoder layer).
        merge (`str`): `"plain"` (eq. 10/12: out = sum_i alpha_i F_i) or `"seq"` (eq. 13-16: G = M^T-permuted
            outputs, cumulative sums G^_j normalised by j, out = sum_j alpha_j G^_j / j; AutoShuffle matrix M).
        use_bias_module (`bool`): the bias module: in training, unit i gets `unit_types[i]` noise on the
            normalised layer input (the residual stays clean). Never active in `eval()`.
        unit_types (`list[str]`): one noise type per unit: `"identity"`, `"swap"`, `"mask"`, `"disorder"`.
            Default [identity, swap, mask, disorder] (cycled after the identity for other unit counts).
        sample_rate (`float`): p_beta in [0, 1]: once per layer per batch, the biased units get their noise with
            this probability (otherwise every unit gets the clean input).
        swap_range (`int`): swaps exchange a token with one at most this far away (3).
        swap_mode (`str`): `"clean"` (first position among the real tokens, offset in {+-1..+-swap_range}, second
            position clamped into the sentence) or `"onmt_compat"` (the authors' code: first position drawn over
            the padded length and clamped to the sentence length, offset in [-r, r-1]; may swap with padding).
        disorder_window (`int`): length of the window whose tokens are randomly permuted (3).
        disorder_mode (`str`): `"clean"` (window inside the real tokens, skipped for shorter sentences) or
            `"onmt_compat"` (window start drawn over the padded length, as the authors' code).
        mask_prob (`float`): per-token probability that a real token is replaced by the layer's learnable mask
            vector (`mask_mode="token"`, the authors' code).
        mask_mode (`str`): `"token"` (each real token independently with `mask_prob`) or `"one"` (exactly one
            real token per sentence, the paper's wording).
        shuffle_init (`str`): AutoShuffle init: `"uniform"` (1/I, the authors' default) or `"abs_normal"` (|N(0,1)|).
        shuffle_sinkhorn_iterations (`int`): row-then-column normalisations per projection of M (1 in the code).
        shuffle_eps (`float`): lower bound of the row/column sums in the projection (a row can vanish after relu).
        shuffle_penalty_weight (`float`): lambda of eq. 20 for the Lipschitz penalty (eq. 19, summed over layers).
        penalty_normalization (`str`): `"tokens"` (the code: penalty added to the token-SUMMED loss, so divided by
            the number of target tokens here) or `"none"` (added as is to the token-mean cross-entropy).
    """

    model_type = "mute_nmt"
    FIELD_TYPES: ClassVar[dict[str, tuple]] = {
        **dict.fromkeys(("num_units", "swap_range", "disorder_window", "shuffle_sinkhorn_iterations"), (INT,)),
        **dict.fromkeys(("sample_rate", "mask_prob", "shuffle_eps", "shuffle_penalty_weight"), (FLOAT,)),
        **dict.fromkeys(
            ("merge", "swap_mode", "disorder_mode", "mask_mode", "shuffle_init", "penalty_normalization"), (STR,)
        ),
        "use_bias_module": (BOOL,),
        "unit_types": (STR_LIST,),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        name: {**preset, **MUTE_BACKBONE} for name, preset in TransformerNmtConfig.PRESETS.items()
    }

    def __init__(
        self,
        num_units: int = 4,
        merge: str = "seq",
        use_bias_module: bool = True,
        unit_types: list[str] | None = None,
        sample_rate: float = 0.85,
        swap_range: int = 3,
        swap_mode: str = "clean",
        disorder_window: int = 3,
        disorder_mode: str = "clean",
        mask_prob: float = 0.1,
        mask_mode: str = "token",
        shuffle_init: str = "uniform",
        shuffle_sinkhorn_iterations: int = 1,
        shuffle_eps: float = 1e-6,
        shuffle_penalty_weight: float = 1.0,
        penalty_normalization: str = "tokens",
        normalize_before: bool = True,
        max_relative_positions: int = 16,
        relative_position_values: bool = True,
        **kwargs,
    ):
        super().__init__(
            normalize_before=normalize_before,
            max_relative_positions=max_relative_positions,
            relative_position_values=relative_position_values,
            **kwargs,
        )
        self.num_units = num_units
        self.merge = merge
        self.use_bias_module = use_bias_module
        valid_units = isinstance(num_units, int) and not isinstance(num_units, bool) and num_units > 0
        self.unit_types = (
            _as_list(unit_types) if unit_types is not None else (default_unit_types(num_units) if valid_units else [])
        )
        self.sample_rate = sample_rate
        self.swap_range = swap_range
        self.swap_mode = swap_mode
        self.disorder_window = disorder_window
        self.disorder_mode = disorder_mode
        self.mask_prob = mask_prob
        self.mask_mode = mask_mode
        self.shuffle_init = shuffle_init
        self.shuffle_sinkhorn_iterations = shuffle_sinkhorn_iterations
        self.shuffle_eps = shuffle_eps
        self.shuffle_penalty_weight = shuffle_penalty_weight
        self.penalty_normalization = penalty_normalization
        self._validate_mute()

    def _validate_mute(self) -> None:
        self._check_field_types()

        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
                name,
                f"an integer >= {minimum}",
                value,
            )

        def probability(name: str) -> None:
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0,
                name,
                "a float in [0, 1]",
                value,
            )

        positive_int("num_units")
        positive_int("swap_range")
        positive_int("disorder_window", 2)
        positive_int("shuffle_sinkhorn_iterations")
        probability("sample_rate")
        probability("mask_prob")
        _check(self.merge in MERGE_MODES, "merge", f"one of {MERGE_MODES}", self.merge)
        _check(isinstance(self.use_bias_module, bool), "use_bias_module", "a bool", self.use_bias_module)
        _check(
            len(self.unit_types) == self.num_units and all(t in UNIT_TYPES for t in self.unit_types),
            "unit_types",
            f"a list of num_units={self.num_units} entries from {UNIT_TYPES}",
            self.unit_types,
        )
        _check(self.swap_mode in NOISE_MODES, "swap_mode", f"one of {NOISE_MODES}", self.swap_mode)
        _check(self.disorder_mode in NOISE_MODES, "disorder_mode", f"one of {NOISE_MODES}", self.disorder_mode)
        _check(self.mask_mode in MASK_MODES, "mask_mode", f"one of {MASK_MODES}", self.mask_mode)
        _check(self.shuffle_init in SHUFFLE_INITS, "shuffle_init", f"one of {SHUFFLE_INITS}", self.shuffle_init)
        _check(
            isinstance(self.shuffle_eps, (int, float)) and 0 < self.shuffle_eps < 1,
            "shuffle_eps",
            "a float in (0, 1)",
            self.shuffle_eps,
        )
        _check(
            isinstance(self.shuffle_penalty_weight, (int, float)) and self.shuffle_penalty_weight >= 0,
            "shuffle_penalty_weight",
            "a float >= 0",
            self.shuffle_penalty_weight,
        )
        _check(
            self.penalty_normalization in PENALTY_NORMALIZATIONS,
            "penalty_normalization",
            f"one of {PENALTY_NORMALIZATIONS}",
            self.penalty_normalization,
        )

    @property
    def has_mask_unit(self) -> bool:
        """Whether the layers need a learnable mask vector (a `mask` unit behind an enabled bias module)."""
        return self.use_bias_module and "mask" in self.unit_types


__all__ = ["MuteConfig", "MUTE_MODELS", "UNIT_TYPES", "default_unit_types"]
