"""The training step's speed levers at GPU scale: the compiled model body and the fused optimizer.

- `compile_body(model)`: `torch.compile` of the encoder-decoder stacks (`model.model`, in place: parameter names,
  `state_dict` and checkpoints unchanged), with dynamic batch and length dimensions, so the length-bucketed batches
  of a run (every step a different [sentences, tokens] shape) share one graph instead of compiling one per shape.
  The compiled forward serves training calls only (`training` mode, gradients on); validation and `generate` (a
  cache growing by one position a step) stay eager. The loss stays outside the graph: the chunked cross-entropy
  (`loss_transformer_nmt`) loops over row chunks in Python, which a compiled graph would specialise to each batch's
  row count (one recompilation per shape). Models without the `model` body attribute (transformers' own, through
  `external`) are compiled whole, under the same rule.
- `adam(params, device, ...)`: `torch.optim.Adam` (the papers' optimizer, L2 weight decay as before) with
  `fused=True` on CUDA (one kernel for the whole update instead of a few per parameter group), the multi-tensor
  (`foreach`) implementation elsewhere.
- `recompilations()`: dynamo's count of compiled graphs, for the benchmark and the tests.
Neither adds a host synchronisation to the step.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_COMPILED: dict[tuple, object] = {}  # (module class, compile options) -> torch.compile of the class's forward


def _training_forward(self, *args, **kwargs):
    """The forward `compile_body` installs: compiled in training with gradients, eager otherwise."""
    forward = type(self).forward
    if not (self.training and torch.is_grad_enabled()):
        return forward(self, *args, **kwargs)
    key = (type(self), tuple(sorted(self._compile_options.items())))
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = torch.compile(forward, **self._compile_options)
    return compiled(self, *args, **kwargs)


def compile_body(model: nn.Module, backend: str = "inductor", mode: str | None = None, dynamic: bool = True):
    """Compile `model`'s body for training (see the module docstring); returns the module whose forward is now
    compiled. A bound method on the instance (a deep copy of the model is bound to the copy)."""
    body = getattr(model, "model", None)
    target = body if isinstance(body, nn.Module) else model
    target._compile_options = {"backend": backend, "mode": mode, "dynamic": dynamic}
    target.forward = types.MethodType(_training_forward, target)
    return target


def fused_available(device: torch.device | str) -> bool:
    """Whether the fused Adam kernel is used on `device` (CUDA: yes; elsewhere the multi-tensor path)."""
    return torch.device(device).type == "cuda"


def adam(params, device, lr: float, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.0):
    """`torch.optim.Adam` with `fused=True` where `fused_available(device)`, `foreach=True` otherwise."""
    flags = {"fused": True} if fused_available(device) else {"foreach": True}
    return torch.optim.Adam(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **flags)


def recompilations() -> int:
    """The number of graphs dynamo has compiled in this process (a first compilation included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


__all__ = ["compile_body", "adam", "fused_available", "recompilations"]
