#!/usr/bin/env python
"""Which int8 kernel `hf_variants.quantize_for_cpu` runs on: the candidates side by side.

1. matmul micro-benchmark: y = x W^T + b at the shapes of decoding (rows = batch x beams, or a whole source
   batch), fp32 against each int8 candidate, interleaved, with each candidate's max error relative to the
   largest fp32 output:
   - `onednn`: oneDNN's int8 linear on plain int8 tensors (`torch.ops.onednn.qlinear_pointwise`), dynamic
     per-token uint8 activations (what `quantize_for_cpu` runs by default); `onednn_per_tensor`: one scale a call;
   - `fbgemm`: `torch.ops.quantized.linear_dynamic` (the kernel of `torch.ao.quantization.quantize_dynamic`;
     needs qint8 weights, deprecated in torch 2.13);
   - `int_mm`: `torch._int_mm` (int8 x int8 -> int32) with per-token activation scales computed in Python;
   - `int8pack`: `torch.ops.aten._weight_int8pack_mm` (int8 weights, fp32 activations: weight-only);
   - `torchao`: torchao's `Int8DynamicActivationInt8WeightConfig` in eager mode (when torchao is installed).
2. `generate()` of the baseline (random weights, `--size` dims) in fp32 and under each whole-model candidate
   (`quantize_for_cpu` with each backend, torch's `quantize_dynamic`, torchao), exactly `--new_tokens` tokens.

Numbers are worthless on a busy machine: run it on a quiet one.

    python benchmarks/bench_int8_kernels.py [--threads 1] [--reps 10] [--skip_generate]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import CLOCKS, interleaved, random_batch  # noqa: E402

from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration  # noqa: E402
from hf_variants.deploy.int8 import quantize_for_cpu, quantize_weight  # noqa: E402

# (in, out) of the baseline's linears at small and base dims: qkv, ffn in/out, output projection (vocab 8000)
SHAPES = [(256, 768), (256, 1024), (1024, 256), (256, 8000), (512, 1536), (512, 2048), (2048, 512), (512, 8000)]


def torchao_available() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_  # noqa: F401
        return True
    except Exception:  # noqa: BLE001  (not installed, or incompatible with this torch)
        return False


def torchao_quantize(model: torch.nn.Module) -> torch.nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


def kernels(weight: torch.Tensor, bias: torch.Tensor) -> dict:
    """Each candidate as a function of x, built from the same fp32 weight."""
    from hf_variants.deploy.int8 import Int8Linear

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
    linear.weight.data.copy_(weight)
    linear.bias.data.copy_(bias)
    q, scale = quantize_weight(weight)
    q_t = q.t().contiguous()
    fns = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fns["onednn"] = Int8Linear.from_linear(linear)  # per-token activations
        fns["onednn_per_tensor"] = Int8Linear.from_linear(linear, activation_granularity="per_tensor")
        fns["fbgemm"] = Int8Linear.from_linear(linear, "fbgemm")

    def int_mm(x):
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
        xq = torch.round(x / s).to(torch.int8)
        return torch.addcmul(bias, torch._int_mm(xq, q_t).float(), s * scale)

    fns["int_mm"] = int_mm
    fns["int8pack"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale) + bias
    if torchao_available():
        fns["torchao"] = torchao_quantize(torch.nn.Sequential(copy.deepcopy(linear)))
    return fns


def matmul_bench(args) -> list[dict]:
    rows = []
    for k, n in SHAPES:
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(n, k, generator=g) * k**-0.5
        bias = torch.randn(n, generator=g) * 0.1
        candidates = kernels(weight, bias)
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            if k > n:  # the FFN's second linear reads ReLU outputs
                x = x.relu()
            with torch.inference_mode():
                ref = F.linear(x, weight, bias)
                err = {name: ((fn(x) - ref).abs().max() / ref.abs().max()).item() for name, fn in candidates.items()}
                fns = {
                    "fp32": lambda x=x: F.linear(x, weight, bias),
                    **{name: (lambda fn=fn, x=x: fn(x)) for name, fn in candidates.items()},
                }
                seconds = interleaved(fns, args.reps, args.clock)
            row = {
                "in": k,
                "out": n,
                "rows": m,
                **{f"{name}_us": round(s * 1e6, 1) for name, s in seconds.items()},
                **{f"{name}_rel_err": round(e, 4) for name, e in err.items()},
            }
            rows.append(row)
            print(
                f"in {k:5d} out {n:5d} rows {m:4d} | "
                + " ".join(f"{name} {s * 1e6:8.0f} us ({seconds['fp32'] / s:4.2f}x)" for name, s in seconds.items())
                + " | rel err "
                + " ".join(f"{name} {e:.3f}" for name, e in err.items()),
                flush=True,
            )
    return rows


def generate_bench(args) -> dict:
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(args.size, vocab_size=args.vocab, dropout=0.0)
    fp32 = TransformerNmtForConditionalGeneration(config).eval()
    models = {"fp32": fp32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models["ours_onednn"] = quantize_for_cpu(copy.deepcopy(fp32))
        models["ours_onednn_per_tensor"] = quantize_for_cpu(copy.deepcopy(fp32), activation_granularity="per_tensor")
        models["ours_fbgemm"] = quantize_for_cpu(copy.deepcopy(fp32), backend="fbgemm")
        models["quantize_dynamic"] = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(fp32), {torch.nn.Linear}, dtype=torch.qint8
        )
        if torchao_available():
            models["torchao"] = torchao_quantize(copy.deepcopy(fp32))
    inputs, _ = random_batch(args.batch, args.src_len, 2, args.vocab)
    result = {}
    for beams in (1, 4):
        gen = dict(
            num_beams=beams,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            **({"length_penalty": 0.6} if beams > 1 else {}),
        )

        def run(model, gen=gen):
            with torch.inference_mode():
                return model.generate(**inputs, **gen)

        reference = run(fp32)
        agree = {name: (run(m) == reference).float().mean().item() for name, m in models.items()}
        seconds = interleaved({name: (lambda m=m: run(m)) for name, m in models.items()}, args.gen_reps, args.clock)
        key = "greedy" if beams == 1 else f"beam{beams}"
        tokens = args.batch * args.new_tokens
        result[key] = {
            name: {
                "tok_s": round(tokens / s, 1),
                "vs_fp32": round(seconds["fp32"] / s, 3),
                "tokens_equal_to_fp32": round(agree[name], 3),
            }
            for name, s in seconds.items()
        }
        print(
            f"generate {args.size} {key}: "
            + " | ".join(
                f"{name} {tokens / s:7.1f} tok/s ({seconds['fp32'] / s:4.2f}x, {agree[name]:.0%} tokens = fp32)"
                for name, s in seconds.items()
            ),
            flush=True,
        )
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[32, 128, 480],
        help="matmul rows: 32 = greedy batch, 128 = beam 4, 480 = 32 sources x 15 tokens",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src_len", type=int, default=15)
    parser.add_argument("--new_tokens", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--gen_reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (0 = torch default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--skip_matmul", action="store_true")
    parser.add_argument("--skip_generate", action="store_true")
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {
        "settings": vars(args),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torchao": torchao_available(),
    }
    if not args.skip_matmul:
        results["matmul"] = matmul_bench(args)
    if not args.skip_generate:
        results["generate"] = generate_bench(args)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
