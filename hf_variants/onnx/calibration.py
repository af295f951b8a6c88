"""Fixed activation scales for an export's int8 graphs, from a calibration run (`export_onnx --int8
--int8_activations calibrated --calibration_data FILE`).

The per-row int8 graphs compute, for every quantized activation x, its row maxima max|x| (`{x}/per_row/max`). A
calibration run translates the calibration sentences with those graphs, each graph's row maxima declared extra outputs
(`quantization.add_row_maxima_outputs`, in copies of the graphs in a scratch folder) and read after every step
(`_Graph.probe`), and keeps each activation's largest value. Every decoding runs in transformers' loop
(`bound_search = False`), so each step of each graph passes through `_Graph.run`: once on the shared-cache step graph
(where the export has it) and once on the concatenated-cache one. `quantization.quantize_activations_calibrated` then
gives each symmetric activation the fixed scale max / 127; a Relu's output stays per row.

Why: ONNX Runtime applies a per-row activation scale in a pass of its own after the MatMul and cannot take the bias
there (`benchmarks/bench_ort_int8_matmul.py`), so per-row graphs run at 0.85-0.98x of per-tensor ones; fixed scales
are constants, so a sentence's numbers still do not depend on its batch, and the MatMuls run as fast as per tensor
(calibrated graphs: 0.94-1.04x, `benchmarks/RESULTS.md` section 9).
The cost: a value beyond what calibration saw saturates at the int8 limit, so the calibration sentences should be
like the text the model will translate (a few hundred to a thousand sentences of its training or validation data).

Tooling (imported by `export_onnx`), not shipped with saved models.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from .manifest import read_manifest
from .quantization import add_row_maxima_outputs, quantize_activations_calibrated

# the calibration sentences translated per generate() call
CALIBRATION_BATCH = 32


def int8_graph_files(manifest: dict) -> dict[str, str]:
    """{role: int8 graph file} of the graphs a translation runs: "encoder", "decoder" and, where written,
    "shared_cache" (the scoring graph, which forced decoding runs, keeps its per-row activations)."""
    files = dict(manifest["graphs"]["int8"])
    shared = manifest.get("shared_cache") or {}
    if shared.get("written") and "int8" in shared.get("graphs", {}):
        files["shared_cache"] = shared["graphs"]["int8"]
    return files


def calibrate(
    folder: Path, sources: list[str], num_threads: int | None = None, src_lang: str | None = None
) -> dict[str, dict[str, float]]:
    """{int8 graph file: {row-maximum tensor: its largest value}} over `sources` (in language `src_lang`, which a
    model marking the source language with a token needs where it has several) translated with `folder`'s per-row
    int8 graphs (the model's saved decoding settings; a model with several target languages translates the sentences
    into each of them but `src_lang` in turn). Raises a ValueError when the folder's int8 graphs are not per row, or
    when an activation was never reached."""
    import onnx
    import torch
    from transformers import AutoTokenizer

    from .modeling import OrtModelForSeq2SeqLM

    folder = Path(folder)
    manifest = read_manifest(folder)
    if (manifest.get("int8") or {}).get("activations") != "per_row":
        raise ValueError(f"{folder}: calibration reads the row maxima of per-row int8 graphs; this folder has none.")
    files = int8_graph_files(manifest)
    maxima: dict[str, dict[str, float]] = defaultdict(dict)
    with tempfile.TemporaryDirectory(prefix="calibration-", dir=folder.parent) as scratch:
        probe = Path(scratch) / folder.name
        shutil.copytree(folder, probe, ignore=shutil.ignore_patterns("*.onnx", "*.onnx.data"))
        for graph in folder.glob("*.onnx"):  # the graphs not run: there for the manifest's check only
            if graph.name not in files.values():
                (probe / graph.name).touch()
        wanted = {}  # graph file -> the row maxima it must report
        for name in files.values():
            graph = onnx.load(str(folder / name))
            wanted[name] = add_row_maxima_outputs(graph)
            onnx.save(graph, str(probe / name))
        model = OrtModelForSeq2SeqLM.from_pretrained(probe, precision="int8", num_threads=num_threads)
        tokenizer = AutoTokenizer.from_pretrained(probe)
        model.bound_search = False
        graphs = {"encoder": model.source_graph, "decoder": model.step_graph}
        if model.shared_cache_graph is not None:
            graphs["shared_cache"] = model.shared_cache_graph
        for role, graph in graphs.items():
            graph.probe = _recorder(maxima[files[role]])
        targets = [lang for lang in _target_languages(model.config) if lang != src_lang]
        for shared in [True, False] if model.shared_cache_graph is not None else [False]:
            if not shared:  # the loop on the concatenated-cache step graph
                model.shared_cache_graph = None
            for start in range(0, len(sources), CALIBRATION_BATCH):
                texts = sources[start : start + CALIBRATION_BATCH]
                languages = [targets[(start + i) % len(targets)] for i in range(len(texts))] if targets else None
                inputs = model.prepare_translation_inputs(tokenizer, texts, src_lang=src_lang, tgt_lang=languages)
                with torch.inference_mode():
                    model.generate(**inputs)
    for name, names in wanted.items():
        missing = sorted(set(names) - set(maxima[name]))
        if missing:
            raise ValueError(f"{folder / name}: calibration never ran {missing[:3]}: no translation reached them.")
    return dict(maxima)


def check_calibration_language(config, src_lang: str | None) -> None:
    """A ValueError naming `calibration_src_lang` when a model that marks the source language with a token and
    translates from several languages gets none (checked before the export starts), or gets one it does not
    translate from."""
    if not getattr(config, "target_language_token", False):
        return
    sources = config.translation_languages()[0]
    if src_lang is None and config.default_source_language() is None:
        raise ValueError(
            "calibration_src_lang (--calibration_src_lang): this model marks the source language with a token and "
            f"translates from several languages ({', '.join(sources[:12])}{', ...' if len(sources) > 12 else ''}): "
            "name the calibration sentences' language."
        )
    if src_lang is not None:
        try:
            config.check_languages(src_lang=src_lang)
        except ValueError as error:
            raise ValueError(f"calibration_src_lang (--calibration_src_lang): {error}") from None


def _target_languages(config) -> list[str]:
    """The target languages to cycle through: those of a model translating into several (its config's
    `translation_languages()`), else none (the model's own target)."""
    method = getattr(config, "translation_languages", None)
    targets = list(method()[1]) if callable(method) else []
    return targets if len(targets) > 1 else []


def _recorder(seen: dict[str, float]):
    def record(values: dict) -> None:
        for name, value in values.items():
            if value.size:
                seen[name] = max(seen.get(name, 0.0), float(value.max()))

    return record


def apply_calibration(folder: Path, maxima: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """Rewrite `folder`'s per-row int8 graphs with fixed scales from `maxima` (`calibrate`), in place; returns
    {graph file: `quantize_activations_calibrated`'s counts}."""
    import onnx

    counts = {}
    for name, found in maxima.items():
        graph = onnx.load(str(Path(folder) / name))
        counts[name] = quantize_activations_calibrated(graph, found)
        onnx.save(graph, str(Path(folder) / name))
    return counts
