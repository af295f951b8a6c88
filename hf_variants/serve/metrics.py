"""The server's Prometheus metrics (`GET /metrics`, text exposition format 0.0.4).

Written with `prometheus_client` (the Prometheus project's own Python client) on a registry of the server's own:
it gets the format's escaping, histogram buckets and `_created` samples right, and is what a scrape config
expects. Every name starts with `hf_variants_serve_`:

| metric | type | what |
| --- | --- | --- |
| `requests_total{endpoint,status}` | counter | answered HTTP requests by route and status code |
| `errors_total{kind}` | counter | refused or failed requests by error kind (the error's `type`) |
| `request_duration_seconds{endpoint}` | histogram | time from the request's arrival to its answer |
| `sentences_total` | counter | sentences translated (`rate()` of it: sentences/s) |
| `sentences_per_second` | gauge | sentences decoded per second over the last 60 s |
| `batch_sentences`, `batch_tokens` | histograms | sentences and padded source tokens of each decoded batch |
| `batch_duration_seconds` | histogram | decoding time of each batch |
| `batches_stopped_total` | counter | batches stopped at a step: nobody waited (timeouts, clients gone, drain) |
| `queue_sentences` | gauge | sentences waiting for a batch |
| `requests_in_flight` | gauge | requests received and not yet answered |
| `errors_total{kind="client_closed"}` | counter | requests whose client left before the answer (499 in the log) |
| `ready` | gauge | 1 once the model is loaded and warmed up, 0 while loading or stopping |
| `model_info{model_type,engine,precision,workers,num_threads}` | gauge (info) | what is served |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..inference.requests import DecodingCancelled

PREFIX = "hf_variants_serve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServeMetrics:
    """The metrics of one server, on their own registry (two servers in one process do not share counts)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Answered HTTP requests by route and status code.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.errors = Counter(
            f"{PREFIX}_errors", "Refused or failed requests by error kind.", ["kind"], registry=registry
        )
        self.latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from a request's arrival to its answer.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.sentences = Counter(f"{PREFIX}_sentences", "Sentences translated.", registry=registry)
        self.throughput = Gauge(
            f"{PREFIX}_sentences_per_second",
            "Sentences decoded per second over the last 60 seconds.",
            registry=registry,
        )
        self.batch_sentences = Histogram(
            f"{PREFIX}_batch_sentences", "Sentences in each decoded batch.", buckets=SIZE_BUCKETS, registry=registry
        )
        self.batch_tokens = Histogram(
            f"{PREFIX}_batch_tokens",
            "Padded source tokens (longest x sentences) of each decoded batch.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.batch_duration = Histogram(
            f"{PREFIX}_batch_duration_seconds",
            "Decoding time of each batch.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.stopped = Counter(
            f"{PREFIX}_batches_stopped",
            "Batches stopped at a decoding step because nobody waited for them any more.",
            registry=registry,
        )
        self.queue = Gauge(f"{PREFIX}_queue_sentences", "Sentences waiting for a batch.", registry=registry)
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight", "Requests received and not yet answered.", registry=registry
        )
        self.ready = Gauge(
            f"{PREFIX}_ready",
            "1 once the model is loaded and warmed up, 0 while loading or stopping.",
            registry=registry,
        )
        self.model = Info(f"{PREFIX}_model", "The model and engine served.", registry=registry)

    def watch(self, batcher) -> None:
        """Read the queue depth and the recent throughput from `batcher` at every scrape."""
        self.queue.set_function(lambda: batcher.queued)
        self.throughput.set_function(batcher.sentences_per_second)

    def on_batch(self, batch, seconds: float, error: BaseException | None) -> None:
        """The batcher's callback after each batch."""
        self.batch_sentences.observe(len(batch.items))
        self.batch_tokens.observe(batch.padded_tokens)
        self.batch_duration.observe(seconds)
        if error is None:
            self.sentences.inc(len(batch.items))
        elif isinstance(error, DecodingCancelled):
            self.stopped.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
