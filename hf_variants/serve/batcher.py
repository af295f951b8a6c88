"""Dynamic batching: the sentences of concurrent requests are decoded together, in one batching decision.

Every HTTP request becomes a job: its sentences (tokenized once, `Translator.encode`: their token counts and ids
travel with them), one set of resolved decoding options, and their batch key (the options; requests of equal keys
form a settings group). A batch holds the sentences of one group; the engine decodes it as it was taken
(`Translator.decode_batch`: nothing is sorted, re-batched, checked or tokenized again).

Scheduling, on the event loop's thread (all queue state lives there; the engines run in their own threads):

1. **Groups, round robin.** Groups with sentences waiting are served in turn (least recently served first), so a
   group of other settings never waits behind a busy one for more than one batch of each group ahead of it.
2. **Lanes.** Each engine worker (`--workers`, one model each) decodes up to `concurrent_batches` batches at once,
   each of another group (the engine threads release the GIL while decoding): a request of other settings starts
   beside a long batch instead of waiting for it to end. One group's batches follow one another on a worker (its
   waiting sentences join the next batch). A batch that samples decodes alone on its worker (torch's random
   generator is one per process, and `seed` must give the same samples).
3. **When.** A group's batch is due once its waiting sentences fill `max_batch_tokens` padded tokens, or
   `max_wait_ms` after its oldest waiting sentence arrived and after its last batch ended (the clients just answered
   may send their next sentence: they join instead of being left for a batch of their own), or as soon as as many
   requests arrived since its last batch ended as that batch answered (the answered clients are back: no one else is
   waited for).
4. **What.** The sentences of a group's jobs in arrival order, one sentence of each job in turn (a request of many
   sentences cannot hold back a later request of one: that one is in the next batch), each job's own sentences
   shortest first, while the padded size (longest sentence x sentences) stays within `max_batch_tokens`; the first
   sentence always fits (the per-sentence limit caps it).

A request waits for its first batch at most `max_wait_ms` plus one batch of its own group per worker, when no more
than `concurrent_batches` groups have work; with more groups, plus one batch of each group ahead of it in the round.

Cancellation: a job that times out or whose client leaves is withdrawn: its sentences not yet taken leave the queue;
a running batch all of whose jobs are withdrawn stops at its next decoding step (`decode_batch(cancelled=...)`:
a stopping criterion of generate(), the ONNX Runtime bound search's flag, CTranslate2's greedy callback); a batch
shared with requests still waiting runs on and the withdrawn rows' results are dropped (dropping rows mid-search
would change what int8 engines give their neighbours). An exception of the engine fails the jobs of that batch
(their other sentences leave the queue too); the other jobs and the server go on. `abort()` (the end of a drain)
fails every job still queued or decoding with `ShuttingDown` and stops the running batches at their next step.
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

from ..inference.requests import DecodingCancelled

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds too many sentences to take this request; `retry_after` is the suggested wait in seconds."""

    def __init__(self, queued: int, limit: int, retry_after: int):
        super().__init__(f"{queued} sentences are waiting and the queue holds at most {limit}")
        self.queued, self.limit, self.retry_after = queued, limit, retry_after


class ShuttingDown(Exception):
    """The batcher stopped (or aborted a drain) before the request was decoded."""


class EngineError(Exception):
    """The engine raised while decoding the batch that held this request's sentences; `error` is what it raised."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@dataclass(eq=False)
class Job:
    """One request: its sentences (`requests`), their token counts, its decoding options and batch key, whether
    it samples (`exclusive`: decoded alone on its worker) and its request id (logs)."""

    requests: Sequence[Any]
    lengths: Sequence[int]
    options: Any
    key: Any
    future: asyncio.Future
    exclusive: bool = False
    request_id: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    results: list = field(init=False)
    order: list[int] = field(init=False)  # sentence indexes, shortest first
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

    def pending_tokens(self) -> int:
        return sum(self.lengths[i] for i in self.order[self.taken :])


@dataclass(eq=False)
class Group:
    """The jobs of one batch key with sentences not yet in a batch, in arrival order."""

    key: Any
    jobs: collections.deque = field(default_factory=collections.deque)
    pending: int = 0
    pending_tokens: int = 0

    @property
    def exclusive(self) -> bool:
        return bool(self.jobs) and self.jobs[0].exclusive


@dataclass(eq=False)
class Batch:
    """A batch taken from the queue: (job, sentence index) pairs, its padded size in tokens, its group's key, and
    the lane (`Lane`) decoding it."""

    items: list[tuple[Job, int]]
    padded_tokens: int
    tokens: int
    key: Any = None
    exclusive: bool = False
    lane: Any = None
    aborted: bool = False

    @property
    def jobs(self) -> list[Job]:
        return list({id(job): job for job, _ in self.items}.values())

    def cancelled(self) -> bool:
        """Whether nobody waits for this batch any more (every job withdrawn, or the batcher aborted): asked by the
        engine's thread at every decoding step."""
        return self.aborted or all(job.withdrawn for job, _ in self.items)


@dataclass(eq=False)
class Lane:
    """One batch at a time of one worker: its own thread and translator (sharing the worker's model)."""

    worker: int
    index: int
    translator: Any
    executor: ThreadPoolExecutor
    batch: Batch | None = None


def lane_translator(translator, parallel: bool = True):
    """A translator sharing `translator`'s model for another thread (`Translator.fork`: its own copy of the
    tokenizer; `parallel`: it decodes at the same time); `translator` itself when it cannot fork."""
    fork = getattr(translator, "fork", None)
    return fork(parallel=parallel) if callable(fork) else translator


class Batcher:
    """Decode the sentences of concurrent requests in shared batches (see the module docstring).

    `workers` engine workers, each with its own translator (`start(load)`), one with `decode_batch(requests,
    options, *, cancelled=None)` returning one result per request in order (the translation core's `Translator`);
    `concurrent_batches` lanes per worker. `on_batch(batch, seconds, error)` is called on the event loop after every
    batch (metrics; `error` a `DecodingCancelled` for a stopped batch).
    """

    def __init__(
        self,
        workers: int,
        *,
        max_batch_tokens: int,
        max_wait_ms: float,
        max_queue: int,
        concurrent_batches: int = 2,
        on_batch: Callable[[Batch, float, BaseException | None], None] | None = None,
    ):
        if workers < 1 or concurrent_batches < 1:
            raise ValueError(f"the batcher needs a worker and a lane, got {workers} and {concurrent_batches}")
        self.workers, self.concurrent_batches = workers, concurrent_batches
        self.translators: list = []
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.on_batch = on_batch
        self._groups: dict[Any, Group] = {}  # by key: the groups with sentences waiting
        self._last_done: dict[Any, float] = {}  # when each key's last batch ended
        self._served: dict[Any, int] = {}  # each key's last turn (the round robin: least recently served first)
        self._answered: dict[Any, int] = {}  # requests each key's last batch answered
        self._since: dict[Any, int] = {}  # requests of each key that arrived after its last batch ended
        self._turn = 0
        self._queued = 0  # sentences not yet in a batch
        self._lanes: list[Lane] = []
        self._changed: asyncio.Condition | None = None
        self._tasks: list[asyncio.Task] = []
        self._accepting = False
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
        return sum(lane.batch is not None for lane in self._lanes)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        return not self._queued and not self.running

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
        """Build worker i's translator with `load(i)` in that worker's first lane's thread (where it will decode:
        thread settings such as torch's stay with it), its other lanes' translators from it (`lane_translator`),
        then start the lanes on the running event loop."""
        loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()
        for worker in range(self.workers):
            executors = [
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hf-variants-serve-engine-{worker}.{lane}")
                for lane in range(self.concurrent_batches)
            ]
            translator = await loop.run_in_executor(executors[0], load, worker)
            self.translators.append(translator)
            for lane, executor in enumerate(executors):
                own = translator if lane == 0 else await loop.run_in_executor(executor, lane_translator, translator)
                self._lanes.append(Lane(worker, lane, own, executor))
        self._accepting = True
        for lane in self._lanes:
            self._tasks.append(asyncio.create_task(self._work(lane), name=f"batcher-{lane.worker}.{lane.index}"))

    async def run_in_worker(self, i: int, function: Callable, *args) -> Any:
        """Run `function(translator_i, *args)` in worker i's first lane's thread (loading checks, warm-up)."""
        lane = next(lane for lane in self._lanes if lane.worker == i and lane.index == 0)
        return await asyncio.get_running_loop().run_in_executor(lane.executor, function, lane.translator, *args)

    def close(self) -> None:
        """Take no new request (`translate` raises ShuttingDown); what is queued or decoding goes on (a drain)."""
        self._accepting = False

    async def drained(self, timeout: float) -> bool:
        """Wait until nothing is queued or decoding, at most `timeout` seconds; whether it got there."""
        deadline = time.monotonic() + timeout
        async with self._changed:
            while not self.idle:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return self.idle
        return True

    async def abort(self) -> None:
        """Fail every queued job with ShuttingDown and stop the running batches at their next decoding step (their
        jobs fail with ShuttingDown too)."""
        self._accepting = False
        for group in list(self._groups.values()):
            for job in list(group.jobs):
                self._fail(job, ShuttingDown("the server is stopping"))
        for lane in self._lanes:
            if lane.batch is not None:
                lane.batch.aborted = True
                for job in lane.batch.jobs:
                    self._fail(job, ShuttingDown("the server is stopping"))
        await self._notify()

    async def stop(self) -> None:
        """Abort what is left, wait for the lanes to stop, shut their threads down."""
        await self.abort()
        self._stopping = True
        await self._notify()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for lane in self._lanes:
            lane.executor.shutdown(wait=False, cancel_futures=True)

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    # -------------------------------------------------------------------------------------------- requests
    async def translate(
        self,
        requests: Sequence[Any],
        lengths: Sequence[int],
        options: Any,
        key: Any,
        timeout: float | None = None,
        *,
        exclusive: bool = False,
        request_id: str | None = None,
    ) -> list:
        """Queue `requests` (with their token counts) for decoding with `options` (sentences of equal `key` may
        share a batch; `exclusive`: a batch of them decodes alone on its worker); return their results in order.
        Raises QueueFull before queueing, asyncio.TimeoutError after `timeout` seconds, EngineError when the engine
        failed on one of its batches, ShuttingDown."""
        if not self._accepting or self._changed is None:
            raise ShuttingDown("the server is stopping")
        if self._queued + len(requests) > self.max_queue:
            raise QueueFull(self._queued, self.max_queue, self.retry_after())
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        job = Job(requests, lengths, options, key, loop.create_future(), exclusive, request_id)
        group = self._groups.setdefault(key, Group(key))
        group.jobs.append(job)
        if key in self._last_done and not self._running_key(key):
            self._since[key] = self._since.get(key, 0) + 1
        group.pending += len(requests)
        group.pending_tokens += sum(lengths)
        self._queued += len(requests)
        await self._notify()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except BaseException:  # timeout, the client left (cancelled), an engine error: withdraw what is left
            await self._withdraw(job)
            raise

    def _unqueue(self, job: Job) -> None:
        """`job`'s sentences not yet taken leave the queue."""
        group = self._groups.get(job.key)
        if job.pending and group is not None:
            group.pending -= job.pending
            group.pending_tokens -= job.pending_tokens()
            self._queued -= job.pending
        job.taken = len(job.order)
        if group is not None and job in group.jobs:
            group.jobs.remove(job)
            if not group.jobs:
                del self._groups[job.key]

    async def _withdraw(self, job: Job) -> None:
        job.withdrawn = True
        self._unqueue(job)
        await self._notify()

    def _fail(self, job: Job, error: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(error)
        job.withdrawn = True
        self._unqueue(job)

    # ------------------------------------------------------------------------------------------ the choice
    def _due_at(self, group: Group) -> float:
        """When `group`'s next batch is due: now when it fills a batch, else max_wait after its oldest sentence
        arrived and after its last batch ended."""
        key = group.key
        if group.pending_tokens >= self.max_batch_tokens:
            return -math.inf
        if 0 < self._answered.get(key, 0) <= self._since.get(key, 0):  # the clients it answered are back
            return -math.inf
        return max(group.jobs[0].arrived, self._last_done.get(key, -math.inf)) + self.max_wait

    def _allowed(self, lane: Lane, group: Group) -> bool:
        """Whether `lane` may decode `group` now: its worker decodes no batch of that key, none that samples, and
        (for a group that samples) nothing else."""
        others = [other.batch for other in self._lanes if other.worker == lane.worker and other.batch is not None]
        if any(batch.key == group.key or batch.exclusive for batch in others):
            return False
        return not (group.exclusive and others)

    def _choose(self, lane: Lane, now: float) -> tuple[Group | None, float | None]:
        """The group `lane` decodes next (the least recently served due one it may take) or None and when to look
        again (None: at the next change)."""
        wake = None
        for group in sorted(self._groups.values(), key=lambda g: self._served.get(g.key, -1)):
            if not group.pending or not self._allowed(lane, group):
                continue
            due = self._due_at(group)
            if due <= now:
                return group, None
            wake = due if wake is None else min(wake, due)
        return None, wake

    async def _next_batch(self, lane: Lane) -> Batch | None:
        """Wait until `lane` may take a due batch and take it; None when stopping."""
        async with self._changed:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                group, wake = self._choose(lane, now)
                if group is not None:
                    batch = self._take(group)
                    batch.lane, lane.batch = lane, batch
                    self._changed.notify_all()  # what this batch left may be due at once for another lane
                    return batch
                try:
                    await asyncio.wait_for(self._changed.wait(), None if wake is None else max(0.0, wake - now))
                except asyncio.TimeoutError:
                    pass

    def _take(self, group: Group) -> Batch:
        items: list[tuple[Job, int]] = []
        longest = tokens = 0
        active = list(group.jobs)
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
        group.pending -= len(items)
        group.pending_tokens -= tokens
        self._queued -= len(items)
        for job in [job for job in group.jobs if not job.pending]:
            group.jobs.remove(job)
        if not group.jobs:
            del self._groups[group.key]
        self._turn += 1
        self._served[group.key] = self._turn  # served: to the end of the round
        return Batch(items, longest * len(items), tokens, group.key, any(job.exclusive for job, _ in items))

    # ------------------------------------------------------------------------------------------ the lanes
    async def _work(self, lane: Lane) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch(lane)
            if batch is None:
                return
            requests = [job.requests[i] for job, i in batch.items]
            options = batch.items[0][0].options
            start = time.monotonic()
            results, error = None, None
            try:
                results = await loop.run_in_executor(
                    lane.executor,
                    lambda: lane.translator.decode_batch(requests, options, cancelled=batch.cancelled),
                )
                if len(results) != len(requests):
                    raise RuntimeError(f"the engine returned {len(results)} results for {len(requests)} sentences")
            except DecodingCancelled as cancelled:
                error = cancelled
            except Exception as exc:  # one failed batch fails its requests, not the server
                error = exc
                ids = ", ".join(sorted({job.request_id for job in batch.jobs if job.request_id}))
                logger.exception(
                    "The engine failed on a batch of %d sentences%s",
                    len(requests),
                    f" (requests {ids})" if ids else "",
                )
            finally:
                lane.batch = None
                self._last_done[batch.key] = time.monotonic()
                self._since[batch.key] = 0
            self._finish(batch, results, error)
            if self.on_batch is not None:
                self.on_batch(batch, time.monotonic() - start, error)
            await self._notify()

    def _running_key(self, key) -> bool:
        return any(lane.batch is not None and lane.batch.key == key for lane in self._lanes)

    def _finish(self, batch: Batch, results: list | None, error: BaseException | None) -> None:
        """Route each result to its job and slot (answer a job once its last sentence is back), or fail the jobs of
        a failed batch; a stopped batch's jobs were already answered (withdrawn or aborted)."""
        now = time.monotonic()
        self._answered[batch.key] = 0
        for key, done in list(self._last_done.items()):  # keys whose last batch is past any wait, with none waiting
            if now - done > self.max_wait and key not in self._groups and not self._running_key(key):
                del self._last_done[key]
                for state in (self._served, self._answered, self._since):
                    state.pop(key, None)
        if isinstance(error, DecodingCancelled):
            for job in batch.jobs:
                if not job.future.done():  # cancelled with a job still waiting: cannot be, but never leave it hanging
                    self._fail(job, ShuttingDown("the decoding was stopped"))
            return
        if error is not None:
            for job in batch.jobs:
                self._fail(job, EngineError(error))
            return
        self._done_times.append((now, len(results)))
        answered = 0
        for (job, i), result in zip(batch.items, results):
            job.results[i] = result
            job.remaining -= 1
            if job.remaining == 0 and not job.future.done():
                job.future.set_result(job.results)
                answered += 1
        self._answered[batch.key] = answered
