#!/usr/bin/env python
"""Serving throughput: `hf-variants-serve` under 1, 8 and 64 concurrent clients, each sending single sentences of
test_2016_flickr (natural lengths) one request at a time, beside the same engine's offline batched throughput
(the translation core's `Translator.translate` on the same sentences, batched by the server's --max_batch_tokens)
and a one-request-at-a-time `pipeline()` loop (the torch model's translation pipeline called per sentence: the web
app a user writes without this server), all in one run.

For each engine (torch fp32, ONNX Runtime int8, CTranslate2 int8 by default) at each thread count: a real server
process (`python -m hf_variants.serve --num_threads T`), the clients in this process (threads with an HTTP client
each, a shared queue of sentences), then the server stopped and the offline run here with the same threads.

The server and the offline run are pinned to the same cores (`--server_cpus`, default the first T cores: the server
started under `taskset -c`) and the clients to others (`--client_cpus`, default the next core): the clients' HTTP
work does not take the engine's core, so a row measures the server, not its neighbours. `--no_pin` runs everything
unpinned (the previous rounds' setup). Per row: sentences/s, p50/p99 latency of a request, the mean batch size (the
server's `batch_sentences` histogram), the ratio to the engine's offline throughput, and the server process's CPU
time a sentence (all its threads, from /proc) with its ratio to the offline pass's (this process's CPU time), and its
main thread's (the event loop: HTTP, routing, JSON) a request. Decoding is the model's saved one (what the server
does for a request that names none). Goals: at 64 clients >= 0.8x offline and >= the 8-client rate; ONNX Runtime
int8 served >= 4x the pipeline loop.

`--front_ends HTTP/LOOP ...`: one server per combination of `--http` and `--loop` (e.g. `h11/asyncio
httptools/uvloop`), measured in turn within every round, each round starting with the next server.

`--health_probe`: per engine, also the latency of `GET /health/ready` (p50 / p99 / max over `--probes` probes) while
other clients post 1 MB bodies of long sentences (each parsed, checked and tokenized, then refused with 413): the
event loop must stay free for the probes (goal: p99 < 50 ms).

    python benchmarks/bench_serve.py --model runs/transformer_nmt-en-de/model [--onnx DIR] [--ct2 DIR] \\
        [--sentences 300] [--threads 1] [--clients 1 8 64] [--health_probe] [--output benchmarks/results/serve]
    python benchmarks/bench_serve.py --random_preset small    # no trained model at hand: random weights

Without `--onnx` / `--ct2` the model is exported into a temporary folder (int8 graphs; CTranslate2 for a
`transformer_nmt`). The load average before and after is recorded; run it on a quiet machine. Writes
`--output`.json/.md and (for the default output) the `serve` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import write_section  # noqa: E402
from timing import cpu_model, write_result  # noqa: E402

DATA = ROOT / "training" / "data" / "multi30k" / "test_2016_flickr.en.gz"
ENGINES = {"torch": "fp32", "onnx": "int8", "ctranslate2": "int8"}


def sentences(n: int) -> list[str]:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line, _ in zip(f, range(n))]


def pinning(args) -> tuple[set[int] | None, set[int] | None]:
    """(the server's cores, the clients' cores) for runs at up to `max(args.threads)` threads; (None, None)
    unpinned."""
    if args.no_pin:
        return None, None
    available = sorted(os.sched_getaffinity(0))
    server = set(args.server_cpus) if args.server_cpus else set(available[: max(args.threads)])
    others = [cpu for cpu in available if cpu not in server]
    clients = set(args.client_cpus) if args.client_cpus else set(others[:1])
    if not clients or server & clients or not (server | clients) <= set(available):
        raise SystemExit(
            f"--server_cpus {sorted(server)} and --client_cpus {sorted(clients)}: disjoint cores of {available} "
            "are needed (fewer --threads, or --no_pin)"
        )
    return server, clients


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """This process (its threads: the clients, or the offline run) on `cpus` within the block."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Server:
    def __init__(
        self,
        folder: str,
        engine: str,
        precision: str,
        threads: int,
        args,
        cpus: set[int] | None = None,
        front_end: str = "auto/auto",
    ):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        http, loop = front_end.split("/")
        command = [sys.executable, "-m", "hf_variants.serve", "--model", folder, "--engine", engine]
        command += ["--http", http, "--loop", loop]
        command += ["--precision", precision, "--num_threads", str(threads), "--port", "0", "--no_access_log"]
        command += ["--max_batch_tokens", str(args.max_batch_tokens), "--max_wait_ms", str(args.max_wait_ms)]
        command += ["--max_queue", "4096", "--request_timeout_s", "600", "--max_concurrent_requests", "4096"]
        if cpus is not None:  # the server and every thread it starts on these cores
            command = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *command]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        import httpx

        deadline = time.monotonic() + 600
        self.url = None
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text()
            if self.url is None and (match := re.search(r"listening on (http://\S+) ", text)):
                self.url = match.group(1)
                found = re.search(r"HTTP: (\w+), event loop: (\w+)", text)
                self.front_end = f"{found.group(1)}/{found.group(2)}" if found else front_end
            if self.url:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited:\n{text[-3000:]}")
            time.sleep(0.3)
        raise SystemExit("the server did not get ready in 600 s")

    def cpu_seconds(self, main_thread: bool = False) -> float:
        """The server process's CPU time so far (user + system, from /proc): all its threads, or its main thread's
        (the event loop's: HTTP, routing, JSON)."""
        pid = self.process.pid
        stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def batch_sizes(self) -> tuple[float, float]:
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = {}
        for name in ("hf_variants_serve_batch_sentences_sum", "hf_variants_serve_batch_sentences_count"):
            values[name] = float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
        return values["hf_variants_serve_batch_sentences_sum"], values["hf_variants_serve_batch_sentences_count"]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)
        os.unlink(self.log.name)


def serve_run(server: Server, texts: list[str], clients: int) -> dict:
    """`clients` threads sending single sentences (a shared queue) until all are answered. Each thread's HTTP client
    is built and connected before the clock starts (an httpx.Client builds an SSL context: 22-23 ms of the client
    core each, 1.4-1.5 s for 64 of them, inside runs of 3-5 s), and the threads start their first requests together
    behind a barrier: the rate is the server's, not the clients' start-up."""
    import httpx

    todo: queue.Queue = queue.Queue()
    for text in texts:
        todo.put(text)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    https = [httpx.Client(base_url=server.url, timeout=600) for _ in range(clients)]
    for http in https:  # each opens its keep-alive connection now
        http.get("/health/live")
    go = threading.Barrier(clients + 1)

    def client(http):
        go.wait()
        while True:
            try:
                text = todo.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            response = http.post("/translate", json={"text": text})
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)
                if response.status_code != 200:
                    errors.append(response.text[:200])

    total_before, count_before = server.batch_sizes()
    cpu_before, loop_before = server.cpu_seconds(), server.cpu_seconds(main_thread=True)
    threads = [threading.Thread(target=client, args=(http,)) for http in https]
    for thread in threads:
        thread.start()
    go.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    cpu, loop = server.cpu_seconds() - cpu_before, server.cpu_seconds(main_thread=True) - loop_before
    for http in https:
        http.close()
    total, count = server.batch_sizes()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    latencies.sort()
    return {
        "sentences_per_s": len(texts) / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_batch": (total - total_before) / max(1, count - count_before),
        "server_cpu_ms": 1000 * cpu / len(texts),
        "loop_cpu_ms": 1000 * loop / len(texts),
    }


def health_probe(server: Server, probes: int, posters: int = 4) -> dict:
    """Latency of `GET /health/ready` (`probes` of them, one after the other) while `posters` clients post 1 MB bodies
    of long sentences without pause (each refused with 413 once parsed, checked and tokenized)."""
    import httpx

    # 127 sentences of 8 KB (within --max_sentences): every one tokenized before the first is refused as too long
    sentence = "A man in a blue shirt is riding a red bicycle down a very long road near the big old house. " * 88
    body = json.dumps({"text": [sentence] * min(127, ((1 << 20) - 64) // (len(sentence) + 4))}).encode()
    stop = threading.Event()
    statuses: list[int] = []

    def poster():
        with httpx.Client(base_url=server.url, timeout=600) as http:
            while not stop.is_set():
                response = http.post("/translate", content=body, headers={"Content-Type": "application/json"})
                statuses.append(response.status_code)

    threads = [threading.Thread(target=poster) for _ in range(posters)]
    for thread in threads:
        thread.start()
    latencies = []
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            while not statuses:  # the bodies are being posted
                time.sleep(0.01)
            for _ in range(probes):
                start = time.perf_counter()
                http.get("/health/ready").raise_for_status()
                latencies.append(1000 * (time.perf_counter() - start))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    latencies.sort()
    return {
        "body_bytes": len(body),
        "bodies": len(statuses),
        "body_statuses": sorted(set(statuses)),
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "max_ms": latencies[-1],
    }


def offline_runner(folder: str, engine: str, threads: int, texts: list[str], max_tokens: int, precision: str):
    """The engine loaded (and warmed up) once; the returned function times one offline pass over `texts`, on the
    calling thread's cores: (sentences/s, this process's CPU ms a sentence)."""
    import torch

    from hf_variants.inference import Translator

    torch.set_num_threads(threads)
    translator = Translator.from_pretrained(folder, engine=engine, precision=precision, num_threads=threads)
    translator.translate(texts[:8], max_tokens=max_tokens)  # warm-up

    def timed() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        translator.translate(texts, max_tokens=max_tokens)
        return len(texts) / (time.perf_counter() - start), 1000 * (time.process_time() - cpu) / len(texts)

    return timed


def pipeline_loop(model_dir: str, threads: int, texts: list[str]) -> float:
    """The torch model's translation pipeline called once per sentence, one after the other."""
    import torch
    from transformers import pipeline

    import hf_variants  # noqa: F401  (the translation task)

    torch.set_num_threads(threads)
    translator = pipeline("translation", model=model_dir)
    translator(texts[0])
    start = time.perf_counter()
    for text in texts:
        translator(text)
    return len(texts) / (time.perf_counter() - start)


def random_model(preset: str, folder: Path) -> str:
    """A `transformer_nmt` of `preset` with random weights (seed 0) and a BPE tokenizer of 8,000 tokens trained on the
    bundled Multi30k train split (en, de), saved in `folder`: compute of that size, outputs up to the length rule."""
    import torch

    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
    from hf_variants.tokenization import train_tokenizer

    texts = []
    for lang in ("en", "de"):
        with gzip.open(DATA.parent / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f]
    tokenizer = train_tokenizer(texts, vocab_size=8000)
    torch.manual_seed(0)
    config = TransformerNmtConfig.from_preset(
        preset, vocab_size=len(tokenizer), languages=["en", "de"], target_languages=["de"]
    )
    model = TransformerNmtForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def exports(args, tmp: Path) -> dict[str, str]:
    if args.model is None:
        args.model = random_model(args.random_preset, tmp / "model")
    folders = {"torch": args.model}
    if "onnx" in args.engines:
        if args.onnx is None:
            from hf_variants.commands.export_onnx import main as export_onnx

            args.onnx = str(tmp / "onnx")
            export_onnx(["--model", args.model, "--output_dir", args.onnx, "--int8"])
        folders["onnx"] = args.onnx
    if "ctranslate2" in args.engines:
        if args.ct2 is None:
            from hf_variants.commands.export_ctranslate2 import main as export_ct2

            args.ct2 = str(tmp / "ct2")
            export_ct2(["--model", args.model, "--output_dir", args.ct2])
        folders["ctranslate2"] = args.ct2
    return folders


def cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def table(record: dict) -> str:
    lines = [
        f"`{record['command']}`; CPU: {record['cpu']}; load average before/after: "
        f"{record['load_before']} / {record['load_after']}; {record['sentences']} sentences of test_2016_flickr, "
        f"single-sentence requests; pinning: {record.get('pinning', 'none')}; rounds: {record.get('rounds', 1)} "
        "(each an offline pass then every client count; a row is the rounds' median, x offline the median of each "
        "round's own ratio)",
        "",
        "| engine | threads | clients | sentences/s | p50 ms | p99 ms | mean batch | x offline | rounds' x offline "
        "| server CPU ms a sentence | CPU x offline | event loop CPU ms a request |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    several = len({row.get("front_end") for row in record["rows"]}) > 1
    for row in record["rows"]:
        label = f"{row['engine']} {row['precision']}" + (f" ({row['front_end']})" if several else "")
        lines.append(
            f"| {label} | {row['threads']} | {row['clients']} "
            f"| {row['sentences_per_s']:.1f} | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} "
            f"| {row['mean_batch']:.1f} | {row['x_offline']:.2f} "
            f"| {' '.join(f'{x:.2f}' for x in row.get('x_offline_rounds', [row['x_offline']]))} "
            f"| {cell(row.get('server_cpu_ms'))} | {cell(row.get('cpu_x_offline'))} | {cell(row.get('loop_cpu_ms'))} |"
        )
    lines += [
        "",
        "| engine | threads | offline sentences/s | offline CPU ms a sentence | pipeline() loop sentences/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for item in record["offline"]:
        loop = record["pipeline_loop"].get(str(item["threads"]))
        shown = f"{loop:.1f}" if loop is not None and item["engine"] == "torch" else ""
        lines.append(
            f"| {item['engine']} {item['precision']} | {item['threads']} | {item['sentences_per_s']:.1f} "
            f"| {cell(item.get('cpu_ms'))} | {shown} |"
        )
    if record.get("health"):
        lines += [
            "",
            "| engine | /health p50 ms | p99 ms | max ms | 1 MB bodies posted meanwhile |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for probe in record["health"]:
            lines.append(
                f"| {probe['engine']} {probe['precision']} | {probe['p50_ms']:.1f} | {probe['p99_ms']:.1f} "
                f"| {probe['max_ms']:.1f} | {probe['bodies']} |"
            )
    if record.get("note"):
        lines += ["", f"Note: {record['note']}."]
    lines += ["", "Goals:"]
    for goal in record["goals"]:
        lines.append(f"- {goal}")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a saved model folder (the torch engine's)")
    source.add_argument(
        "--random_preset",
        help="instead of --model: a transformer_nmt of this preset with random weights (small, base)",
    )
    parser.add_argument("--onnx", help="its ONNX export with int8 graphs (default: exported here)")
    parser.add_argument("--ct2", help="its CTranslate2 export (default: exported here)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--max_batch_tokens", type=int, default=4096)
    parser.add_argument("--max_wait_ms", type=float, default=10)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of (offline pass, each client count) per engine; rows are the rounds' medians",
    )
    parser.add_argument("--server_cpus", nargs="+", type=int, help="the server's (and offline run's) cores")
    parser.add_argument("--client_cpus", nargs="+", type=int, help="the clients' cores (disjoint from the server's)")
    parser.add_argument("--no_pin", action="store_true", help="no pinning: clients and server share every core")
    parser.add_argument("--health_probe", action="store_true", help="also /health latency under 1 MB bodies")
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--no_pipeline", action="store_true", help="skip the pipeline() loop")
    parser.add_argument(
        "--front_ends",
        nargs="+",
        default=["auto/auto"],
        metavar="HTTP/LOOP",
        help="the servers' --http and --loop, one server each, measured in turn within every round (e.g. "
        "httptools/uvloop h11/asyncio; default auto/auto: the server's own choice)",
    )
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "serve"))
    return parser.parse_args()


def run_engine(args, record: dict, folder: str, engine: str, threads: int, texts: list[str], cpus) -> None:
    """One engine: its server (one per `--front_ends`, all started before the first round), and `--rounds` rounds
    of an offline pass then each server under each client count (then the health probe). The offline pass runs in
    this process on the server's cores while the servers idle, right before the round's client runs: each round's
    ratio to offline is taken within seconds on the same machine (a shared host's speed drifts by 10-20% over
    minutes). A row is the median over the rounds; its `x_offline` is the median of the rounds' own ratios, with
    their range."""
    server_cpus, client_cpus = cpus
    precision = ENGINES[engine]
    with pinned(server_cpus):
        offline = offline_runner(folder, engine, threads, texts, args.max_batch_tokens, precision)
    servers: list[Server] = []
    rounds: list[tuple[float, dict]] = []
    try:
        for front_end in args.front_ends:
            servers.append(Server(folder, engine, precision, threads, args, server_cpus, front_end))
        names = [server.front_end for server in servers]
        if len(set(names)) < len(names):
            raise SystemExit(f"--front_ends {' '.join(args.front_ends)}: the servers run {names}: one pair each")
        for number in range(args.rounds):
            with pinned(server_cpus):
                rate, offline_cpu = offline()
            runs = {}
            with pinned(client_cpus):  # the servers in turn, each round starting with the next one (drift)
                for server in servers[number % len(servers) :] + servers[: number % len(servers)]:
                    for clients in args.clients:
                        run = runs[server.front_end, clients] = serve_run(server, texts, clients)
                        print(
                            f"{engine} {precision} ({server.front_end}), {threads} thread(s), round {number + 1}, "
                            f"{clients} clients: {run['sentences_per_s']:.1f} sentences/s "
                            f"({run['sentences_per_s'] / rate:.2f}x offline {rate:.1f}), "
                            f"p50 {run['p50_ms']:.0f} ms, p99 {run['p99_ms']:.0f} ms, "
                            f"mean batch {run['mean_batch']:.1f}, server CPU {run['server_cpu_ms']:.2f} ms a "
                            f"sentence ({offline_cpu / run['server_cpu_ms']:.2f}x offline {offline_cpu:.2f}), event "
                            f"loop {run['loop_cpu_ms']:.2f} ms a request",
                            flush=True,
                        )
            rounds.append((rate, runs, offline_cpu))
        if args.health_probe:
            with pinned(client_cpus):
                probe = health_probe(servers[0], args.probes)
            probe.update(engine=engine, precision=precision, threads=threads, front_end=servers[0].front_end)
            record["health"].append(probe)
            print(f"{engine}: /health under 1 MB bodies: p50 {probe['p50_ms']:.1f} ms, p99 {probe['p99_ms']:.1f} ms")
    finally:
        for server in servers:
            server.stop()
    rates = [rate for rate, _, _ in rounds]
    record["offline"].append(
        {
            "engine": engine,
            "precision": precision,
            "threads": threads,
            "sentences_per_s": statistics.median(rates),
            "rounds": rates,
            "cpu_ms": statistics.median(cpu for _, _, cpu in rounds),
        }
    )
    for server in servers:
        for clients in args.clients:
            key = server.front_end, clients
            ratios = [runs[key]["sentences_per_s"] / rate for rate, runs, _ in rounds]
            row = {name: statistics.median(runs[key][name] for _, runs, _ in rounds) for name in rounds[0][1][key]}
            row["cpu_x_offline"] = statistics.median(cpu / runs[key]["server_cpu_ms"] for _, runs, cpu in rounds)
            row.update(engine=engine, precision=precision, threads=threads, clients=clients)
            row.update(front_end=server.front_end, x_offline=statistics.median(ratios), x_offline_rounds=ratios)
            if 8 in args.clients:  # the round's rate over its own 8-client rate
                row["x_eight_rounds"] = [
                    runs[key]["sentences_per_s"] / runs[server.front_end, 8]["sentences_per_s"]
                    for _, runs, _ in rounds
                ]
            if server is not servers[0]:  # the round's rate over the first front end's, same clients
                first = servers[0].front_end, clients
                row["first_front_end"] = servers[0].front_end
                row["x_first_rounds"] = [
                    runs[key]["sentences_per_s"] / runs[first]["sentences_per_s"] for _, runs, _ in rounds
                ]
            record["rows"].append(row)


def main() -> None:
    args = parse_args()
    texts = sentences(args.sentences)
    cpus = pinning(args)
    record = {
        "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model(),
        "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "sentences": len(texts),
        "pinning": "none" if cpus[0] is None else f"server cores {sorted(cpus[0])}, client cores {sorted(cpus[1])}",
        "rounds": args.rounds,
        "front_ends": args.front_ends,
        "rows": [],
        "offline": [],
        "health": [],
        "pipeline_loop": {},
        "partial": True,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folders = exports(args, Path(tmp))
        for threads in args.threads:
            if not args.no_pipeline:
                with pinned(cpus[0]):
                    record["pipeline_loop"][str(threads)] = pipeline_loop(args.model, threads, texts)
                print(f"pipeline() loop, {threads} thread(s): {record['pipeline_loop'][str(threads)]:.1f} sentences/s")
            for engine in args.engines:
                run_engine(args, record, folders[engine], engine, threads, texts, cpus)
                save(args, record)  # what is measured so far (an interrupted run keeps it)
    record.pop("partial", None)
    save(args, record)


def spread(values: list[float]) -> str:
    """` (rounds: lo-hi)` for more than one round."""
    return f" (rounds: {min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def goals_of(args, record: dict) -> list[str]:
    goals = []
    for row in record["rows"]:
        if row["clients"] != max(args.clients):
            continue
        ratios = row.get("x_offline_rounds", [row["x_offline"]])
        name = f"{row['engine']} {row['precision']}" + (f" ({row['front_end']})" if len(args.front_ends) > 1 else "")
        goals.append(
            f"{name}, {row['threads']} thread(s), {row['clients']} clients: "
            f"{row['x_offline']:.2f}x offline{spread(ratios)} (goal >= 0.8)"
        )
        if row.get("x_eight_rounds"):
            eights = row["x_eight_rounds"]
            goals.append(f"{name}: {statistics.median(eights):.2f}x its 8-client rate{spread(eights)} (goal >= 1)")
        if row.get("x_first_rounds"):
            firsts = row["x_first_rounds"]
            goals.append(
                f"{name}, {row['clients']} clients: {statistics.median(firsts):.2f}x the rate with "
                f"{row['first_front_end']}{spread(firsts)}"
            )
        loop = record["pipeline_loop"].get(str(row["threads"]))
        if row["engine"] == "onnx" and loop and not row.get("x_first_rounds"):
            goals.append(
                f"onnx int8 served, {row['threads']} thread(s): {row['sentences_per_s'] / loop:.2f}x the pipeline() "
                "loop (goal >= 4)"
            )
    for probe in record["health"]:
        goals.append(
            f"{probe['engine']}: health probe (GET health/ready) p99 {probe['p99_ms']:.1f} ms under 1 MB bodies "
            "(goal < 50)"
        )
    return goals


def save(args, record: dict) -> None:
    """Write the record (goals from the rows so far) to `--output`.json/.md and, for the default output, the
    `serve` section of RESULTS.md."""
    record["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    record["goals"] = goals_of(args, record)
    clients = ", ".join(str(c) for c in args.clients)
    if record.get("partial"):
        record["note"] = f"partial: the rows measured so far of threads {args.threads}, clients {clients}"
    else:
        record.pop("note", None)
    written = write_result(args.output + ".json", record)
    text = f"Commit {written['metadata']['commit']}, {written['metadata']['date']}. " + table(record)
    Path(args.output + ".md").write_text(text)
    if Path(args.output).resolve() == (ROOT / "benchmarks" / "results" / "serve").resolve():
        write_section("serve", text)
    print(table(record))


if __name__ == "__main__":
    main()
