"""Progress of a long command on stderr: a tqdm bar on a terminal; elsewhere (nohup, a SLURM log, CI) a line
`progress: D/T sentences (P%), R sentences/s, elapsed H:MM:SS, ETA H:MM:SS` every few seconds."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    """The progress bar of a log file: a line `progress: D/T sentences (P%), R sentences/s, ETA H:MM:SS` on stderr
    at most every `interval` seconds (nohup, SLURM, CI: where a bar's carriage returns would be lost), and a last
    line when done if any was written. Same interface as the tqdm bar (`update`, context manager)."""

    def __init__(self, total: int, interval: float, stream=None, clock=time.monotonic):
        self.total, self.interval, self.stream, self.clock = total, interval, stream or sys.stderr, clock
        self.done = 0
        self.start = self.last = clock()
        self.lines = 0

    def update(self, n: int) -> None:
        self.done += n
        now = self.clock()
        done = self.total is not None and self.done >= self.total
        if now - self.last >= self.interval or (self.lines and done):
            self.last = now
            self.write(now)

    def write(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.total is None:  # a stream (stdin): no total, no ETA
            print(
                f"progress: {self.done} sentences, {rate:.1f} sentences/s, elapsed {_duration(elapsed)}",
                file=self.stream,
                flush=True,
            )
            self.lines += 1
            return
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"progress: {self.done}/{self.total} sentences ({percent:.0f}%), {rate:.1f} sentences/s, "
            f"elapsed {_duration(elapsed)}, ETA {eta}",
            file=self.stream,
            flush=True,
        )
        self.lines += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def progress_bar(
    total: int | None,
    disable: bool,
    interval: float = 10.0,
    *,
    unit: str = "sent",
    desc: str = "translating",
    log_lines: bool = True,
):
    """A tqdm bar when stderr is a terminal; elsewhere `ProgressLines` every `interval` seconds (`log_lines`) or
    nothing; none at all with `disable`."""
    from tqdm.auto import tqdm

    if not disable and not sys.stderr.isatty():
        if log_lines:
            return ProgressLines(total, interval)
        disable = True
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, disable=disable, dynamic_ncols=True)


__all__ = ["ProgressLines", "progress_bar"]
