"""Warm start: build a MUTE, HySAN, MG-SA, MIMO or Tied model from a pretrained baseline (`transformer_nmt`, hence
any Marian / opus-mt model converted with `hf_variants.convert_marian`; a saved `MarianMTModel` folder is converted
on the fly).

    python -m hf_variants.warm_start --base DIR --model_type mute_nmt [--config_overrides merge=plain] \\
        --output_dir OUT

or `warm_start(base, "mute_nmt", {"merge": "plain"}, output_dir=OUT)`. The variant keeps the base's dimensions,
vocabulary, special tokens, languages and backbone settings (norm placement, positions, activation, embedding
sharing); dropouts, label smoothing and the init of new parameters default to the base's values and may be
overridden, like every variant field. Every weight the two models share is copied (mapped by state-dict key, e.g.
MUTE's `...self_attn.qkv_proj.units.{k}.weight` <- the base's `...self_attn.qkv_proj.weight`), and what the paper
adds is initialised so that the variant starts as close to the pretrained function as the paper allows:

- **MUTE** (`mute_nmt`): every unit of an encoder layer is a copy of the pretrained layer (attention, FFN, its
  LayerNorm, relative table if any), alpha = 1/I. With identical units the `plain` merge (sum_i alpha_i F_i) is the
  pretrained layer: **exact** (eval logits equal the base's). The `seq` merge (the default, MUTE + Bias + Seq) is
  exact too: with the uniform AutoShuffle M (doubly stochastic, a fixed point of its projection; an `abs_normal` M is
  projected here first) G_j = sum_i M_ij F = F, G^_j / j = F and out = sum_j alpha_j F = F. In training the bias
  module's noise (the new `mask_embedding` included) and, for `seq`, the Lipschitz penalty (4 per layer at uniform
  M, divided by the target tokens) are added, as the paper trains.
- **HySAN** (`hysan_nmt`): the branches reuse the pretrained Q/K/V (one shared score matrix, as in the paper) and
  output projection; the reference branch is the one the base computes (encoder `global`, decoder `forward` = causal).
  `concat` fusion: H = [W^o on the reference branch, 0 on the others]: **exact**. `sum` / `gated_sum` (the paper's
  default) cannot select a branch (the squeeze gate reads the branch's content, not its name): the gate's `excite`
  matrix is zeroed (gate = sigmoid(0) = 1/2 everywhere, `squeeze` keeps its random init so the gate learns from step
  1) and W^o is scaled by 2/nb (gated) or 1/nb (sum), so the output is W^o applied to the **mean of the branches**:
  an attention whose probabilities are the mean of the branches' (a valid attention distribution). Not exact; the
  distance is measured in `modeling_tests/test_warm_start.py` and README ("Warm start").
- **MG-SA** (`mgsa_nmt`): in the MG-SA layers the word heads are the base's first `word_heads` heads (queries, keys,
  values); the phrase heads keep the base's queries; the phrase memory (composition, ON-LSTM / LSTM interaction) and
  the tag classifiers are new (their paper init). The phrase heads' columns of W^o are **zeroed** by default: at step
  0 the layer is the base layer with only its word heads' contribution, independent of the random phrase memory
  (and of the seed), and the phrase heads enter as W^o learns (their gradient is non-zero from step 1).
  `phrase_heads_output="copy"` keeps the base's columns instead (the phrase heads then add the output of random
  memories through W^o; about the same step-0 loss, README "Warm start"). Other encoder layers and the decoder:
  exact copies. Not exact.
- **MIMO** (`mimo_nmt`): every transformation of every block is a copy of the pretrained sub-layer (its LayerNorm
  included). Any softmax mixture of identical streams is that stream, so the model is **exact** whatever the mixing
  logits (zeros by default: uniform 1/n). With a multilingual base (`languages`: `<2xx>` tags, or a converted
  NLLB-200 / M2M100's language tokens) the task-attention tables get one row per language of the base, its
  `tgt_lang_ids` picking the row; with a bilingual one they have a single row (the links are learned but
  task-independent: MIMO's cardinality without its task awareness) and the start is exact all the same. A pre-norm
  base (NLLB-200, M2M100) gives a pre-norm MIMO (`normalize_before=True`: pre-norm units, the final LayerNorm on
  each encoder stream and on the decoder output), exact too; it needs task attention. MIMO has no relative
  positions: a base with them cannot be warm-started as MIMO (ValueError). With `task_attention=False` (the
  ablation's plain-sum links, eq. 1) every transformation's LayerNorm of a post-norm base is scaled by 1/n, so that
  each sum of n streams is the base's value: exact too.
- **Tied** (`tied_nmt`): one stack from two pretrained stacks has no exact start. Default `tied_init="decoder"`: every
  block (self-attention, cross-attention, FFN, LayerNorms) and the final LayerNorm come from the base's decoder, so
  the decoder path is the pretrained decoder exactly and the encoder path runs the decoder blocks without their
  causal mask and cross-attention; `tied_init="encoder"` takes self-attention, FFN and their LayerNorms (and the
  final LayerNorm) from the encoder and only the cross-attention from the decoder (the encoder path is then exact
  and the decoder path is not). The decoder start gave the lower step-0 loss (README "Warm start"). The direction
  embedding starts at zero (the encoder input is the base's). Tied needs one embedding matrix
  (`tie_word_embeddings`) and equal encoder/decoder depths and widths, as the config requires.

Mismatches between `config_overrides` and the base in dimensions, vocabulary, special tokens, languages or backbone
settings raise a ValueError naming both values. The output folder holds the model (config with
`warm_started_from`, generation config copied from the base, weights, code for `trust_remote_code`) and the base
folder's tokenizer files; `training/train.py --model_name_or_path OUT` fine-tunes it, and the model card of the run
names the base model (from the saved config's `warm_started_from`).

A converted NLLB-200 / M2M100 (`hf-variants-convert-m2m100`, pruned or not) is a base like any other: the variant
keeps its language tokens (`language_token_ids`, `target_language_token`) and its tokenizer, so it translates with
the same `src_lang` / `tgt_lang` codes.

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..configuration_transformer_nmt import (
    TransformerNmtConfig,
    _check_overrides_applied,
    _plain,
    _resolve_aliases,
    check_config_field_names,
    parse_config_overrides,
)
from ..model_classes import MODEL_CLASSES
from ..modeling_mute import project_doubly_stochastic
from ..modeling_transformer_nmt import TransformerNmtForConditionalGeneration
from ..outputs import (
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
    read_json_object,
)
from ..sizing import check_fits

# Fields of the base that define the function it computes (or its vocabulary): the variant keeps them; an override
# with another value is an error naming both values.
BASE_FIELDS = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "activation_function",
    "max_position_embeddings",
    "position_embedding_type",
    "max_relative_positions",
    "relative_position_values",
    "normalize_before",
    "scale_embedding",
    "share_encoder_decoder_embeddings",
    "tie_word_embeddings",
    "output_bias",
    "layer_norm_eps",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "languages",
    "target_language_tags",
    "language_token_ids",
    "target_language_token",
)
# Training settings: the base's values by default (it was trained with them), free to override.
TRAINING_FIELDS = (
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "label_smoothing",
    "init_method",
    "init_std",
    "use_cache",
)
VARIANT_TYPES = ("mute_nmt", "hysan_nmt", "mgsa_nmt", "mimo_nmt", "tied_nmt")
COMMAND = "warm_start"  # recorded in the output folder's manifest: what `--force` may replace
REPORT_FILE = "warm_start.json"
TIED_INITS = ("decoder", "encoder")
PHRASE_HEADS_OUTPUTS = ("zero", "copy")
# Files of a model folder that belong to its tokenizer (copied as they are).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "source.spm",
    "target.spm",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
)


@dataclass
class WarmStartReport:
    """Where every tensor of the variant came from. `copied`: variant key -> base key (same values, stacked for units
    and MIMO's per-stream LayerNorms); `derived`: variant key -> how it was computed from base tensors; `initialised`:
    variant key -> how a new tensor was set (`"init"`: the variant's own initialisation); `unused`: base keys no
    variant tensor was taken from."""

    base: str
    model_type: str
    copied: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)
    initialised: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # choices made for the user (e.g. MG-SA's phrase form)

    def summary(self) -> str:
        lines = [
            (
                f"{self.model_type} warm-started from {self.base}: {len(self.copied)} tensors copied, "
                f"{len(self.derived)} derived from base tensors, {len(self.initialised)} new"
            )
        ]
        lines += [f"  note     {note}" for note in self.notes]
        lines += [f"  derived  {k}: {v}" for k, v in self.derived.items()]
        lines += [f"  new      {k}: {v}" for k, v in self.initialised.items()]
        if self.unused:
            lines.append(
                f"  base tensors not used ({len(self.unused)}): {', '.join(self.unused[:6])}"
                + (" ..." if len(self.unused) > 6 else "")
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- the base
def load_base(base) -> tuple[TransformerNmtForConditionalGeneration, str]:
    """The base model (eval mode) and its label. `base`: a `TransformerNmtForConditionalGeneration`, or a folder
    (or Hub id) of one or of a `MarianMTModel` (converted with `convert_marian`)."""
    if isinstance(base, TransformerNmtForConditionalGeneration):
        if type(base.config) is not TransformerNmtConfig:
            raise ValueError(f"The base must be a transformer_nmt model, got {base.config.model_type!r}.")
        return base.eval(), str(base.config.name_or_path or "a transformer_nmt model")
    if not isinstance(base, (str, os.PathLike)):
        raise TypeError(
            f"`base` must be a folder, a Hub id or a TransformerNmtForConditionalGeneration, got "
            f"{type(base).__name__}."
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    if config.model_type == "marian":
        from transformers import MarianMTModel

        from .marian import convert_marian

        return convert_marian(MarianMTModel.from_pretrained(base)).eval(), str(base)
    if config.model_type != "transformer_nmt":
        raise ValueError(
            f"{base} holds a {config.model_type!r} model; the base of a warm start must be a "
            f"transformer_nmt model (our baseline, e.g. an opus-mt model converted with "
            f"`python -m hf_variants.convert_marian`) or a MarianMTModel."
        )
    return TransformerNmtForConditionalGeneration.from_pretrained(base).eval(), str(base)


def _base_field_values(config: TransformerNmtConfig) -> dict[str, Any]:
    names = [
        n
        for n in inspect.signature(TransformerNmtConfig.__init__).parameters
        if n not in ("self", "kwargs", "is_encoder_decoder")
    ]
    return {name: copy.deepcopy(getattr(config, name)) for name in names}


def variant_config(base_config: TransformerNmtConfig, model_type: str, overrides: dict[str, Any] | None = None):
    """The variant's config: the base's fields (dimensions, vocabulary, backbone, training settings), the variant's
    own defaults (its paper's), then `overrides` (names checked as in `from_preset`). An override of a field in
    `BASE_FIELDS` with another value than the base's raises a ValueError naming both. MG-SA without a
    `phrase_type` override takes the n-gram form (`MGSA_DEFAULT_PHRASE_TYPE`), which trains on any text: the
    paper's syntactic form needs a constituency parse of every source sentence."""
    if model_type not in VARIANT_TYPES:
        raise ValueError(f"`model_type` must be one of {list(VARIANT_TYPES)}, got {model_type!r}.")
    config_class = MODEL_CLASSES[model_type][0]
    overrides = dict(overrides or {})
    check_config_field_names(config_class, overrides)
    resolved = _resolve_aliases(config_class, overrides)
    if model_type == "mgsa_nmt":
        resolved.setdefault("phrase_type", MGSA_DEFAULT_PHRASE_TYPE)
    base_values = _base_field_values(base_config)
    for name in BASE_FIELDS:
        if name in resolved and _plain(resolved[name]) != _plain(base_values[name]):
            raise ValueError(
                f"`{name}={resolved[name]!r}` does not match the base model's `{name}="
                f"{base_values[name]!r}`: a warm-started {model_type} keeps the base's dimensions, "
                f"vocabulary and backbone settings ({', '.join(BASE_FIELDS[:4])}, ...)."
            )
    if model_type == "hysan_nmt" and "use_positional_embeddings" in resolved:
        wanted = resolved["use_positional_embeddings"]
        if bool(wanted) != (base_values["position_embedding_type"] != "none"):
            raise ValueError(
                f"`use_positional_embeddings={wanted!r}` does not match the base model's "
                f"`position_embedding_type={base_values['position_embedding_type']!r}`."
            )
    try:
        config = config_class(**{**base_values, **resolved})
    except ValueError as error:
        raise ValueError(f"A {model_type} with the base model's settings is not valid: {error}") from error
    _check_overrides_applied(config, resolved)
    return config


# A warm-started MG-SA's phrases when the caller does not choose: n-grams, which need no parses (the data of a warm
# start is not known here; the syntactic form needs a parse of every source sentence, which few corpora have).
MGSA_DEFAULT_PHRASE_TYPE = "ngram"
MGSA_PHRASE_NOTE = (
    "phrase_type='ngram' (n-gram phrases: trains on plain text); the paper's syntactic form needs a constituency "
    "parse of every source sentence: --config_overrides phrase_type=syntactic, then train with --source_annotations "
    "parses"
)


# ------------------------------------------------------------------------------------------------ the mapping
def _side(key: str) -> str:
    return "decoder" if ".decoder." in key else "encoder"


def _layer(key: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)\.", key)
    return int(match.group(1)) if match else None


class _Mapper:
    """Fills the variant's state dict from the base's, key by key, recording every decision in a report."""

    def __init__(
        self,
        base_state: dict[str, torch.Tensor],
        variant_state: dict[str, torch.Tensor],
        config,
        report: WarmStartReport,
    ):
        self.base, self.variant, self.config, self.report = base_state, variant_state, config, report
        self.state: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()

    def take(self, key: str, source: str) -> torch.Tensor:
        if source not in self.base:
            raise KeyError(f"warm start: the base model has no tensor {source!r} (needed for {key!r}).")
        self.used.add(source)
        return self.base[source]

    def copy(self, key: str, source: str) -> None:
        """The base tensor `source`, or `n` copies of it stacked on a first axis (units, per-stream norms)."""
        tensor, target = self.take(key, source), self.variant[key]
        if tensor.shape != target.shape:
            if target.shape[1:] != tensor.shape:
                raise ValueError(
                    f"warm start: {key} {tuple(target.shape)} cannot be filled from the base's {source} "
                    f"{tuple(tensor.shape)}."
                )
            tensor = tensor.expand(target.shape)
        self.state[key] = tensor.clone()
        self.report.copied[key] = source

    def derive(self, key: str, tensor: torch.Tensor, how: str) -> None:
        if tensor.shape != self.variant[key].shape:
            raise ValueError(
                f"warm start: {key} derived as {tuple(tensor.shape)}, expected {tuple(self.variant[key].shape)}."
            )
        self.state[key] = tensor
        self.report.derived[key] = how

    def new(self, key: str, tensor: torch.Tensor | None = None, how: str = "init") -> None:
        self.state[key] = self.variant[key] if tensor is None else tensor
        self.report.initialised[key] = how


def _generic(mapper: _Mapper, key: str) -> bool:
    """Same key (and shape, or the shape with a units axis) in the base; units `.units.{k}.` of MUTE / MIMO map to
    the base's one module."""
    target = mapper.variant[key]
    for source in (key, re.sub(r"\.units\.\d+\.", ".", key)):
        tensor = mapper.base.get(source)
        if tensor is not None and (tensor.shape == target.shape or target.shape[1:] == tensor.shape):
            mapper.copy(key, source)
            return True
    return False


def _map_mute(mapper: _Mapper, key: str) -> bool:
    config = mapper.config
    if key.endswith((".ffn.layer_norm_weight", ".ffn.layer_norm_bias")):
        mapper.copy(key, key.replace(".ffn.layer_norm_", ".ffn.final_layer_norm."))
    elif key.endswith(".self_attn.relative_embeddings"):
        mapper.copy(key, key.replace(".relative_embeddings", ".relative_positions.embeddings.weight"))
    elif key.endswith(".alpha"):
        mapper.new(key, torch.full_like(mapper.variant[key], 1.0 / config.num_units), "1/I (the paper's init)")
    elif key.endswith(".shuffle"):
        projected = project_doubly_stochastic(
            mapper.variant[key], config.shuffle_sinkhorn_iterations, config.shuffle_eps
        )
        mapper.new(key, projected, f"{config.shuffle_init} init, projected (columns sum to 1)")
    else:
        return False
    return True


def _map_hysan(mapper: _Mapper, key: str) -> bool:
    config = mapper.config
    hybrid = re.search(r"\.layers\.\d+\.self_attn\.", key) is not None
    if not hybrid:
        return False
    side = _side(key)
    specs = config.branch_specs(side)
    reference = "global" if side == "encoder" else "forward"
    ref = next((i for i, (kind, _) in enumerate(specs) if kind == reference), None)
    nb = len(specs)
    if key.endswith(".gate.excite.weight"):
        mapper.new(key, torch.zeros_like(mapper.variant[key]), "zeros: the gate starts at sigmoid(0) = 1/2")
        return True
    if not key.endswith(".self_attn.out_proj.weight"):
        return False
    source = key
    w_o = mapper.take(key, source)
    if config.fusion == "concat":
        if ref is not None:
            h = torch.zeros(w_o.shape[0], nb * w_o.shape[1], dtype=w_o.dtype)
            h[:, ref * w_o.shape[1] : (ref + 1) * w_o.shape[1]] = w_o
            how = f"H = [W^o on the {reference} branch (#{ref}), 0 on the other {nb - 1}] (exact)"
        else:
            h = torch.cat([w_o / nb] * nb, dim=1)
            how = f"H = [W^o / {nb}] * {nb}: the mean of the branches (no {reference} branch)"
        mapper.derive(key, h, how + f" from {source}")
    else:
        scale = (2.0 if config.fusion == "gated_sum" else 1.0) / nb
        mapper.derive(key, w_o * scale, f"{source} x {scale:g}: W^o on the mean of the {nb} branches")
    mapper.used.add(source)
    return True


def _map_mgsa(mapper: _Mapper, key: str, phrase_heads_output: str) -> bool:
    config = mapper.config
    layer = _layer(key)
    if _side(key) != "encoder" or layer not in config.mgsa_layers or config.num_phrase_groups == 0:
        return False
    if ".self_attn.phrase_memory." in key or ".self_attn.tag_classifiers." in key:
        mapper.new(key, how="init (new: phrase memory / tag classifier)")
        return True
    d = config.d_model
    head_dim = d // config.encoder_attention_heads
    word = config.word_heads * head_dim
    if re.search(r"\.self_attn\.qkv_proj\.(weight|bias)$", key):
        source = mapper.take(key, key)
        if source.shape == mapper.variant[key].shape:
            mapper.copy(key, key)
        else:  # queries of every head, keys and values of the word heads only
            rows = torch.cat([torch.arange(d + word), 2 * d + torch.arange(word)])
            how = (
                f"{key} rows [0, {d + word}) and [{2 * d}, {2 * d + word}): queries of all heads, K/V of the "
                f"{config.word_heads} word heads"
            )
            mapper.derive(key, source[rows].clone(), how)
        return True
    if key.endswith(".self_attn.out_proj.weight") and phrase_heads_output == "zero":
        w_o = mapper.take(key, key).clone()
        w_o[:, word:] = 0
        mapper.derive(key, w_o, f"{key} with the phrase heads' columns [{word}, {d}) zeroed")
        return True
    return False


def _map_mimo(mapper: _Mapper, key: str) -> bool:
    """With task attention every link is a softmax mixture: copies suffice. Without it (plain-sum links, eq. 1) the
    links add n streams: every transformation's LayerNorm is scaled by 1/n so that each sum is the base's value."""
    config = mapper.config
    if config.task_attention or not re.search(r"layer_norm\.(weight|bias)$", key) or mapper.variant[key].dim() != 2:
        return False
    n = config.num_transformations
    source = mapper.take(key, key)
    mapper.derive(
        key,
        source.expand(mapper.variant[key].shape) / n,
        f"{key} / {n}: the plain-sum links add the {n} streams back to the base's value",
    )
    return True


def _map_tied(mapper: _Mapper, key: str, tied_init: str) -> bool:
    if key.endswith(".target_space_embedding.weight"):
        mapper.new(key, torch.zeros_like(mapper.variant[key]), "zeros: the encoder input is the base's")
        return True
    match = re.match(r"^model\.(layers\.\d+\.|layer_norm\.)(.*)$", key)
    if match is None:
        return False
    prefix, rest = match.groups()
    cross = rest.startswith("encoder_attn")
    stack = "decoder" if tied_init == "decoder" or cross else "encoder"
    mapper.copy(key, f"model.{stack}.{prefix}{rest}")
    return True


def map_state_dict(
    base: TransformerNmtForConditionalGeneration,
    variant,
    *,
    tied_init: str = "decoder",
    phrase_heads_output: str = "zero",
    base_label: str = "base",
) -> tuple[dict, WarmStartReport]:
    """The variant's full state dict filled from the base's (see the module docstring), and the report."""
    config = variant.config
    report = WarmStartReport(base=base_label, model_type=config.model_type)
    base_state = {k: v.detach() for k, v in base.state_dict().items()}
    variant_state = {k: v.detach() for k, v in variant.state_dict().items()}
    mapper = _Mapper(base_state, variant_state, config, report)
    special = {
        "mute_nmt": _map_mute,
        "hysan_nmt": _map_hysan,
        "mgsa_nmt": lambda m, k: _map_mgsa(m, k, phrase_heads_output),
        "mimo_nmt": _map_mimo,
        "tied_nmt": lambda m, k: _map_tied(m, k, tied_init),
    }[config.model_type]
    for key in variant_state:
        if not special(mapper, key) and not _generic(mapper, key):
            mapper.new(key)
    report.unused = sorted(set(base_state) - mapper.used)
    return mapper.state, report


# ------------------------------------------------------------------------------------------------ the function
def warm_start(
    base,
    model_type: str,
    config_overrides: dict[str, Any] | str | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    base_model_id: str | None = None,
    tied_init: str = "decoder",
    phrase_heads_output: str = "zero",
    seed: int = 0,
    return_report: bool = False,
    force: bool = False,
    allow_large_model: bool = False,
):
    """A `model_type` model (eval mode) starting from the pretrained baseline `base` (a folder, Hub id, or
    `TransformerNmtForConditionalGeneration`; a MarianMTModel folder is converted first), saved to `output_dir`
    with the generation config and the tokenizer files of the base folder when given.

    `config_overrides`: variant fields (dict, or "key=value,..." as train.py's `--config_overrides`); fields of the
    base's function or vocabulary must keep the base's values. `base_model_id`: what the config records as
    `warm_started_from` (default: `base` as given; pass the Hub id of a converted opus-mt model). `tied_init`:
    `"decoder"` or `"encoder"` (Tied only); `phrase_heads_output`: `"zero"` or `"copy"` (MG-SA only). New parameters
    are initialised under `torch.manual_seed(seed)` (the global RNG is left as it was). With `return_report` the
    result is `(model, WarmStartReport)`.

    `output_dir` is checked before the base loads: it may not be, hold or lie inside the base folder, and a
    non-empty one is replaced only with `force` and only when this function wrote it (`hf_variants.outputs`). The
    variant's size is estimated from its config before it is built (`hf_variants.sizing.check_fits`, the base
    and the variant in memory together): one that would not fit raises `ModelTooLargeError` naming the fields,
    unless `allow_large_model`."""
    if tied_init not in TIED_INITS:
        raise ValueError(f"`tied_init` must be one of {TIED_INITS}, got {tied_init!r}.")
    if phrase_heads_output not in PHRASE_HEADS_OUTPUTS:
        raise ValueError(f"`phrase_heads_output` must be one of {PHRASE_HEADS_OUTPUTS}, got {phrase_heads_output!r}.")
    overrides = parse_config_overrides(config_overrides) if isinstance(config_overrides, str) else config_overrides
    base_dir = base if isinstance(base, (str, os.PathLike)) else None
    if output_dir is not None:
        check_not_an_input(output_dir, {"--base": base_dir})
        check_output_dir(output_dir, command=COMMAND, force=force)
    base_model, label = load_base(base)
    config = variant_config(base_model.config, model_type, overrides)
    config.warm_started_from = base_model_id or label
    if not allow_large_model:  # the variant, and its state dict while it is filled
        check_fits(config, training=False, extra_models=1, override_flag="--allow_large_model")
    generation_class = MODEL_CLASSES[model_type][2]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        variant = generation_class(config)
    state, report = map_state_dict(
        base_model,
        variant,
        tied_init=tied_init,
        phrase_heads_output=phrase_heads_output,
        base_label=config.warm_started_from,
    )
    if model_type == "mgsa_nmt" and "phrase_type" not in (overrides or {}):
        report.notes.append(MGSA_PHRASE_NOTE)  # printed by the command with the report's summary
    variant.load_state_dict(state, strict=True)
    variant.generation_config = copy.deepcopy(base_model.generation_config)
    variant.eval()
    if output_dir is not None:
        save_warm_start(variant, output_dir, base_dir, report, force=force)
    return (variant, report) if return_report else variant


def save_warm_start(
    model, output_dir, base_dir=None, report: WarmStartReport | None = None, *, force: bool = False
) -> list[str]:
    """Save `model` to `output_dir` with the tokenizer files of `base_dir` (a local folder) and the report
    (`warm_start.json`); returns the tokenizer files copied. The folder is written atomically (a temporary sibling,
    then renamed); it may not be, hold or lie inside `base_dir`, and a non-empty one is replaced only with `force`
    and only when a warm start wrote it."""
    if base_dir is not None:
        check_not_an_input(output_dir, {"--base": base_dir})
    copied = []
    with atomic_output_dir(output_dir, command=COMMAND, force=force) as staging:
        model.save_pretrained(staging)
        if base_dir is not None and Path(base_dir).is_dir():
            for name in TOKENIZER_FILES:
                if (Path(base_dir) / name).is_file():
                    shutil.copy2(Path(base_dir) / name, staging / name)
                    copied.append(name)
        if report is not None:
            (staging / REPORT_FILE).write_text(
                json.dumps(
                    {
                        "base": report.base,
                        "model_type": report.model_type,
                        "copied": report.copied,
                        "derived": report.derived,
                        "initialised": report.initialised,
                        "unused_base_tensors": report.unused,
                    },
                    indent=1,
                )
                + "\n"
            )
    return copied


def load_warm_start_report(folder: str | os.PathLike) -> WarmStartReport:
    """The `warm_start.json` of a warm-started model folder, read as untrusted input: a ValueError naming the file
    and the field when it is not JSON, a field has the wrong type, or the file is a link leaving the folder."""
    path = Path(folder) / REPORT_FILE
    data = read_json_object(folder, REPORT_FILE, 256 * 1024 * 1024, "a warm-start report", "a warm start")

    def field_of(name, kind):
        value = data.get(name)
        ok = isinstance(value, str) if kind is str else isinstance(value, kind)
        if ok and kind is dict:
            ok = all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        if ok and kind is list:
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            what = {str: "a string", dict: "an object of strings", list: "a list of strings"}[kind]
            raise ValueError(f"{path}: `{name}` must be {what}, got {type(value).__name__}.")
        return value

    model_type = field_of("model_type", str)
    if model_type not in VARIANT_TYPES:
        raise ValueError(f"{path}: `model_type` must be one of {list(VARIANT_TYPES)}, got {model_type!r}.")
    return WarmStartReport(
        base=field_of("base", str),
        model_type=model_type,
        copied=field_of("copied", dict),
        derived=field_of("derived", dict),
        initialised=field_of("initialised", dict),
        unused=field_of("unused_base_tensors", list),
    )
