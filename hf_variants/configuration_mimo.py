"""Configuration of MIMO: the multilingual Transformer with task-aware multi-input-multi-output cardinality of
Xu, Liu, van Genabith and Xiong (ACL 2021), "Modeling Task-Aware MIMO Cardinality for Efficient Multilingual NMT".

The `__init__` defaults are the paper's setting (6 layers, 4 full-size transformations per block, post-norm
"Trans" units with the Lipschitz-constrained initialisation, Neutron's dropouts). See `docs/variants-spec.md` §4.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .configuration_transformer_nmt import BOOL, FLOAT, INT, STR, TransformerNmtConfig, _check

MIMO_MEMORY_MODES = ("mix", "merge")


class MimoConfig(TransformerNmtConfig):
    r"""
    Configuration of [`MimoForConditionalGeneration`]. Takes every argument of [`TransformerNmtConfig`] and:

    Args:
        num_transformations (`int`): n, the cardinality: full-size parallel transformations (attention or FFN
            sub-layers, each with its own LayerNorm) in every block. 4 in the paper (6 layers x 4 matches the
            parameters of a 24-layer Transformer).
        mimo (`bool`): the multi-input-multi-output links (eq. 2-4): the input of transformation k of a block is its
            own softmax-weighted sum of the previous block's n outputs. `False` is the "-MIMO" ablation (Tab. 2):
            every block takes ONE merged input (Fig. 1(a)/(d)), merged with task-aware weights.
        task_attention (`bool`): mixing weights are learned per target language (task), `softmax(V[task, k, :])`,
            gathered per example from `tgt_lang_ids`. `False` is the "-Task Attention" ablation: every link is the
            plain sum of the previous block's outputs (eq. 1, the ResNeXt/MUTE-style block of Fig. 1(a)); with a
            plain sum every transformation receives the same input, so `mimo` then makes no difference.
        mimo_memory (`str`): what decoder cross-attention reads (the paper is silent; DECISION in
            docs/variants-spec.md §4.1):
            `"mix"` keeps the encoder's n output streams and gives cross-attention transformation k of every decoder
            layer its own task-aware mixture of them; `"merge"` merges the streams once at the encoder top with one
            task-aware many-to-one link.
        mixing_init_std (`float`): standard deviation of the initial task-attention logits. 0 (DECISION in
            docs/variants-spec.md §4.1) starts every mixture uniform at 1/n.
        normalize_before (`bool`): False (default) is the paper's post-norm "Trans" unit,
            LN_k(i_k + Dropout(f_k(i_k))); True makes every unit pre-norm, i_k + Dropout(f_k(LN_k(i_k))), with the
            backbone's final LayerNorm on each encoder output stream and on the decoder's output (what a warm start
            from a pre-norm base, e.g. a converted NLLB-200 / M2M100, needs). Pre-norm needs task attention
            (softmax links): plain sums of n residual streams would grow n-fold per block.
        lipschitz_init (`bool`): Neutron's Lipschitz-constrained initialisation (the paper's, §4.1): every weight
            matrix U(+-1/sqrt(fan_in)), embeddings Xavier-uniform with gain sqrt(1/3) (padding row 0), biases 0,
            LayerNorms 1/0. `False` uses the backbone's `init_method`.

    Multilingual plumbing: `languages` lists the target languages; a language's index is its task id
    (`language_id`). With `languages` set, `target_language_tags` defaults to True: the source carries `<2xx>`.
    """

    model_type = "mimo_nmt"
    FIELD_TYPES: ClassVar[dict[str, tuple]] = {
        "num_transformations": (INT,),
        "mimo_memory": (STR,),
        "mixing_init_std": (FLOAT,),
        **dict.fromkeys(("mimo", "task_attention", "lipschitz_init"), (BOOL,)),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        **TransformerNmtConfig.PRESETS,
        "tiny": {**TransformerNmtConfig.PRESETS["tiny"], "num_transformations": 2},
        "small": {**TransformerNmtConfig.PRESETS["small"], "num_transformations": 4},
        "base": {**TransformerNmtConfig.PRESETS["base"], "num_transformations": 4},
        "big": {**TransformerNmtConfig.PRESETS["big"], "num_transformations": 4},
    }

    def __init__(
        self,
        num_transformations: int = 4,
        mimo: bool = True,
        task_attention: bool = True,
        mimo_memory: str = "mix",
        mixing_init_std: float = 0.0,
        lipschitz_init: bool = True,
        attention_dropout: float = 0.1,
        activation_dropout: float = 0.1,
        languages: list[str] | None = None,
        target_language_tags: bool | None = None,
        **kwargs,
    ):
        if target_language_tags is None:  # the source carries `<2xx>` whenever the model is multilingual (and the
            # target language is not the decoder's first token, M2M100 / NLLB's way: `target_language_token`)
            target_language_tags = bool(languages) and not kwargs.get("target_language_token", False)
        super().__init__(
            attention_dropout=attention_dropout,
            activation_dropout=activation_dropout,
            languages=languages,
            target_language_tags=target_language_tags,
            **kwargs,
        )
        self.num_transformations = num_transformations
        self.mimo = mimo
        self.task_attention = task_attention
        self.mimo_memory = mimo_memory
        self.mixing_init_std = mixing_init_std
        self.lipschitz_init = lipschitz_init
        self._validate_mimo()

    def _validate_mimo(self) -> None:
        self._check_field_types()
        n = self.num_transformations
        _check(
            isinstance(n, int) and not isinstance(n, bool) and n > 0, "num_transformations", "a positive integer", n
        )
        for name in ("mimo", "task_attention", "lipschitz_init"):
            _check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        _check(self.mimo_memory in MIMO_MEMORY_MODES, "mimo_memory", f"one of {MIMO_MEMORY_MODES}", self.mimo_memory)
        _check(
            isinstance(self.mixing_init_std, (int, float))
            and not isinstance(self.mixing_init_std, bool)
            and self.mixing_init_std >= 0,
            "mixing_init_std",
            "a float >= 0",
            self.mixing_init_std,
        )
        _check(
            not (self.normalize_before and not self.task_attention),
            "normalize_before",
            "False with task_attention=False (plain sums of n pre-norm residual streams grow n-fold per block)",
            self.normalize_before,
        )
        _check(
            self.max_relative_positions == 0,
            "max_relative_positions",
            "0 (MIMO uses sinusoidal absolute positions; relative positions are not implemented for stacked "
            "transformations)",
            self.max_relative_positions,
        )

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads per cache layer: the n transformations' heads side by side (what cache utilities and
        cache-format checks read; `head_dim` is each head's width)."""
        return self.num_transformations * self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_attention_heads

    @property
    def num_tasks(self) -> int:
        """Rows of every task-attention table: one per target language (1 for a model without `languages`)."""
        return max(1, len(self.languages))


__all__ = ["MimoConfig"]
