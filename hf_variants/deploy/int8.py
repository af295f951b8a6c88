"""int8 CPU inference for every hf_variants model: `quantize_for_cpu(model)`.

Every `nn.Linear` of the model (the output projection included, unless listed in `modules_to_not_convert`) becomes
an `Int8Linear`: int8 weights with one symmetric scale per output row, and activations quantized on the fly
(dynamic quantization: one symmetric scale per token, from the token's largest magnitude, as CTranslate2 does;
`activation_granularity="per_tensor"`: one asymmetric scale and zero point per call, as torch's `quantize_dynamic`).
Per-token scales keep a token's resolution when another token of the batch has large values (an outlier
token no longer coarsens the whole batch).

The matrix product runs on oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_pointwise`), the kernel torch's own x86
int8 inference path (PT2E / inductor) lowers to: plain int8/uint8 tensors, nothing of torch's deprecated quantized
tensor types (`torch.qint8`, `quantize_dynamic`). The model keeps its class, `generate()` and the translation
pipeline.

    model = quantize_for_cpu(AutoModelForSeq2SeqLM.from_pretrained(folder))   # in place; returns the model
    model.generate(**inputs)

Why this kernel (measured on a 2-core AVX2 machine; `benchmarks/README.md` says where to read the script):
`torch._int_mm`, `torch.ops.aten._weight_int8pack_mm` and torchao's `Int8DynamicActivationInt8WeightConfig` (which
runs on them in eager mode) are 15-80x SLOWER than the fp32 matmul on a CPU without VNNI; fbgemm's
`quantized::linear_dynamic` (what `torch.ao.quantization.quantize_dynamic` uses) is the fastest, but its weights
must be `torch.qint8` tensors, whose creation functions torch 2.13 deprecates for removal. oneDNN's int8 linear
takes plain int8 tensors; per matmul it is 0.9-2.3x as fast as fp32 at decoding shapes (least at d_model 256 with 32
rows, where fbgemm is 1.6x; most on the output projection), and 1.2-1.6x slower than fbgemm at 32 rows.
`backend="fbgemm"` is kept as an opt-in for comparison while torch still ships it (it warns).

Batches: per token, a row's int8 values and scale come from that row alone and the int32 products are exact, so an
`Int8Linear` gives each row the same output in any batch, bit for bit (`test_quantization`). Per tensor (and
fbgemm, which only quantizes per tensor) one scale covers every token of the call, i.e. every sentence of the batch:
a sentence's numbers, and at times its translation, depend on its neighbours (the trained tiny baseline, 300
test_2016_flickr sentences: 177 translated differently at batch size 1 and 64 greedy, 149 with beam 4). The rest of
the torch model runs in float32, whose kernels (attention over a padded length, matrix products of another row
count) can differ in the last bit with the batch; int8 rounding can, rarely, carry such a bit into another token
(per token, the same test: 1 of 300 sentences differed greedy, none with beam 4). ONNX Runtime's int8 graphs
quantize activations per row too (`hf_variants.onnx.quantization`).

Numerics: without VNNI (AVX2, AVX-512 without VNNI), x86 int8 kernels multiply uint8 by int8 in pairs summed in
int16, which saturates for full-range activations; activations then use 7 bits (`reduce_range=True`, as torch's
dynamic quantization does on x86). `reduce_range=None` (default) picks it from the CPU.

Saving: a quantized model is an inference object. `save_pretrained` / `push_to_hub` raise (a folder of int8
buffers would load back into the fp32 class as randomly initialised weights): save the fp32 model and quantize
after loading (a few milliseconds per layer). Its `state_dict()` holds plain tensors (`weight_int8`,
`weight_scale`, `bias`) and loads with `load_state_dict` into a model quantized the same way.

int8 modules are for inference only: `quantize_for_cpu` puts the model in eval mode and freezes its remaining
parameters; an int8 forward with gradients required raises.
"""

from __future__ import annotations

import logging
import types
import warnings

import torch
from torch import nn

logger = logging.getLogger(__name__)

BACKENDS = ("onednn", "fbgemm")
GRANULARITIES = ("per_token", "per_tensor")


def cpu_has_vnni() -> bool:
    """True when the CPU multiplies uint8 by int8 into int32 without saturating (AVX512-VNNI / AVX-VNNI / AMX)."""
    check = getattr(torch.cpu, "_is_vnni_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((check is not None and check()) or (amx is not None and amx()))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: ([out, in] int8 in [-127, 127], [out] float32 scales), weight ~ q * scale."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x W^T + b with int8 weights (per-row scales) and dynamically quantized activations.

    Not an `nn.Linear` subclass on purpose: code that reads a plain linear's weights for a fused fast path must
    see that this module is something else and call it. For code that reads `.weight` anyway, `weight` is the
    dequantized float matrix (computed on each access)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        backend: str = "onednn",
        reduce_range: bool | None = None,
        activation_granularity: str | None = None,
    ):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")
        granularity = activation_granularity or ("per_token" if backend == "onednn" else "per_tensor")
        if granularity not in GRANULARITIES:
            raise ValueError(f"`activation_granularity` must be one of {GRANULARITIES}, got {granularity!r}.")
        if backend == "fbgemm" and granularity != "per_tensor":
            raise ValueError(
                "backend='fbgemm' quantizes activations per tensor only: activation_granularity must "
                f"be 'per_tensor', got {granularity!r}."
            )
        if backend == "onednn" and not hasattr(torch.ops.onednn, "qlinear_pointwise"):
            raise RuntimeError(
                "backend='onednn' needs a torch build with oneDNN's int8 linear "
                "(torch.ops.onednn.qlinear_pointwise, x86 builds): none in this torch."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.activation_granularity = granularity
        self.reduce_range = (not cpu_has_vnni()) if reduce_range is None else bool(reduce_range)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32) if bias else None)
        self._packed = None  # the backend's prepacked weight, built on first use (not part of the state dict)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        backend: str = "onednn",
        reduce_range: bool | None = None,
        activation_granularity: str | None = None,
    ) -> "Int8Linear":
        module = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            backend,
            reduce_range,
            activation_granularity,
        )
        q, scale = quantize_weight(linear.weight)
        module.weight_int8.copy_(q)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        return module

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (float32), for code that reads a linear's matrix directly."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._packed = None  # new weights: pack again

    def _apply(self, fn, recurse=True):
        self._packed = None  # moved or converted buffers: pack again
        return super()._apply(fn, recurse)

    def _pack(self):
        if self.backend == "onednn":
            # a zero point z factors out of the integer product: sum_k (q_ik - z) w_jk s_j
            # = [sum_k q_ik w_jk s_j] - z * (s_j sum_k w_jk), the second factor precomputed here
            column_sums = self.weight_scale * self.weight_int8.sum(dim=1, dtype=torch.int32).float()
            zero_point = (127 if self.reduce_range else 255) // 2 + 1  # the per-token scheme's fixed zero point
            self._packed = (
                torch.ops.onednn.qlinear_prepack(self.weight_int8.contiguous(), None),
                torch.zeros(self.out_features, dtype=torch.long),
                column_sums,
                (column_sums * -zero_point).contiguous(),
            )
        else:
            with warnings.catch_warnings():  # torch's own deprecation of qint8 tensors; warned once at quantization
                warnings.simplefilter("ignore")
                qweight = torch._make_per_channel_quantized_tensor(
                    self.weight_int8, self.weight_scale.double(), torch.zeros(self.out_features, dtype=torch.long), 0
                )
                self._packed = torch.ops.quantized.linear_prepack(qweight, self.bias)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError(f"Int8Linear runs on the CPU only; got an input on {x.device}.")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                "Int8Linear is inference-only (no gradients): run the quantized model under "
                "torch.no_grad() / torch.inference_mode(), or train the fp32 model."
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8Linear expects inputs with {self.in_features} features, got {x.shape[-1]}.")
        dtype = x.dtype
        if dtype != torch.float32:  # (a `.float()` / `.to(dtype)` of a float32 tensor still costs a dispatch)
            return self.forward(x.float()).to(dtype)
        if x.numel() == 0:
            out = x.new_zeros(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        packed = self._packed if self._packed is not None else self._pack()
        if self.backend == "fbgemm":
            return torch.ops.quantized.linear_dynamic(x, packed, self.reduce_range)
        qmax = 127 if self.reduce_range else 255
        if self.activation_granularity == "per_token":
            return self._per_token(x, qmax, packed)
        # dynamic per-tensor activation quantization: uint8 with a zero point covering [min(x, 0), max(x, 0)]
        low, high = (v.item() for v in torch.aminmax(x))
        low, high = min(low, 0.0), max(high, 0.0)
        if not (low > float("-inf") and high < float("inf")):
            raise FloatingPointError("Int8Linear input has non-finite values (inf or NaN).")
        scale = (high - low) / qmax if high > low else 1.0
        zero_point = min(qmax, max(0, round(-low / scale)))
        # round(x / scale) + zero_point, clamped; values are >= 0 after the clamp, so truncation rounds half up
        shifted = x.mul(1.0 / scale).add_(zero_point + 0.5).clamp_(0, qmax + 0.49)
        qx = shifted.to(torch.int8).view(torch.uint8) if qmax <= 127 else shifted.to(torch.uint8)  # see _per_token
        weight, zeros, column_sums, _ = packed
        # the zero point's term as a bias (see _pack): oneDNN's own zero-point compensation reads the weights again
        shift = -scale * zero_point
        bias = column_sums * shift if self.bias is None else torch.add(self.bias, column_sums, alpha=shift)
        return torch.ops.onednn.qlinear_pointwise(
            qx, scale, 0, weight, self.weight_scale, zeros, bias, 1.0, 0, torch.float32, "none", [], ""
        )

    def _per_token(self, x: torch.Tensor, qmax: int, packed) -> torch.Tensor:
        """Symmetric per-row (per-token) activation quantization, as CTranslate2 does: row i is scaled by
        s_i = max_k |x_ik| / h (h = `qmax` // 2, 63 with 7-bit activations) to integers in [-h, h], stored as uint8
        with the fixed zero point h + 1. The int8 product runs with zero point 0; the zero point's term
        -(h + 1) * sum_k w_jk * w_scale_j is the same for every row, so oneDNN adds it as a precomputed bias (no
        runtime zero-point compensation, which oneDNN would compute from the weights at every call), and the row
        scales and the real bias are applied to the output. 5 passes over the activations (|x|, max, scale,
        shift, convert) instead of the 11 of an asymmetric min/max scheme with per-row zero points, for the same
        number of levels on signed activations (127 with 7 bits) and half of them on one-sided rows (after a ReLU).

        Non-finite values are not checked for (a check costs a host sync per call): a row with NaN or inf gets a
        NaN or inf scale, and so a non-finite output row, as the float linear gives (never finite garbage)."""
        weight, zeros, _, shift_bias = packed
        half = qmax // 2
        rows = x.reshape(-1, self.in_features)
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)  # an all-zero row: any scale
        # x * h / s_i + zero point, rounded half up by the truncation (values are in (0.5, 2h + 1.5)); with
        # qmax <= 127 they fit int8, whose float conversion is vectorized where uint8's is not: the bits are the same
        shifted = torch.mul(rows, half / scale).add_(half + 1.5)
        qx = shifted.to(torch.int8).view(torch.uint8) if qmax <= 127 else shifted.to(torch.int32).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(
            qx, 1.0, 0, weight, self.weight_scale, zeros, shift_bias, 1.0, 0, torch.float32, "none", [], ""
        )
        out.mul_(scale.mul_(1.0 / half))
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"backend={self.backend}, activations={'7' if self.reduce_range else '8'}-bit "
            f"{self.activation_granularity}"
        )


def _save_refused(self, *args, **kwargs):
    raise NotImplementedError(
        f"This {type(self).__name__} was quantized with quantize_for_cpu (int8 buffers): save_pretrained / "
        "push_to_hub would write weights the fp32 class cannot load. Save the fp32 model and call "
        "hf_variants.quantize_for_cpu after loading it; or keep model.state_dict() and load it into a model "
        "quantized the same way."
    )


def quantize_for_cpu(
    model: nn.Module,
    *,
    modules_to_not_convert: list[str] | tuple[str, ...] | None = None,
    backend: str = "onednn",
    reduce_range: bool | None = None,
    activation_granularity: str | None = None,
) -> nn.Module:
    """Replace every `nn.Linear` of `model` by an `Int8Linear` (in place) and return the model, in eval mode with
    its parameters frozen. Works on any model: a module used at several places (the Tied Transformer's shared
    blocks) becomes ONE int8 module used at the same places.

    Args:
        modules_to_not_convert: qualified module names (as in `model.named_modules()`) to keep in float, each with
            everything under it, e.g. `["lm_head"]`. A name that matches no module raises.
        backend: `"onednn"` (default: oneDNN int8 GEMM on plain int8 tensors) or `"fbgemm"` (torch's legacy
            dynamic-quantization kernel; its qint8 weights are deprecated in torch 2.13).
        reduce_range: 7-bit activations (True), 8-bit (False), or None: 7-bit unless the CPU has VNNI.
        activation_granularity: `"per_token"` (one symmetric scale per token: default with oneDNN; what
            CTranslate2 does; a token's output does not depend on the other tokens of the call) or `"per_tensor"`
            (one per call: a little faster, less accurate on trained models, and a sentence's translation can
            depend on its batch; the only choice of fbgemm, and what `quantize_dynamic` does).
    """
    Int8Linear(1, 1, backend=backend, activation_granularity=activation_granularity)  # validates the options
    skip = list(modules_to_not_convert or [])
    names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    unknown = [s for s in skip if s not in names]
    if unknown:
        raise ValueError(f"`modules_to_not_convert` names modules the model does not have: {unknown}.")
    for name, param in model.named_parameters():
        if param.device.type != "cpu":
            raise ValueError(f"quantize_for_cpu needs a model on the CPU; parameter {name!r} is on {param.device}.")

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skip)

    if backend == "fbgemm":
        warnings.warn(
            "backend='fbgemm' uses torch's qint8 tensors, deprecated in torch 2.13 and due for removal; "
            "backend='onednn' is the kept path.",
            FutureWarning,
            stacklevel=2,
        )
    converted: dict[int, Int8Linear] = {}
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, nn.Linear) or skipped(full):
                continue
            if type(child) is not nn.Linear:  # a subclass may compute something else: say so, never guess
                raise TypeError(
                    f"{full} is a {type(child).__name__} (an nn.Linear subclass); quantize_for_cpu "
                    "converts plain nn.Linear modules only: list it in modules_to_not_convert."
                )
            if id(child) not in converted:
                converted[id(child)] = Int8Linear.from_linear(child, backend, reduce_range, activation_granularity)
            setattr(parent, child_name, converted[id(child)])
    if not converted:
        raise ValueError(f"{type(model).__name__} has no nn.Linear module to quantize (all skipped or none).")
    model.eval()
    model.requires_grad_(False)
    model.save_pretrained = types.MethodType(_save_refused, model)
    model.push_to_hub = types.MethodType(_save_refused, model)
    remaining = sum(p.numel() for p in model.parameters())
    int8 = sum(m.weight_int8.numel() for m in converted.values())
    logger.info(
        "quantize_for_cpu: %d linear modules to int8 (%.1fM int8 weights; %.1fM float parameters left: "
        "embeddings, norms, non-linear-module weights)",
        len(converted),
        int8 / 1e6,
        remaining / 1e6,
    )
    return model


__all__ = ["Int8Linear", "quantize_for_cpu", "quantize_weight", "cpu_has_vnni"]
