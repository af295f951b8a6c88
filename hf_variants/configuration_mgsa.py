"""Configuration of MG-SA, Multi-Granularity Self-Attention (Hao, Wang, Shi, Zhang, Tu, EMNLP 2019).

In the encoder layers listed in `mgsa_layers`, a quarter of the self-attention heads stay word-level and every
other group of heads attends to a *phrase memory* of one granularity: non-overlapping n-grams (n = 2, 3, 4) or the
top levels of a constituency parse. A phrase memory is built by composition (max-pool, SAN or LSTM over each
phrase's tokens), optionally supervised by the phrase's constituent tag, then by interaction (LSTM or ON-LSTM over
the phrases). The defaults are the paper's final model (Tab. 3-4: syntactic phrases + L_tag + ON-LSTM, bottom
layer only), with dimensions resolved from its parameter counts (`docs/variants-spec.md` §3).
"""

from __future__ import annotations

from typing import Any, ClassVar

from .configuration_transformer_nmt import (
    BOOL,
    FLOAT,
    INT,
    INT_LIST,
    NONE,
    STR,
    STR_LIST,
    TransformerNmtConfig,
    _as_list,
    _check,
)
from .phrases import PTB_TAG_LABELS, TAG_LABEL_SETS

PHRASE_TYPES = ("ngram", "syntactic")
COMPOSITIONS = ("max_pool", "san", "lstm")
INTERACTIONS = ("none", "lstm", "on_lstm")
PHRASE_KV = ("split", "project")
TAG_CLASSIFIERS = ("shared", "per_level")
LSTM_COMPOSITION_SIZES = ("state", "model")
PHRASE_KV_ROWS = ("used", "all")

# What a config saved by hf_variants <= 0.2 meant by the fields it did not have yet (`from_dict` fills them in for a
# saved config that lacks them, so an old model keeps computing what it was trained to compute).
SAVED_BEFORE_0_3 = dict(ngram_skip_special_tokens=False, lstm_composition_size="model", phrase_kv_rows="all")

# The paper's final model (Tab. 4 "MG-SA"), used by the `base` and `big` presets.
MGSA_PAPER = dict(
    mgsa_layers=[0],
    phrase_type="syntactic",
    syntactic_levels=3,
    phrase_composition="san",
    phrase_interaction="on_lstm",
    tag_loss_weight=0.001,
)


class MgsaConfig(TransformerNmtConfig):
    r"""
    Configuration of [`MgsaForConditionalGeneration`]. Takes every argument of [`TransformerNmtConfig`] plus:

    Args:
        mgsa_layers (`list[int]`): 0-based encoder layers whose self-attention is MG-SA (default `[0]`, the bottom
            layer, the paper's best, Tab. 2). `[]` gives the baseline.
        phrase_type (`str`): `"syntactic"` (phrases = nodes of the top `syntactic_levels` levels of a parse; the
            model needs `phrase_index`, and `phrase_tags` for the tag loss, see `prepare_translation_inputs(...,
            parses=...)`) or `"ngram"` (non-overlapping n-grams of each size in `ngram_sizes`, derived from the
            attention mask; no extra inputs).
        ngram_sizes (`list[int]`): one phrase group per n (paper: 2, 3, 4).
        syntactic_levels (`int`): one phrase group per parse level (paper: 3).
        mgsa_word_heads (`int` or `None`): word-level heads; `None` = about 1 / (groups + 1) of the heads (a
            quarter with the paper's 3 groups), rounded up so that the phrase groups get equal head counts. The
            other heads are split evenly among the phrase groups; a group of h_g heads has width
            d_g = h_g * head_dim (d/4 in the paper).
        ngram_skip_special_tokens (`bool`): n-gram phrases are counted on the source's words only: the `</s>` that
            ends every source (its last real token) and, with `target_language_tags`, the `<2xx>` tag that starts it
            (its first real token) belong to no phrase (docs/variants-spec.md §3.2a). Derived from the attention
            mask and the config alone, so the n-gram model takes exactly the inputs of any seq2seq model (and
            `inputs_embeds` works). False (configs saved by hf_variants <= 0.2) counts every real token.
        phrase_composition (`str`): `"max_pool"` (g_m = max over the phrase's tokens, no parameters), `"san"` (the
            max-pooled vector queries the phrase's tokens: W_Q, W_K in R^{d x d_g} per group, no value projection;
            default) or `"lstm"` (last hidden state of an LSTM run over the phrase's tokens, per group, d -> d_g in
            `split` mode, see `lstm_composition_size`).
        lstm_composition_size (`str`): hidden size of the `"lstm"` composition: `"state"` (default: the phrase
            state width, d_g in `split` mode, d in `project` mode; the heads read K = V = slices of a d_g-wide
            memory, docs/variants-spec.md §3.2b) or `"model"` (d -> d in every mode, the layout of hf_variants
            <= 0.2).
        phrase_interaction (`str`): `"none"`, `"lstm"` or `"on_lstm"` (ordered-neurons LSTM, cumax master gates;
            default), run left to right over each group's phrases, one recurrent net per group.
        on_lstm_chunk_size (`int`): ON-LSTM chunk size C (master gates have d_state / C entries; paper count: 1).
        mgsa_phrase_kv (`str`): keys/values of the phrase heads. `"split"` (default, count-derived): with an
            interaction, the recurrent state has width d_g and K = V = its slice per head (no projection); without
            one, K = G W_K, V = G W_V (eq. 5). `"project"`: the recurrent state has width d and K, V are always
            projected with the heads' W_K, W_V (eq. 5 literally; more parameters).
        phrase_kv_rows (`str`): rows of the fused QKV projection: `"used"` (default: queries for every head, keys
            and values for the heads that project them; the phrase heads of a `split` memory have none) or
            `"all"` (K/V rows for every head, unused ones included: the layout of checkpoints saved by
            hf_variants <= 0.2; `from_pretrained` slices the unused rows away and switches to `"used"`).
        tag_loss_weight (`float`): lambda of the phrase tag loss (syntactic phrases; 0.001 in the paper; 0
            disables the tag classifier). The loss is the SUM of the tag cross-entropies over the batch's phrases,
            divided, like the translation loss, by the number of target tokens.
        phrase_tag_labels (`list[str]` or `str`): constituent tag vocabulary: a list of labels, or the name of a
            built-in one: `"ptb"` (default: Penn Treebank phrase labels and POS tags, for English parses) or `"ctb"`
            (Penn Chinese Treebank labels and POS tags, for Chinese parses: the paper's Zh-En setting), stored as
            given (`tag_labels` is the list). Labels outside it are not supervised.
        tag_classifier (`str`): `"per_level"` (one softmax layer W_t, b_t per parse level; default, a DECISION
            in docs/variants-spec.md §3.2) or `"shared"` (one for all levels). The tag head is training-only: the
            paper's parameter counts are reproduced without it (see `test_parameter_counts_of_the_paper`).
    """

    model_type = "mgsa_nmt"
    FIELD_TYPES: ClassVar[dict[str, tuple]] = {
        "mgsa_layers": (INT_LIST,),
        "ngram_sizes": (INT_LIST,),
        "syntactic_levels": (INT,),
        "mgsa_word_heads": (INT, NONE),
        "on_lstm_chunk_size": (INT,),
        "tag_loss_weight": (FLOAT,),
        "phrase_tag_labels": (STR_LIST, STR),
        "ngram_skip_special_tokens": (BOOL,),
        **dict.fromkeys(
            (
                "phrase_type",
                "phrase_composition",
                "phrase_interaction",
                "mgsa_phrase_kv",
                "tag_classifier",
                "lstm_composition_size",
                "phrase_kv_rows",
            ),
            (STR,),
        ),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        **{name: {**preset, **MGSA_PAPER} for name, preset in TransformerNmtConfig.PRESETS.items()},
        # Quick runs on corpora without a parser: n-gram phrases (Tab. 3 row 2 with ON-LSTM interaction).
        "small": {**TransformerNmtConfig.PRESETS["small"], **MGSA_PAPER, "phrase_type": "ngram"},
    }

    def __init__(
        self,
        mgsa_layers: list[int] | None = None,
        phrase_type: str = "syntactic",
        ngram_sizes: list[int] | None = None,
        syntactic_levels: int = 3,
        mgsa_word_heads: int | None = None,
        phrase_composition: str = "san",
        phrase_interaction: str = "on_lstm",
        on_lstm_chunk_size: int = 1,
        mgsa_phrase_kv: str = "split",
        tag_loss_weight: float = 0.001,
        phrase_tag_labels: list[str] | str | None = None,
        tag_classifier: str = "per_level",
        ngram_skip_special_tokens: bool = True,
        lstm_composition_size: str = "state",
        phrase_kv_rows: str = "used",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.mgsa_layers = _as_list(mgsa_layers) if mgsa_layers is not None else [0]
        self.phrase_type = phrase_type
        self.ngram_sizes = _as_list(ngram_sizes) if ngram_sizes is not None else [2, 3, 4]
        self.syntactic_levels = syntactic_levels
        self.mgsa_word_heads = mgsa_word_heads
        self.phrase_composition = phrase_composition
        self.phrase_interaction = phrase_interaction
        self.on_lstm_chunk_size = on_lstm_chunk_size
        self.mgsa_phrase_kv = mgsa_phrase_kv
        self.tag_loss_weight = tag_loss_weight
        if phrase_tag_labels is None:
            phrase_tag_labels = PTB_TAG_LABELS
        self.phrase_tag_labels = _as_list(phrase_tag_labels)
        self.tag_classifier = tag_classifier
        self.ngram_skip_special_tokens = ngram_skip_special_tokens
        self.lstm_composition_size = lstm_composition_size
        self.phrase_kv_rows = phrase_kv_rows
        self._validate_mgsa()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """A saved config (it carries `transformers_version`) without the fields added in hf_variants 0.3 was
        saved by an older version: those fields take the values that reproduce it (`SAVED_BEFORE_0_3`)."""
        if "transformers_version" in config_dict:
            config_dict = {**{k: v for k, v in SAVED_BEFORE_0_3.items() if k not in config_dict}, **config_dict}
        return super().from_dict(config_dict, **kwargs)

    # ----------------------------------------------------------------------------------------- derived values
    @property
    def required_source_annotations(self) -> dict[str, str]:
        """Source annotations every sentence needs (name -> how to do without), read by training scripts before
        they train: the syntactic MG-SA needs a constituency parse of each source sentence."""
        if self.phrase_type == "syntactic" and self.num_phrase_groups and self.mgsa_layers:
            return {
                "parses": "or train the n-gram form, which needs none: train.py --config_overrides phrase_type=ngram "
                "(the config field phrase_type='ngram'; the `small` preset's form)"
            }
        return {}

    @property
    def num_phrase_groups(self) -> int:
        """G: one head group per n-gram size or parse level (0 = no phrase heads)."""
        return len(self.ngram_sizes) if self.phrase_type == "ngram" else self.syntactic_levels

    @property
    def word_heads(self) -> int:
        heads, groups = self.encoder_attention_heads, self.num_phrase_groups
        if groups == 0:
            return heads
        if self.mgsa_word_heads is not None:
            return self.mgsa_word_heads
        # a quarter with 3 groups (the paper); in general about 1/(G+1), rounded so that the groups are equal
        return heads - groups * ((heads - heads // (groups + 1)) // groups)

    @property
    def heads_per_group(self) -> int:
        groups = self.num_phrase_groups
        return (self.encoder_attention_heads - self.word_heads) // groups if groups else 0

    @property
    def group_dim(self) -> int:
        """d_g: width of one phrase group's heads (and of its recurrent state in `split` mode)."""
        return self.heads_per_group * (self.d_model // self.encoder_attention_heads)

    @property
    def phrase_state_dim(self) -> int:
        """Width of the learned phrase states (ON-LSTM / LSTM interaction, LSTM composition): d_g in `split`
        mode (the heads read their slices), d in `project` mode (the heads project them with W_K, W_V)."""
        return self.group_dim if self.mgsa_phrase_kv == "split" else self.d_model

    @property
    def composed_dim(self) -> int:
        """Width of a composed phrase g_m: d for max-pool and SAN (weighted sums of token vectors), the LSTM's
        hidden size for the LSTM composition."""
        if self.phrase_composition != "lstm":
            return self.d_model
        return self.phrase_state_dim if self.lstm_composition_size == "state" else self.d_model

    @property
    def phrase_heads_project_kv(self) -> bool:
        """Whether the phrase heads' keys and values are projected from the memory (eq. 5, with their rows of the
        fused QKV), or are the heads' slices of a d_g-wide memory (`split` mode with an interaction or an LSTM
        composition of the state size)."""
        if self.mgsa_phrase_kv == "project":
            return True
        return self.phrase_interaction == "none" and self.composed_dim == self.d_model

    @property
    def tag_labels(self) -> list[str]:
        """The tag vocabulary as a list (`phrase_tag_labels`, a built-in name resolved)."""
        labels = self.phrase_tag_labels
        return list(TAG_LABEL_SETS[labels.lower()]) if isinstance(labels, str) else list(labels)

    @property
    def uses_tag_loss(self) -> bool:
        return (
            self.phrase_type == "syntactic"
            and self.tag_loss_weight > 0
            and self.num_phrase_groups > 0
            and len(self.tag_labels) > 0
            and len(self.mgsa_layers) > 0
        )

    # ----------------------------------------------------------------------------------------------- validation
    def _validate_mgsa(self) -> None:
        self._check_field_types()
        layers = self.mgsa_layers
        _check(
            all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.encoder_layers for i in layers)
            and len(set(layers)) == len(layers),
            "mgsa_layers",
            f"a list of distinct encoder layer indices in [0, encoder_layers={self.encoder_layers})",
            layers,
        )
        _check(self.phrase_type in PHRASE_TYPES, "phrase_type", f"one of {PHRASE_TYPES}", self.phrase_type)
        _check(
            all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.ngram_sizes),
            "ngram_sizes",
            "a list of integers >= 1",
            self.ngram_sizes,
        )
        _check(
            isinstance(self.syntactic_levels, int) and self.syntactic_levels >= 0,
            "syntactic_levels",
            "an integer >= 0",
            self.syntactic_levels,
        )
        heads, groups = self.encoder_attention_heads, self.num_phrase_groups
        if groups:
            word = self.word_heads
            _check(
                isinstance(word, int) and 0 <= word < heads and (heads - word) % groups == 0,
                "mgsa_word_heads",
                f"None or an integer w in [0, encoder_attention_heads={heads}) with {heads} - w divisible by the "
                f"{groups} phrase groups",
                self.mgsa_word_heads,
            )
        _check(
            self.phrase_composition in COMPOSITIONS,
            "phrase_composition",
            f"one of {COMPOSITIONS}",
            self.phrase_composition,
        )
        _check(
            self.phrase_interaction in INTERACTIONS,
            "phrase_interaction",
            f"one of {INTERACTIONS}",
            self.phrase_interaction,
        )
        _check(self.mgsa_phrase_kv in PHRASE_KV, "mgsa_phrase_kv", f"one of {PHRASE_KV}", self.mgsa_phrase_kv)
        chunk = self.on_lstm_chunk_size
        state = self.d_model if self.mgsa_phrase_kv == "project" else self.group_dim
        _check(
            isinstance(chunk, int) and chunk >= 1 and (not groups or state % chunk == 0),
            "on_lstm_chunk_size",
            f"a positive divisor of the ON-LSTM state size {state}",
            chunk,
        )
        _check(
            isinstance(self.tag_loss_weight, (int, float)) and self.tag_loss_weight >= 0,
            "tag_loss_weight",
            "a float >= 0",
            self.tag_loss_weight,
        )
        labels = self.phrase_tag_labels
        if isinstance(labels, str):
            _check(
                labels.lower() in TAG_LABEL_SETS,
                "phrase_tag_labels",
                f"a list of labels or the name of a built-in one, {sorted(TAG_LABEL_SETS)}",
                labels,
            )
        else:
            _check(
                all(isinstance(x, str) and x for x in labels) and len(set(labels)) == len(labels),
                "phrase_tag_labels",
                f"a list of distinct non-empty strings, or one of {sorted(TAG_LABEL_SETS)}",
                labels,
            )
        _check(
            self.tag_classifier in TAG_CLASSIFIERS, "tag_classifier", f"one of {TAG_CLASSIFIERS}", self.tag_classifier
        )
        _check(
            isinstance(self.ngram_skip_special_tokens, bool),
            "ngram_skip_special_tokens",
            "a bool",
            self.ngram_skip_special_tokens,
        )
        _check(
            self.lstm_composition_size in LSTM_COMPOSITION_SIZES,
            "lstm_composition_size",
            f"one of {LSTM_COMPOSITION_SIZES}",
            self.lstm_composition_size,
        )
        _check(
            self.phrase_kv_rows in PHRASE_KV_ROWS, "phrase_kv_rows", f"one of {PHRASE_KV_ROWS}", self.phrase_kv_rows
        )


__all__ = ["MgsaConfig"]
