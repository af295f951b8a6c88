"""Dynamic batching: the sentences of concurrent requests are decoded together.

Every HTTP request becomes a job (its sentences, their token counts, one set of decoding options). Each engine
worker (`--workers`, one translator each, decoding one batch at a time in its own thread) runs this loop:

1. Wait for work. The oldest job with sentences left decides when and what: once it arrives, the worker waits at
   most `max_wait_ms` for more sentences with the same options (less when the pending ones already fill a batch);
   a worker that was busy finds the oldest job past that wait and starts at once.
2. Take a batch of sentences with the oldest job's options, round-robin over the jobs in arrival order (one sentence
   of each in turn), so a request of many sentences cannot hold back a later request of one: that one is in the next
   batch. A job's own sentences go by length, so consecutive batches of a long request hold similar lengths.
   Sentences are added while the padded size (longest sentence x sentences) stays within `max_batch_tokens`; the
   first sentence always fits (the per-sentence limit caps it).
3. Decode the batch (the translation core sorts it by length and restores the order), route each result back to its
   job and slot, and answer a job when its last sentence is back.

A job that times out or whose client leaves is withdrawn: its sentences not yet taken leave the queue, and results
of a batch already running are dropped. An exception of the engine fails the jobs of that batch (their other
sentences leave the queue too); the other jobs and the server go on.

All queue state lives on the event loop's thread; the engines run in one thread per worker (`run_in_executor`), so
nothing here needs a lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds too many sentences to take this request; `retry_after` is the suggested wait in seconds."""

    def __init__(self, queued: int, limit: int, retry_after: int):
        super().__init__(f"{queued} sentences are waiting and the queue holds at most {limit}")
        self.queued, self.limit, self.retry_after = queued, limit, retry_after


class ShuttingDown(Exception):
    """The batcher stopped before the request was decoded."""


class EngineError(Exception):
    """The engine raised while decoding the batch that held this request's sentences; `error` is what it raised."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@dataclass(eq=False)
class Job:
    """One request: its sentences (`requests`), their token counts, its decoding options and the batch key."""

    requests: Sequence[Any]
    lengths: Sequence[int]
    options: Any
    key: Any
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    results: list = field(init=False)
    order: list[int] = field(init=False)  # pending sentence indexes, shortest first
    taken: int = 0  # sentences of `order` already in a batch
    remaining: int = field(init=False)  # sentences not answered yet
    withdrawn: bool = False

    def __post_init__(self):
        self.results = [None] * len(self.requests)
        self.order = sorted(range(len(self.requests)), key=lambda i: self.lengths[i])
        self.remaining = len(self.requests)

    @property
    def pending(self) -> int:
        return len(self.order) - self.taken


@dataclass
class Batch:
    """A batch taken from the queue: (job, sentence index) pairs and its padded size in tokens."""

    items: list[tuple[Job, int]]
    padded_tokens: int
    tokens: int


class Batcher:
    """Decode the sentences of concurrent requests in shared batches.

    `workers` engine workers, each with its own translator (`start(load)`), one with `translate(requests, options,
    *, max_tokens=...)` returning one result per request in input order (the translation core's `Translator`).
    `on_batch(batch, seconds, error)` is called on the event loop after every batch (metrics).
    """

    def __init__(
        self,
        workers: int,
        *,
        max_batch_tokens: int,
        max_wait_ms: float,
        max_queue: int,
        on_batch: Callable[[Batch, float, BaseException | None], None] | None = None,
    ):
        if workers < 1:
            raise ValueError(f"the batcher needs at least one worker, got {workers}")
        self.workers = workers
        self.translators: list = []
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.on_batch = on_batch
        self._jobs: collections.deque[Job] = collections.deque()  # jobs with sentences not yet in a batch
        self._queued = 0  # sentences not yet in a batch
        self._running = 0  # batches being decoded
        self._changed: asyncio.Condition | None = None
        self._workers: list[asyncio.Task] = []
        self._executors: list[ThreadPoolExecutor] = []
        self._stopping = False
        self._done_times: collections.deque[tuple[float, int]] = collections.deque()  # (time, sentences) of batches

    # ----------------------------------------------------------------------------------------------- state
    @property
    def queued(self) -> int:
        """Sentences waiting for a batch."""
        return self._queued

    @property
    def running(self) -> int:
        """Batches being decoded now."""
        return self._running

    def sentences_per_second(self, window: float = 60.0) -> float:
        """Sentences decoded per second over the last `window` seconds (0 before the first batch)."""
        now = time.monotonic()
        while self._done_times and self._done_times[0][0] < now - window:
            self._done_times.popleft()
        if not self._done_times:
            return 0.0
        span = max(now - self._done_times[0][0], 1.0)
        return sum(n for _, n in self._done_times) / span

    def retry_after(self) -> int:
        """Seconds until the queue should have room again, from the recent throughput (1 to 60)."""
        rate = self.sentences_per_second()
        return 1 if rate <= 0 else max(1, min(60, math.ceil(self._queued / rate)))

    # ------------------------------------------------------------------------------------------- lifecycle
    async def start(self, load: Callable[[int], Any]) -> None:
        """Build worker i's translator with `load(i)` in that worker's own thread (where it will decode: thread
        settings such as torch's stay with it), then start the workers on the running event loop."""
        loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()
        for i in range(self.workers):
            self._executors.append(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hf-variants-serve-engine-{i}")
            )
        for i, executor in enumerate(self._executors):
            self.translators.append(await loop.run_in_executor(executor, load, i))
        for i, (translator, executor) in enumerate(zip(self.translators, self._executors)):
            self._workers.append(asyncio.create_task(self._work(translator, executor), name=f"batcher-worker-{i}"))

    async def run_in_worker(self, i: int, function: Callable, *args) -> Any:
        """Run `function(translator_i, *args)` in worker i's thread (loading checks, warm-up)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executors[i], function, self.translators[i], *args)

    async def stop(self) -> None:
        """Fail what is still queued (ShuttingDown), let running batches finish, stop the workers."""
        self._stopping = True
        while self._jobs:
            job = self._jobs.popleft()
            self._queued -= job.pending
            job.taken = len(job.order)
            if not job.future.done():
                job.future.set_exception(ShuttingDown("the server is stopping"))
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------------------------------------- requests
    async def translate(
        self, requests: Sequence[Any], lengths: Sequence[int], options: Any, key: Any, timeout: float | None = None
    ) -> list:
        """Queue `requests` (with their token counts) for decoding with `options` (sentences of equal `key` may share
        a batch); return their results in order. Raises QueueFull before queueing, asyncio.TimeoutError after
        `timeout` seconds, EngineError when the engine failed on one of its batches, ShuttingDown."""
        if self._stopping or self._changed is None:
            raise ShuttingDown("the server is stopping")
        if self._queued + len(requests) > self.max_queue:
            raise QueueFull(self._queued, self.max_queue, self.retry_after())
        if not requests:
            return []
        job = Job(requests, lengths, options, key, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        self._queued += len(requests)
        async with self._changed:
            self._changed.notify_all()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except BaseException:  # timeout, the client left (cancelled), an engine error: withdraw what is left
            await self._withdraw(job)
            raise

    async def _withdraw(self, job: Job) -> None:
        job.withdrawn = True
        if job.pending:
            self._queued -= job.pending
            job.taken = len(job.order)
        if job in self._jobs:
            self._jobs.remove(job)
            async with self._changed:
                self._changed.notify_all()

    # ------------------------------------------------------------------------------------------ the workers
    def _pending_tokens(self, key) -> int:
        return sum(job.lengths[i] for job in self._jobs if job.key == key for i in job.order[job.taken :])

    async def _next_batch(self) -> Batch | None:
        """Wait until a batch is due (see the module docstring) and take it; None when stopping."""
        async with self._changed:
            while True:
                await self._changed.wait_for(lambda: self._jobs or self._stopping)
                if self._stopping:
                    return None
                oldest = self._jobs[0]
                due = oldest.arrived + self.max_wait
                while (
                    oldest in self._jobs
                    and not self._stopping
                    and self._pending_tokens(oldest.key) < self.max_batch_tokens
                    and (wait := due - time.monotonic()) > 0
                ):
                    try:
                        await asyncio.wait_for(self._changed.wait(), wait)
                    except asyncio.TimeoutError:
                        break
                if self._stopping:
                    return None
                if oldest not in self._jobs:  # taken by another worker or withdrawn meanwhile
                    continue
                batch = self._take(oldest.key)
                self._changed.notify_all()  # what this batch left is due at once: another idle worker may take it
                return batch

    def _take(self, key) -> Batch:
        items: list[tuple[Job, int]] = []
        longest = tokens = 0
        active = [job for job in self._jobs if job.key == key]
        while active:
            still = []
            for job in active:
                i = job.order[job.taken]
                length = job.lengths[i]
                if items and max(longest, length) * (len(items) + 1) > self.max_batch_tokens:
                    continue  # this job's next sentence does not fit: it waits for a later batch
                items.append((job, i))
                job.taken += 1
                longest, tokens = max(longest, length), tokens + length
                if job.pending:
                    still.append(job)
            active = still
        self._queued -= len(items)
        for job in {id(job): job for job, _ in items}.values():
            if not job.pending:
                self._jobs.remove(job)
        return Batch(items, longest * len(items), tokens)

    async def _work(self, translator, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            jobs = list({id(job): job for job, _ in batch.items}.values())
            options = jobs[0].options
            requests = [job.requests[i] for job, i in batch.items]
            self._running += 1
            start = time.monotonic()
            error = None
            try:
                results = await loop.run_in_executor(
                    executor, lambda: translator.translate(requests, options, max_tokens=self.max_batch_tokens)
                )
                if len(results) != len(requests):
                    raise RuntimeError(f"the engine returned {len(results)} results for {len(requests)} sentences")
            except Exception as exc:  # one failed batch fails its requests, not the server
                error = exc
                logger.exception("The engine failed on a batch of %d sentences", len(requests))
            finally:
                self._running -= 1
            seconds = time.monotonic() - start
            if error is None:
                self._done_times.append((time.monotonic(), len(requests)))
                for (job, i), result in zip(batch.items, results):
                    job.results[i] = result
                    job.remaining -= 1
                    if job.remaining == 0 and not job.future.done():
                        job.future.set_result(job.results)
            else:
                for job in jobs:
                    if not job.withdrawn and not job.future.done():
                        job.future.set_exception(EngineError(error))
                    await self._withdraw(job)
            if self.on_batch is not None:
                self.on_batch(batch, seconds, error)
