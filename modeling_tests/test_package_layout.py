"""The package's layout: the files a saved model ships stay flat and import nothing of the runtime subpackages, the
import graph of `hf_variants` has no cycle and no import from a lower layer back up, the documented `python -m
hf_variants.X` commands keep working, and a wheel built from the checkout holds every subpackage.

Layers, bottom to top (an import may only go down or stay inside its own subpackage):

0. the model closure: `configuration_*`, `modeling_*`, `generation_transformer_nmt`, `loss_transformer_nmt`,
   `phrases`, `pipeline_translation` (copied flat next to a saved model; `auto_map` and `custom_pipelines` name them);
1. `model_classes`, `tokenization`, `outputs`, `sizing`, `model_folders`, `finetuning` (the package's own tables,
   training utilities, output folders, memory estimates, the model folders commands read, Seq2SeqTrainer inputs);
2. the runtime subpackages `onnx`, `deploy`, `convert`;
3. `inference`, the translation core (requests, batching, decoding on the torch / ONNX Runtime / CTranslate2
   engines, scoring), which drives the runtime subpackages;
4. `training` (training, the translate and score commands, evaluation) and `serve` (the HTTP service), both on
   the translation core;
5. `registration` (names `OrtModelForSeq2SeqLM` for the pipeline task);
6. the package itself (`__init__`), the command-line front ends (`commands`) and the command modules kept at their
   documented paths (`export_onnx`, ...).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hf_variants
from hf_variants import MODEL_CLASSES

PACKAGE = Path(hf_variants.__file__).parent
REPO = PACKAGE.parent
SUBPACKAGES = ("onnx", "deploy", "convert")
COMMANDS = ("export_onnx", "export_ctranslate2", "convert_marian", "convert_legacy", "warm_start")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def imports_of(path: Path) -> set[str]:
    """Every `hf_variants` module `path` imports, at any depth of the file (function-level imports included), as a
    name relative to the package (`onnx.modeling`, `registration`, `__init__` for the package itself)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    if package == ["__init__"]:
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hf_variants":
                target = node.module.split(".")[1:]
            else:
                continue
            # `from . import x` / `from .onnx import modeling` name modules; `from .m import Name` a module's name
            found.update(n for n in (".".join(target + [a.name]) for a in node.names) if _is_module(n))
            if target and _is_module(".".join(target)):
                found.add(".".join(target))
            elif not target:
                found.add("__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_variants":
                    found.add(".".join(alias.name.split(".")[1:]) or "__init__")
    found.discard(module_name(path))
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(name: str) -> int:
    top = name.split(".")[0]
    if top in SUBPACKAGES:
        return 2
    if top == "inference":
        return 3
    if top in ("training", "serve"):
        return 4
    if top in ("model_classes", "tokenization", "outputs", "sizing", "model_folders", "finetuning"):
        return 1
    if top == "registration":
        return 5
    if top in COMMANDS or top in ("__init__", "commands"):  # commands: the console scripts' front ends
        return 6
    return 0


def closure_modules() -> set[str]:
    """The modules a saved model ships: what its `auto_map` and `custom_pipelines` name, and their relative imports."""
    roots = {"pipeline_translation"}
    for config_class, model_class, generation_class in MODEL_CLASSES.values():
        roots |= {cls.__module__.rsplit(".", 1)[1] for cls in (config_class, model_class, generation_class)}
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += imports_of(PACKAGE / f"{name}.py")
    return seen


def test_the_model_closure_is_flat_and_imports_only_siblings():
    closure = closure_modules()
    assert {"configuration_transformer_nmt", "modeling_mgsa", "phrases", "pipeline_translation"} <= closure
    for name in closure:
        path = PACKAGE / f"{name}.py"
        assert path.is_file(), f"{name} is not a flat module of hf_variants"
        assert layer(name) == 0, f"the saved model's code imports {name} (not a model-closure module)"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module, f"{path.name}: `from {'.' * node.level}{node.module or ''}`"
                assert (PACKAGE / f"{node.module}.py").is_file(), f"{path.name} imports .{node.module}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                absolute = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "hf_variants" for n in absolute if not getattr(node, "level", 0)), (
                    f"{path.name} imports hf_variants by absolute name: a saved model runs without the package"
                )


def test_no_import_cycle_and_no_import_up_the_layers():
    modules = all_modules()
    graph = {name: imports_of(path) for name, path in modules.items()}
    for name, targets in graph.items():
        for target in targets:
            assert target in modules or target == "__init__", f"{name} imports unknown {target}"
            same_subpackage = name.split(".")[0] == target.split(".")[0] and layer(name) in (2, 3, 4)
            assert same_subpackage or layer(target) < layer(name) or (layer(name) == layer(target) == 0), (
                f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
            )
    # no cycle: a depth-first search over every import
    state = {}

    def visit(node, path):
        state[node] = "open"
        for target in graph.get(node, ()):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_documented_commands_keep_their_paths():
    """`python -m hf_variants.X --help` for every documented command: the first for real, the others in one more
    process through runpy's `run_module(..., run_name="__main__")`, which is what `python -m` does (one interpreter
    start instead of four)."""
    first = subprocess.run(
        [sys.executable, "-m", f"hf_variants.{COMMANDS[0]}", "--help"], capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "--output_dir" in first.stdout and "Overwriting pipeline" not in first.stderr
    script = (
        "import contextlib, io, runpy, sys\n"
        f"for name in {list(COMMANDS[1:])!r}:\n"
        "    sys.argv, out = [name, '--help'], io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            runpy.run_module('hf_variants.' + name, run_name='__main__', alter_sys=True)\n"
        "        except SystemExit as stop:\n"
        "            assert stop.code in (0, None), (name, stop.code)\n"
        "    assert '--output_dir' in out.getvalue(), name\n"
        "    print(name, 'ok')\n"
    )
    rest = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert rest.stdout.split() == [w for name in COMMANDS[1:] for w in (name, "ok")]
    assert "Overwriting pipeline" not in rest.stderr, "a command registers the translation task twice"
    # the public names stay importable where they were
    from hf_variants.convert_marian import convert_marian
    from hf_variants.export_onnx import export
    from hf_variants.warm_start import warm_start

    assert convert_marian.__module__ == "hf_variants.convert.marian"
    assert export.__module__ == "hf_variants.onnx.export"
    assert warm_start.__module__ == "hf_variants.convert.warm_start"
    for name in hf_variants.__all__:
        assert getattr(hf_variants, name) is not None


@pytest.mark.timeout(600)
def test_a_wheel_from_the_checkout_ships_every_subpackage(checkout_wheel):
    names = set(zipfile.ZipFile(checkout_wheel).namelist())
    for name, path in all_modules().items():
        assert str(path.relative_to(REPO)) in names, f"the wheel lacks {path.relative_to(REPO)}"
    assert "model_cards/templates/_base.md" in names
