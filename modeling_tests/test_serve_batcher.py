"""The server's dynamic batcher (`hf_variants.serve.batcher`) on a recording stand-in engine: answers routed back to
their requests in order under concurrency, batches by padded tokens, a long request not starving a later short
one, a request's sentences shortest first, options never mixed in one batch, waiting for company at most
max_wait_ms, withdrawal of timed-out requests, a failed batch failing only its requests, the full queue.

The engine here is a stand-in on purpose: these are properties of the scheduling, checked batch by batch; the
real engines behind the real server are `test_serve.py` and `test_serve_engines.py`."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest

from hf_variants.serve.batcher import Batcher, EngineError, QueueFull


class RecordingTranslator:
    """Answers each source upper-cased; records every batch (sources, options) and the time it started."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.batches: list[tuple[list[str], object]] = []
        self.lock = threading.Lock()

    def translate(self, requests, options, *, max_tokens=None):
        with self.lock:
            self.batches.append(([r.source for r in requests], options))
        if any("CRASH" in r.source for r in requests):
            raise RuntimeError("injected fault")
        if self.delay:
            time.sleep(self.delay)
        return [SimpleNamespace(source=r.source, text=r.source.upper()) for r in requests]


def request(text: str):
    return SimpleNamespace(source=text)


def run(coroutine):
    return asyncio.run(coroutine)


async def started(translator, workers=1, **settings) -> Batcher:
    settings = {"max_batch_tokens": 1000, "max_wait_ms": 5, "max_queue": 1000, **settings}
    batcher = Batcher(workers, **settings)
    await batcher.start(lambda i: translator)
    return batcher


def test_concurrent_requests_get_their_own_answers_in_order():
    translator = RecordingTranslator(delay=0.002)
    rng = random.Random(0)
    jobs = [[f"job{j} sentence {i} " + "x" * rng.randrange(20) for i in range(rng.randrange(1, 6))] for j in range(40)]

    async def main():
        batcher = await started(translator, workers=2, max_batch_tokens=60, max_wait_ms=20)

        async def client(sentences):
            await asyncio.sleep(rng.random() * 0.05)
            lengths = [len(s) // 4 for s in sentences]
            return await batcher.translate([request(s) for s in sentences], lengths, "options", "key", timeout=30)

        results = await asyncio.gather(*(client(sentences) for sentences in jobs))
        await batcher.stop()
        return results

    results = run(main())
    for sentences, answer in zip(jobs, results):
        assert [r.text for r in answer] == [s.upper() for s in sentences]
    assert sum(len(sources) for sources, _ in translator.batches) == sum(map(len, jobs))  # each sentence once
    mixed = [b for b, _ in translator.batches if len({s.split()[0] for s in b}) > 1]
    assert mixed, "no batch held sentences of two requests"


def test_batches_respect_the_padded_token_budget_and_go_shortest_first_within_a_request():
    translator = RecordingTranslator()
    sentences = ["a" * 50, "b" * 5, "c" * 30, "d" * 10]

    async def main():
        batcher = await started(translator, max_batch_tokens=60)
        out = await batcher.translate([request(s) for s in sentences], [len(s) for s in sentences], "o", "k")
        await batcher.stop()
        return out

    out = run(main())
    assert [r.text for r in out] == [s.upper() for s in sentences]  # order restored
    # shortest first; a batch holds what fits in 60 padded tokens (longest x sentences): 10 x 2, then 30, then 50
    assert [b for b, _ in translator.batches] == [["b" * 5, "d" * 10], ["c" * 30], ["a" * 50]]


def test_a_long_request_does_not_starve_a_later_short_one():
    translator = RecordingTranslator(delay=0.15)
    long_request = [f"long {i:02d}" for i in range(40)]

    async def main():
        batcher = await started(translator, max_batch_tokens=50, max_wait_ms=0)  # 5 sentences of 10 tokens a batch
        lengths = [10] * len(long_request)
        long_task = asyncio.create_task(batcher.translate([request(s) for s in long_request], lengths, "o", "k"))
        await asyncio.sleep(0.05)  # the first batch of the long request is decoding
        short = await batcher.translate([request("short")], [10], "o", "k")
        long_still_running = not long_task.done()
        await long_task
        await batcher.stop()
        return short, long_still_running

    short, long_still_running = run(main())
    assert short[0].text == "SHORT" and long_still_running
    assert "short" in translator.batches[1][0]  # in the first batch taken after it arrived
    assert len(translator.batches) == 9  # the long request's 40 sentences: 8 batches of 5, plus one


def test_requests_with_other_options_never_share_a_batch():
    translator = RecordingTranslator(delay=0.05)

    async def main():
        batcher = await started(translator, max_wait_ms=50)
        calls = [
            batcher.translate([request(f"{key} {i}")], [3], f"options-{key}", key)
            for i in range(6)
            for key in ("beam", "greedy")
        ]
        await asyncio.gather(*calls)
        await batcher.stop()

    run(main())
    for sources, options in translator.batches:
        assert {s.split()[0] for s in sources} == {options.split("-")[1]}
    assert len(translator.batches) < 12  # requests of equal options did share batches


def test_an_idle_worker_waits_max_wait_ms_for_company():
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator, max_wait_ms=300)
        first = asyncio.create_task(batcher.translate([request("one")], [3], "o", "k"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(batcher.translate([request("two")], [3], "o", "k"))
        start = time.monotonic()
        await asyncio.gather(first, second)
        waited = time.monotonic() - start
        await batcher.stop()
        return waited

    waited = run(main())
    assert [b for b, _ in translator.batches] == [["one", "two"]]
    assert waited < 2.0


def test_a_full_batch_does_not_wait():
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator, max_wait_ms=10_000, max_batch_tokens=20)
        start = time.monotonic()
        await batcher.translate([request("a"), request("b")], [10, 10], "o", "k")
        elapsed = time.monotonic() - start
        await batcher.stop()
        return elapsed

    assert run(main()) < 5.0  # 20 pending tokens fill the budget: no 10 s wait


def test_a_timed_out_request_leaves_the_queue():
    translator = RecordingTranslator(delay=0.4)

    async def main():
        batcher = await started(translator, max_wait_ms=0, max_batch_tokens=10)
        busy = asyncio.create_task(batcher.translate([request("busy")], [10], "o", "k"))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await batcher.translate([request(f"late {i}") for i in range(3)], [10] * 3, "o", "k", timeout=0.1)
        assert batcher.queued == 0
        await busy
        after = await batcher.translate([request("after")], [10], "o", "k")
        await batcher.stop()
        return after

    assert run(main())[0].text == "AFTER"
    decoded = [s for batch, _ in translator.batches for s in batch]
    assert decoded == ["busy", "after"]  # the timed-out sentences never reached the engine


def test_an_engine_error_fails_only_the_requests_of_that_batch():
    translator = RecordingTranslator(delay=0.05)

    async def main():
        batcher = await started(translator, max_wait_ms=100, max_batch_tokens=30)
        crash = batcher.translate([request("CRASH here")], [10], "o", "k")
        neighbour = batcher.translate([request("neighbour")], [10], "o", "k")
        results = await asyncio.gather(crash, neighbour, return_exceptions=True)
        later = await batcher.translate([request("later")], [10], "o", "k")
        await batcher.stop()
        return results, later

    (crash, neighbour), later = run(main())
    assert isinstance(crash, EngineError) and "RuntimeError: injected fault" in str(crash)
    assert isinstance(neighbour, EngineError)  # it shared the failed batch
    assert translator.batches[0][0] == ["CRASH here", "neighbour"]
    assert later[0].text == "LATER"


def test_a_full_queue_refuses_at_once_with_a_retry_delay():
    translator = RecordingTranslator(delay=0.3)

    async def main():
        batcher = await started(translator, max_wait_ms=0, max_batch_tokens=10, max_queue=3)
        busy = asyncio.create_task(batcher.translate([request("busy")], [10], "o", "k"))
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(batcher.translate([request("w1"), request("w2")], [10, 10], "o", "k"))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as full:
            await batcher.translate([request("x"), request("y")], [10, 10], "o", "k")
        await asyncio.gather(busy, waiting)
        await batcher.stop()
        return full.value

    full = run(main())
    assert (full.queued, full.limit) == (2, 3) and full.retry_after >= 1
