"""int8 weights for exported graphs (`export_onnx --int8`): onnxruntime's `quantize_dynamic`, after two rewrites
that let it quantize every constant MatMul per output channel.

`quantize(source, target, weights)`:
1. folds constant subgraphs (ONNX Runtime's basic optimizations): the exporter writes MUTE's unit and MIMO's
   stream weights as initializers followed by Transposes and Reshapes, and quantize_dynamic only quantizes a
   MatMul whose weight is an initializer;
2. splits every MatMul on a stacked weight [n, in, out] (n units side by side: `StackedLinear`, MUTE's relative
   embeddings) into n MatMuls on [in, out] weights (`split_stacked_matmuls`): ONNX Runtime's MatMulInteger takes
   per-channel zero points on 2-D weights only, so a stacked weight would get ONE scale for all n units (the trained
   small MUTE: int8 BLEU 0.35 below float32, 0.19 split). The split costs 2-6% of int8 decoding speed (small MUTE
   and MIMO, 1 thread: `benchmarks/bench_ort_stacked_weights.py`);
3. quantizes every MatMul/Gemm on a constant weight with `INT8_WEIGHTS[weights]` (activations per call), and any
   weight left of another rank per tensor (none in the exporter's graphs; the names are returned).

Tooling (imported by `export_onnx`), not shipped with saved models.
"""

from __future__ import annotations

import logging
from pathlib import Path

# onnxruntime.quantization.quantize_dynamic settings, one per `--int8_weights` choice; every one quantizes each
# output channel's weights with its own scale and the activations per call (DynamicQuantizeMatMul). Chosen by
# measurement (the int8-weights investigation listed in benchmarks/README.md, the `small` baseline and its MatMul
# shapes, 1 thread, an AVX-512 VNNI CPU, 2026-11-26):
# - "s8_reduce_range" (default): signed 8-bit weights in 7 bits. MLAS multiplies u8 activations by s8 weights, the
#   VNNI instruction's own pair (vpdpbusd): 2-4x faster than "u8" per MatMul on VNNI CPUs (32 x 512 @ 512 x 8000, the
#   output projection: 716 us vs 2838 us), equal to it on AVX2 without VNNI, where MLAS sums u8 x s8 products in
#   saturating 16 bits: the 7-bit range keeps those sums from saturating (full-range s8 weights saturate there:
#   relative errors of 0.12-0.19 were measured there), so the same graph is right on every CPU.
# - "u8": unsigned 8-bit weights at full range, the u8 x u8 kernel (no VNNI): about half the error, 2-4x slower on
#   VNNI CPUs.
# Full-range s8 is not offered: it is silently wrong on AVX2 CPUs, and an exported folder moves between machines.
INT8_WEIGHTS = {
    "s8_reduce_range": {"weight_type": "QInt8", "per_channel": True, "reduce_range": True},
    "u8": {"weight_type": "QUInt8", "per_channel": True, "reduce_range": False},
}
DEFAULT_INT8_WEIGHTS = "s8_reduce_range"
QUANTIZED_OP_TYPES = ["MatMul", "Gemm"]


def quantize(
    source: Path, target: Path, weights: str = DEFAULT_INT8_WEIGHTS, split_units: bool = True
) -> dict[str, list[str]]:
    """int8 weights for every MatMul/Gemm of `source` with a constant weight (`INT8_WEIGHTS[weights]`), written to
    `target` (steps: the module docstring; `split_units=False` skips step 2, for
    `benchmarks/bench_ort_stacked_weights.py`). Returns {"split": the MatMuls on stacked weights split per unit,
    "per_tensor": the MatMuls quantized with one scale per tensor (weights of a rank other than 2 after the split)}."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # quantize_dynamic logs a root-logger warning per call suggesting shape-inference pre-processing, which the
    # exporter's graphs (dynamic shapes from torch.export) do not need
    logging.getLogger().addFilter(_without_preprocess_hint)
    folded = _fold_constants(Path(source))
    try:
        model = onnx.load(str(folded))
        split = split_stacked_matmuls(model) if split_units else []
        if split:
            onnx.save(model, str(folded))
        per_tensor = _quantize(folded, Path(target), INT8_WEIGHTS[weights], QuantType, quantize_dynamic)
        return {"split": split, "per_tensor": per_tensor}
    finally:
        logging.getLogger().removeFilter(_without_preprocess_hint)
        folded.unlink(missing_ok=True)


def _fold_constants(source: Path) -> Path:
    """A copy of `source` with its constant subgraphs folded (ONNX Runtime's basic optimizations: constant folding
    and redundant-node removal, the same on every execution provider), written beside it. quantize_dynamic only
    quantizes a MatMul whose weight is an initializer: the exporter writes MUTE's unit and MIMO's stream weights
    [n, in, out] as initializers followed by Transposes and Reshapes, which left every one of them in float32 (MIMO's
    step graph: 1 of 19 MatMuls quantized, 19 of 19 folded). Small MIMO, 1 thread, int8 against int8 without
    folding: greedy 1.86x, beam 4 1.53x (process CPU time, under load)."""
    import onnxruntime

    folded = source.with_name(source.stem + ".folded.onnx")
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(folded)
    onnxruntime.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return folded


def split_stacked_matmuls(model) -> list[str]:
    """Rewrite, in place, every MatMul of `model` (an onnx ModelProto) whose weight is a 3-D initializer [n, in, out]
    and whose input is [..., n, M, in] (rank 3 or more; n known from the graph's shapes: the units' axis, which the
    weight's first axis broadcasts against) as Split(input, that axis) -> n MatMuls on the weight's slices [in, out]
    -> Concat(that axis): the same function (unit k's rows meet unit k's weight), with 2-D weights that quantize per
    output channel. Stacked weights: `StackedLinear`'s [units, in, out] on [units, M, in] and the MUTE units' Shaw
    relative embeddings [units, 2k + 1, head_dim] on [batch, units, heads x length, ...]. Returns the names of the
    split nodes; a stacked weight no other node reads is removed."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    dims = {v.name: v.type.tensor_type.shape.dim for v in (*graph.value_info, *graph.input)}
    nodes, split, slices = [], [], {}
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        shape = dims.get(node.input[0])
        axis = len(shape) - 3 if shape is not None else -1
        if weight is None or len(weight.dims) != 3 or axis < 0 or shape[axis].dim_value != weight.dims[0]:
            nodes.append(node)  # (an unknown size has dim_value 0)
            continue
        units, base = weight.dims[0], node.name or node.output[0]
        if weight.name not in slices:
            stacked = numpy_helper.to_array(weight)
            slices[weight.name] = [f"{weight.name}/unit{k}" for k in range(units)]
            graph.initializer.extend(numpy_helper.from_array(stacked[k], slices[weight.name][k]) for k in range(units))
        sizes = f"{base}/unit_sizes"
        graph.initializer.append(numpy_helper.from_array(np.ones(units, dtype=np.int64), sizes))
        rows = [f"{base}/unit{k}_input" for k in range(units)]
        outputs = [f"{base}/unit{k}_output" for k in range(units)]
        nodes.append(helper.make_node("Split", [node.input[0], sizes], rows, name=f"{base}/split", axis=axis))
        for k, unit_weight in enumerate(slices[weight.name]):
            nodes.append(helper.make_node("MatMul", [rows[k], unit_weight], [outputs[k]], name=f"{base}/unit{k}"))
        nodes.append(helper.make_node("Concat", outputs, list(node.output), name=f"{base}/concat", axis=axis))
        split.append(node.name)
    if split:
        del graph.node[:]
        graph.node.extend(nodes)
        read = {name for node in graph.node for name in node.input}
        for name in slices:
            if name not in read:
                graph.initializer.remove(weights[name])
    return split


def _without_preprocess_hint(record) -> bool:
    return "pre-processing before quantization" not in record.getMessage()


def _quantize(source: Path, target: Path, settings: dict, QuantType, quantize_dynamic) -> list[str]:
    """quantize_dynamic per output channel, then (per-channel settings) one scale per tensor for MatMuls whose weight
    is not 2-D, whose per-channel zero points ONNX Runtime's MatMulInteger rejects; returns their names."""
    import onnx

    graph = onnx.load(str(source), load_external_data=False).graph
    ranks = {init.name: len(init.dims) for init in graph.initializer}
    kept = [node.name for node in graph.node if node.op_type == "MatMul" and ranks.get(node.input[1], 2) != 2]
    quantize_dynamic(
        str(source),
        str(target),
        weight_type=getattr(QuantType, settings["weight_type"]),
        per_channel=settings["per_channel"],
        reduce_range=settings["reduce_range"],
        op_types_to_quantize=QUANTIZED_OP_TYPES,
        nodes_to_exclude=kept,
        extra_options={"DefaultTensorType": 1},
    )  # FLOAT, for outputs of ops without shape inference
    if kept and settings["per_channel"]:
        quantize_dynamic(
            str(target),
            str(target),
            weight_type=getattr(QuantType, settings["weight_type"]),
            per_channel=False,
            reduce_range=settings["reduce_range"],
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=kept,
            extra_options={"DefaultTensorType": 1},
        )
    return kept
