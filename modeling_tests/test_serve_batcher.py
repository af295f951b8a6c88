"""The server's dynamic batcher (`hf_variants.serve.batcher`) on a recording stand-in engine: answers routed back to
their requests in order under concurrency, batches by padded tokens, a long request not starving a later short
one, a request's sentences shortest first, options never mixed in one batch, waiting for company at most
max_wait_ms (and after a group's batch, for the clients it answered), withdrawal of timed-out requests, a failed
batch failing only its requests, the full queue; settings groups served in turn and beside each other (no head-of-
line blocking), a batch stopped once nobody waits for it (and not while someone does), sampling batches alone,
the drain's abort.

The engine here is a stand-in on purpose: these are properties of the scheduling, checked batch by batch; the
real engines behind the real server are `test_serve.py` and `test_serve_engines.py`."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest

from hf_variants.inference.requests import DecodingCancelled
from hf_variants.serve.batcher import Batcher, EngineError, QueueFull, ShuttingDown


class RecordingTranslator:
    """Answers each source upper-cased; records every batch (sources, options). A batch holding a source that
    begins with "HOLD" waits until `release` is set, or stops once the batcher cancels it (`cancelled()`, asked as
    an engine asks it at every decoding step): `stopped` records the sources of the batches that stopped so."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.batches: list[tuple[list[str], object]] = []
        self.stopped: list[list[str]] = []
        self.release = threading.Event()
        self.holding = threading.Event()  # set while a HOLD batch waits
        self.lock = threading.Lock()

    def decode_batch(self, requests, options, *, cancelled=None):
        sources = [r.source for r in requests]
        with self.lock:
            self.batches.append((sources, options))
        if any("CRASH" in s for s in sources):
            raise RuntimeError("injected fault")
        if any(s.startswith("HOLD") for s in sources):
            self.holding.set()
            while not self.release.wait(0.005):
                if cancelled is not None and cancelled():
                    self.stopped.append(sources)
                    raise DecodingCancelled("stopped")
        if self.delay:
            time.sleep(self.delay)
        return [SimpleNamespace(source=s, text=s.upper()) for s in sources]


def request(text: str):
    return SimpleNamespace(source=text)


def run(coroutine):
    return asyncio.run(coroutine)


async def started(translator, workers=1, **settings) -> Batcher:
    settings = {"max_batch_tokens": 1000, "max_wait_ms": 5, "max_queue": 1000, "concurrent_batches": 1, **settings}
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


# ----------------------------------------------------------------------------------------- groups, lanes, stopping
def test_a_request_of_other_settings_decodes_beside_a_held_batch():
    """No head-of-line blocking: while a batch of one settings group is held (it never ends on its own), a request of
    other settings is answered, by the worker's second lane."""
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator, concurrent_batches=2)
        held = asyncio.create_task(batcher.translate([request("HOLD long")], [10], "beam", "beam"))
        await asyncio.to_thread(translator.holding.wait, 30)
        plain = await asyncio.wait_for(batcher.translate([request("plain")], [3], "greedy", "greedy"), 30)
        still_held = not held.done()
        translator.release.set()
        await held
        await batcher.stop()
        return plain, still_held

    plain, still_held = run(main())
    assert plain[0].text == "PLAIN" and still_held


def test_settings_groups_are_served_in_turn():
    """With one batch at a time, a request of other settings arriving while a long request decodes batch by batch is
    in the next batch, not after all of the long request's batches (the oldest request no longer decides)."""
    translator = RecordingTranslator()
    long_request = [f"HOLD long {i}" for i in range(8)]

    async def main():
        batcher = await started(translator, max_batch_tokens=10, max_wait_ms=0)  # one sentence a batch
        first = asyncio.create_task(batcher.translate([request(s) for s in long_request], [10] * 8, "a", "a"))
        await asyncio.to_thread(translator.holding.wait, 30)  # the long request's first batch decodes (held)
        other = asyncio.create_task(batcher.translate([request("other")], [10], "b", "b"))
        while batcher.queued < 8:  # 7 sentences of the long request and the other one wait
            await asyncio.sleep(0.005)
        translator.release.set()
        await asyncio.gather(first, other)
        await batcher.stop()
        return other.result()

    assert run(main())[0].text == "OTHER"
    assert [b for b, _ in translator.batches][1] == ["other"]


def test_a_batch_nobody_waits_for_stops_and_frees_the_engine():
    """A request withdrawn while its batch decodes (its client left; a timeout withdraws it the same way): the batch
    is cancelled at its next step (the engine's `cancelled()` turns true), and the next request of the same settings
    is decoded at once."""
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator)
        leaving = asyncio.create_task(batcher.translate([request("HOLD a"), request("HOLD b")], [5, 5], "o", "k"))
        await asyncio.to_thread(translator.holding.wait, 30)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        after = await asyncio.wait_for(batcher.translate([request("after")], [5], "o", "k"), 30)
        await batcher.stop()
        return after

    assert run(main())[0].text == "AFTER"
    assert translator.stopped == [["HOLD a", "HOLD b"]]


def test_a_batch_shared_with_a_waiting_request_runs_on():
    """Only one of the two requests sharing a held batch leaves: the batch is not stopped (the other still waits),
    and the other request gets its answer once the batch ends."""
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator, max_batch_tokens=10)  # the two requests fill a batch: taken at once
        leaving = asyncio.create_task(batcher.translate([request("HOLD x")], [5], "o", "k"))
        staying = asyncio.create_task(batcher.translate([request("HOLD y")], [5], "o", "k"))
        await asyncio.to_thread(translator.holding.wait, 30)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await asyncio.sleep(0.1)  # the engine asks cancelled() every 5 ms: it would have stopped by now
        translator.release.set()
        answer = await staying
        await batcher.stop()
        return answer

    assert run(main())[0].text == "HOLD Y"
    assert translator.stopped == [] and translator.batches[0][0] == ["HOLD x", "HOLD y"]


def test_abort_answers_the_queued_and_the_decoding_requests_and_stops_the_batch():
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator)
        running = asyncio.create_task(batcher.translate([request("HOLD run")], [5], "o", "k"))
        await asyncio.to_thread(translator.holding.wait, 30)
        queued = asyncio.create_task(batcher.translate([request("queued")], [5], "o", "k"))
        while batcher.queued == 0:
            await asyncio.sleep(0.005)
        batcher.close()
        with pytest.raises(ShuttingDown):
            await batcher.translate([request("new")], [5], "o", "k")
        assert not await batcher.drained(0.2)  # the held batch does not end by itself
        await batcher.abort()
        results = await asyncio.gather(running, queued, return_exceptions=True)
        while batcher.running:  # the lane notices the stop at the held batch's next check
            await asyncio.sleep(0.005)
        await batcher.stop()
        return results

    results = run(main())
    assert all(isinstance(r, ShuttingDown) for r in results)
    assert translator.stopped == [["HOLD run"]] and [b for b, _ in translator.batches] == [["HOLD run"]]


def test_a_sampling_batch_decodes_alone_on_its_worker():
    """torch's random generator is one per process: a batch that samples never runs beside another batch."""
    translator = RecordingTranslator()

    async def main():
        batcher = await started(translator, concurrent_batches=2)
        held = asyncio.create_task(batcher.translate([request("HOLD a")], [5], "beam", "beam"))
        await asyncio.to_thread(translator.holding.wait, 30)
        sampled = asyncio.create_task(batcher.translate([request("sampled")], [5], "sample", "sample", exclusive=True))
        await asyncio.sleep(0.3)
        started_beside = len(translator.batches) > 1
        translator.release.set()
        await asyncio.gather(held, sampled)
        await batcher.stop()
        return started_beside

    assert not run(main())
    assert [b for b, _ in translator.batches] == [["HOLD a"], ["sampled"]]


def test_the_clients_just_answered_join_the_next_batch():
    """A closed loop of 4 clients in step plus one client out of step (its request arrives while the others' batch
    decodes): the next batch waits max_wait_ms after the last one ended, so the 4 answered clients' next requests
    join the late one's instead of the two groups alternating in batches of 4 and 1."""
    translator = RecordingTranslator(delay=0.3)

    async def client(batcher, name: str, rounds: int, late: bool = False):
        while late and not translator.batches:  # the late client sends once the others' first batch decodes
            await asyncio.sleep(0.005)
        for i in range(rounds):
            await batcher.translate([request(f"{name}{i}")], [3], "o", "k")

    async def main():
        batcher = await started(translator, max_wait_ms=100, max_batch_tokens=15)  # 5 sentences fill a batch
        await asyncio.gather(*(client(batcher, name, 3) for name in "abcd"), client(batcher, "e", 3, late=True))
        await batcher.stop()

    run(main())
    sizes = [len(b) for b, _ in translator.batches]
    assert sizes[0] == 4 and sizes[1] == 5, sizes  # the late client joined the answered ones


def test_a_batch_goes_as_soon_as_the_clients_it_answered_are_back():
    """Two clients in step: their first batch waits max_wait_ms (3 s) for company; each later one goes as soon as
    both answered clients sent their next sentence, not max_wait_ms after the previous batch (4 rounds: about 3 s,
    not 12)."""
    translator = RecordingTranslator()

    async def client(batcher, name: str):
        for i in range(4):
            await batcher.translate([request(f"{name}{i}")], [3], "o", "k")

    async def main():
        batcher = await started(translator, max_wait_ms=3000, max_batch_tokens=100)
        start = time.monotonic()
        await asyncio.gather(client(batcher, "a"), client(batcher, "b"))
        elapsed = time.monotonic() - start
        await batcher.stop()
        return elapsed

    elapsed = run(main())
    assert [sorted(b) for b, _ in translator.batches] == [[f"a{i}", f"b{i}"] for i in range(4)]
    assert elapsed < 9.0  # one company wait (3 s), where waiting after every batch would take 12 s
