"""Config field names and values on the paths where a user types them: `from_preset(name, **overrides)`,
`apply_config_overrides` and `training/train.py --config_overrides` (new and saved models), for every model type;
and saved configs with metadata or legacy keys keep loading."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hf_variants  # noqa: E402
from hf_variants.configuration_transformer_nmt import apply_config_overrides  # noqa: E402
from hf_variants.training import train  # noqa: E402

CONFIGS = hf_variants.CONFIG_CLASSES
TINY_OVERRIDES = {"mgsa_nmt": {"phrase_type": "ngram"}}  # no parses needed


def tiny(model_type, **overrides):
    return CONFIGS[model_type].from_preset(
        "tiny", **{"vocab_size": 500, **TINY_OVERRIDES.get(model_type, {}), **overrides}
    )


# A misspelling of one of each variant's own fields, and the field it should suggest.
VARIANT_TYPOS = {
    "transformer_nmt": ("d_modle", "d_model"),
    "mute_nmt": ("num_unit", "num_units"),
    "hysan_nmt": ("encoder_branch", "encoder_branches"),
    "mgsa_nmt": ("phrase_typ", "phrase_type"),
    "mimo_nmt": ("num_transformation", "num_transformations"),
    "tied_nmt": ("direction_embeding", "direction_embedding"),
}
# A bad value of each variant's own fields, checked by the variant's validation.
VARIANT_BAD_VALUES = {
    "transformer_nmt": ("position_embedding_type", "rotary"),
    "mute_nmt": ("sample_rate", 1.5),
    "hysan_nmt": ("fusion", "product"),
    "mgsa_nmt": ("phrase_composition", "mean"),
    "mimo_nmt": ("mimo_memory", "concat"),
    "tied_nmt": ("decoder_layers", 3),
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_from_preset_rejects_unknown_names_with_a_suggestion(model_type):
    with pytest.raises(ValueError, match=r"`d_modle` is not a field of .*Did you mean `d_model`"):
        tiny(model_type, d_modle=64)
    typo, field = VARIANT_TYPOS[model_type]
    with pytest.raises(
        ValueError,
        match=rf"`{typo}` is not a field of {CONFIGS[model_type].__name__}\. "
        rf"Did you mean `{field}`",
    ):
        tiny(model_type, **{typo: 2})
    # generation parameters are dropped by PretrainedConfig: say where they belong instead
    with pytest.raises(ValueError, match=r"`num_beams` is a generation parameter.*generation_config"):
        tiny(model_type, num_beams=5)
    # aliases are applied, not silently lost (the base __init__ set them before our own fields overwrote them)
    assert tiny(model_type, hidden_size=64).d_model == 64
    with pytest.raises(ValueError, match="alias of `d_model`"):
        tiny(model_type, d_model=64, hidden_size=64)
    # PretrainedConfig's own fields stay accepted, in the forms PretrainedConfig takes them
    assert tiny(model_type, output_hidden_states=True, attn_implementation="eager").output_hidden_states is True
    assert tiny(model_type, dtype=torch.float16).dtype == tiny(model_type, dtype="float16").dtype == torch.float16


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_overrides_on_a_saved_config_are_validated(model_type, tmp_path):
    tiny(model_type).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    before = config.to_dict()
    for name, value in (("dropout", 1.5), ("encoder_attention_heads", 5), VARIANT_BAD_VALUES[model_type]):
        with pytest.raises(ValueError, match=f"`{name}`"):
            apply_config_overrides(config, {name: value})
    typo, field = VARIANT_TYPOS[model_type]
    with pytest.raises(ValueError, match=f"`{typo}`.*`{field}`"):
        apply_config_overrides(config, {typo: 2})
    new = apply_config_overrides(config, {"dropout": 0.25, "hidden_size": 64})
    assert type(new) is type(config) and (new.dropout, new.d_model) == (0.25, 64)
    assert config.to_dict() == before  # the given config is not modified
    assert {k: v for k, v in new.to_dict().items() if k not in ("dropout", "d_model")} == {
        k: v for k, v in before.items() if k not in ("dropout", "d_model")
    }


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_saved_configs_with_metadata_and_legacy_keys_keep_loading(model_type, tmp_path):
    """from_pretrained / from_dict stay permissive: config.json carries transformers' metadata and keys of other
    tools or older versions. Such a legacy key also counts as known for overrides of that saved config."""
    config = tiny(model_type)
    data = {
        **config.to_dict(),
        "architectures": ["X"],
        "auto_map": {"AutoConfig": "configuration_x.XConfig"},
        "dtype": "float32",
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "transformers_version": "5.0.0",
        "custom_pipelines": config.custom_pipelines,
        "legacy_field_of_an_old_version": 3,
    }
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is CONFIGS[model_type] and loaded.legacy_field_of_an_old_version == 3
    assert loaded.d_model == config.d_model and loaded.architectures == ["X"]
    new = apply_config_overrides(loaded, {"legacy_field_of_an_old_version": 4, "dropout": 0.2})
    assert new.legacy_field_of_an_old_version == 4 and new.dropout == 0.2


def test_a_derived_field_follows_its_source_or_raises():
    """HySAN derives `use_positional_embeddings` from `position_embedding_type`: an override of the source
    re-derives it; a contradicting request raises instead of being dropped."""
    config = hf_variants.HysanConfig.from_preset("tiny", use_positional_embeddings=False)
    assert config.position_embedding_type == "none"
    learned = apply_config_overrides(config, {"position_embedding_type": "learned"})
    assert (learned.position_embedding_type, learned.use_positional_embeddings) == ("learned", True)
    with pytest.raises(ValueError, match="use_positional_embeddings=True.*not applied.*position_embedding_type"):
        apply_config_overrides(config, {"use_positional_embeddings": True})
    with pytest.raises(ValueError, match="use_positional_embeddings=True.*not applied"):
        hf_variants.HysanConfig.from_preset("tiny", use_positional_embeddings=True, position_embedding_type="none")


def _train_args(*extra):
    return train.parse_args(["--preset", "tiny", *extra])


def test_train_config_overrides_on_a_new_model(tokenizer, capsys):
    """An unknown field is refused when the flags are parsed (one line naming it and the closest field), by
    build_model too for callers that build the arguments themselves; a bad value when the config is built."""
    with pytest.raises(SystemExit):
        _train_args("--config_overrides", "d_modle=64")
    assert re.search("--config_overrides: `d_modle`.*`d_model`", capsys.readouterr().err)
    args = _train_args("--config_overrides", "dropout=0.1")
    args.config_overrides = "d_modle=64"
    with pytest.raises(ValueError, match="`d_modle`.*`d_model`"):
        train.build_model(args, tokenizer, ["en", "de"], False)
    args = _train_args("--model_type", "mute_nmt", "--config_overrides", "sample_rate=1.5")
    with pytest.raises(ValueError, match="`sample_rate`"):
        train.build_model(args, tokenizer, ["en", "de"], False)
    model = train.build_model(
        _train_args("--config_overrides", "hidden_size=64,dropout=0.2"), tokenizer, ["en", "de"], False
    )
    assert (model.config.d_model, model.config.dropout) == (64, 0.2)


def test_train_config_overrides_on_a_saved_model(tokenizer, tmp_path, capsys):
    """`--model_name_or_path` + `--config_overrides`: the same names and values as a new config, checked before
    torch sees them (`encoder_attention_heads=5` used to fail inside the attention reshape)."""
    model = AutoModelForSeq2SeqLM.from_config(tiny("transformer_nmt", vocab_size=len(tokenizer)))
    model.save_pretrained(tmp_path)
    for spec, field in (
        ("dropout=1.5", "dropout"),
        ("encoder_attention_heads=5", "encoder_attention_heads"),
        ("d_modle=64", "d_modle"),
    ):
        args = _train_args("--model_name_or_path", str(tmp_path), "--config_overrides", spec)
        with pytest.raises(ValueError, match=f"`{field}`"):
            train.build_model(args, tokenizer, ["en", "de"], False)
    with pytest.raises(SystemExit):  # train.py's own --dropout is refused when the flags are parsed
        _train_args("--model_name_or_path", str(tmp_path), "--dropout", "1.5")
    assert "--dropout must be in [0, 1), got 1.5" in capsys.readouterr().err
    args = _train_args(
        "--model_name_or_path",
        str(tmp_path),
        "--config_overrides",
        "dropout=0.3,attention_dropout=0.1",
        "--label_smoothing",
        "0.2",
    )
    loaded = train.build_model(args, tokenizer, ["en", "de"], False)
    assert (loaded.config.dropout, loaded.config.attention_dropout, loaded.config.label_smoothing) == (0.3, 0.1, 0.2)
    for name, param in model.state_dict().items():  # the weights are the saved ones
        assert loaded.state_dict()[name].equal(param), name


# ------------------------------------------------------------------------------------------------- field types
# (field, a value of the wrong type, the expected type as the message names it): for every type of field of the
# backbone, and each variant's own fields. Strings are never read as bools or numbers, bools never as integers.
BOOL_, INT_, FLOAT_, STR_ = "a bool \\(true or false\\)", "an integer", "a float", "a string"
BASE_BAD_TYPES = [
    ("normalize_before", "false", BOOL_),
    ("normalize_before", 0, BOOL_),
    ("scale_embedding", None, BOOL_),
    ("tie_word_embeddings", "true", BOOL_),
    ("use_cache", "no", BOOL_),
    ("layer_norm_eps", "1e-5", FLOAT_),
    ("dropout", "0.1", FLOAT_),
    ("label_smoothing", True, FLOAT_),
    ("d_model", True, INT_),
    ("d_model", 32.0, INT_),
    ("encoder_layers", "2", INT_),
    ("max_relative_positions", False, INT_),
    ("position_embedding_type", 1, STR_),
    ("activation_function", None, STR_),
    ("init_method", True, STR_),
    ("pad_token_id", "0", "an integer or null \\(None\\)"),
    ("eos_token_id", 2.0, "an integer or null"),
    ("languages", "de", "a list of strings"),
    ("languages", ["en", 1], "a list of strings"),
]
VARIANT_BAD_TYPES = {
    "transformer_nmt": [],
    "mute_nmt": [
        ("use_bias_module", "true", BOOL_),
        ("sample_rate", "0.85", FLOAT_),
        ("num_units", 4.0, INT_),
        ("merge", 1, STR_),
        ("unit_types", "identity", "a list of strings"),
    ],
    "hysan_nmt": [
        ("use_positional_embeddings", "false", BOOL_),
        ("local_k", "5", "an integer or a list of integers"),
        ("gate_reduction", True, INT_),
        ("fusion", None, STR_),
        ("encoder_branches", "global", "a list of strings"),
    ],
    "mgsa_nmt": [
        ("ngram_skip_special_tokens", "false", BOOL_),
        ("tag_loss_weight", "0.001", FLOAT_),
        ("mgsa_layers", "0", "a list of integers"),
        ("mgsa_layers", [True], "a list of integers"),
        ("syntactic_levels", 3.0, INT_),
        ("phrase_type", 0, STR_),
        ("mgsa_word_heads", "1", "an integer or null"),
    ],
    "mimo_nmt": [
        ("mimo", "false", BOOL_),
        ("mixing_init_std", "0", FLOAT_),
        ("num_transformations", True, INT_),
        ("mimo_memory", 1, STR_),
    ],
    "tied_nmt": [("direction_embedding", "false", BOOL_), ("num_directions", "1", INT_), ("direction_loss", 1, STR_)],
}


def _bad_types(model_type):
    return [(model_type, *case) for case in BASE_BAD_TYPES + VARIANT_BAD_TYPES[model_type]]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_field_types_are_checked_on_construction_and_on_load(model_type, tmp_path):
    """A wrong type raises a ValueError naming the field and its type, from the constructor, from a hand-edited
    config.json (`"normalize_before": "false"` used to load as pre-norm, a wrong model without an error) and
    from `from_pretrained`'s keyword arguments; never coerced."""
    config = tiny(model_type)
    config.save_pretrained(tmp_path / "good")
    saved = json.loads((tmp_path / "good" / "config.json").read_text())
    kwargs = {k: v for k, v in config.to_dict().items() if k in CONFIGS[model_type].field_types()}
    for _, name, value, expected in _bad_types(model_type):
        message = rf"`{name}` must be {expected}.*, got {value!r}".replace("[", "\\[").replace("]", "\\]")
        with pytest.raises(ValueError, match=message):
            CONFIGS[model_type](**{**kwargs, name: value})
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "config.json").write_text(json.dumps({**saved, name: value}))
        with pytest.raises(ValueError, match=message):
            AutoConfig.from_pretrained(tmp_path / "bad")
        with pytest.raises(ValueError, match=message):
            AutoConfig.from_pretrained(tmp_path / "good", **{name: value})
    with pytest.raises(
        ValueError,
        match=r"`layer_norm_eps` must be a float, got '1e-5' \(str\) \(in config.json "
        r"write numbers without quotes\)",
    ):
        CONFIGS[model_type](**{**kwargs, "layer_norm_eps": "1e-5"})


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_integers_for_floats_and_null_where_allowed(model_type, tmp_path):
    config = tiny(model_type)
    saved = json.loads(config.to_json_string())
    (tmp_path / "config.json").write_text(
        json.dumps({**saved, "layer_norm_eps": 1, "dropout": 0, "init_std": 1, "pad_token_id": None})
    )
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert (loaded.layer_norm_eps, loaded.dropout, loaded.init_std, loaded.pad_token_id) == (1, 0, 1, None)
    assert all(
        isinstance(getattr(loaded, name), bool)
        for name, types in type(loaded).field_types().items()
        if types == (hf_variants.configuration_transformer_nmt.BOOL,) and hasattr(loaded, name)
    )


def test_every_field_has_a_declared_type():
    """Each config's `__init__` parameters all have an entry in its type table (a new field cannot skip it)."""
    import inspect

    for model_type, config_class in CONFIGS.items():
        types = config_class.field_types()
        for klass in config_class.__mro__:
            if "__init__" in vars(klass) and issubclass(klass, hf_variants.TransformerNmtConfig):
                params = [
                    n
                    for n, p in inspect.signature(klass.__init__).parameters.items()
                    if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD
                ]
                assert not [n for n in params if n not in types], (model_type, klass.__name__)
