"""Helpers of the server tests: a real `hf-variants-serve` process on a port the OS picks, an HTTP client, and the
fault-injecting start used where a test needs an engine that is slow or fails on purpose.

`ServerProcess(args)` runs `python -m hf_variants.serve --port 0 ARGS` (or, with `faults=True`, the same `main()`
behind `FAULTS_PRELUDE`, which wraps the real translator of each worker in `FaultyTranslator`); the URL comes from
the server's own "listening on" line; `wait_ready()` polls `/health` until it answers 200.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from conftest import REPO_ROOT

# The fault-injecting start (`ServerProcess(faults=True)`): each worker's real translator is wrapped in
# FaultyTranslator, whose `decode_batch` (the batcher's one call into the engine) does, for a batch holding
# - a sentence beginning with "SLOW ": sleep FAULT_DELAY seconds, then decode;
# - a sentence holding "CRASH": raise;
# - a sentence beginning with "HOLD:NAME ": print "fault: HOLD:NAME waiting", wait until the file FAULT_DIR/NAME
#   exists, then decode; or stop when the batcher cancels the batch (the engine's DecodingCancelled), printing
#   "fault: HOLD:NAME cancelled";
# - a sentence beginning with "STEPS ": decode on the real engine, whose cancel flag (asked at every decoding step)
#   is wrapped: at the second ask it prints "fault: held at decoding step 2" and waits (at most 120 s) until the
#   batcher cancels the batch; once the engine returned it prints "fault: stopped after N asks" (a stopped decoding:
#   its 2 steps and the engine's check after generate(), 3).
# A body holding b"PREPHOLD" waits in the preparation thread until FAULT_DIR/prephold exists ("fault: prepare held").
# FAULT_LOAD_DELAY seconds are added to the loading of each worker.
FAULTS_PRELUDE = """
import os, sys, time
from pathlib import Path
import hf_variants.commands.serve as command
import hf_variants.serve.app as serve_app
from hf_variants.inference.requests import DecodingCancelled

real_loader = command.server_translator
real_prepare = serve_app.prepare_body
FAULT_DIR = Path(os.environ.get("FAULT_DIR", "."))


def say(message):
    print(f"fault: {message}", file=sys.stderr, flush=True)


def wait_for(name, cancelled):
    say(f"HOLD:{name} waiting")
    while not (FAULT_DIR / name).exists():
        if cancelled is not None and cancelled():
            say(f"HOLD:{name} cancelled")
            raise DecodingCancelled("held batch cancelled")
        time.sleep(0.01)


class StepWatch:
    def __init__(self, cancelled):
        self.cancelled, self.steps = cancelled, 0

    def __call__(self):
        self.steps += 1
        if self.steps == 2:
            say("held at decoding step 2")
            deadline = time.monotonic() + 120
            while not self.cancelled() and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.cancelled()


class FaultyTranslator:
    def __init__(self, translator):
        self.translator = translator

    def __getattr__(self, name):
        return getattr(self.translator, name)

    def fork(self, parallel=False):
        return FaultyTranslator(self.translator.fork(parallel))

    def decode_batch(self, requests, options, cancelled=None):
        sources = [r.source for r in requests]
        if any("CRASH" in s for s in sources):
            raise RuntimeError("injected engine fault")
        if any(s.startswith("SLOW ") for s in sources):
            time.sleep(float(os.environ.get("FAULT_DELAY", "2")))
        for s in sources:
            if s.startswith("HOLD:"):
                wait_for(s.split()[0][5:], cancelled)
        if any(s.startswith("STEPS ") for s in sources) and cancelled is not None:
            watch = StepWatch(cancelled)
            try:
                return self.translator.decode_batch(requests, options, cancelled=watch)
            finally:
                say(f"stopped after {watch.steps} asks")
        return self.translator.decode_batch(requests, options, cancelled=cancelled)


def faulty_loader(location, settings):
    time.sleep(float(os.environ.get("FAULT_LOAD_DELAY", "0")))
    return FaultyTranslator(real_loader(location, settings))


def held_prepare(translator, body, *args):
    if b"PREPHOLD" in body:
        say("prepare held")
        while not (FAULT_DIR / "prephold").exists():
            time.sleep(0.01)
    return real_prepare(translator, body, *args)


command.server_translator = faulty_loader
serve_app.prepare_body = held_prepare
main = command.main

sys.exit(main(sys.argv[1:]))
"""


class ServerProcess:
    """A real server process (see the module docstring). Use as a context manager or call `stop()`."""

    def __init__(self, args: list[str], faults: bool = False, env: dict | None = None, startup_timeout: float = 180):
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="hf-variants-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-c", FAULTS_PRELUDE] if faults else [sys.executable, "-m", "hf_variants.serve"]
        child_env = {**os.environ, **(env or {})}
        self.process = subprocess.Popen(
            [*command, "--port", "0", *args],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=REPO_ROOT,
        )
        self.url = self._read_url(startup_timeout)

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def wait_for_log(self, text: str, count: int = 1, timeout: float = 120) -> str:
        """Wait until the log holds `text` at least `count` times (the server wrote it); the log."""
        deadline = time.monotonic() + timeout
        while (log := self.log()).count(text) < count:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{log[-4000:]}")
            assert time.monotonic() < deadline, f"{text!r} not logged {count} times in {timeout} s:\n{log[-4000:]}"
            time.sleep(0.02)
        return log

    def _read_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"listening on (http://\S+) ", self.log())
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"the server did not start listening in {timeout} s:\n{self.log()[-4000:]}")

    def wait_ready(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200:
                    return response.json()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready in {timeout} s:\n{self.log()[-4000:]}")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 120), **kwargs)

    def terminate(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()
        os.unlink(self.log_file.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def metric_values(text: str) -> dict[str, float]:
    """`{'name{labels}': value}` of a Prometheus text exposition (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
