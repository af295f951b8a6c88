#!/usr/bin/env python
"""Where the time of int8 activations per row goes, one MatMul at a time: ONNX Runtime's per-tensor node against the
per-row chain the exporter writes, and that chain with one of its costs taken out, on the MatMul shapes of one
decoder step of a model (its config: `--model DIR` or `--preset`), at the rows of greedy search and of beam 4.

Variants, each a one-MatMul graph with random int8 weights (speed does not depend on their values), timed in one
process, interleaved (A, B, C, ...), median of `--reps`:
- `per_tensor`: `DynamicQuantizeMatMul` with its bias, what quantize_dynamic's graphs run (one scale per call);
- `per_row`: the exporter's chain (`hf_variants.onnx.quantization`): Abs, ReduceMax, Mul (the row scales), the zero
  point's Shape and Expand, a blocked `QuantizeLinear`, `MatMulIntegerToFloat` and the bias `Add`;
- `per_row_no_add`: the same without the bias Add (what the separate Add costs: `MatMulIntegerToFloat` applies a
  per-row A scale in a second pass over its output, after any bias it is given, so the bias cannot go inside);
- `per_row_scalar_scale`: the same chain handing `MatMulIntegerToFloat` one scale for the whole A, the bias inside
  (not a correct product: it shows what the second pass and the Add cost together, as the row quantization's own
  nodes stay);
- `matmul_nbits8`: `MatMulNBits` at 8 bits, accuracy level 4 (activations quantized per block of each row inside
  the kernel: batch-independent too), one block per row of the weight.

Prints µs per MatMul and per decoder step (the step's MatMuls summed, the output projection included) for each
variant, and each over `per_tensor`; writes `--output`.json/.md.

    python benchmarks/bench_ort_int8_matmul.py --model benchmarks/runs/ema_averaging_400-plain --reps 50
    python benchmarks/bench_ort_int8_matmul.py --preset tiny --reps 3 --output /tmp/smoke   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import cpu_model, interleaved, write_result  # noqa: E402

VARIANTS = ("per_tensor", "per_row", "per_row_no_add", "per_row_scalar_scale", "matmul_nbits8")


def step_matmuls(config: dict) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, has bias) of one decoder step's MatMuls in the exporter's graphs: per layer the packed
    self-attention q/k/v, its output, the cross-attention query and output, the two feed-forward MatMuls; then the
    output projection (no bias)."""
    d, ffn = config["d_model"], config.get("decoder_ffn_dim") or config["encoder_ffn_dim"]
    layer = [("qkv", d, 3 * d), ("self_out", d, d), ("cross_q", d, d), ("cross_out", d, d)]
    layer += [("ffn_in", d, ffn), ("ffn_out", ffn, d)]
    shapes = [(name, k, n, True) for name, k, n in layer] * config["decoder_layers"]
    return shapes + [("output_projection", d, config["vocab_size"], False)]


def parameters(K: int, N: int, rng) -> dict:
    """Random int8 weights [K, N] (7-bit range, as the exporter's), their per-column scales and a bias."""
    return {
        "W": rng.integers(-64, 64, (K, N)).astype(np.int8),
        "W_scale": rng.uniform(0.001, 0.01, N).astype(np.float32),
        "bias": rng.standard_normal(N).astype(np.float32),
    }


def graph(variant: str, K: int, N: int, bias: bool, params: dict):
    """A one-MatMul ONNX model of `variant` on an input A [rows, K] (float32) to Y [rows, N], on `params`."""
    from onnx import TensorProto, helper, numpy_helper

    weights = params["W"]
    inits = {
        **params,
        "W_zero": np.zeros(N, np.int8),
        "axes": np.array([-1], np.int64),
        "inv_127": np.array(1 / 127, np.float32),
        "zero_128": np.array(128, np.uint8),
        "scalar_scale": np.array(0.02, np.float32),
    }
    bias_input = ["bias"] if bias else []
    if variant == "per_tensor":
        nodes = [helper.make_node("DynamicQuantizeMatMul", ["A", "W", "W_scale", "W_zero", *bias_input], ["Y"])]
    elif variant == "matmul_nbits8":
        blocks = weights.T.astype(np.int16) + 128  # [N, K] as unsigned with zero point 128, one block per row
        inits = {
            "Wq": blocks.astype(np.uint8).reshape(N, 1, K),
            "W_scale": inits["W_scale"],
            "bias": inits["bias"],
        }
        attributes = {"K": K, "N": N, "bits": 8, "block_size": K, "accuracy_level": 4}
        inputs = ["A", "Wq", "W_scale", "", "", *bias_input]
        nodes = [helper.make_node("MatMulNBits", inputs, ["Y"], **attributes)]
    else:
        nodes = [
            helper.make_node("Abs", ["A"], ["abs"]),
            helper.make_node("ReduceMax", ["abs", "axes"], ["max"], keepdims=1),
            helper.make_node("Mul", ["max", "inv_127"], ["scale"]),
            helper.make_node("Shape", ["scale"], ["shape"]),
            helper.make_node("Expand", ["zero_128", "shape"], ["zero"]),
            helper.make_node("QuantizeLinear", ["A", "scale", "zero"], ["q"], axis=-1, block_size=K),
        ]
        a_scale = "scalar_scale" if variant == "per_row_scalar_scale" else "scale"
        inside = bias_input if variant == "per_row_scalar_scale" else []
        product = "Y" if variant != "per_row" or not bias else "product"
        inputs = ["q", "W", a_scale, "W_scale", "zero_128", "W_zero", *inside]
        nodes.append(helper.make_node("MatMulIntegerToFloat", inputs, [product]))
        if variant == "per_row" and bias:
            nodes.append(helper.make_node("Add", ["product", "bias"], ["Y"]))
    for node in nodes:
        if node.op_type in ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits"):
            node.domain = "com.microsoft"
    read = {name for node in nodes for name in node.input}
    initializers = [numpy_helper.from_array(value, name) for name, value in inits.items() if name in read]
    model = helper.make_graph(
        nodes,
        variant,
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["rows", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", N])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(model, opset_imports=opsets)


def session(model, threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def check(sessions: dict, model, a: np.ndarray) -> None:
    """Raise a RuntimeError when a variant other than `per_row_scalar_scale` is not the float product of `a` and the
    int8 weights of `model` plus its bias (`per_row_no_add`: without) to int8 accuracy: a graph built wrong would be
    timed for nothing."""
    from onnx import numpy_helper

    inits = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    product = a @ (inits["W"].astype(np.float32) * inits["W_scale"])
    biased = product + (inits["bias"] if "bias" in inits else 0)
    for variant, run in sessions.items():
        if variant == "per_row_scalar_scale":
            continue
        reference = product if variant == "per_row_no_add" else biased
        error = np.abs(run.run(None, {"A": a})[0] - reference).max() / np.abs(reference).max()
        if not error < 0.05:
            raise RuntimeError(f"{variant}: relative error {error:.3f} against the float product")


def measure(config: dict, rows_list: list[int], reps: int, threads: int, seed: int = 0) -> dict:
    """{rows: {"matmuls": [{name, K, N, variant: µs}], "step": {variant: µs}}}: each distinct shape timed once,
    the step summed over its MatMuls."""
    rng = np.random.default_rng(seed)
    shapes = step_matmuls(config)
    result = {}
    for rows in rows_list:
        timed = {}
        for _, K, N, bias in shapes:
            if (K, N, bias) in timed:
                continue
            a = rng.standard_normal((rows, K)).astype(np.float32)
            params = parameters(K, N, rng)
            models = {v: graph(v, K, N, bias, params) for v in VARIANTS}
            sessions = {v: session(model, threads) for v, model in models.items()}
            check(sessions, models["per_tensor"], a)
            calls = {v: (lambda s=s: s.run(None, {"A": a})) for v, s in sessions.items()}
            seconds = interleaved(calls, reps, clock="wall")
            timed[(K, N, bias)] = {v: seconds[v] * 1e6 for v in VARIANTS}
        matmuls = [{"name": name, "K": K, "N": N, **timed[(K, N, bias)]} for name, K, N, bias in shapes]
        step = {v: sum(m[v] for m in matmuls) for v in VARIANTS}
        result[rows] = {"matmuls": matmuls, "step": step}
    return result


def _cells(times: dict) -> str:
    return " | ".join(f"{times[v]:.1f} ({times[v] / times['per_tensor']:.2f}x)" for v in VARIANTS)


def render(result: dict, label: str) -> str:
    header = "| rows | MatMul (K x N) | " + " | ".join(VARIANTS) + " |"
    lines = [label, "", header, "|---|---|" + "---:|" * len(VARIANTS)]
    for rows, record in result.items():
        shapes = set()
        for m in record["matmuls"]:
            if (m["K"], m["N"]) not in shapes:  # each shape once: the layers repeat them
                shapes.add((m["K"], m["N"]))
                lines.append(f"| {rows} | {m['name']} ({m['K']} x {m['N']}) | " + _cells(m) + " |")
        lines.append(f"| {rows} | **one decoder step, summed** | " + _cells(record["step"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a model folder (its config.json gives the shapes)")
    source.add_argument("--preset", default="small", help="a TransformerNmtConfig preset when no --model (small)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128], help="A's rows (32: greedy, 128: beam 4)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "int8_matmul"))
    args = parser.parse_args()
    if args.model:
        config = json.loads((Path(args.model) / "config.json").read_text())
        name = args.model
    else:
        from hf_variants.configuration_transformer_nmt import TransformerNmtConfig

        config = TransformerNmtConfig.from_preset(args.preset).to_dict()
        name = f"the {args.preset} preset"
    result = measure(config, args.rows, args.reps, args.threads)
    label = (
        f"One decoder step's MatMuls of {name} (d_model {config['d_model']}, {config['decoder_layers']} decoder "
        f"layers, vocabulary {config['vocab_size']}), ONNX Runtime, {args.threads} thread(s), median of {args.reps} "
        f"interleaved calls (wall clock); {cpu_model()}. Each cell: microseconds (over per_tensor)."
    )
    table = render(result, label)
    print(table)
    record = {"config": name, "threads": args.threads, "reps": args.reps, "variants": list(VARIANTS)}
    record["results"] = {str(rows): value for rows, value in result.items()}
    write_result(Path(args.output).with_suffix(".json"), record)
    Path(args.output).with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
