"""Configuration of HySAN, the Hybrid Self-Attention Network (Song, Tan, Peng, Lu, AAAI 2019).

Every self-attention module runs several *branches* on one shared score matrix QK^T (a global branch, forward and
backward directional branches, local windows) and fuses their outputs (`sum`, `concat` or the squeeze-gated
`gated_sum`). The defaults are the paper's e1 setting as resolved in `docs/variants-spec.md` §2: encoder
{global, forward, backward, local k=5}, decoder {forward (= causal), causal local k=5}, gated sum with one squeeze
gate per attention module (r = 16, no biases), pre-norm, and tensor2tensor's attention and ReLU dropout 0.1
(`docs/variants-spec.md` §2.4; the `tiny` test preset keeps 0).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from .configuration_transformer_nmt import (
    BOOL,
    INT,
    INT_LIST,
    STR,
    STR_LIST,
    TransformerNmtConfig,
    _as_list,
    _check,
    check_field_type,
)

ENCODER_BRANCH_KINDS = ("global", "forward", "backward", "local")
DECODER_BRANCH_KINDS = ("forward", "local")
FUSIONS = ("sum", "concat", "gated_sum")
_LOCAL_WITH_K = re.compile(r"^local_(\d+)$")

# The paper's e1 setting (docs/variants-spec.md §2.3), shared by every preset.
HYSAN_E1 = dict(
    encoder_branches=["global", "forward", "backward", "local"],
    decoder_branches=["forward", "local"],
    local_k=5,
    fusion="gated_sum",
    gate_reduction=16,
    use_positional_embeddings=True,
    normalize_before=True,
)
# tensor2tensor's `transformer_base` / `transformer_small` (the setting the paper was run in): attention and ReLU
# dropout 0.1 beside the residual dropout (docs/variants-spec.md §2.4).
T2T_DROPOUT = dict(attention_dropout=0.1, activation_dropout=0.1)


class HysanConfig(TransformerNmtConfig):
    r"""
    Configuration of [`HysanForConditionalGeneration`]. Takes every argument of [`TransformerNmtConfig`] plus:

    Args:
        encoder_branches (`list[str]`): branches of every encoder self-attention, each an allowed set of keys j for
            query i (always ANDed with key padding): `"global"` (all j), `"forward"` (j <= i), `"backward"`
            (j >= i), `"local"` (|i - j| <= k, one branch per value of `local_k`) or `"local_<k>"` (an explicit
            window, e.g. `"local_2"`).
        decoder_branches (`list[str]`): branches of every decoder self-attention: `"forward"` (the causal mask,
            j <= i) and `"local"` / `"local_<k>"` (causal local: 0 <= i - j <= k). Nothing in the decoder sees the
            future, so `"global"` and `"backward"` are rejected.
        local_k (`int` or `list[int]`): window radius k of the `"local"` entries; a list gives one local branch per
            value (the paper's e2 setting uses [1, 2, 5]).
        fusion (`str`): `"sum"` (o = W^o sum_b x_b, no parameters), `"concat"` (o = H[x_1; ...; x_l], H: l*d -> d
            replaces W^o) or `"gated_sum"` (o = W^o sum_b x_b * SG(x_b), SG(x) = sigmoid(W2 ReLU(W1 x)) shared by
            the branches of one module).
        gate_reduction (`int`): the squeeze ratio r of the gate (W1: d -> d/r, W2: d/r -> d, no biases).
        use_positional_embeddings (`bool`): False is the paper's "NoPos" study (`position_embedding_type="none"`).
        attention_dropout / activation_dropout (`float`): 0.1 by default (tensor2tensor's attention and ReLU
            dropout), unlike the baseline's 0.0.
    """

    model_type = "hysan_nmt"
    derived_fields: ClassVar[dict[str, str]] = {"use_positional_embeddings": "position_embedding_type"}
    FIELD_TYPES: ClassVar[dict[str, tuple]] = {
        "encoder_branches": (STR_LIST,),
        "decoder_branches": (STR_LIST,),
        "local_k": (INT, INT_LIST),
        "fusion": (STR,),
        "gate_reduction": (INT,),
        "use_positional_embeddings": (BOOL,),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        **{name: {**preset, **HYSAN_E1, **T2T_DROPOUT} for name, preset in TransformerNmtConfig.PRESETS.items()},
        # Unit tests only: no dropout anywhere.
        "tiny": {
            **TransformerNmtConfig.PRESETS["tiny"],
            **HYSAN_E1,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
        },
        # The paper's IWSLT14 setting: 2 + 2 layers, d 256, 4 heads (tensor2tensor transformer_small, FFN 1024).
        "small": {
            **TransformerNmtConfig.PRESETS["small"],
            "encoder_layers": 2,
            "decoder_layers": 2,
            **HYSAN_E1,
            **T2T_DROPOUT,
        },
    }

    def __init__(
        self,
        encoder_branches: list[str] | None = None,
        decoder_branches: list[str] | None = None,
        local_k: int | list[int] = 5,
        fusion: str = "gated_sum",
        gate_reduction: int = 16,
        use_positional_embeddings: bool = True,
        normalize_before: bool = True,
        attention_dropout: float = 0.1,
        activation_dropout: float = 0.1,
        **kwargs,
    ):
        check_field_type(type(self), "use_positional_embeddings", use_positional_embeddings)  # before it is read
        if not use_positional_embeddings:
            kwargs["position_embedding_type"] = "none"
        super().__init__(
            normalize_before=normalize_before,
            attention_dropout=attention_dropout,
            activation_dropout=activation_dropout,
            **kwargs,
        )
        self.encoder_branches = _as_list(
            encoder_branches if encoder_branches is not None else HYSAN_E1["encoder_branches"]
        )
        self.decoder_branches = _as_list(
            decoder_branches if decoder_branches is not None else HYSAN_E1["decoder_branches"]
        )
        self.local_k = list(local_k) if isinstance(local_k, (list, tuple)) else local_k
        self.fusion = fusion
        self.gate_reduction = gate_reduction
        # Derived, so that the two fields never disagree (position_embedding_type="none" also means NoPos).
        self.use_positional_embeddings = self.position_embedding_type != "none"
        self._validate_hysan()

    def _validate_hysan(self) -> None:
        self._check_field_types()
        ks = self.local_k if isinstance(self.local_k, list) else [self.local_k]
        _check(
            len(ks) > 0
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in ks)
            and len(set(ks)) == len(ks),
            "local_k",
            "a positive integer or a list of distinct positive integers",
            self.local_k,
        )
        for side, kinds in (("encoder", ENCODER_BRANCH_KINDS), ("decoder", DECODER_BRANCH_KINDS)):
            field = f"{side}_branches"
            allowed = f"a non-empty list of distinct branches among {list(kinds)} or 'local_<k>' (k >= 1)" + (
                "; the decoder never sees the future, so no 'global'/'backward'" if side == "decoder" else ""
            )
            names = getattr(self, field)
            _check(
                len(names) > 0 and all(isinstance(n, str) and (n in kinds or _LOCAL_WITH_K.match(n)) for n in names),
                field,
                allowed,
                names,
            )
            specs = self.branch_specs(side)
            _check(len(set(specs)) == len(specs) and all(k is None or k > 0 for _, k in specs), field, allowed, names)
        _check(self.fusion in FUSIONS, "fusion", f"one of {list(FUSIONS)}", self.fusion)
        _check(
            isinstance(self.gate_reduction, int)
            and not isinstance(self.gate_reduction, bool)
            and self.gate_reduction > 0
            and self.d_model % self.gate_reduction == 0,
            "gate_reduction",
            f"a positive divisor of d_model={self.d_model}",
            self.gate_reduction,
        )

    def branch_specs(self, side: str) -> list[tuple[str, int | None]]:
        """The branches of one side as (kind, k) pairs, `"local"` expanded to one branch per `local_k`."""
        names = self.encoder_branches if side == "encoder" else self.decoder_branches
        ks = self.local_k if isinstance(self.local_k, list) else [self.local_k]
        specs = []
        for name in names:
            match = _LOCAL_WITH_K.match(name)
            if match:
                specs.append(("local", int(match.group(1))))
            elif name == "local":
                specs.extend(("local", k) for k in ks)
            else:
                specs.append((name, None))
        return specs

    def num_branches(self, side: str) -> int:
        return len(self.branch_specs(side))


__all__ = ["HysanConfig"]
