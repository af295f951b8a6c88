"""The training loop of training/train.py as a `Trainer` over the run's named stages.

`train.py` runs `setup_run` → `load_data` → `build_job` → `Trainer.train` → `finish`; the stages hand each other
the plain records defined here (`RunContext`, `RunData`, `Job`), so each can be built and tested on its own. The
`Trainer` owns one step (`train_step`), the logging window (`TrainStats`), validation (`evaluate`), checkpoints
(`save`) and the step loop (`train`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..loss_transformer_nmt import smoothed_cross_entropy
from . import best_checkpoints, cache_store, checkpointing, corpus, early_stopping, ema, evaluation, external
from .collectives import accelerator_broadcast  # noqa: F401 (re-exported: the stages import it from here)
from .run_identity import KEY as RUN_ID_KEY
from .run_identity import resolve as resolve_run_id

logger = logging.getLogger("hf_variants.train")

# run_dir/model_config: the model's config.json and generation_config.json, written when the run starts, so that a
# checkpoint loads (the config + its weights: training/translate.py) before the run has finished
MODEL_CONFIG_DIR = checkpointing.MODEL_CONFIG_DIR  # the run's model config, written at its start
EXIT_NONFINITE = 3  # exit status of a run stopped by a non-finite loss (--on_nonfinite stop)
EXIT_INTERRUPTED = 130  # exit status of a process stopped by Ctrl-C (SIGINT) after its checkpoint: 128 + SIGINT


class TrainingStopped(RuntimeError):
    """The run stopped before its last step: `details` ({"reason", "step", ...}) go into results.json, the process
    exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int, details: dict):
        super().__init__(message)
        self.exit_code = exit_code
        self.details = {**details, "message": message, "exit_code": exit_code}


# ------------------------------------------------------------------------------------------------ run records
class TrainState:
    """Everything about the run's progress that a checkpoint must restore besides the model, optimizer and random
    states (saved as JSON in the checkpoint's trainer_state.json)."""

    def __init__(self):
        self.step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.train_tokens = 0
        self.train_time = 0.0
        self.wall_time = 0.0
        self.best_metric = None
        self.best_step = None
        self.evals: list[dict] = []
        # settings changed on a resume, in order: {"step", "setting", "from", "to", "free"}
        self.settings_changes: list[dict] = []
        # --streaming: the position after the last step ({"epoch", "buffer", "row", "step"}) and the stream's own
        # state (the first epoch's drop report, rows per epoch)
        self.stream: dict | None = None
        self.stream_state: dict | None = None
        # optimizer steps skipped for a non-finite loss or gradient (--on_nonfinite skip)
        self.nonfinite_skipped = 0
        # the logging window not yet logged when a preempted run saved its checkpoint (TrainStats.state_dict)
        self.window: dict | None = None
        self.checkpoints: list[int] | None = None  # steps of the checkpoints this run wrote (best_checkpoints.py)
        self.early_stopping: dict | None = None  # --patience: best value, validations without improvement

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


@dataclass
class RunContext:
    """`setup_run`'s result: the parsed options, the Accelerator, the run folder, languages and directions, the
    checkpoint to resume (if any) with the settings it changes."""

    args: argparse.Namespace
    accelerator: Any
    run_name: str
    run_dir: Path
    languages: list[str]
    directions: list[tuple[str, str]]
    eval_directions: list[tuple[str, str]]
    trackers: list[str]
    resume: Path | None
    run_settings: dict
    settings_changes: list[dict]
    session_start: float
    lock: Any = None  # training/run_lock.RunLock on the main process: released when the run ends

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclass
class RunData:
    """`load_data`'s result: the tokenizer, the training batches (a cached pair set and its sampler, or a stream),
    validation and test pairs, the drop reports and the length of the run in optimizer steps."""

    tokenizer: Any
    target_tags: bool
    train_set: Any
    stream: Any
    sampler: Any
    valid_pairs: list
    valid_batches: list
    test_pairs: list
    train_report: corpus.DropReport
    eval_report: corpus.DropReport
    steps_per_epoch: int | None
    max_steps: int


@dataclass
class Job:
    """`build_job`'s result: the prepared model (and its unwrapped module), optimizer, scheduler and the progress
    state (restored on a resume), with the hyperparameters recorded in results.json."""

    model: Any
    unwrapped: Any
    optimizer: Any
    scheduler: Any
    state: TrainState
    params: int
    hyperparameters: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ batches, eval
def batch_texts(pairs: list[corpus.Pair], bidirectional: bool):
    """Sources, targets, target languages, the source language (one code, or one per sentence in a batch of several
    sources) and the variant inputs of a batch; with `bidirectional`, every pair also appears reversed."""
    src = [p.src for p in pairs]
    tgt = [p.tgt for p in pairs]
    tgt_langs = [p.tgt_lang for p in pairs]
    src_langs = [p.src_lang for p in pairs]
    extra = {name: [p.src_extra[name] for p in pairs] for name in (pairs[0].src_extra if pairs else {})}
    if bidirectional:
        src, tgt, tgt_langs, src_langs = src + tgt, tgt + src, tgt_langs + src_langs, src_langs + tgt_langs
        extra = {name: values + [p.tgt_extra[name] for p in pairs] for name, values in extra.items()}
    src_lang = src_langs[0] if len(set(src_langs)) == 1 else src_langs  # per sentence: M2M100 / NLLB language tokens
    return src, tgt, tgt_langs, src_lang, extra


def make_batch(model, tokenizer, pairs, bidirectional: bool, max_length: int) -> dict:
    src, tgt, tgt_langs, src_lang, extra = batch_texts(pairs, bidirectional)
    if not isinstance(src_lang, str) and not getattr(getattr(model, "config", None), "target_language_token", False):
        src_lang = None  # only a model marking the source language with a token (M2M100 / NLLB) reads each one
    # length filtering already dropped longer pairs; the margin leaves room for a language tag
    return external.prepare_translation_inputs(
        model,
        tokenizer,
        src,
        src_lang=src_lang,
        tgt_lang=tgt_langs,
        text_target=tgt,
        max_length=max_length + 2,
        **extra,
    )


def evaluate_pairs(
    accelerator, model, tokenizer, pairs: list[corpus.Pair], directions, bidirectional: bool, args
) -> dict | None:
    """Translate `pairs` (each evaluated direction) and score them: overall and per direction. Main process only
    gets the scores (others get None)."""
    rows = [((p.src_lang, p.tgt_lang), p.src, p.tgt, p.src_extra) for p in pairs]  # (direction, src, ref, extra)
    if bidirectional:
        rows += [((p.tgt_lang, p.src_lang), p.tgt, p.src, p.tgt_extra) for p in pairs]
    hyps_all: dict[int, str] = {}
    for direction in directions:
        idx = [i for i, r in enumerate(rows) if r[0] == direction]
        if not idx:
            continue
        hyps = evaluation.translate_distributed(
            accelerator,
            model,
            tokenizer,
            [rows[i][1] for i in idx],
            [direction[1]] * len(idx),
            src_lang=direction[0],
            batch_size=args.eval_batch_size,
            num_beams=args.num_beams,
            length_penalty=args.length_penalty,
            max_len_a=args.max_len_a,
            max_len_b=args.max_len_b,
            variant_inputs={name: [rows[i][3][name] for i in idx] for name in args.source_annotations},
        )
        if hyps is not None:
            hyps_all.update(zip(idx, hyps))
    if not accelerator.is_main_process:
        return None
    order = sorted(hyps_all)
    tokenize = getattr(args, "bleu_tokenize", evaluation.DEFAULT_BLEU_TOKENIZE)
    result = evaluation.score([hyps_all[i] for i in order], [rows[i][2] for i in order], tokenize=tokenize)
    result["per_direction"] = {}
    if len(directions) > 1:
        for direction in directions:
            idx = [i for i in order if rows[i][0] == direction]
            if idx:
                s = evaluation.score([hyps_all[i] for i in idx], [rows[i][2] for i in idx], tokenize=tokenize)
                result["per_direction"][f"{direction[0]}-{direction[1]}"] = {
                    **{metric: s[metric] for metric in ("bleu", "chrf", "chrfpp", "ter")},
                    "pairs": len(idx),
                }
    result["examples"] = [
        {
            "direction": f"{rows[i][0][0]}-{rows[i][0][1]}",
            "source": rows[i][1],
            "reference": rows[i][2],
            "translation": hyps_all[i],
        }
        for i in order
    ]
    return result


@torch.no_grad()
def validation_loss(
    accelerator, model, tokenizer, pairs, batches, bidirectional, max_length, label_smoothing
) -> float:
    """The validation loss, one measure for every model type: the cross-entropy of the reference tokens of `pairs`,
    label-smoothed by `label_smoothing` (the run's, as trained; 0 gives the plain cross-entropy, whose exp is the
    perplexity), averaged over every labelled target token (both directions of a bidirectional run together), without
    the auxiliary losses. It is computed here from the logits, not read from the model's loss, whose token weights a
    variant may choose (the Tied Transformer's training loss sums one mean per direction)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    world = accelerator.num_processes
    # every process runs the same number of forwards (sharded models need them in lockstep); the padding repeats
    # a batch and is not counted
    padded = batches + batches[: (-len(batches)) % world] if batches else []
    for j in range(accelerator.process_index, len(padded), world):
        batch = make_batch(model, tokenizer, [pairs[i] for i in padded[j]], bidirectional, max_length)
        logits = model(**batch).logits
        if j >= len(batches):
            continue
        # summed on the device: no host sync per batch (the one read is the reduced total at the end)
        ntok = (batch["labels"] != -100).sum().double()
        loss = smoothed_cross_entropy(logits, batch["labels"], label_smoothing).double()  # the token mean
        total += torch.stack([loss * ntok, ntok])
    model.train(was_training)
    total = accelerator.reduce(total, "sum")
    return float(total[0] / total[1].clamp(min=1))


def every(step: int, interval: int) -> bool:
    """Whether `step` is on the cadence `interval` (0: never)."""
    return interval > 0 and step % interval == 0


# ------------------------------------------------------------------------------------------------ the window
class TrainStats:
    """Device-side sums of the steps since the last logging step (loss x tokens, target tokens, all tokens,
    non-finite steps, auxiliary losses x tokens) and their host time. Nothing here reads a device value: `reduce`
    does, once per logging step, with one all-reduce over the processes. Each step's loss sum and non-finite flag
    are kept (device scalars) for the message of a run stopped by a non-finite loss (`step_losses`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss = 0.0
        self.ntok = 0
        self.tokens = 0
        self.nonfinite = 0
        self.time = 0.0
        self.aux: dict = {}
        self.skipped = 0  # host count (--on_nonfinite skip)
        self.steps: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss x tokens, tokens)

    def add(self, loss, ntok, tokens, seconds: float, aux: dict, nonfinite=None, step: int | None = None) -> None:
        self.loss = self.loss + loss
        self.ntok = self.ntok + ntok
        self.tokens = self.tokens + tokens
        if nonfinite is not None:
            self.nonfinite = self.nonfinite + nonfinite
        self.time += seconds
        for name, value in aux.items():
            self.aux[name] = self.aux.get(name, 0.0) + value
        if step is not None:
            self.steps.append((step, loss, ntok))

    def skip(self, tokens, seconds: float) -> None:
        """A step whose update was skipped (non-finite): its tokens and time count, its loss does not."""
        self.tokens = self.tokens + tokens
        self.time += seconds
        self.skipped += 1

    def _sums(self, accelerator) -> list[float]:
        device = accelerator.device
        return accelerator.reduce(
            torch.stack(
                [
                    torch.as_tensor(v, device=device).double()
                    for v in [self.loss, self.ntok, self.tokens, self.nonfinite, *self.aux.values()]
                ]
            ),
            "sum",
        ).tolist()

    def reduce(self, accelerator) -> dict:
        """The window summed over the processes (the host sync): {"loss" (per target token), "ntok", "tokens",
        "tokens_per_sec", "nonfinite" (steps with a non-finite loss or gradient norm), "aux": {name: per target
        token}}."""
        sums = self._sums(accelerator)
        per_token = (lambda x: float(x / sums[1])) if sums[1] else (lambda x: math.nan)
        return {
            "loss": per_token(sums[0]),
            "ntok": sums[1],
            "tokens": sums[2],
            "tokens_per_sec": sums[2] / max(self.time, 1e-9),
            "nonfinite": int(sums[3]),
            "aux": {name: per_token(sums[4 + j]) for j, name in enumerate(self.aux)},
        }

    def step_losses(self, accelerator) -> dict[int, float]:
        """{step: loss per target token} of the window's steps, over all processes (a host sync: for messages)."""
        if not self.steps:
            return {}
        device = accelerator.device
        sums = accelerator.reduce(
            torch.stack(
                [
                    torch.stack([torch.as_tensor(x, device=device).double() for x in (loss, ntok)])
                    for _, loss, ntok in self.steps
                ]
            ),
            "sum",
        ).tolist()
        return {step: (a / b if b else math.nan) for (step, _, _), (a, b) in zip(self.steps, sums)}

    def state_dict(self, accelerator) -> dict:
        """The window summed over the processes, to carry it through a checkpoint taken between logging steps."""
        return {"sums": self._sums(accelerator), "aux": list(self.aux), "time": self.time, "skipped": self.skipped}

    def load_state_dict(self, state: dict, device, main_process: bool) -> None:
        """Continue a carried window: its sums on the main process (they are already summed over the processes)."""
        self.reset()
        sums = [x if main_process else 0.0 for x in state["sums"]]
        self.loss, self.ntok, self.tokens, self.nonfinite = (
            torch.tensor(x, dtype=torch.float64, device=device) for x in sums[:4]
        )
        self.aux = {
            name: torch.tensor(x, dtype=torch.float64, device=device) for name, x in zip(state["aux"], sums[4:])
        }
        self.time, self.skipped = state["time"], state["skipped"]


class AgreedFlag:
    """A flag all processes agree on without a host sync in the step: its value rides along an all-reduce the
    step already does, and is read one step later on a GPU (from a pinned copy, waiting only for that step's
    reduce, not for the work queued since) or at once on CPU, where reads cost nothing. Every process reads the
    same reduced value at the same step."""

    def __init__(self, device):
        self.device = device
        self.lag = 1 if device.type == "cuda" else 0
        self.pending: list = []
        self.values = torch.tensor([0, 1], dtype=torch.int64, device=device)  # indexed, never copied per step

    def local(self, raised: bool) -> torch.Tensor:
        return self.values[int(raised)]

    def push(self, reduced: torch.Tensor) -> None:
        if self.lag == 0:
            self.pending.append(reduced)
            return
        host = torch.empty((), dtype=reduced.dtype, pin_memory=True)
        host.copy_(reduced, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((host, event))

    def pop(self) -> int:
        """The reduced value pushed `lag` steps ago (0 before that)."""
        if len(self.pending) <= self.lag:
            return 0
        item = self.pending.pop(0)
        if self.lag == 0:
            return int(item)
        host, event = item
        event.synchronize()
        return int(host)


class StopRequested(BaseException):
    """Raised by the signal handler in an interruptible stage (the final stages of a single-process run): the stage
    stops at once. A BaseException, so that no `except Exception` on the way swallows it."""


class StopSignals:
    """SIGTERM and SIGUSR1 (what SLURM and Kubernetes send before preemption; `sbatch --signal=USR1@120`) and SIGINT
    (Ctrl-C) set a flag instead of ending the process, whatever stage the run is in (`stage`): during training the
    trainer checkpoints and exits at the next step boundary; in the final stages (final evaluation, final save,
    model card) the last checkpoint is current, and the run stops there (at once when `interrupt` is set:
    `StopRequested` is raised; else at the next stage boundary) and exits with the requeue status (after SIGINT:
    `EXIT_INTERRUPTED`, 130). A second SIGTERM/SIGUSR1 while that happens changes nothing; a second Ctrl-C stops the
    process at once (SIGINT's default action: the newest complete checkpoint stays, a partial one is ignored and
    removed by the next save). SIGINT is left alone where the process was started with it ignored (`nohup`, `&`)."""

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self):
        self.received: str | None = None
        self.previous: dict = {}
        self.stage = "training"
        self.received_stage: str | None = None  # the stage the first signal arrived in
        self.interrupt = False  # raise StopRequested from the handler (a stage that may stop anywhere)

    def install(self) -> bool:
        """Install the handlers (the main thread only); False when they already are (or cannot be)."""
        import signal
        import threading

        if self.previous or threading.current_thread() is not threading.main_thread():
            return False
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None and not (name == "SIGINT" and signal.getsignal(sig) == signal.SIG_IGN):
                self.previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        import os
        import signal

        name = signal.Signals(signum).name
        if self.received is not None and name == "SIGINT":  # Ctrl-C again: stop now, as Ctrl-C does
            os.write(2, f"{name} received again while stopping (after {self.received}): stopping at once\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is not None:
            note = f"{name} received while stopping (after {self.received}): ignored, the checkpoint is on its way\n"
            os.write(2, note.encode())
            return
        self.received, self.received_stage = name, self.stage
        again = " (Ctrl-C again: stop at once, without it)" if name == "SIGINT" else ""
        if self.stage == "training":
            note = f"{name} received: saving a checkpoint at the next step boundary, then exiting{again}\n"
        else:
            when = "now" if self.interrupt else "at the end of it"
            note = (
                f"{name} received during the {self.stage}: stopping {when} (the last checkpoint is current), "
                f"then exiting{again}\n"
            )
        os.write(2, note.encode())
        if self.interrupt:
            raise StopRequested(name)


class RunLogError(ValueError):
    """The run's log (`log.jsonl`) is damaged before its last line."""


def read_run_log(path: Path) -> list[dict]:
    """The records of an append-only run log (`log.jsonl`: one JSON object with an integer "step" a line), read back
    as untrusted input: a torn last line (a crash while it was written) is dropped with a warning naming the file;
    a damaged line before it, or a file that is not a regular file, raises `RunLogError` naming the file (and
    line)."""
    import stat

    mode = path.lstat().st_mode
    if not stat.S_ISREG(mode):
        raise RunLogError(f"{path} is not a regular file: the run log cannot be read.")
    lines = path.read_bytes().split(b"\n")
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    records = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        problem = None
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            problem = f"not a JSON record ({type(err).__name__}: {err})"
        else:
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                problem = "not a record of a step (a JSON object with an integer 'step')"
        if problem is None:
            records.append(record)
        elif i == last:  # a write cut short by a crash
            logger.warning("%s: its last line (%d) is torn (%s): dropped.", path, i + 1, problem)
        else:
            raise RunLogError(f"{path}, line {i + 1}: {problem}; the run log is damaged before its last line.")
    return records


# ------------------------------------------------------------------------------------------------ the trainer
class Trainer:
    """The step loop over a prepared `Job`: one optimizer step (`train_step`), logging (`log_window`), validation
    (`evaluate`) and checkpoints (`save`) at their cadences."""

    def __init__(self, run: RunContext, data: RunData, job: Job):
        self.run, self.data, self.job = run, data, job
        self.args = run.args
        self.accelerator = run.accelerator
        self.state = job.state
        self.stats = TrainStats()
        self.loss_kwargs = external.loss_only_kwargs(job.unwrapped, self.args.label_smoothing)
        self.log_path = run.run_dir / "log.jsonl"
        self.wall_time_base = self.state.wall_time
        self.signals = StopSignals()
        self.tokenizer_fingerprint = cache_store.tokenizer_fingerprint(data.tokenizer)
        self.run_id = resolve_run_id(self.accelerator, run.resume)  # kept on resume, in every checkpoint
        self.stop_flag = AgreedFlag(self.accelerator.device)
        # the step of the newest checkpoint of this run's state (the resumed one: nothing has changed since)
        self.saved_step: int | None = self.state.step if run.resume is not None else None
        self.last_losses: list[tuple[int, float]] = []  # (step, loss) of the last logging steps
        self.ema = ema.for_run(self.args, job.unwrapped, run.resume)  # --ema_decay (a no-op without it)
        best_checkpoints.adopt(self.state, run.checkpoint_dir, resumed=run.resume is not None)
        early_stopping.check_validation_data(self.args, data.valid_pairs)  # --patience, --keep_best
        self.kept_best = best_checkpoints.log_ranking(self.args, len(data.valid_pairs or []))  # the best N kept
        if self.state.window is not None:  # a preempted run's window, logged at its next logging step
            self.stats.load_state_dict(self.state.window, self.accelerator.device, self.accelerator.is_main_process)
            self.state.window = None
        if self.accelerator.is_main_process and self.log_path.exists():  # drop entries past the resumed step
            kept = [record for record in read_run_log(self.log_path) if record["step"] <= self.state.step]
            checkpointing.atomic_write(self.log_path, "".join(json.dumps(record) + "\n" for record in kept))

    # ---- records
    def log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.run.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def wall_time(self) -> float:
        return self.wall_time_base + time.time() - self.run.session_start

    def epoch_progress(self) -> float:
        state, stream = self.state, self.data.stream
        if stream is None:
            return state.epoch + state.step_in_epoch / max(self.data.steps_per_epoch, 1)
        rows = stream.rows_per_epoch
        return state.epoch + ((state.stream or {}).get("row", 0) / rows if rows else 0.0)

    # ---- checkpoints and validation
    def nonfinite_weights(self) -> int:
        """Parameters holding a non-finite value, over all processes (a host sync: at checkpoints only)."""
        params = [p for p in self.job.model.parameters() if p.numel()]
        bad = torch.stack([~torch.isfinite(p).all() for p in params]).sum() if params else torch.zeros(())
        return int(self.accelerator.reduce(bad.to(self.accelerator.device, torch.int64), "sum"))

    def save(self, step: int) -> None:
        state, args = self.state, self.args
        bad = self.nonfinite_weights()
        if bad:
            self.stop_nonfinite(f"{bad} parameter tensor(s) hold non-finite values after step {step}", step)
        state.wall_time = self.wall_time()
        best_checkpoints.record_save(state, step)
        checkpointing.save_checkpoint(
            self.accelerator,
            self.run.checkpoint_dir,
            step,
            {
                "epoch": state.epoch,
                "best_step": state.best_step,
                "settings": self.run.run_settings,
                checkpointing.TOKENIZER_KEY: self.tokenizer_fingerprint,
                RUN_ID_KEY: self.run_id,  # hf_variants/training/run_identity.py
            },
            {"train_state": state.state_dict(), "scheduler": self.job.scheduler.state_dict()},
            tokenizer_dir=self.run.run_dir / checkpointing.TOKENIZER_DIR,
            extra_files=self.ema.checkpoint_files(),
        )
        if self.accelerator.is_main_process:  # only the run's own checkpoints, never the newest and best ones
            best_checkpoints.rotate(self.run.checkpoint_dir, state, args, self.kept_best)
        self.accelerator.wait_for_everyone()
        self.saved_step = step

    def evaluate(self, step: int) -> bool:
        """Validation loss and BLEU/chrF; returns True when this step is the best so far."""
        args, data, state, accelerator = self.args, self.data, self.state, self.accelerator
        if not data.valid_pairs:
            return False
        record = {
            "step": step,
            "valid_loss": validation_loss(
                accelerator,
                self.job.unwrapped,
                data.tokenizer,
                data.valid_pairs,
                data.valid_batches,
                args.bidirectional,
                args.max_length,
                args.label_smoothing,
            ),
        }
        if args.eval_bleu_pairs:
            scores = evaluate_pairs(
                accelerator,
                self.job.unwrapped,
                data.tokenizer,
                data.valid_pairs[: args.eval_bleu_pairs],
                self.run.eval_directions,
                args.bidirectional,
                args,
            )
            if scores is not None:
                record.update(valid_bleu=scores["bleu"], valid_chrf=scores["chrf"])
        record = accelerator_broadcast(accelerator, record)
        if not math.isfinite(record["valid_loss"]):  # never the best
            state.evals.append(record)
            self.log(record)
            if args.on_nonfinite == "stop":  # before this step's checkpoint: the weights overflow
                self.stop_nonfinite(f"the validation loss is not finite ({record['valid_loss']})", step)
            logger.warning(
                "step %d: the validation loss is not finite (%s): never the best", step, record["valid_loss"]
            )
            return False
        # higher is better; BLEU ties (e.g. 0 early on) are broken by the validation loss
        value = [record.get("valid_bleu", 0.0) if args.best_metric == "bleu" else 0.0, -record["valid_loss"]]
        best = state.best_metric is None or value > list(state.best_metric)
        if best:
            state.best_metric, state.best_step = value, step
        state.evals.append(record)
        self.log(record)
        logger.info(
            "step %d: %s%s",
            step,
            ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step"),
            " (best)" if best else "",
        )
        return best

    # ---- one step
    def epoch_steps(self):
        """The current epoch's optimizer steps from the current position: (micro-batches, the stream position
        after the step)."""
        data, state = self.data, self.state
        if data.stream is not None:
            return data.stream.steps(state.stream or {"epoch": state.epoch, "buffer": 0, "row": 0, "step": 0})
        plan = corpus.StepPlan(
            data.sampler.epoch(state.epoch), self.accelerator.num_processes, self.args.gradient_accumulation_steps
        )
        if isinstance(data.sampler, corpus.SharedEpochs):
            # epochs before the previous one: every process opened them before the collectives of the previous
            # epoch's steps (the previous epoch itself may have had no step left, after a resume at its end)
            data.sampler.forget_before(state.epoch - 1)
        return ((plan[i], None) for i in range(state.step_in_epoch, len(plan)))

    def micro_batches(self, step_batches) -> list[dict]:
        """This process's micro-batches of one optimizer step, tokenized."""
        acc, rank = self.args.gradient_accumulation_steps, self.accelerator.process_index
        data = self.data
        return [
            make_batch(
                self.job.unwrapped,
                data.tokenizer,
                b if data.stream is not None else data.train_set.pairs(b),
                self.args.bidirectional,
                self.args.max_length,
            )
            for b in step_batches[rank * acc : (rank + 1) * acc]
        ]

    def train_step(self, batches: list[dict]):
        """Forward/backward over this process's micro-batches and one optimizer step. Token counts and losses stay
        on the device: no host sync in the step (the only ones are at logging and evaluation steps), so a GPU can
        run ahead of Python (with --on_nonfinite skip, reading whether the gradient is finite is one). Returns (loss x
        tokens, target tokens, all tokens, {aux: loss x tokens}, grad norm, non-finite flag (a device scalar), whether
        the update was skipped)."""
        accelerator, args, job = self.accelerator, self.args, self.job
        ntoks = [(b["labels"] != -100).sum() for b in batches]
        local_ntok = torch.stack(ntoks).sum()
        local_tokens = local_ntok + sum(b["attention_mask"].sum() for b in batches)
        # the global token count, with the stop flag (a signal received by any process) riding along
        counts = accelerator.reduce(
            torch.stack([local_ntok, self.stop_flag.local(self.signals.received is not None)]), "sum"
        )
        total_ntok = counts[0]
        self.stop_flag.push(counts[1])
        step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        step_aux: dict[str, torch.Tensor] = {}
        for i, (batch, ntok) in enumerate(zip(batches, ntoks)):
            # token-weighted over the global batch: sum(loss_i * ntok_i) / total tokens, with DDP's gradient
            # mean over processes undone by the world-size factor
            weight = ntok * accelerator.num_processes / total_ntok
            sync = accelerator.no_sync(job.model) if i < len(batches) - 1 else nullcontext()
            with sync:
                out = job.model(**batch, **self.loss_kwargs)  # hf_variants: no logits, see external.loss_only_kwargs
                loss = external.translation_loss(job.unwrapped, out, batch["labels"], args.label_smoothing)
                aux = getattr(out, "aux_losses", None) or {}
                del out  # other models' logits ([tokens, vocabulary]): the loss's backward does not need them
                accelerator.backward(loss * weight)
            step_loss += loss.detach().double() * ntok
            for name, value in aux.items():
                step_aux[name] = step_aux.get(name, 0.0) + value.detach().double() * ntok
        grad_norm = None
        if args.max_grad_norm > 0 or args.on_nonfinite == "skip":  # skip: the norm (of all processes) decides
            grad_norm = accelerator.clip_grad_norm_(job.model.parameters(), args.max_grad_norm or math.inf)
        nonfinite = ~torch.isfinite(step_loss)
        if grad_norm is not None:
            nonfinite = nonfinite | ~torch.isfinite(grad_norm)
        skipped = args.on_nonfinite == "skip" and not bool(torch.isfinite(grad_norm))
        if not skipped:
            job.optimizer.step()
        job.scheduler.step()  # the schedule follows the step count, skipped steps included
        job.optimizer.zero_grad(set_to_none=True)
        if not skipped:
            external.after_optimizer_step(job.unwrapped)
        return step_loss, local_ntok, local_tokens, step_aux, grad_norm, nonfinite.long(), skipped

    def log_window(self, grad_norm) -> dict:
        """Reduce the window (one host sync), log it and start a new one; also before every evaluation and
        checkpoint, so the saved token count is exact."""
        sums = self.stats.reduce(self.accelerator)
        if sums["nonfinite"] and self.args.on_nonfinite == "stop":
            self.stop_nonfinite("the training loss is not finite")
        self.state.train_tokens += int(sums["tokens"])
        lr = self.job.scheduler.get_last_lr()[0]
        record = {
            "step": self.state.step,
            "epoch": self.epoch_progress(),
            "loss": sums["loss"],
            "lr": lr,
            "tokens_per_sec": sums["tokens_per_sec"],
        }
        record.update({f"aux/{name}": value for name, value in sums["aux"].items()})
        if grad_norm is not None and (self.args.max_grad_norm > 0 or math.isfinite(grad_norm)):
            record["grad_norm"] = float(grad_norm)
        if self.stats.skipped:
            record["nonfinite_skipped"] = self.stats.skipped
        self.log(record)
        self.progress.set_postfix(
            loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}", lr=f"{lr:.2e}", refresh=False
        )
        self.last_losses = (self.last_losses + [(record["step"], record["loss"])])[-5:]
        self.stats.reset()
        return record

    # ---- stopping
    def last_checkpoint(self) -> str | None:
        found = checkpointing.list_checkpoints(self.run.checkpoint_dir)
        return str(found[-1][1]) if found else None

    def stop_nonfinite(self, what: str, step: int | None = None) -> None:
        """--on_nonfinite stop: raise `TrainingStopped` naming the first non-finite step, the last losses and the
        last checkpoint (every checkpoint holds finite weights: each save is checked first)."""
        losses = self.stats.step_losses(self.accelerator)
        bad = [s for s, loss in losses.items() if not math.isfinite(loss)]
        step = bad[0] if bad else (step or self.state.step)
        recent = dict(self.last_losses)
        recent.update(losses)
        shown = ", ".join(f"step {s} {loss:.4g}" for s, loss in sorted(recent.items())[-8:])
        checkpoint = self.last_checkpoint()
        message = (
            f"Stopped at step {step}: {what} (--on_nonfinite stop). Last losses: {shown or 'none logged'}. "
            + (
                f"The last checkpoint, with finite weights, is {checkpoint}: resume from it with e.g. a lower "
                f"--learning_rate (--resume_from_checkpoint {checkpoint} --allow_changed_settings "
                f"learning_rate)"
                if checkpoint
                else "No checkpoint was saved before it"
            )
            + ", or pass --on_nonfinite skip to skip such steps. No final model was saved."
        )
        raise TrainingStopped(
            message,
            EXIT_NONFINITE,
            {
                "reason": "nonfinite",
                "step": step,
                "detected_at_step": self.state.step,
                "last_losses": {str(s): loss for s, loss in sorted(recent.items())[-8:]},
                "last_finite_checkpoint": checkpoint,
            },
        )

    def stop_requested(self) -> bool:
        """Whether any process received SIGTERM/SIGUSR1/SIGINT (a collective every process must reach)."""
        received = self.signals.received is not None
        if self.accelerator.num_processes == 1:
            return received
        flag = torch.tensor([1.0 if received else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum").item() > 0)

    def stop_point(self, stage: str) -> None:
        """A stage boundary after training (collective): `stop_preempted` when any process received a signal."""
        if self.stop_requested():
            self.stop_preempted(self.signals.received_stage or stage)

    def stop_preempted(self, stage: str = "training") -> None:
        """All processes agreed that one received SIGTERM/SIGUSR1/SIGINT: checkpoint this step unless its checkpoint is
        current (with the logging window not yet logged, so the resumed run logs what an uninterrupted one would)
        and raise `TrainingStopped` (the requeue status). `stage`: what the run was doing (after training: the
        last step's checkpoint is current, and a resume finishes the job without training)."""
        state = self.state
        kept = self.saved_step == state.step
        if not kept:
            state.window = self.stats.state_dict(self.accelerator)
            self.save(state.step)
            state.window = None
        checkpoint = self.run.checkpoint_dir / f"step_{state.step}"
        received = self.signals.received or "a stop signal in another process"
        during = "" if stage == "training" else f" during the {stage}"
        what = "kept (current)" if kept else "saved"
        interrupted = received == "SIGINT"  # Ctrl-C: the user's stop, not a preemption to requeue
        status = EXIT_INTERRUPTED if interrupted else self.args.requeue_exit_code
        message = (
            f"{'Interrupted' if interrupted else 'Preempted'} ({received}){during}: checkpoint {checkpoint} {what} "
            f"at step {state.step}; exiting with status {status}. Continue with --resume_from_checkpoint latest."
        )
        logger.warning("%s", message)
        raise TrainingStopped(
            message,
            status,
            {
                "reason": "preempted",
                "stage": stage,
                "signal": self.signals.received,
                "step": state.step,
                "checkpoint": str(checkpoint),
            },
        )

    # ---- the loop
    def train(self) -> None:
        """Optimizer steps until `max_steps`, validating, logging and checkpointing at their cadences (and at the
        last step, which is always checkpointed)."""
        from .progress import training_progress

        self.job.model.train()
        self.progress = training_progress(  # a bar on a terminal, progress lines in a log
            self.data.max_steps,
            self.state.step,
            disable=not self.accelerator.is_main_process or getattr(self.args, "no_progress", False),
            interval=getattr(self.args, "progress_interval", 30.0),
        )
        if self.data.stream is not None and self.state.stream_state is not None:
            self.data.stream.load_state_dict(self.state.stream_state)  # the first epoch's drop report so far
        installed = self.signals.install()  # main(): installed for the whole run, final stages included
        self.signals.stage, self.signals.interrupt = "training", False
        try:
            while not self.done():
                self.train_epoch()
        finally:
            if installed:
                self.signals.restore()
            self.progress.close()
        self.accelerator.wait_for_everyone()
        sampler = self.data.sampler
        if isinstance(sampler, corpus.SharedEpochs) and self.accelerator.is_local_main_process:
            shutil.rmtree(sampler.directory, ignore_errors=True)

    def done(self) -> bool:
        """`max_steps` reached, or stopped early (--patience)."""
        return self.state.step >= self.data.max_steps or early_stopping.stopped(self.state, self.args)

    def train_epoch(self) -> None:
        """The steps left in the current epoch (or up to `max_steps`, or an early stop)."""
        state = self.state
        epoch_steps = self.epoch_steps()
        while not self.done():
            t0 = time.time()
            step_batches, position = next(epoch_steps, (None, None))
            if step_batches is None:  # the end of the epoch
                state.epoch += 1
                state.step_in_epoch = 0
                state.stream = None
                return
            step_loss, ntok, tokens, aux, grad_norm, nonfinite, skipped = self.train_step(
                self.micro_batches(step_batches)
            )
            state.step += 1
            state.step_in_epoch += 1
            if self.data.stream is not None:
                state.stream, state.stream_state = position, self.data.stream.state_dict()
            dt = time.time() - t0
            state.train_time += dt
            if skipped:
                state.nonfinite_skipped += 1
                self.stats.skip(tokens, dt)
                logger.warning(
                    "step %d: non-finite loss or gradient: update skipped (%d so far; --on_nonfinite skip)",
                    state.step,
                    state.nonfinite_skipped,
                )
            else:
                self.stats.add(step_loss, ntok, tokens, dt, aux, nonfinite, state.step)
                self.ema.update(state.step)
            self.progress.update(1)
            self.after_step(grad_norm)
            if self.stop_flag.pop():
                self.stop_preempted()

    def after_step(self, grad_norm) -> None:
        """Logging, validation and checkpoint at the steps that have them."""
        state, args = self.state, self.args
        last = state.step == self.data.max_steps
        evaluating = every(state.step, args.eval_steps) or last
        saving = every(state.step, args.save_steps) or last
        if every(state.step, args.logging_steps) or last or evaluating or saving:
            self.log_window(grad_norm)
        is_best = False
        if evaluating:
            with self.ema.for_validation():  # --eval_weights ema: the moving average validates
                is_best = self.evaluate(state.step)
            if state.evals and state.evals[-1]["step"] == state.step:
                # --keep_best, --final_candidates: a step among the best N is checkpointed; --patience: a stopping
                # step is the last
                is_best |= best_checkpoints.in_top(state.evals, state.step, args.best_metric, self.kept_best)
                is_best |= early_stopping.update(state, state.evals[-1], args)
        if saving or is_best:
            self.save(state.step)
