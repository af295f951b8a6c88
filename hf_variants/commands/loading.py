"""One model loader for every command: the model flags, where a model is, its configs without its weights, and its
`Translator` on any engine.

    add_model_flags(parser)                  # --model --engine --precision --num_threads --tokenizer
                                             # --trust_remote_code --weights, and the aliases --onnx DIR, --int8
    location = locate_model(args)            # checks, before anything loads: what --model holds, for which engine
    config, generation_config = read_configs(location)          # cheap: the checks before loading run on them
    translator = load_translator(location)   # hf_variants.inference.Translator on the engine

`--model` takes every kind of model folder the package writes, and the engine follows from it (`--engine auto`, the
default): a saved model folder (`run_dir/model`, `save_pretrained`, an averaged or converted model) or a Hub id
→ torch; a training checkpoint (`run_dir/checkpoints/step_N`: the run's config with the checkpoint's weights,
`--weights ema|raw`) → torch; a folder written by `hf-variants-export-onnx` → onnx; a folder written by
`hf-variants-export-ctranslate2` → ctranslate2. `--engine` names one explicitly (a folder it cannot load is refused
naming both); `--precision int8` runs int8 (torch: every linear layer quantized for the CPU; onnx: the export's
int8 graphs; ctranslate2: its int8 compute type). `--onnx DIR` is `--model DIR --engine onnx`, `--int8` is
`--precision int8` (the flags of earlier releases).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..inference.decode import ENGINES, PRECISIONS
from ..outputs import int_in_range
from .common import UsageError

AUTO = "auto"
ONNX_MANIFEST = "onnx_manifest.json"  # written by hf-variants-export-onnx
CTRANSLATE2_MANIFEST = "hf_variants_export.json"  # written by hf-variants-export-ctranslate2 (beside model.bin)
WEIGHT_CHOICES = ("ema", "raw")


def add_model_flags(
    parser: argparse.ArgumentParser, *, what: str = "translate", weights: bool = True
) -> argparse._ArgumentGroup:
    """The model and engine flags (see the module docstring), in a group of their own (returned)."""
    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        help="a saved model folder or Hub id, a training checkpoint (run_dir/checkpoints/step_N), a folder written "
        "by hf-variants-export-onnx or by hf-variants-export-ctranslate2",
    )
    g.add_argument(
        "--engine",
        choices=(AUTO, *ENGINES),
        default=AUTO,
        help=f"the engine that {what}s; auto: the one --model's folder is for (onnx and ctranslate2 exports, "
        "torch otherwise)",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="int8: torch's linear layers quantized for the CPU, the ONNX export's int8 graphs, CTranslate2's int8 "
        "compute type",
    )
    g.add_argument("--num_threads", type=int_in_range(1), help="CPU threads of the engine (default: the library's)")
    g.add_argument("--tokenizer", help="default: the model folder (the run's tokenizer for a checkpoint)")
    g.add_argument("--trust_remote_code", action="store_true", help="for Hub ids whose code is not installed")
    if weights:
        g.add_argument(
            "--weights",
            choices=WEIGHT_CHOICES,
            help="a checkpoint of a run trained with --ema_decay: its moving average or its trained weights "
            "(default: those the run validated, what its model/ folder holds)",
        )
    g.add_argument("--onnx", metavar="DIR", help="the same as --model DIR --engine onnx")
    g.add_argument("--int8", action="store_true", help="the same as --precision int8")
    return g


@dataclass(frozen=True)
class ModelLocation:
    """Where a model is and how it loads: `path` (a folder or Hub id), `engine`, `precision`, `kind` ("model",
    "hub", "checkpoint", "onnx", "ctranslate2"), `tokenizer` (a folder, None: the model's), `weights` (a
    checkpoint's "ema" / "raw", None otherwise), `config_dir` (where its config.json is; None for a Hub id or a
    CTranslate2 export, whose config is in its manifest)."""

    path: str
    engine: str
    precision: str = "fp32"
    kind: str = "model"
    tokenizer: str | None = None
    weights: str | None = None
    config_dir: str | None = None
    num_threads: int | None = None
    trust_remote_code: bool = False

    @property
    def label(self) -> str:
        return self.path


def folder_kind(path: str) -> str | None:
    """What a folder holds: "onnx", "ctranslate2", "checkpoint", "model" (config.json), "run" (a training run
    folder: its model/ or checkpoints/), None (nothing loadable)."""
    from ..training.checkpoint_models import is_checkpoint

    folder = Path(path)
    if (folder / ONNX_MANIFEST).is_file():
        return "onnx"
    if (folder / CTRANSLATE2_MANIFEST).is_file() or (folder / "model.bin").is_file():
        return "ctranslate2"
    if is_checkpoint(folder):
        return "checkpoint"
    if (folder / "config.json").is_file():
        return "model"
    if (folder / "model" / "config.json").is_file() or (folder / "checkpoints").is_dir():
        return "run"
    return None


def _looks_like_a_hub_id(text: str) -> bool:
    return not text.startswith((".", "/", "~")) and text.count("/") <= 1 and not Path(text).exists()


KIND_ENGINE = {"model": "torch", "hub": "torch", "checkpoint": "torch", "onnx": "onnx", "ctranslate2": "ctranslate2"}
ENGINE_NEEDS = {
    "torch": "a folder with config.json and weights",
    "onnx": f"a folder with {ONNX_MANIFEST}, written by hf-variants-export-onnx",
    "ctranslate2": "a folder with model.bin, written by hf-variants-export-ctranslate2",
}
KIND_NAME = {
    "model": "a saved model folder",
    "checkpoint": "a training checkpoint",
    "onnx": "an ONNX export (hf-variants-export-onnx)",
    "ctranslate2": "a CTranslate2 export (hf-variants-export-ctranslate2)",
}


def _model_and_engine(args: argparse.Namespace) -> tuple[str, str, str]:
    """(--model, --engine, --precision) with the aliases --onnx and --int8 folded in."""
    if (args.model is None) == (args.onnx is None):
        raise UsageError("pass exactly one of --model and --onnx.")
    engine, path = args.engine, args.model
    if args.onnx is not None:
        if engine not in (AUTO, "onnx"):
            raise UsageError(f"--onnx DIR is --model DIR --engine onnx, but --engine is {engine}.")
        engine, path = "onnx", args.onnx
    precision = args.precision
    if args.int8:
        if precision not in ("fp32", "int8"):
            raise UsageError(f"--int8 is --precision int8, but --precision is {precision}.")
        precision = "int8"
    return path, engine, precision


def _kind_of(path: str) -> str:
    """The kind of model at `path` (see `folder_kind`), or a UsageError saying what to pass."""
    folder = Path(path)
    if not folder.is_dir():
        if folder.exists() or not _looks_like_a_hub_id(path):
            raise UsageError(f"--model {path}: no such model folder.")
        return "hub"
    kind = folder_kind(path)
    if kind == "run":
        raise UsageError(
            f"--model {path} is a training run folder: pass its saved model, --model {folder / 'model'} "
            f"(or one of its checkpoints, {folder / 'checkpoints'}/step_N)."
        )
    if kind is None:
        raise UsageError(
            f"--model {path}: no config.json; pass a saved model folder (a run's model/), a checkpoint folder "
            "(a run's checkpoints/step_N), an ONNX or CTranslate2 export, or a Hub id."
        )
    return kind


def _check_precision(path: str, kind: str, precision: str) -> None:
    if kind != "onnx" or precision != "int8":
        return
    from ..onnx.manifest import read_manifest

    try:
        graphs = read_manifest(Path(path))["graphs"]
    except (ValueError, OSError) as error:
        raise UsageError(f"--model {path}: {error}") from None
    if precision not in graphs:
        raise UsageError(
            f"--precision int8: {path} has {' and '.join(sorted(graphs))} graphs (export with --int8 for int8)"
        )


def locate_model(args: argparse.Namespace) -> ModelLocation:
    """The model of the parsed model flags (see the module docstring), checked without loading anything: a
    `UsageError` naming the flag for a folder that holds nothing loadable, a run folder, an engine the folder is
    not for, int8 an ONNX export does not have, `--weights` for a model that is not a checkpoint."""
    path, engine, precision = _model_and_engine(args)
    kind = _kind_of(path)
    if engine == AUTO:
        engine = KIND_ENGINE[kind]
    elif KIND_ENGINE[kind] != engine:
        flag = "--onnx" if args.onnx is not None else "--model"
        raise UsageError(
            f"{flag} {path} is {KIND_NAME[kind]}, not a model for --engine {engine} (which loads "
            f"{ENGINE_NEEDS[engine]}): pass --engine {KIND_ENGINE[kind]} (or leave --engine out)."
        )
    _check_precision(path, kind, precision)
    weights = getattr(args, "weights", None)
    config_dir = None
    if kind == "checkpoint":
        from ..training.checkpoint_models import check_weights, run_config_dir
        from ..training.checkpointing import CheckpointError

        try:
            config_dir = str(run_config_dir(path))
            weights = check_weights(path, weights)
        except CheckpointError as error:
            raise UsageError(str(error)) from None
    elif weights is not None:
        what = KIND_NAME.get(kind, "a Hub id")
        raise UsageError(f"--weights {weights}: --model {path} is {what}, not a training checkpoint.")
    elif kind in ("model", "onnx"):
        config_dir = path
    return ModelLocation(
        path=path,
        engine=engine,
        precision=precision,
        kind=kind,
        tokenizer=args.tokenizer,
        weights=weights,
        config_dir=config_dir,
        num_threads=getattr(args, "num_threads", None),
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)) and kind in ("model", "hub"),
    )


def read_configs(location: ModelLocation):
    """(config, generation config) of the model without its weights: the checks before loading run on them."""
    from transformers import AutoConfig, GenerationConfig

    if location.kind == "ctranslate2":
        from ..configuration_transformer_nmt import TransformerNmtConfig
        from ..deploy.ctranslate2 import read_export_manifest

        manifest = read_export_manifest(Path(location.path))
        if "model_config" not in manifest:
            raise UsageError(
                f"--model {location.path} was exported before the export recorded the model's config: export it "
                "again with hf-variants-export-ctranslate2"
            )
        config = TransformerNmtConfig.from_dict(manifest["model_config"])
        source = location.path
    else:
        source = location.config_dir or location.path
        config = AutoConfig.from_pretrained(source, trust_remote_code=location.trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(source)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return config, generation


def load_translator(location: ModelLocation):
    """The `Translator` of `location` on its engine (a checkpoint: the run's config with its weights; every model
    checked against its tokenizer)."""
    import torch

    from ..inference import Translator
    from ..inference.decode import TorchEngine

    if location.num_threads is not None:  # also the torch operations around an ONNX Runtime / CTranslate2 engine
        torch.set_num_threads(location.num_threads)
    if location.kind != "checkpoint":
        return Translator.from_pretrained(
            location.path,
            engine=location.engine,
            precision=location.precision,
            num_threads=location.num_threads,
            trust_remote_code=location.trust_remote_code,
            tokenizer=location.tokenizer,
        )
    from transformers import AutoTokenizer

    from ..generation_transformer_nmt import check_tokenizer_fits_model
    from ..training.checkpoint_models import load_checkpoint_model

    model, _, tokenizer_dir = load_checkpoint_model(location.path, location.weights)
    tokenizer_path = location.tokenizer or str(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    check_tokenizer_fits_model(tokenizer, model.config, tokenizer_path, location.path)
    if location.precision == "int8":
        from ..deploy.int8 import quantize_for_cpu

        quantize_for_cpu(model)
    return Translator(engine=TorchEngine(model, tokenizer))


def model_record(location: ModelLocation) -> dict:
    """What a command's summary says of the model it used."""
    record = {"model": location.path, "engine": location.engine, "precision": location.precision}
    if location.weights is not None:
        record["weights"] = location.weights
    return record


__all__ = [
    "ModelLocation",
    "add_model_flags",
    "folder_kind",
    "load_translator",
    "locate_model",
    "model_record",
    "read_configs",
]


def load_model_folder(model: str, tokenizer: str | None):
    """(model, tokenizer) of a saved model folder for the export commands (the tokenizer from `tokenizer`, else
    the model's folder; a UsageError saying to pass --tokenizer when it has none)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    loaded = AutoModelForSeq2SeqLM.from_pretrained(model)
    try:
        return loaded, AutoTokenizer.from_pretrained(tokenizer or model)
    except (OSError, ValueError) as error:
        raise UsageError(f"no tokenizer in {tokenizer or model}: pass --tokenizer DIR ({error}).") from None


def check_export_paths(model: str, tokenizer: str | None, output_dir: str, command: str, force: bool):
    """Before an export loads anything: the output is no input and can be written, the model is a saved model
    folder, the tokenizer folder (if given) holds a tokenizer. Returns the model's config."""
    from ..model_folders import check_tokenizer_source, load_config
    from ..outputs import check_not_an_input, check_output_dir

    try:
        check_not_an_input(output_dir, {"--model": model, "--tokenizer": tokenizer})
        check_output_dir(output_dir, command=command, force=force)
        config = load_config(model, "--model")
        check_tokenizer_source(tokenizer, model)
    except (ValueError, FileExistsError) as error:  # ModelFolderError and OutputPathError are ValueErrors
        raise UsageError(str(error)) from None
    return config


def load_model_and_tokenizer(
    path: str, tokenizer: str | None = None, trust_remote_code: bool = False, weights: str | None = None
):
    """(PyTorch model, tokenizer) of a saved model folder, Hub id or training checkpoint, loaded as the commands
    load it (for scripts and benchmarks that drive a model directly)."""
    args = argparse.Namespace(
        model=path,
        onnx=None,
        engine="torch",
        precision="fp32",
        int8=False,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        weights=weights,
        num_threads=None,
    )
    translator = load_translator(locate_model(args))
    return translator.model, translator.tokenizer
