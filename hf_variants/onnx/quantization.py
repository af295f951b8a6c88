"""int8 graphs for exports (`export_onnx --int8`): onnxruntime's `quantize_dynamic`, after two rewrites that let it
quantize every constant MatMul per output channel, and a rewrite after it that quantizes activations per row.

`quantize(source, target, weights, activations="per_row")`:
1. folds constant subgraphs (ONNX Runtime's basic optimizations): the exporter writes MUTE's unit and MIMO's
   stream weights as initializers followed by Transposes and Reshapes, and quantize_dynamic only quantizes a
   MatMul whose weight is an initializer;
2. splits every MatMul on a stacked weight [n, in, out] (n units side by side: `StackedLinear`, MUTE's relative
   embeddings) into n MatMuls on [in, out] weights (`split_stacked_matmuls`): ONNX Runtime's MatMulInteger takes
   per-channel zero points on 2-D weights only, so a stacked weight would get ONE scale for all n units (the trained
   small MUTE: int8 BLEU 0.35 below float32, 0.19 split). The split costs 2-6% of int8 decoding speed (small MUTE
   and MIMO, 1 thread: `benchmarks/bench_ort_stacked_weights.py`);
3. quantizes every MatMul/Gemm on a constant weight with `INT8_WEIGHTS[weights]`, and any weight left of another
   rank per tensor (none in the exporter's graphs; the names are returned);
4. (`activations="per_row"`, the default) quantizes every activation row by row (`quantize_activations_per_row`):
   quantize_dynamic's activations are quantized per call, one scale and zero point over the whole tensor, i.e. over
   every sentence of the batch (ONNX Runtime's DynamicQuantizeMatMul), so a sentence's numbers, and at times its
   translation, depended on the other sentences of its batch (a trained small baseline, test_2016_flickr: 107 of
   461 sentences translated differently at batch size 1 and 64). Per row (per token, as CTranslate2 quantizes),
   each row's int8 values and scale come from that row alone, and the int32 products are exact: a sentence gets the
   same numbers in any batch, whatever its neighbours, their number and the batch's padded length.

The per-row graph, for each quantized activation x [..., K] (shared by the MatMuls that read it):
`scale = ReduceMax(Abs(x), axis -1) / 127` ([..., 1], symmetric), `q = QuantizeLinear(x, scale, 128)` (uint8,
one block per row: opset 21's blocked quantization; the zero point 128 expanded to the scale's shape once per row
shape of the graph), then per MatMul `com.microsoft::MatMulIntegerToFloat(q, W, scale, W scale, 128, W zero point)`
(the u8 x s8 kernel of DynamicQuantizeMatMul, the row scales applied to its output) and the bias `Add` it had fused.
The output of a Relu is one-sided: `scale = ReduceMax(x) / 255` and zero point 0 (all 256 levels, no Abs). ONNX
Runtime has no fused per-row kernel (DynamicQuantizeMatMul and MatMulIntegerToFloat take one scale for A; MatMulNBits
quantizes rows per block but runs 2-3x slower at 32 rows and more), so the scheme costs a few small nodes per
activation: `benchmarks/bench_ort_int8_activations.py` measures it against per-tensor activations side by side.

`quantize_activations_calibrated` turns a per-row graph's symmetric activations into fixed scales from a calibration
run (`export_onnx --int8_activations calibrated`, `calibration.py`), the bias back inside each MatMul; a Relu's output
stays per row.

Tooling (imported by `export_onnx`), not shipped with saved models.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

from .manifest import CALIBRATED, INT8_ACTIVATIONS

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
# how the int8 graphs quantize activations, one per `--int8_activations` choice (`manifest.INT8_ACTIVATIONS`):
# "per_row" (default; batch-independent) or "per_tensor" (quantize_dynamic's own: one scale per call)
DEFAULT_INT8_ACTIVATIONS = "per_row"
# the opset of the per-row graphs: QuantizeLinear with `block_size` (a scale per block of the last axis) is opset 21's
PER_ROW_OPSET = 21


def quantize(
    source: Path,
    target: Path,
    weights: str = DEFAULT_INT8_WEIGHTS,
    split_units: bool = True,
    activations: str = DEFAULT_INT8_ACTIVATIONS,
) -> dict:
    """int8 weights for every MatMul/Gemm of `source` with a constant weight (`INT8_WEIGHTS[weights]`), activations
    quantized per row (`activations="per_row"`) or per tensor ("per_tensor"), written to `target` (steps: the module
    docstring; `split_units=False` skips step 2, for `benchmarks/bench_ort_stacked_weights.py`). Returns {"split": the
    MatMuls on stacked weights split per unit, "per_tensor": the MatMuls whose WEIGHTS have one scale per tensor
    (a rank other than 2 after the split), "activations": the scheme, "per_row": what
    `quantize_activations_per_row` rewrote (per_row only)}."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if activations not in INT8_ACTIVATIONS or activations == CALIBRATED:
        raise ValueError(
            f"activations={activations!r}: choose per_row or per_tensor (calibrated graphs are per-row ones given "
            "fixed scales by a calibration run: `export(..., int8_activations='calibrated', calibration_sources=)`)."
        )

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
        result = {"split": split, "per_tensor": per_tensor, "activations": activations}
        if activations == "per_row":
            model = onnx.load(str(target))
            result["per_row"] = quantize_activations_per_row(model)
            onnx.save(model, str(target))
        return result
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


def quantize_activations_per_row(model) -> dict[str, int]:
    """Rewrite, in place, quantize_dynamic's per-tensor activation quantization of `model` (an onnx ModelProto) to
    one scale per row (the module docstring's graph): every `DynamicQuantizeLinear` becomes the row-scale nodes and a
    blocked `QuantizeLinear`, and each `MatMulInteger -> Cast -> Mul(x scale * W scale)` reading it one
    `com.microsoft::MatMulIntegerToFloat`. The default domain's opset becomes at least `PER_ROW_OPSET`. A
    DynamicQuantizeLinear whose outputs feed anything else raises a RuntimeError naming it (no activation is left
    quantized per tensor). Returns {"activations": the tensors quantized per row, "one_sided": those of them read
    from a Relu, "matmuls": the MatMuls rewritten}."""
    from onnx import helper

    graph = model.graph
    index = _GraphIndex(graph)
    replaced, dropped, zero_points = {}, set(), {}
    counts = {"activations": 0, "one_sided": 0, "matmuls": 0}
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            continue
        chains = _matmul_chains(node, index)
        one_sided = index.producer_type(node.input[0]) == "Relu"
        nodes, scale, zero_point = _row_quantization(node, _width(chains, index), one_sided, index, zero_points)
        for matmul, cast, mul, scales in chains:
            nodes_of_matmul = helper.make_node(
                "MatMulIntegerToFloat",
                [
                    node.output[0],
                    matmul.input[1],
                    scale,
                    _other(scales, node.output[1]),
                    zero_point,
                    *matmul.input[3:4],
                ],
                list(mul.output),
                name=matmul.name,
                domain="com.microsoft",
            )
            replaced[id(matmul)] = [nodes_of_matmul]
            dropped.update({id(cast), id(mul), id(scales)})
        replaced[id(node)] = nodes
        counts["activations"] += 1
        counts["one_sided"] += one_sided
        counts["matmuls"] += len(chains)
    rewritten = [new for node in graph.node if id(node) not in dropped for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(rewritten)
    _add_constants(graph)
    _set_opsets(model)
    return counts


class _GraphIndex:
    """A graph's producers, consumers, initializers and declared shapes, by tensor name."""

    def __init__(self, graph):
        self.producers = {name: node for node in graph.node for name in node.output}
        self.consumers = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.initializers = {init.name: init for init in graph.initializer}
        self.shapes = {
            value.name: value.type.tensor_type.shape.dim
            for value in (*graph.value_info, *graph.input, *graph.output)
            if value.type.tensor_type.HasField("shape")
        }

    def producer_type(self, name: str) -> str | None:
        node = self.producers.get(name)
        return node.op_type if node is not None else None

    def only_consumer(self, name: str, op_type: str, where: str):
        consumers = self.consumers[name]
        if len(consumers) != 1 or consumers[0].op_type != op_type:
            found = [c.op_type for c in consumers]
            raise RuntimeError(f"per-row int8: {where} feeds {found}, not one {op_type} (quantize_dynamic's pattern).")
        return consumers[0]

    def row_shape(self, name: str) -> tuple | None:
        """The leading dimensions of `name` (all but the last) when the graph declares every one of them (a size or
        a symbolic name), else None."""
        dims = self.shapes.get(name)
        if not dims:
            return None
        leading = tuple(d.dim_param or d.dim_value for d in list(dims)[:-1])
        return leading if all(leading) else None


_AXES, _INV_127, _INV_255 = "per_row/axes", "per_row/inv_127", "per_row/inv_255"
_ZERO_POINT_128, _ZERO_POINT_0 = "per_row/zero_point_128", "per_row/zero_point_0"


def _add_constants(graph) -> None:
    """The rewrite's constants that its nodes read (an unread initializer makes ONNX Runtime warn at every load)."""
    import numpy as np
    from onnx import numpy_helper

    constants = {
        _AXES: np.array([-1], dtype=np.int64),
        _INV_127: np.array(1 / 127, dtype=np.float32),
        _INV_255: np.array(1 / 255, dtype=np.float32),
        _ZERO_POINT_128: np.array(128, dtype=np.uint8),
        _ZERO_POINT_0: np.array(0, dtype=np.uint8),
    }
    read = {name for node in graph.node for name in node.input}
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items() if name in read)


def _matmul_chains(node, index: _GraphIndex) -> list[tuple]:
    """The (MatMulInteger, Cast, Mul, scales Mul) chains reading DynamicQuantizeLinear `node`'s outputs, checked to be
    all that reads them."""
    quantized, scale, zero_point = node.output
    chains = []
    for matmul in index.consumers[quantized]:
        if matmul.op_type != "MatMulInteger" or matmul.input[0] != quantized or matmul.input[2] != zero_point:
            raise RuntimeError(f"per-row int8: {quantized} feeds {matmul.op_type} {matmul.name!r}, not MatMulInteger.")
        cast = index.only_consumer(matmul.output[0], "Cast", f"MatMulInteger {matmul.name!r}")
        mul = index.only_consumer(cast.output[0], "Mul", f"the Cast of {matmul.name!r}")
        scales = index.producers.get(_other(mul, cast.output[0]))
        if scales is None or scales.op_type != "Mul" or scale not in scales.input:
            raise RuntimeError(
                f"per-row int8: the output scale of {matmul.name!r} is not {scale} times a weight scale."
            )
        chains.append((matmul, cast, mul, scales))
    readers = {id(c) for c in (*index.consumers[scale], *index.consumers[zero_point])}
    if not chains or readers != {id(n) for chain in chains for n in (chain[0], chain[3])}:
        raise RuntimeError(f"per-row int8: the outputs of DynamicQuantizeLinear {node.name!r} feed other nodes.")
    return chains


def _width(chains: list[tuple], index: _GraphIndex) -> int:
    """The length of the quantized rows: the weights' input dimension (the rows' last axis)."""
    matmul = chains[0][0]
    weight = index.initializers.get(matmul.input[1])
    if weight is None or len(weight.dims) < 2:
        raise RuntimeError(f"per-row int8: MatMulInteger {matmul.name!r} has no constant weight of rank 2 or more.")
    return weight.dims[-2]


def _other(node, name: str) -> str:
    """The input of two-input `node` that is not `name`."""
    (other,) = [i for i in node.input if i != name] or [name]
    return other


def _row_quantization(node, width: int, one_sided: bool, index: _GraphIndex, zero_points: dict):
    """The nodes quantizing DynamicQuantizeLinear `node`'s input row by row into its quantized output (rows of
    `width` values), and the names of the row scales and of the zero point for MatMulIntegerToFloat. `zero_points`:
    the zero-point tensors made so far, by row shape (one per row shape of the graph)."""
    from onnx import helper

    x, quantized = node.input[0], node.output[0]
    base = f"{x}/per_row"
    scale = f"{base}/scale"
    if one_sided:  # a Relu's output: [0, max] on all 256 levels, zero point 0 (QuantizeLinear's default)
        nodes = [
            helper.make_node("ReduceMax", [x, _AXES], [f"{base}/max"], name=f"{base}/max", keepdims=1),
            helper.make_node("Mul", [f"{base}/max", _INV_255], [scale], name=f"{base}/scale"),
            helper.make_node("QuantizeLinear", [x, scale], [quantized], name=f"{base}/q", axis=-1, block_size=width),
        ]
        return nodes, scale, _ZERO_POINT_0
    nodes = [
        helper.make_node("Abs", [x], [f"{base}/abs"], name=f"{base}/abs"),
        helper.make_node("ReduceMax", [f"{base}/abs", _AXES], [f"{base}/max"], name=f"{base}/max", keepdims=1),
        helper.make_node("Mul", [f"{base}/max", _INV_127], [scale], name=f"{base}/scale"),
    ]
    rows = index.row_shape(x)
    zero_point = zero_points.get(rows) if rows is not None else None
    if zero_point is None:  # 128 in the scale's shape (blocked quantization takes no broadcast zero point)
        zero_point = f"{base}/zero_point"
        nodes += [
            helper.make_node("Shape", [scale], [f"{base}/shape"], name=f"{base}/shape"),
            helper.make_node("Expand", [_ZERO_POINT_128, f"{base}/shape"], [zero_point], name=f"{base}/zero_point"),
        ]
        if rows is not None:
            zero_points[rows] = zero_point
    nodes.append(
        helper.make_node(
            "QuantizeLinear", [x, scale, zero_point], [quantized], name=f"{base}/q", axis=-1, block_size=width
        )
    )
    return nodes, scale, _ZERO_POINT_128


def _set_opsets(model) -> None:
    """The default domain at opset `PER_ROW_OPSET` or later (blocked QuantizeLinear) and com.microsoft's declared."""
    from onnx import helper

    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, PER_ROW_OPSET)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


# ------------------------------------------------------------------------------------- calibrated activations
# the per-row graph's row maxima of a symmetric activation x: `{x}/per_row/max` (`_row_quantization`)
ROW_MAXIMUM_SUFFIX = "/per_row/max"


def row_maxima(model) -> list[str]:
    """The row-maximum tensors of `model`'s symmetric per-row activations (a per-row int8 graph, an onnx
    ModelProto), in graph order: what calibration records, one per activation a fixed scale can replace (a Relu's
    output, one-sided, stays per row)."""
    nodes = model.graph.node
    return [n.output[0] for n in nodes if n.output[0].endswith(ROW_MAXIMUM_SUFFIX) and n.input[0].endswith("/abs")]


def add_row_maxima_outputs(model) -> list[str]:
    """Declare every `row_maxima` tensor of `model` a graph output (in place), for a calibration run to read;
    returns their names."""
    from onnx import TensorProto, helper

    names = row_maxima(model)
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names)
    return names


def quantize_activations_calibrated(model, maxima: dict[str, float]) -> dict[str, int]:
    """Rewrite, in place, a per-row int8 graph (`quantize_activations_per_row`'s) so that every symmetric activation
    x takes one fixed scale, `maxima[x's row-maximum tensor] / 127` (the largest |x| a calibration run saw): its
    Abs, ReduceMax and Mul go, its `QuantizeLinear` takes the scale and zero point 128 per tensor, and each
    `MatMulIntegerToFloat` reading it takes the same scale, and the bias of the `Add` after it (a 1-D constant) as
    its own bias input, which ONNX Runtime then applies in the MatMul's output stage. A value beyond the calibrated
    range saturates at the int8 limit. The output of a Relu stays per row (its range varies the most between
    tokens). Like per row, a sentence's numbers do not depend on its batch: the scales are constants. Raises a
    RuntimeError naming the activation when `maxima` lacks one, or holds a maximum that is not a positive finite
    number. Returns {"activations": the activations given a fixed scale, "biases": the biases moved into a MatMul}."""
    import math

    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    index = _GraphIndex(graph)
    nodes = {node.name: node for node in graph.node}
    dropped, scales, counts = set(), [], {"activations": 0, "biases": 0}
    for name in row_maxima(model):
        maximum = maxima.get(name)
        if maximum is None or not math.isfinite(maximum) or maximum <= 0:
            raise RuntimeError(f"calibrated int8: no usable maximum for {name!r} (got {maximum!r}).")
        base = name[: -len("/max")]  # `{x}/per_row`
        x = nodes[base + "/abs"].input[0]
        quantize = nodes[base + "/q"]
        old_scale, scale = quantize.input[1], f"{x}/calibrated/scale"
        scales.append(numpy_helper.from_array(np.array(maximum / 127, dtype=np.float32), scale))
        dropped.update(id(nodes[base + suffix]) for suffix in ("/abs", "/max", "/scale"))
        del quantize.input[:]
        quantize.input.extend([x, scale, _ZERO_POINT_128])
        del quantize.attribute[:]  # per tensor: no axis, no block size
        for matmul in index.consumers[quantize.output[0]]:
            if matmul.input[2] != old_scale:
                raise RuntimeError(f"calibrated int8: {matmul.name!r} does not read {x}'s row scales.")
            matmul.input[2] = scale
            counts["biases"] += _take_bias(matmul, index, dropped)
        counts["activations"] += 1
    graph.initializer.extend(scales)
    kept = [node for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    _drop_unread(graph)
    return counts


def _take_bias(matmul, index: _GraphIndex, dropped: set) -> int:
    """Move the bias of the Add that alone reads `matmul`'s output into `matmul` (its input 6) and drop the Add
    (added to `dropped`): 1 when it did, 0 when there is no such Add (a MatMul without a bias)."""
    readers = index.consumers[matmul.output[0]]
    if len(readers) != 1 or readers[0].op_type != "Add" or len(matmul.input) > 6:
        return 0
    add = readers[0]
    bias = _other(add, matmul.output[0])
    weight = index.initializers.get(matmul.input[1])
    constant = index.initializers.get(bias)
    if constant is None or weight is None or list(constant.dims) != [weight.dims[-1]]:
        return 0
    matmul.input.extend([""] * (6 - len(matmul.input)) + [bias])
    matmul.output[0] = add.output[0]
    dropped.add(id(add))
    return 1


def _drop_unread(graph) -> None:
    """Remove the nodes of the per-row zero point (Shape, Expand) and the rewrite's constants nothing reads any
    more."""
    outputs = {value.name for value in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        unread = [n for n in graph.node if "/per_row/" in n.name and not any(o in read for o in n.output)]
        if not unread:
            break
        for node in unread:
            graph.node.remove(node)
    read = {name for node in graph.node for name in node.input}
    for init in [i for i in graph.initializer if i.name.startswith("per_row/") and i.name not in read]:
        graph.initializer.remove(init)
