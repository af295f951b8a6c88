"""An exponential moving average of the weights (`--ema_decay D`, `--ema_start_step S`): Marian's exponential
smoothing, fairseq's `--ema-decay`, timm's ModelEma.

After every optimizer step t (whose update was not skipped) the average moves towards the weights:
`ema = D * ema + (1 - D) * weights` (`torch._foreach_lerp_`, in place), and for t <= S it is set to the weights
(so a run can leave the first, fast-moving steps out of the average: fairseq's `--ema-start-update`). The average
is kept in float32 whatever the weights' precision, one copy per process: in a DDP run every process holds the same
weights after each step, hence the same average, and no collective is needed.

- **Checkpoints.** Each checkpoint holds the average as `ema.safetensors` (the model's state-dict names, shared
  tensors once, as `model.safetensors`), written by the main process into the checkpoint before its manifest, so it
  is digested and published with the rest; a resume loads it, and the resumed run's average is bit-identical to an
  uninterrupted run's. A run resumed from a checkpoint without one (EMA switched on by `--allow_changed_settings
  ema_decay`) starts the average from the resumed weights.
- **Validation and the final model** use the average (`--eval_weights ema`, the default with `--ema_decay`): it is
  swapped into the model's parameters for the validation (each tensor exchanged with its average, no second copy of
  the model) and swapped back after; `--final_model best/last` and `--average_last` then take the checkpoints'
  averages (`averaging.final_weights`). `--eval_weights raw` validates and publishes the trained weights and keeps
  the average in the checkpoints only (`hf-variants-average --weights ema` reads it).
- **Cost**: one float32 copy of the parameters per process (the weights, gradients and Adam's two moments are four)
  and one fused lerp per step; `benchmarks/ema_cost.py` measures both.
- **FSDP** is refused: there each process holds a shard of the flattened parameters, and an average of shards
  would need a gather at every checkpoint and validation, which this loop does not do. Average checkpoints instead
  (`--average_last`, `hf-variants-average`), which read FSDP's full-state-dict checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

EMA_WEIGHTS = "ema.safetensors"  # in each checkpoint of a run with --ema_decay

logger = logging.getLogger("hf_variants.train")


class ExponentialMovingAverage:
    """The float32 moving average of a model's floating-point parameters (each shared parameter once)."""

    def __init__(self, model: torch.nn.Module, decay: float, start_step: int = 0):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.model, self.decay, self.start_step = model, float(decay), int(start_step)
        named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]  # shared ones once
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow = [p.detach().to(torch.float32, copy=True) for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step`: copy the weights up to `start_step`, then move towards them."""
        weights = [p.detach().float() for p in self.params]
        if step <= self.start_step:
            torch._foreach_copy_(self.shadow, weights)
        else:
            torch._foreach_lerp_(self.shadow, weights, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average under the model's state-dict names (each shared tensor under its first name)."""
        return dict(zip(self.names, self.shadow))

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """What `ema.safetensors` holds: the average of every parameter and the model's other (buffer) state, so it
        loads into the model as its weights do."""
        out = self.state_dict()
        params = {id(p) for p in self.model.parameters()}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if name not in out and id(value) not in params:
                out[name] = value.detach().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], where: str = "the average") -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"{where} has no average of {missing[:3]}: it is not this model's")
        for name, shadow in zip(self.names, self.shadow):
            value = state[name]
            if value.shape != shadow.shape:
                raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, the model {tuple(shadow.shape)}")
            shadow.copy_(value)

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the model's parameters for the block (validation), the weights back afterwards, bit for
        bit; float32 parameters are exchanged with their average one tensor at a time (no second model in
        memory)."""
        with torch.no_grad():
            saved = []
            for p, s in zip(self.params, self.shadow):
                if p.dtype == torch.float32:
                    tmp = p.detach().clone()
                    p.copy_(s)
                    s.copy_(tmp)
                    saved.append(None)
                else:  # the average keeps its precision; the weights are kept aside
                    saved.append(p.detach().clone())
                    p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s, old in zip(self.params, self.shadow, saved):
                    if old is None:
                        tmp = p.detach().clone()
                        p.copy_(s)
                        s.copy_(tmp)
                    else:
                        p.copy_(old)


class NoAverage:
    """A run without `--ema_decay`: every hook does nothing."""

    def update(self, step: int) -> None:
        pass

    def checkpoint_files(self) -> dict:
        return {}

    def for_validation(self):
        return contextlib.nullcontext()


class RunAverage(NoAverage):
    """A run's moving average with the run's hooks: `update` after each step, `checkpoint_files` for each save,
    `for_validation` around each validation (the average swapped in when `--eval_weights ema`)."""

    def __init__(self, ema: ExponentialMovingAverage, eval_weights: str):
        self.ema, self.eval_weights = ema, eval_weights

    def update(self, step: int) -> None:
        self.ema.update(step)

    def checkpoint_files(self) -> dict:
        return {EMA_WEIGHTS: self.ema.checkpoint_weights()}

    def for_validation(self):
        return self.ema.swapped_in() if self.eval_weights == "ema" else contextlib.nullcontext()


def for_run(args, model: torch.nn.Module, resume: Path | None) -> NoAverage:
    """The run's moving average (`NoAverage` without `--ema_decay`), restored from the checkpoint to resume."""
    if not getattr(args, "ema_decay", None):
        return NoAverage()
    ema = ExponentialMovingAverage(model, args.ema_decay, args.ema_start_step)
    saved = Path(resume) / EMA_WEIGHTS if resume is not None else None
    if saved is not None and saved.is_file():
        from safetensors.torch import load_file

        ema.load_state_dict(load_file(str(saved)), where=str(saved))
    elif resume is not None:
        logger.warning("%s holds no moving average of the weights: it starts from the resumed weights", resume)
    return RunAverage(ema, args.eval_weights)
