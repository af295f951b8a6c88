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

from .configuration_transformer_nmt import TransformerNmtConfig, _check
from .phrases import PTB_TAG_LABELS


PHRASE_TYPES = ("ngram", "syntactic")
COMPOSITIONS = ("max_pool", "san", "lstm")
INTERACTIONS = ("none", "lstm", "on_lstm")
PHRASE_KV = ("split", "project")
TAG_CLASSIFIERS = ("shared", "per_level")

# The paper's final model (Tab. 4 "MG-SA"), used by the `base` and `big` presets.
MGSA_PAPER = dict(mgsa_layers=[0], phrase_type="syntactic", syntactic_levels=3, phrase_composition="san",
                  phrase_interaction="on_lstm", tag_loss_weight=0.001)


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
        phrase_composition (`str`): `"max_pool"` (g_m = max over the phrase's tokens, no parameters), `"san"` (the
            max-pooled vector queries the phrase's tokens: W_Q, W_K in R^{d x d_g} per group, no value projection;
            default) or `"lstm"` (last hidden state of an LSTM d -> d run over the phrase's tokens, per group).
        phrase_interaction (`str`): `"none"`, `"lstm"` or `"on_lstm"` (ordered-neurons LSTM, cumax master gates;
            default), run left to right over each group's phrases, one recurrent net per group.
        on_lstm_chunk_size (`int`): ON-LSTM chunk size C (master gates have d_state / C entries; paper count: 1).
        mgsa_phrase_kv (`str`): keys/values of the phrase heads. `"split"` (default, count-derived): with an
            interaction, the recurrent state has width d_g and K = V = its slice per head (no projection); without
            one, K = G W_K, V = G W_V (eq. 5). `"project"`: the recurrent state has width d and K, V are always
            projected with the heads' W_K, W_V (eq. 5 literally; more parameters).
        tag_loss_weight (`float`): lambda of the phrase tag loss (syntactic phrases; 0.001 in the paper; 0
            disables the tag classifier). The loss is the SUM of the tag cross-entropies over the batch's phrases,
            divided, like the translation loss, by the number of target tokens.
        phrase_tag_labels (`list[str]`): constituent tag vocabulary (default: Penn Treebank phrase labels and POS
            tags). Labels outside it are not supervised.
        tag_classifier (`str`): `"per_level"` (one softmax layer W_t, b_t per parse level; default, a DECISION
            in docs/variants-spec.md §3.2) or `"shared"` (one for all levels). The tag head is training-only: the paper's parameter
            counts are reproduced without it (see `test_parameter_counts_of_the_paper`).
    """

    model_type = "mgsa_nmt"
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
        phrase_tag_labels: list[str] | None = None,
        tag_classifier: str = "per_level",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.mgsa_layers = list(mgsa_layers) if mgsa_layers is not None else [0]
        self.phrase_type = phrase_type
        self.ngram_sizes = list(ngram_sizes) if ngram_sizes is not None else [2, 3, 4]
        self.syntactic_levels = syntactic_levels
        self.mgsa_word_heads = mgsa_word_heads
        self.phrase_composition = phrase_composition
        self.phrase_interaction = phrase_interaction
        self.on_lstm_chunk_size = on_lstm_chunk_size
        self.mgsa_phrase_kv = mgsa_phrase_kv
        self.tag_loss_weight = tag_loss_weight
        self.phrase_tag_labels = list(phrase_tag_labels) if phrase_tag_labels is not None else list(PTB_TAG_LABELS)
        self.tag_classifier = tag_classifier
        self._validate_mgsa()

    # ----------------------------------------------------------------------------------------- derived values
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
    def uses_tag_loss(self) -> bool:
        return (self.phrase_type == "syntactic" and self.tag_loss_weight > 0 and self.num_phrase_groups > 0
                and len(self.phrase_tag_labels) > 0 and len(self.mgsa_layers) > 0)

    # ----------------------------------------------------------------------------------------------- validation
    def _validate_mgsa(self) -> None:
        layers = self.mgsa_layers
        _check(all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.encoder_layers for i in layers)
               and len(set(layers)) == len(layers), "mgsa_layers",
               f"a list of distinct encoder layer indices in [0, encoder_layers={self.encoder_layers})", layers)
        _check(self.phrase_type in PHRASE_TYPES, "phrase_type", f"one of {PHRASE_TYPES}", self.phrase_type)
        _check(all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.ngram_sizes),
               "ngram_sizes", "a list of integers >= 1", self.ngram_sizes)
        _check(isinstance(self.syntactic_levels, int) and self.syntactic_levels >= 0, "syntactic_levels",
               "an integer >= 0", self.syntactic_levels)
        heads, groups = self.encoder_attention_heads, self.num_phrase_groups
        if groups:
            word = self.word_heads
            _check(isinstance(word, int) and 0 <= word < heads and (heads - word) % groups == 0, "mgsa_word_heads",
                   f"None or an integer w in [0, encoder_attention_heads={heads}) with {heads} - w divisible by the "
                   f"{groups} phrase groups", self.mgsa_word_heads)
        _check(self.phrase_composition in COMPOSITIONS, "phrase_composition", f"one of {COMPOSITIONS}",
               self.phrase_composition)
        _check(self.phrase_interaction in INTERACTIONS, "phrase_interaction", f"one of {INTERACTIONS}",
               self.phrase_interaction)
        _check(self.mgsa_phrase_kv in PHRASE_KV, "mgsa_phrase_kv", f"one of {PHRASE_KV}", self.mgsa_phrase_kv)
        chunk = self.on_lstm_chunk_size
        state = self.d_model if self.mgsa_phrase_kv == "project" else self.group_dim
        _check(isinstance(chunk, int) and chunk >= 1 and (not groups or state % chunk == 0), "on_lstm_chunk_size",
               f"a positive divisor of the ON-LSTM state size {state}", chunk)
        _check(isinstance(self.tag_loss_weight, (int, float)) and self.tag_loss_weight >= 0, "tag_loss_weight",
               "a float >= 0", self.tag_loss_weight)
        labels = self.phrase_tag_labels
        _check(all(isinstance(x, str) and x for x in labels) and len(set(labels)) == len(labels),
               "phrase_tag_labels", "a list of distinct non-empty strings", labels)
        _check(self.tag_classifier in TAG_CLASSIFIERS, "tag_classifier", f"one of {TAG_CLASSIFIERS}",
               self.tag_classifier)


__all__ = ["MgsaConfig"]
