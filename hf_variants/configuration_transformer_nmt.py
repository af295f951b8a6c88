"""Configuration of the baseline Transformer for NMT, the config every hf_variants variant extends.

Field names follow Marian/BART (`d_model`, `encoder_layers`, `encoder_ffn_dim`, ...), so users of those models
find what they expect; the generation cache is sized from `decoder_layers` (transformers maps it to
`num_hidden_layers` for encoder-decoder configs).

Presets follow fairseq's named architectures: one place per preset (`PRESETS`), used through
`TransformerNmtConfig.from_preset("base", **overrides)`. Variant configs extend `PRESETS` with their own keys.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from transformers import GenerationConfig, PretrainedConfig
from transformers.activations import ACT2FN

from .compat_transformer_nmt import warn_if_unsupported  # noqa: F401  (the transformers version check, at import)

# `position_embedding_type` values (see `TransformerNmtConfig`'s docstring)
POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned", "none", "fairseq_sinusoidal")
TRANSLATION_PIPELINE = {
    "translation": {"impl": "pipeline_translation.TranslationPipeline", "pt": ["AutoModelForSeq2SeqLM"], "tf": []}
}


def _translation_task_registered() -> bool:
    """Whether this process has the `translation` pipeline task registered with hf_variants' pipeline
    (`hf_variants.registration.register_all`, run by `import hf_variants`)."""
    import sys

    pipelines = sys.modules.get("transformers.pipelines")  # not imported: nothing registered
    if pipelines is None or "translation" in getattr(pipelines, "REMOVED_TASKS", {}):
        return False
    try:
        impl = pipelines.PIPELINE_REGISTRY.check_task("translation")[1]["impl"]
    except KeyError:
        return False
    return getattr(impl, "__name__", None) == "TranslationPipeline"


def language_tag(lang: str) -> str:
    """The target-language tag prepended to source sentences by multilingual models:
    `language_tag("de") == "<2de>"`."""
    lang = str(lang).strip()
    if not lang or any(c.isspace() or c in "<>" for c in lang):
        raise ValueError(f"Invalid language code {lang!r}: expected a non-empty code without spaces or '<', '>'.")
    return f"<2{lang}>"


def _check(condition: bool, field: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"`{field}` must be {allowed}, got {value!r}.")


# ------------------------------------------------------------------------------------------------ field types
class FieldType(NamedTuple):
    """A JSON-level type of a config field: what messages call it and the test of a value."""

    description: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # a bool is no integer (True == 1)


BOOL = FieldType("a bool (true or false)", lambda v: isinstance(v, bool))
INT = FieldType("an integer", _is_int)
FLOAT = FieldType("a float", lambda v: _is_int(v) or isinstance(v, float))  # an integer is a float too (0 = 0.0)
STR = FieldType("a string", lambda v: isinstance(v, str))
NONE = FieldType("null (None)", lambda v: v is None)
INT_LIST = FieldType("a list of integers", lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v))
STR_LIST = FieldType(
    "a list of strings", lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
)
DICT = FieldType("an object (dict)", lambda v: isinstance(v, Mapping))
_BOOL_WORDS = ("true", "false", "yes", "no", "0", "1", "on", "off")


def check_field_type(config_class: type, name: str, value: Any) -> None:
    """Raise a `ValueError` naming `name` and its expected type (`config_class.field_types()`) when `value` has
    another type. Never coerces: `"false"` is no bool, `"1e-5"` no float, `True` no integer."""
    expected = config_class.field_types().get(name)
    if expected is None or any(kind.accepts(value) for kind in expected):
        return
    hint = ""
    if BOOL in expected and isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        hint = " (in config.json write true or false without quotes)"
    elif isinstance(value, str) and any(kind in expected for kind in (INT, FLOAT)):
        hint = " (in config.json write numbers without quotes)"
    raise ValueError(
        f"`{name}` must be {' or '.join(kind.description for kind in expected)}, got {value!r} "
        f"({type(value).__name__}){hint}."
    )


def _as_list(value: Any) -> Any:
    """A list or tuple as a list; anything else unchanged, for the type check to name (`list("de")` would be
    ["d", "e"])."""
    return list(value) if isinstance(value, (list, tuple)) else value


# ------------------------------------------------------------------------------------ field names and overrides
# Keyword arguments `PretrainedConfig.__post_init__` consumes without declaring them as dataclass fields.
_POST_INIT_KWARGS = (
    "attn_implementation",
    "experts_implementation",
    "name_or_path",
    "num_labels",
    "output_attentions",
    "torch_dtype",
    "per_layer_config",
)


def config_field_names(config_class: type[PretrainedConfig]) -> set[str]:
    """Every name a config class takes as a field: the parameters of each `__init__` in its MRO, the dataclass
    fields and public settable properties of `PretrainedConfig`, and the `attribute_map` aliases (`hidden_size`).

    Works for any transformers config class (ours, `MarianConfig`, remote-code classes)."""
    names: set[str] = set(config_class.attribute_map) | set(_POST_INIT_KWARGS)
    for klass in config_class.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, PretrainedConfig)):
            continue
        if dataclasses.is_dataclass(klass):
            names.update(f.name for f in dataclasses.fields(klass))
        if "__init__" in vars(klass):
            names.update(
                name
                for name, param in inspect.signature(klass.__init__).parameters.items()
                if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
            )
        names.update(
            name
            for name, value in vars(klass).items()
            if isinstance(value, property) and value.fset is not None and not name.startswith("_")
        )
    return names


def check_config_field_names(
    config_class: type[PretrainedConfig], names: Iterable[str], also_known: Iterable[str] = ()
) -> None:
    """Raise a `ValueError` naming the first name that is not a field of `config_class` (with the closest field
    names as suggestions), or that is a generation parameter (those belong in `model.generation_config`;
    `PretrainedConfig` drops them silently).

    Used by `from_preset` and `apply_config_overrides`, the paths where a user types field names. Plain
    construction and `from_pretrained` / `from_dict` stay permissive, as for every transformers config: a
    config.json carries metadata keys (`transformers_version`, `architectures`, `auto_map`, `dtype`, ...) and keys
    written by other tools or older versions, and must keep loading."""
    known = config_field_names(config_class) | set(also_known)
    generation = set(GenerationConfig._get_default_generation_params())
    for name in names:
        if name in known:
            continue
        if name in generation:
            raise ValueError(
                f"`{name}` is a generation parameter, not a field of {config_class.__name__}: set it on "
                f"`model.generation_config` (or pass it to `generate()` / the pipeline)."
            )
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""
        raise ValueError(f"`{name}` is not a field of {config_class.__name__}.{hint}")


def _plain(value: Any) -> Any:
    """JSON-like normal form for comparing a requested value with the stored one (tuples as lists, ...)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")  # to_dict stores dtypes by name
    return value


def _check_overrides_applied(config: PretrainedConfig, overrides: Mapping[str, Any]) -> None:
    """A requested value that the config replaced by a derived one (e.g. HySAN's `use_positional_embeddings=True`
    next to `position_embedding_type="none"`) is an error, not a silent change. `None` asks for a default."""
    stored = config.to_dict()
    derived = getattr(config, "derived_fields", {})
    for name, value in overrides.items():
        if value is None or name not in stored:
            continue
        if _plain(stored[name]) != _plain(value):
            source = f"`{derived[name]}`" if name in derived else "its other fields"
            raise ValueError(
                f"`{name}={value!r}` was not applied: {type(config).__name__} derives "
                f"`{name}={stored[name]!r}` from {source}; set that instead."
            )


def _resolve_aliases(config_class: type[PretrainedConfig], overrides: Mapping[str, Any]) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for name, value in overrides.items():
        target = config_class.attribute_map.get(name, name)
        if target in resolved:
            alias = (
                name
                if target != name
                else next(a for a, t in config_class.attribute_map.items() if t == target and a in overrides)
            )
            raise ValueError(f"`{alias}` is an alias of `{target}`: pass only one of them.")
        resolved[target] = value
    return resolved


def parse_config_overrides(spec: str | None) -> dict[str, Any]:
    """`"d_model=128,languages=['en','de'],normalize_before=true"` -> dict: the `--config_overrides` syntax of
    `training/train.py` and `python -m hf_variants.warm_start` (values parsed as JSON/Python literals, else kept as
    strings)."""
    if not spec:
        return {}
    out = {}
    for item in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)", spec):
        if "=" not in item:
            raise ValueError(f"--config_overrides: expected key=value, got {item!r}")
        key, value = (x.strip() for x in item.split("=", 1))
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[key] = lowered == "true"
        elif lowered in ("none", "null"):
            out[key] = None
        else:
            try:
                out[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                out[key] = value
    return out


def apply_config_overrides(config: PretrainedConfig, overrides: Mapping[str, Any]) -> PretrainedConfig:
    """A new config of `config`'s class: its fields with `overrides` applied, built and validated like a config
    constructed from scratch (so `dropout=1.5` or `encoder_attention_heads=5` raise a `ValueError` naming the
    field). Unknown names raise a `ValueError` with the closest field names (`d_modle` -> `d_model`); names stored
    in `config` already (old or foreign keys of a saved config.json) are accepted. Aliases such as `hidden_size`
    are resolved. Used by `training/train.py --config_overrides` on a saved model; `config` is not modified (and is
    returned as is when there are no overrides)."""
    overrides = dict(overrides)
    if not overrides:
        return config
    config_class = type(config)
    current = config.to_dict()
    check_config_field_names(config_class, overrides, also_known=current)
    resolved = _resolve_aliases(config_class, overrides)
    for name, source in getattr(config_class, "derived_fields", {}).items():
        if name not in resolved and source in resolved:
            current.pop(name, None)  # recomputed from the overridden source field
    new = config_class.from_dict({**current, **resolved})
    _check_overrides_applied(new, resolved)
    return new


class TransformerNmtConfig(PretrainedConfig):
    r"""
    Configuration of [`TransformerNmtForConditionalGeneration`], the Transformer of Vaswani et al. (2017) as used by
    the five papers this package implements.

    Args:
        vocab_size (`int`): size of the shared source/target vocabulary.
        d_model (`int`): model width.
        encoder_layers / decoder_layers (`int`): number of layers of each stack (the decoder count sizes the cache).
        encoder_attention_heads / decoder_attention_heads (`int`): heads; must divide `d_model`.
        encoder_ffn_dim / decoder_ffn_dim (`int`): inner size of the position-wise feed-forward networks.
        activation_function (`str`): a key of `transformers.activations.ACT2FN` (`"relu"` in the papers).
        dropout / attention_dropout / activation_dropout (`float`): residual, attention-probability and FFN-inner
            dropout, each in [0, 1).
        max_position_embeddings (`int`): table size for learned positions and the longest accepted sequence.
        position_embedding_type (`str`): `"sinusoidal"` (Marian / tensor2tensor: frequencies 10000^(-2i/d), token
            t at position t), `"learned"`, `"none"`, or `"fairseq_sinusoidal"` (fairseq's
            `SinusoidalPositionalEmbedding`, as M2M100 and NLLB-200 use it: frequencies 10000^(-i/(d/2-1)); the k-th
            non-padding token of a sequence (k = 1, 2, ...) sits at position `pad_token_id + k` (+ the cache length
            in decoding), and a padding token gets the zero vector, so left or inner padding shifts nothing;
            `inputs_embeds` count every position).
        max_relative_positions (`int`): Shaw et al. (2018) clipping distance of relative positions in every
            self-attention; 0 disables them.
        relative_position_values (`bool`): also add the relative-position term to the values (OpenNMT shares one
            table between keys and values). Needs attention probabilities, so those layers run the eager kernel.
        normalize_before (`bool`): pre-norm (True, tensor2tensor v2 / OpenNMT) or post-norm (False, Vaswani/Marian).
            Pre-norm stacks end with a final LayerNorm.
        scale_embedding (`bool`): multiply token embeddings by sqrt(d_model).
        share_encoder_decoder_embeddings (`bool`): one embedding matrix for source and target tokens.
        tie_word_embeddings (`bool`): the output projection shares the decoder embedding matrix. As in Marian, it
            governs every tie (transformers ties declared weights only under it): with False the encoder, decoder
            and output matrices are all separate, whatever `share_encoder_decoder_embeddings` says.
        output_bias (`bool`): give the output projection a bias (Marian's `final_logits_bias` when converting).
        init_method (`str`): `"xavier"` (fairseq/OpenNMT/T2T: Xavier-uniform linears, N(0, d^-1/2) embeddings) or
            `"normal"` (Marian/BART: N(0, `init_std`) everywhere).
        init_std (`float`): standard deviation for `init_method="normal"`.
        label_smoothing (`float`): the label smoothing the model was trained with, in [0, 1): a record (the
            training code writes the run's value; the model card reports it). The model's `.loss` does not read
            it: `model(**batch).loss` is the plain cross-entropy against `labels` (transformers' convention, also
            for configs saved with 0.1), and `model(**batch, smoothing=0.1).loss` is the label-smoothed one, what
            the training code asks for (`train.py --label_smoothing 0.1`, the default there). With a
            `Seq2SeqTrainer`, pass it through `compute_loss` rather than `label_smoothing_factor`, which recomputes
            the loss from the logits and drops the variants' auxiliary losses.
        languages (`list[str]`): language codes a multilingual model knows; index = task / language id.
        source_languages (`list[str]`): the languages the model translates from (a subset of `languages`; the
            training code records its run's sources). `[]`: not recorded (then: `languages` without the recorded
            targets, or all of them). `check_languages` refuses any other source.
        target_languages (`list[str]`): the languages the model translates into (a subset of `languages`; the
            training code records its run's targets; `check_languages` refuses any other). With exactly one, the
            model needs no target language from the caller: `generate`, the pipeline, `prepare_translation_inputs`
            and `model(**batch)` (a `Seq2SeqTrainer` batch without `tgt_lang_ids`) use it. `[]`: not recorded (a
            model with several target-language rows then needs `tgt_lang`).
        target_language_tags (`bool`): prepend a `<2xx>` target-language tag to every source sentence.
        language_token_ids (`list[int]`): the vocabulary id of each language's token, in the order of `languages`
            (`[]`: the model has no language tokens). The tokens of M2M100 / NLLB-200 (`__en__`, `eng_Latn`): the
            tokenizer writes the source language's token before the source (`tokenizer.src_lang`), and with
            `target_language_token` the target language's token is the decoder's first token.
        target_language_token (`bool`): the decoder starts with `decoder_start_token_id` followed by the target
            language's token (`language_token_ids`), which `generate(tgt_lang=...)`, the pipeline and
            `prepare_translation_inputs` force at the first decoding step, one per sentence: M2M100 / NLLB-200's
            `forced_bos_token_id`, with the same scores (the token gets log-probability 0). Training labels start
            with it (`[lang] tokens </s>`, as their tokenizers write targets). Excludes `target_language_tags`.
    """

    model_type = "transformer_nmt"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the cache's name since transformers 5.24, and before
    # Fields a variant recomputes from another field (name -> source): `apply_config_overrides` re-derives them
    # when only the source is overridden.
    derived_fields: ClassVar[dict[str, str]] = {}
    # The type of every field (a tuple: the types it may have), checked on construction and on load before any
    # value check (`check_field_type`). Each variant declares its own fields; `field_types()` merges the MRO.
    FIELD_TYPES: ClassVar[dict[str, tuple[FieldType, ...]]] = {
        **dict.fromkeys(
            (
                "vocab_size",
                "d_model",
                "encoder_layers",
                "decoder_layers",
                "encoder_attention_heads",
                "decoder_attention_heads",
                "encoder_ffn_dim",
                "decoder_ffn_dim",
                "max_position_embeddings",
                "max_relative_positions",
            ),
            (INT,),
        ),
        **dict.fromkeys(
            ("dropout", "attention_dropout", "activation_dropout", "layer_norm_eps", "init_std", "label_smoothing"),
            (FLOAT,),
        ),
        **dict.fromkeys(
            (
                "relative_position_values",
                "normalize_before",
                "scale_embedding",
                "share_encoder_decoder_embeddings",
                "tie_word_embeddings",
                "output_bias",
                "target_language_tags",
                "target_language_token",
                "use_cache",
                "is_encoder_decoder",
                "output_hidden_states",
                "return_dict",
            ),
            (BOOL,),
        ),
        **dict.fromkeys(("activation_function", "position_embedding_type", "init_method"), (STR,)),
        **dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"), (INT, NONE)),
        "languages": (STR_LIST,),
        "source_languages": (STR_LIST,),
        "target_languages": (STR_LIST,),
        "language_token_ids": (INT_LIST,),
        "custom_pipelines": (DICT,),
    }
    # The generic names transformers' utilities read (Marian's mapping). The decoder's KV cache is still sized from
    # `decoder_layers`: `get_text_config(decoder=True)` maps `decoder_layers` onto `num_hidden_layers` for it.
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "encoder_attention_heads",
        "num_hidden_layers": "encoder_layers",
    }

    # ---------------------------------------------------------------------------------- translation pipeline
    @property
    def custom_pipelines(self) -> dict:
        """The `translation` pipeline shipped as remote code (`pipeline_translation.TranslationPipeline`), saved in
        every config.json. It reads as `{}` in a process where the package registered the task itself (`import
        hf_variants`): transformers' `pipeline()` checks a config's custom pipelines first and would ask for
        `trust_remote_code=True`, while the registered task loads the folder like `AutoModelForSeq2SeqLM` does."""
        if _translation_task_registered():
            return {}
        return self.__dict__.get("custom_pipelines", {})

    @custom_pipelines.setter
    def custom_pipelines(self, value: dict) -> None:
        self.__dict__["custom_pipelines"] = value

    # Named presets. Variants extend this dict (their keys add variant fields).
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Unit tests only.
        "tiny": dict(
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            dropout=0.0,
            max_position_embeddings=256,
        ),
        # Vaswani et al. "small" / fairseq transformer_iwslt-like width used by the papers' IWSLT runs.
        "small": dict(
            d_model=256,
            encoder_layers=3,
            decoder_layers=3,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=1024,
            decoder_ffn_dim=1024,
            dropout=0.1,
        ),
        "base": dict(
            d_model=512,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=8,
            decoder_attention_heads=8,
            encoder_ffn_dim=2048,
            decoder_ffn_dim=2048,
            dropout=0.1,
        ),
        "big": dict(
            d_model=1024,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=16,
            decoder_attention_heads=16,
            encoder_ffn_dim=4096,
            decoder_ffn_dim=4096,
            dropout=0.3,
        ),
    }

    def __init__(
        self,
        vocab_size: int = 8000,
        d_model: int = 512,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        encoder_attention_heads: int = 8,
        decoder_attention_heads: int = 8,
        encoder_ffn_dim: int = 2048,
        decoder_ffn_dim: int = 2048,
        activation_function: str = "relu",
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        max_position_embeddings: int = 1024,
        position_embedding_type: str = "sinusoidal",
        max_relative_positions: int = 0,
        relative_position_values: bool = False,
        normalize_before: bool = False,
        scale_embedding: bool = True,
        share_encoder_decoder_embeddings: bool = True,
        tie_word_embeddings: bool = True,
        output_bias: bool = False,
        layer_norm_eps: float = 1e-5,
        init_method: str = "xavier",
        init_std: float = 0.02,
        label_smoothing: float = 0.0,
        languages: list[str] | None = None,
        source_languages: list[str] | None = None,
        target_languages: list[str] | None = None,
        target_language_tags: bool = False,
        language_token_ids: list[int] | None = None,
        target_language_token: bool = False,
        use_cache: bool = True,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        decoder_start_token_id: int = 1,
        is_encoder_decoder: bool = True,
        custom_pipelines: dict | None = None,
        **kwargs,
    ):
        # transformers 5 configs are dataclasses: the base __init__ resets its own fields (is_encoder_decoder,
        # ...) to their defaults, so it runs first and our values are set after it.
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.encoder_layers = encoder_layers
        self.decoder_layers = decoder_layers
        self.encoder_attention_heads = encoder_attention_heads
        self.decoder_attention_heads = decoder_attention_heads
        self.encoder_ffn_dim = encoder_ffn_dim
        self.decoder_ffn_dim = decoder_ffn_dim
        self.activation_function = activation_function
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding_type = position_embedding_type
        self.max_relative_positions = max_relative_positions
        self.relative_position_values = relative_position_values
        self.normalize_before = normalize_before
        self.scale_embedding = scale_embedding
        self.share_encoder_decoder_embeddings = share_encoder_decoder_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.output_bias = output_bias
        self.layer_norm_eps = layer_norm_eps
        self.init_method = init_method
        self.init_std = init_std
        self.label_smoothing = label_smoothing
        self.languages = _as_list(languages) if languages is not None else []
        self.source_languages = _as_list(source_languages) if source_languages is not None else []
        self.target_languages = _as_list(target_languages) if target_languages is not None else []
        self.target_language_tags = target_language_tags
        self.language_token_ids = _as_list(language_token_ids) if language_token_ids is not None else []
        self.target_language_token = target_language_token
        self.use_cache = use_cache
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.decoder_start_token_id = decoder_start_token_id
        self.is_encoder_decoder = is_encoder_decoder
        # Every model ships the translation pipeline: transformers 5 removed the built-in task, and a config's
        # `custom_pipelines` is resolved before the removed-task check (see README, "translation pipeline").
        self.custom_pipelines = copy.deepcopy(
            TRANSLATION_PIPELINE if custom_pipelines is None or custom_pipelines == {} else custom_pipelines
        )
        self._validate()

    # ------------------------------------------------------------------------------------------------ validation
    @classmethod
    def field_types(cls) -> dict[str, tuple[FieldType, ...]]:
        """Every field's allowed types: the `FIELD_TYPES` of this class and its bases (a subclass's entry wins)."""
        merged: dict[str, tuple[FieldType, ...]] = {}
        for klass in reversed(cls.__mro__):
            merged.update(vars(klass).get("FIELD_TYPES", {}))
        return merged

    def _check_field_types(self) -> None:
        """Type-check every field set so far (a variant's own fields are set after the base `__init__`, so each
        variant's validation calls this again first)."""
        values = vars(self)
        for name in self.field_types():
            if name in values:
                check_field_type(type(self), name, values[name])

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """`PretrainedConfig.from_dict`, whose keyword arguments (`from_pretrained(path, dropout=...)`) are set
        after construction: their types are checked too."""
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result)._check_field_types()
        return result

    def _validate(self) -> None:
        """Raise a `ValueError` naming the field and its expected type, or the allowed range, for every bad
        value."""
        self._check_field_types()
        for name in (
            "vocab_size",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value > 0, name, "a positive integer", value
            )
        for side in ("encoder", "decoder"):
            heads = getattr(self, f"{side}_attention_heads")
            _check(self.d_model % heads == 0, f"{side}_attention_heads", f"a divisor of d_model={self.d_model}", heads)
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and 0.0 <= value < 1.0, name, "a float in [0, 1)", value)
        _check(
            self.activation_function in ACT2FN,
            "activation_function",
            f"one of {sorted(ACT2FN)}",
            self.activation_function,
        )
        _check(
            self.position_embedding_type in POSITION_EMBEDDING_TYPES,
            "position_embedding_type",
            f"one of {', '.join(repr(kind) for kind in POSITION_EMBEDDING_TYPES)}",
            self.position_embedding_type,
        )
        _check(
            "sinusoidal" not in self.position_embedding_type or self.d_model % 2 == 0,
            "d_model",
            "even with sinusoidal positions",
            self.d_model,
        )
        fairseq = self.position_embedding_type == "fairseq_sinusoidal"
        _check(
            not fairseq or self.d_model >= 4, "d_model", "at least 4 with fairseq_sinusoidal positions", self.d_model
        )
        _check(
            not fairseq or self.pad_token_id is not None,
            "pad_token_id",
            "an integer with fairseq_sinusoidal positions (positions count from it)",
            self.pad_token_id,
        )
        _check(
            isinstance(self.max_relative_positions, int) and self.max_relative_positions >= 0,
            "max_relative_positions",
            "an integer >= 0 (0 disables relative positions)",
            self.max_relative_positions,
        )
        _check(self.init_method in ("xavier", "normal"), "init_method", "one of 'xavier', 'normal'", self.init_method)
        _check(
            isinstance(self.init_std, (int, float)) and self.init_std > 0,
            "init_std",
            "a positive float",
            self.init_std,
        )
        _check(self.layer_norm_eps > 0, "layer_norm_eps", "a positive float", self.layer_norm_eps)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and 0 <= value < self.vocab_size),
                name,
                f"None or an integer in [0, vocab_size={self.vocab_size})",
                value,
            )
        _check(
            all(isinstance(x, str) and x for x in self.languages) and len(set(self.languages)) == len(self.languages),
            "languages",
            "a list of distinct non-empty language codes",
            self.languages,
        )
        for name in ("source_languages", "target_languages"):
            value = getattr(self, name)
            _check(
                all(lang in self.languages for lang in value) and len(set(value)) == len(value),
                name,
                f"distinct codes of `languages`={self.languages}",
                value,
            )
        _check(
            not self.target_language_tags or len(self.languages) > 0,
            "target_language_tags",
            "False unless `languages` is set",
            self.target_language_tags,
        )
        self._validate_language_tokens()

    def _validate_language_tokens(self) -> None:
        ids = self.language_token_ids
        _check(
            not ids
            or (
                len(ids) == len(self.languages)
                and len(set(ids)) == len(ids)
                and all(0 <= i < self.vocab_size for i in ids)
            ),
            "language_token_ids",
            f"[] or one distinct id in [0, vocab_size={self.vocab_size}) per entry of `languages` "
            f"({len(self.languages)})",
            ids,
        )
        _check(
            not self.target_language_token or len(ids) > 0,
            "target_language_token",
            "False unless `language_token_ids` is set",
            self.target_language_token,
        )
        _check(
            not (self.target_language_token and self.target_language_tags),
            "target_language_tags",
            "False with `target_language_token` (the target language is the decoder's first token)",
            self.target_language_tags,
        )

    # --------------------------------------------------------------------------------------------------- presets
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "TransformerNmtConfig":
        """Build a config from a named preset (`cls.PRESETS`), then apply `overrides`.

        Override names are checked (a misspelled field raises a `ValueError` suggesting the closest field, a
        generation parameter says where it belongs), aliases (`hidden_size`) are resolved, and a value the config
        would replace by a derived one raises; values are validated as in the constructor."""
        if name not in cls.PRESETS:
            raise ValueError(f"`preset` must be one of {sorted(cls.PRESETS)}, got {name!r}.")
        check_config_field_names(cls, overrides)
        resolved = _resolve_aliases(cls, overrides)
        config = cls(**{**cls.PRESETS[name], **resolved})
        _check_overrides_applied(config, resolved)
        return config

    # ------------------------------------------------------------------------------------------------- languages
    @classmethod
    def default_target_language_tags(cls, num_target_languages: int) -> bool:
        """Whether a run of this model type prepends `<2xx>` target-language tags when the user leaves it open
        (train.py's `--target_language_tags auto`): when the run translates into more than one language."""
        return num_target_languages > 1

    def language_id(self, lang: str) -> int:
        """Index of `lang` in `languages` (the task id of multilingual variants)."""
        if lang not in self.languages:
            known = ", ".join(self.languages) if self.languages else "none: this model is not multilingual"
            raise ValueError(f"Unknown language {lang!r}; this model knows: {known}.")
        return self.languages.index(lang)

    def translation_languages(self) -> tuple[list[str], list[str]]:
        """(source languages, target languages) the model was trained for: `source_languages` and
        `target_languages` where the training code recorded them; unrecorded targets are all `languages`, unrecorded
        sources are `languages` without the recorded targets (a one-direction model), or all of them. Both empty
        for a model without a language list (a bilingual model that names no languages)."""
        languages = list(self.languages or [])
        targets = list(getattr(self, "target_languages", None) or []) or languages
        sources = list(getattr(self, "source_languages", None) or [])
        if not sources:
            rest = [lang for lang in languages if lang not in (getattr(self, "target_languages", None) or [])]
            sources = rest or languages
        return sources, targets

    def check_languages(self, src_lang: str | None = None, tgt_lang: str | None = None) -> None:
        """Refuse a source or target language the model was not trained for (`translation_languages`), with a
        `ValueError` naming the argument and the model's languages: a one-direction en->fr model asked for
        `tgt_lang="en"` would otherwise translate into French and label it English. A model without a language
        list takes no language codes to check (None passes)."""
        if not self.languages:
            return
        sources, targets = self.translation_languages()
        direction = f"this model translates from {sources} into {targets}"
        for name, lang, allowed, side in (
            ("tgt_lang", tgt_lang, targets, "target"),
            ("src_lang", src_lang, sources, "source"),
        ):
            if lang is None or lang in allowed:
                continue
            if lang not in self.languages:
                raise ValueError(f"{name}={lang!r} is an unknown language: {direction}.")
            raise ValueError(f"{name}={lang!r} is not a {side} language of this model: {direction}.")
        if src_lang is not None and src_lang == tgt_lang:
            raise ValueError(f"src_lang and tgt_lang are both {src_lang!r}: {direction}, not within one language.")

    def language_token_id(self, lang: str) -> int:
        """The vocabulary id of `lang`'s token (`language_token_ids`); a ValueError for a language without one."""
        index = self.language_id(lang)
        if not self.language_token_ids:
            raise ValueError(f"This model has no language tokens (config.language_token_ids is empty): {lang!r}.")
        return self.language_token_ids[index]

    def default_source_language(self) -> str | None:
        """The source language when the caller names none: the one entry of `translation_languages()`'s sources
        (a model translating from one language); None otherwise."""
        sources = self.translation_languages()[0] if self.languages else []
        return sources[0] if len(sources) == 1 else None

    def default_target_language(self) -> str | None:
        """The language this model translates into when the caller names none: the one entry of
        `target_languages` (a single-direction model); None for a model with several targets, or none recorded."""
        targets = getattr(self, "target_languages", None) or []
        return targets[0] if len(targets) == 1 else None

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0


__all__ = [
    "TransformerNmtConfig",
    "apply_config_overrides",
    "check_config_field_names",
    "check_field_type",
    "config_field_names",
    "language_tag",
]
