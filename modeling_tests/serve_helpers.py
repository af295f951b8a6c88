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

# Sentences beginning with "SLOW " make their batch take FAULT_DELAY seconds more; a sentence holding "CRASH" makes
# the engine raise on its batch; FAULT_LOAD_DELAY seconds are added to the loading of each worker.
FAULTS_PRELUDE = """
import os, sys, time
import hf_variants.commands.serve as command

real_loader = command.server_translator


class FaultyTranslator:
    def __init__(self, translator):
        self.translator = translator

    def __getattr__(self, name):
        return getattr(self.translator, name)

    def translate(self, requests, options=None, **kwargs):
        if any("CRASH" in r.source for r in requests):
            raise RuntimeError("injected engine fault")
        if any(r.source.startswith("SLOW ") for r in requests):
            time.sleep(float(os.environ.get("FAULT_DELAY", "2")))
        return self.translator.translate(requests, options, **kwargs)


def faulty_loader(location, settings):
    time.sleep(float(os.environ.get("FAULT_LOAD_DELAY", "0")))
    return FaultyTranslator(real_loader(location, settings))


command.server_translator = faulty_loader
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
