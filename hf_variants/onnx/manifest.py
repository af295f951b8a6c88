"""Reading an exported folder's `onnx_manifest.json` back as untrusted input.

`python -m hf_variants.export_onnx` writes the manifest; `OrtModelForSeq2SeqLM.from_pretrained` reads it back. A
folder may have been copied, edited or damaged since, so `read_manifest` checks every field the runtime reads (its
type, and for graph files that the path is relative, has no `..`, and resolves, symlinks included, to a file inside
the folder) and raises a ValueError naming the manifest and the entry, before any graph is opened.

`int8_activations(manifest)` says how a folder's int8 graphs quantize activations: "per_row" (one scale per row, i.e.
per token: a sentence's numbers do not depend on the other rows of its batch), "calibrated" (one fixed scale per
activation from a calibration run, a Relu's output per row: batch-independent too) or "per_tensor" (one scale per
call, over the whole batch: what folders exported before the manifest recorded `int8.activations` have).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath

MANIFEST = "onnx_manifest.json"
PRECISIONS = ("fp32", "int8")
# how int8 graphs quantize their activations (the manifest's `int8.activations`): one scale per row (per token), or one
# per call over the whole tensor, i.e. over the batch (folders exported before the entry existed)
INT8_ACTIVATIONS = ("per_row", "per_tensor", "calibrated")
# one fixed scale per activation from a calibration run, a Relu's output per row (`calibration.py`)
CALIBRATED = "calibrated"
LEGACY_INT8_ACTIVATIONS = "per_tensor"
# the ONNX element types the runtime binds (`modeling._NUMPY`)
DTYPES = ("float", "int64", "int32", "bool")


class ManifestError(ValueError):
    """A manifest entry the runtime refuses (the message names the manifest file and the entry)."""


def _fail(path: Path, entry: str, problem: str):
    raise ManifestError(f"{path}: entry {entry!r} {problem}.")


def _expect(path: Path, entry: str, value, kind, what: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        _fail(path, entry, f"must be {what}, got {type(value).__name__} {value!r:.80}")
    return value


def _strings(path: Path, entry: str, value) -> list[str]:
    _expect(path, entry, value, list, "a list of strings")
    for i, item in enumerate(value):
        _expect(path, f"{entry}[{i}]", item, str, "a string")
    return value


def graph_path(folder: Path, manifest_path: Path, entry: str, name) -> Path:
    """The file a manifest entry names, checked to lie inside `folder`: a relative path without `..` that resolves
    (symlinks followed) to a regular file under the folder's own resolved path."""
    _expect(manifest_path, entry, name, str, "a file name")
    if (
        not name
        or PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
    ):
        _fail(manifest_path, entry, f"names {name!r}: graph paths must be relative to the folder")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        _fail(manifest_path, entry, f"names {name!r}: graph paths may not contain '..'")
    root = folder.resolve()
    resolved = (folder / name).resolve()
    if not resolved.is_relative_to(root):
        _fail(manifest_path, entry, f"names {name!r}, which resolves outside {folder} (to {resolved})")
    if not resolved.is_file():
        _fail(manifest_path, entry, f"names {name!r}, which is not a file in {folder}")
    return resolved


def _io(path: Path, entry: str, value) -> dict:
    _expect(path, entry, value, dict, "an object with 'inputs' and 'outputs'")
    for side in ("inputs", "outputs"):
        values = _expect(path, f"{entry}.{side}", value.get(side), list, "a list")
        for i, item in enumerate(values):
            where = f"{entry}.{side}[{i}]"
            _expect(path, where, item, dict, "an object")
            _expect(path, f"{where}.name", item.get("name"), str, "a string")
            if item.get("dtype") not in DTYPES:
                _fail(path, f"{where}.dtype", f"must be one of {list(DTYPES)}, got {item.get('dtype')!r:.80}")
            shape = _expect(path, f"{where}.shape", item.get("shape"), list, "a list")
            for j, dim in enumerate(shape):
                if isinstance(dim, bool) or not isinstance(dim, (int, str)) or (isinstance(dim, int) and dim < 0):
                    _fail(path, f"{where}.shape[{j}]", f"must be a size or a symbolic name, got {dim!r:.80}")
    return value


def _graphs(folder: Path, path: Path, entry: str, value, roles: tuple[str, ...]) -> dict:
    _expect(path, entry, value, dict, "an object of precisions")
    for precision, files in value.items():
        if precision not in PRECISIONS:
            _fail(path, f"{entry}.{precision}", f"is not a precision ({list(PRECISIONS)})")
        if len(roles) == 1:
            graph_path(folder, path, f"{entry}.{precision}", files)
            continue
        _expect(path, f"{entry}.{precision}", files, dict, f"an object with {list(roles)}")
        for role in roles:
            graph_path(folder, path, f"{entry}.{precision}.{role}", files.get(role))
    return value


def read_manifest(folder: str | Path) -> dict:
    """`folder`'s manifest, every field the runtime reads checked (see the module docstring). Raises
    FileNotFoundError without a manifest and ManifestError (a ValueError) naming the entry for a bad one."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no {MANIFEST}: export the model first with `python -m hf_variants.export_onnx --model "
            f"MODEL --output_dir {folder}`."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"{path}: not valid JSON ({error}).") from error
    _expect(path, "(top level)", manifest, dict, "an object")
    _expect(path, "model_type", manifest.get("model_type"), str, "a string")
    layers = _expect(path, "num_layers", manifest.get("num_layers"), int, "an integer")
    if layers < 1:
        _fail(path, "num_layers", f"must be at least 1, got {layers}")
    for entry in ("encoder_fields", "source_inputs", "step_inputs"):
        _strings(path, entry, manifest.get(entry))
    _expect(path, "tgt_lang_ids_required", manifest.get("tgt_lang_ids_required", False), bool, "true or false")
    graphs = _graphs(folder, path, "graphs", manifest.get("graphs"), ("encoder", "decoder"))
    if "fp32" not in graphs and "int8" not in graphs:
        _fail(path, "graphs", "names no graphs")
    _io(path, "encoder", manifest.get("encoder"))
    _io(path, "decoder", manifest.get("decoder"))
    shared = _expect(path, "shared_cache", manifest.get("shared_cache"), dict, "an object")
    if _expect(path, "shared_cache.written", shared.get("written"), bool, "true or false"):
        _graphs(folder, path, "shared_cache.graphs", shared.get("graphs"), ("decoder",))
        _io(path, "shared_cache.decoder", shared.get("decoder"))
    else:
        _expect(path, "shared_cache.reason", shared.get("reason"), str, "a string")
    int8 = manifest.get("int8")
    if int8 is not None:  # written by --int8 exports (null without): the activation scheme is read at load
        _expect(path, "int8", int8, dict, "an object or null")
        if int8.get("activations", LEGACY_INT8_ACTIVATIONS) not in INT8_ACTIVATIONS:
            _fail(
                path, "int8.activations", f"must be one of {list(INT8_ACTIVATIONS)}, got {int8['activations']!r:.80}"
            )
    scoring = _expect(path, "scoring", manifest.get("scoring", {"written": False}), dict, "an object")
    if _expect(path, "scoring.written", scoring.get("written"), bool, "true or false"):  # optional (--scoring_graph)
        _graphs(folder, path, "scoring.graphs", scoring.get("graphs"), ("scoring",))
        _io(path, "scoring.io", scoring.get("io"))
    return manifest


def int8_activations(manifest: dict) -> str:
    """How the folder's int8 graphs quantize activations (`INT8_ACTIVATIONS`): the manifest's `int8.activations`, or
    "per_tensor" for a folder exported before that entry was written (`read_manifest` checked the value)."""
    return (manifest.get("int8") or {}).get("activations", LEGACY_INT8_ACTIVATIONS)
