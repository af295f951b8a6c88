"""Progress of long work (training steps, reading and tokenizing a corpus) that reads well in a log file.

On a terminal the training loop shows a tqdm bar. Elsewhere (nohup, a SLURM or Kubernetes log, CI: stderr is no
terminal) a bar's carriage-return updates end up in the log as one endless line with the log's INFO lines glued to
them, so `training_progress` gives `ProgressLines` instead: a log record `progress: step 60/200 (30%), loss 5.112,
tok_s 1593, lr 1.20e-04, elapsed 0:00:41, ETA 0:01:36` at most every `interval` seconds (and one when the work is
done), through the `hf_variants.train` logger, so it goes wherever the log goes (stdout, `train.log`) with the log's
timestamp. `Every` paces the progress records of the data stages (`sources.load_rows`, `measure.measure`).
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("hf_variants.train")

# Seconds between progress records of the data stages (reading a corpus, counting its tokens); `train.py` sets it
# from --progress_interval.
DATA_PROGRESS_SECONDS = 30.0


def duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    """tqdm's interface (`update`, `set_postfix`, `close`) as log records every `interval` seconds (0: every
    update) and a last one at the end. `initial`: steps done before (a resumed run), left out of the rate."""

    def __init__(self, total: int, initial: int = 0, interval: float = 30.0, unit: str = "step", clock=time.monotonic):
        self.total, self.done, self.interval, self.unit, self.clock = total, initial, interval, unit, clock
        self.initial = initial
        self.start = self.last = clock()
        self.postfix: dict[str, str] = {}
        self.written_at = None

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = {name: str(value) for name, value in values.items()}

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.interval or self.done >= self.total:
            self.last = now
            self.write(now)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self.initial) / elapsed
        eta = duration((self.total - self.done) / rate) if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        extra = "".join(f", {name} {value}" for name, value in self.postfix.items())
        return (
            f"progress: {self.unit} {self.done}/{self.total} ({percent:.0f}%){extra}, elapsed {duration(elapsed)}, "
            f"ETA {eta}"
        )

    def write(self, now: float) -> None:
        if self.written_at == self.done:
            return
        self.written_at = self.done
        logger.info(self.line(now))

    def close(self) -> None:
        if self.written_at is not None and self.written_at != self.done:
            self.write(self.clock())


def training_progress(total: int, initial: int, disable: bool, interval: float, stream=None):
    """A tqdm bar on stderr when it is a terminal, else `ProgressLines` every `interval` seconds; neither with
    `disable` (the other processes of a launch, --no_progress)."""
    from tqdm.auto import tqdm

    stream = stream or sys.stderr
    if not disable and not stream.isatty():
        return ProgressLines(total, initial=initial, interval=interval)
    return tqdm(
        total=total,
        initial=initial,
        disable=disable,
        desc="training",
        dynamic_ncols=True,
        mininterval=1.0,
        file=stream,
    )


class Every:
    """True at most every `seconds` (default: `DATA_PROGRESS_SECONDS` when called): paces progress records."""

    def __init__(self, seconds: float | None = None, clock=time.monotonic):
        self.seconds = DATA_PROGRESS_SECONDS if seconds is None else seconds
        self.clock = clock
        self.start = self.last = clock()

    def __call__(self) -> bool:
        now = self.clock()
        if now - self.last >= self.seconds:
            self.last = now
            return True
        return False

    def elapsed(self) -> str:
        return duration(self.clock() - self.start)


def quiet_library_bars() -> None:
    """Turn off the tqdm bars of transformers, datasets and huggingface_hub (loading and saving weights, reading a
    dataset's splits): off a terminal they would write carriage-return updates into the log."""
    import datasets
    import huggingface_hub
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
