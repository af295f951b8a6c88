"""The front ends agree with the translation core: every decoding option is one definition (`DecodeOptions`' field
metadata) that the translate command's flags, the server's request schema, training's evaluation flags and
`DecodeOptions.check` all read, so each accepts and refuses exactly the same values; the commands share one
definition of their model, engine, batching and output-folder flags, and one model loader that tells the engine
from the folder. No model runs here (the engines' agreement is in test_serve_engines.py)."""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path

import pytest

import hf_variants
from hf_variants.commands import average, export_ctranslate2, export_onnx, score, serve, translate, warm_start
from hf_variants.commands.common import UsageError
from hf_variants.commands.loading import folder_kind, locate_model
from hf_variants.inference.requests import DecodeOptions, OptionError, option_specs
from hf_variants.training import options as train_options

PACKAGE = Path(hf_variants.__file__).parent


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions}


def probes(spec) -> list:
    """Values on both sides of each end of an option's range (and a few ordinary ones)."""
    if spec.kind is bool:
        return [True, False]
    values = [0, 1, 2, 5, -1]
    for end in (spec.minimum, spec.above, spec.maximum):
        if end is not None:
            values += [end, end - 1, end + 1] if spec.kind is int else [end, end - 1e-3, end + 1e-3]
    return sorted({spec.kind(v) for v in values})


def cli_accepts(action: argparse.Action, value) -> bool:
    try:
        action.type(str(value))
    except argparse.ArgumentTypeError:
        return False
    return True


def schema_accepts(name: str, value) -> bool:
    from pydantic import ValidationError

    from hf_variants.serve.schema import TranslateRequest

    try:
        TranslateRequest.model_validate({"text": "x", name: value}, strict=True)
    except ValidationError:
        return False
    return True


def core_accepts(spec, value) -> bool:
    return spec.problem(value) is None


def test_every_decoding_option_is_one_definition_for_the_cli_the_server_and_the_core():
    pytest.importorskip("pydantic")
    from hf_variants.serve.schema import TranslateRequest, server_options

    cli = actions(translate.build_parser())
    fields = DecodeOptions.__dataclass_fields__
    assert list(option_specs()) == list(fields)  # every field has its metadata
    for name, spec in option_specs().items():
        action = cli[name]
        assert action.option_strings[0] == f"--{name}" and action.default == fields[name].default, name
        assert spec.help in action.help, name
        in_schema = name in TranslateRequest.model_fields
        assert in_schema == spec.server == (name in server_options()), name
        if in_schema:
            assert spec.help[1:] in TranslateRequest.model_fields[name].description, name
        if spec.kind is bool:
            assert isinstance(action, argparse._StoreTrueAction), name
            continue
        for value in probes(spec):
            expected = core_accepts(spec, value)
            assert cli_accepts(action, value) == expected, (name, value)
            if in_schema:
                assert schema_accepts(name, value) == expected, (name, value)
        for bad in (math.nan, math.inf):
            assert not cli_accepts(action, bad) and not core_accepts(spec, bad), (name, bad)
            if in_schema and spec.kind is float:
                assert not schema_accepts(name, bad), (name, bad)


def test_the_core_check_refuses_what_the_flags_refuse():
    """`DecodeOptions.check` names the field with the range the flag's parser states."""
    for name, spec in option_specs().items():
        if spec.kind is bool:
            with pytest.raises(OptionError, match=f"{name}=1: expected true or false") as error:
                DecodeOptions(**{name: 1}).check()
            assert error.value.names[:1] == (name,)
            continue
        low = spec.minimum if spec.minimum is not None else spec.above
        if low is None:
            continue
        below = spec.kind(low - 1) if spec.minimum is not None else spec.kind(low)
        extra = {"do_sample": True} if spec.group == "sampling" else {}
        with pytest.raises(OptionError, match=f"expected {spec.range_text().replace('(', '.').replace(')', '.')}"):
            DecodeOptions(**{name: below, **extra}).check()


def test_training_evaluation_flags_are_the_same_options_with_the_papers_defaults():
    train = actions(train_options.build_parser())
    cli = actions(translate.build_parser())
    for name, default in train_options.EVAL_DECODING.items():
        assert train[name].default == default and train[name].help == cli[name].help, name
        for value in probes(option_specs()[name]):
            assert cli_accepts(train[name], value) == cli_accepts(cli[name], value), (name, value)
    assert "--generation_num_beams" in train["num_beams"].option_strings


SHARED_FLAGS = {
    "model": ("--model", "--engine", "--precision", "--num_threads", "--tokenizer", "--trust_remote_code", "--onnx"),
    "batches": ("--batch_size", "--max_tokens"),
}


def test_translate_score_and_serve_share_their_model_and_batching_flags():
    parsers = {
        "translate": actions(translate.build_parser()),
        "score": actions(score.build_parser()),
        "serve": actions(serve.build_parser()),
    }
    for flag in SHARED_FLAGS["model"]:
        dest = flag[2:]
        first = parsers["translate"][dest]
        for name, found in parsers.items():
            other = found[dest]
            assert (other.option_strings, other.default, other.choices) == (
                first.option_strings,
                first.default,
                first.choices,
            ), (name, flag)
    for flag in SHARED_FLAGS["batches"]:
        dest = flag[2:]
        assert parsers["translate"][dest].type is not None and parsers["score"][dest].default is None
    # score decodes nothing: none of the decoding flags
    assert not set(option_specs()) & set(parsers["score"])


def flag_definitions() -> dict[str, set[str]]:
    """{flag: the files of hf_variants that call add_argument with it as a literal}."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                        found.setdefault(arg.value, set()).add(str(path.relative_to(PACKAGE)))
    return found


def test_no_flag_block_is_repeated_and_training_holds_training_only():
    defined = flag_definitions()
    # the same name with another meaning, each defined once: train's own flags, the tokenizer trainer's --model (bpe
    # or unigram), the exports' --model/--tokenizer (a model folder as it is, add_model_folder_flags)
    elsewhere = {"training/options.py", "commands/train_tokenizer.py"}
    for flag in (*SHARED_FLAGS["model"], *SHARED_FLAGS["batches"], "--force", "--output_dir"):
        assert defined[flag] - elsewhere <= {"commands/loading.py", "commands/common.py"}, (flag, defined[flag])
        assert len(defined[flag] & {"commands/loading.py", "commands/common.py"}) <= 2, flag
    # generated, never typed in a front end (warm start's --seed is its initialisation's: another meaning)
    for name in option_specs():
        typed = {f for f in defined.get(f"--{name}", ()) if f.startswith(("commands/", "serve/"))}
        assert typed <= ({"commands/warm_start.py"} if name == "seed" else set()), name
    builders = [p.name for p in (PACKAGE / "training").rglob("*.py") if "(argparse.ArgumentParser)" in p.read_text()]
    builders += [p.name for p in (PACKAGE / "training").rglob("*.py") if "argparse.ArgumentParser(" in p.read_text()]
    assert builders == ["options.py"]  # train's own parser; every other command's is in commands/
    for name in ("translate", "score", "average"):  # kept as launchers only
        assert "runpy.run_module" in (PACKAGE / "training" / f"{name}.py").read_text()


def test_every_command_has_its_parser_in_commands():
    for module in (translate, score, average, serve, export_onnx, export_ctranslate2, warm_start):
        assert module.__name__.startswith("hf_variants.commands."), module
        assert callable(module.build_parser) and callable(module.cli)


# ---------------------------------------------------------------------------------------------------- the loader
def namespace(**kwargs) -> argparse.Namespace:
    values = dict(model=None, onnx=None, engine="auto", precision="fp32", int8=False, tokenizer=None, weights=None)
    values.update(num_threads=None, trust_remote_code=False)
    values.update(kwargs)
    return argparse.Namespace(**values)


def test_the_loader_tells_the_engine_from_the_folder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    onnx = tmp_path / "onnx"
    onnx.mkdir()
    (onnx / "onnx_manifest.json").write_text("{}")  # a real export's int8 check: test_serve_engines.py
    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    (ct2 / "model.bin").write_bytes(b"")
    (ct2 / "config.json").write_text("{}")  # CTranslate2's own config: no transformers model
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    assert [folder_kind(str(p)) for p in (model, onnx, ct2, run, tmp_path / "run" / "nothing")] == [
        "model",
        "onnx",
        "ctranslate2",
        "run",
        None,
    ]
    assert locate_model(namespace(model=str(model))).engine == "torch"
    assert locate_model(namespace(model=str(onnx))).engine == "onnx"
    assert locate_model(namespace(onnx=str(onnx))).engine == "onnx"  # the alias
    assert locate_model(namespace(model=str(ct2), int8=True)).precision == "int8"
    refusals = [
        (namespace(model=str(model), engine="ctranslate2"), "is a saved model folder, not a model for --engine"),
        (namespace(model=str(ct2), engine="onnx"), "pass --engine ctranslate2"),
        (namespace(model=str(run)), "is a training run folder: pass its saved model"),
        (namespace(model=str(model), onnx=str(onnx)), "pass exactly one of --model and --onnx"),
        (namespace(onnx=str(onnx), engine="torch"), "--onnx DIR is --model DIR --engine onnx"),
        (namespace(model=str(model), weights="ema"), "is a saved model folder, not a training checkpoint"),
        (namespace(model=str(tmp_path / "run" / "nothing")), "no such model folder"),
    ]
    for args, message in refusals:
        with pytest.raises(UsageError, match=message):
            locate_model(args)
