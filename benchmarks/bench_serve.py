#!/usr/bin/env python
"""Serving throughput: `hf-variants-serve` under 1, 8 and 64 concurrent clients, each sending single sentences of
test_2016_flickr (natural lengths) one request at a time, beside the same engine's offline batched throughput
(the translation core's `Translator.translate` on the same sentences, batched by the server's --max_batch_tokens)
and a one-request-at-a-time `pipeline()` loop (the torch model's translation pipeline called per sentence: the web
app a user writes without this server), all in one run.

For each engine (torch fp32, ONNX Runtime int8, CTranslate2 int8 by default) at each thread count (1 and 2): a real
server process (`python -m hf_variants.serve --num_threads T`), the clients in this process (threads with an HTTP
client each, a shared queue of sentences), then the server stopped and the offline run here with the same threads.
Per row: sentences/s, p50/p99 latency of a request, the mean batch size (the server's `batch_sentences` histogram)
and the ratio to the engine's offline throughput. Decoding is the model's saved one (what the server does for a
request that names none). Goals: at 64 clients >= 0.8x offline; ONNX Runtime int8 served >= 4x the pipeline loop.

    python benchmarks/bench_serve.py --model runs/transformer_nmt-en-de/model [--onnx DIR] [--ct2 DIR] \\
        [--sentences 300] [--threads 1 2] [--clients 1 8 64] [--output benchmarks/results/serve]
    python benchmarks/bench_serve.py --random_preset small    # no trained model at hand: random weights

Without `--onnx` / `--ct2` the model is exported into a temporary folder (int8 graphs; CTranslate2 for a
`transformer_nmt`). The load average before and after is recorded: the clients share the machine with the server,
as they would on one host; run it on a quiet machine. Writes `--output`.json/.md and (for the default output) the
`serve` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gzip
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


class Server:
    def __init__(
        self, folder: str, engine: str, precision: str, threads: int, max_batch_tokens: int, max_wait_ms: float
    ):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        command = [sys.executable, "-m", "hf_variants.serve", "--model", folder, "--engine", engine]
        command += ["--precision", precision, "--num_threads", str(threads), "--port", "0", "--no_access_log"]
        command += ["--max_batch_tokens", str(max_batch_tokens), "--max_wait_ms", str(max_wait_ms)]
        command += ["--max_queue", "4096", "--request_timeout_s", "600"]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        import httpx

        deadline = time.monotonic() + 600
        self.url = None
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text()
            if self.url is None and (match := re.search(r"listening on (http://\S+) ", text)):
                self.url = match.group(1)
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
    """`clients` threads sending single sentences (a shared queue) until all are answered."""
    import httpx

    todo: queue.Queue = queue.Queue()
    for text in texts:
        todo.put(text)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client():
        with httpx.Client(base_url=server.url, timeout=600) as http:
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
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    total, count = server.batch_sizes()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    latencies.sort()
    return {
        "sentences_per_s": len(texts) / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_batch": (total - total_before) / max(1, count - count_before),
    }


def offline_run(folder: str, engine: str, precision: str, threads: int, texts: list[str], max_tokens: int) -> float:
    import torch

    from hf_variants.inference import Translator

    torch.set_num_threads(threads)
    translator = Translator.from_pretrained(folder, engine=engine, precision=precision, num_threads=threads)
    translator.translate(texts[:8], max_tokens=max_tokens)  # warm-up
    start = time.perf_counter()
    translator.translate(texts, max_tokens=max_tokens)
    return len(texts) / (time.perf_counter() - start)


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
            from hf_variants.onnx.export import main as export_onnx

            args.onnx = str(tmp / "onnx")
            export_onnx(["--model", args.model, "--output_dir", args.onnx, "--int8"])
        folders["onnx"] = args.onnx
    if "ctranslate2" in args.engines:
        if args.ct2 is None:
            from hf_variants.deploy.ctranslate2 import main as export_ct2

            args.ct2 = str(tmp / "ct2")
            export_ct2(["--model", args.model, "--output_dir", args.ct2])
        folders["ctranslate2"] = args.ct2
    return folders


def table(record: dict) -> str:
    lines = [
        f"`{record['command']}`; CPU: {record['cpu']}; load average before/after: "
        f"{record['load_before']} / {record['load_after']}; {record['sentences']} sentences of test_2016_flickr, "
        "single-sentence requests",
        "",
        "| engine | threads | clients | sentences/s | p50 ms | p99 ms | mean batch | x offline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['engine']} {row['precision']} | {row['threads']} | {row['clients']} "
            f"| {row['sentences_per_s']:.1f} | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} "
            f"| {row['mean_batch']:.1f} | {row['x_offline']:.2f} |"
        )
    lines += [
        "",
        "| engine | threads | offline sentences/s | pipeline() loop sentences/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for item in record["offline"]:
        loop = record["pipeline_loop"].get(str(item["threads"]))
        shown = f"{loop:.1f}" if loop is not None and item["engine"] == "torch" else ""
        lines.append(
            f"| {item['engine']} {item['precision']} | {item['threads']} | {item['sentences_per_s']:.1f} | {shown} |"
        )
    if record.get("note"):
        lines += ["", f"Note: {record['note']}."]
    lines += ["", "Goals:"]
    for goal in record["goals"]:
        lines.append(f"- {goal}")
    return "\n".join(lines) + "\n"


def main() -> None:
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
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--max_batch_tokens", type=int, default=4096)
    parser.add_argument("--max_wait_ms", type=float, default=10)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "serve"))
    args = parser.parse_args()
    texts = sentences(args.sentences)
    record = {
        "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model(),
        "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "sentences": len(texts),
        "rows": [],
        "offline": [],
        "pipeline_loop": {},
        "partial": True,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folders = exports(args, Path(tmp))
        for threads in args.threads:
            record["pipeline_loop"][str(threads)] = pipeline_loop(args.model, threads, texts)
            print(f"pipeline() loop, {threads} thread(s): {record['pipeline_loop'][str(threads)]:.1f} sentences/s")
            for engine in args.engines:
                precision = ENGINES[engine]
                offline = offline_run(folders[engine], engine, precision, threads, texts, args.max_batch_tokens)
                record["offline"].append(
                    {"engine": engine, "precision": precision, "threads": threads, "sentences_per_s": offline}
                )
                server = Server(folders[engine], engine, precision, threads, args.max_batch_tokens, args.max_wait_ms)
                try:
                    for clients in args.clients:
                        row = serve_run(server, texts, clients)
                        row.update(engine=engine, precision=precision, threads=threads, clients=clients)
                        row["x_offline"] = row["sentences_per_s"] / offline
                        record["rows"].append(row)
                        print(
                            f"{engine} {precision}, {threads} thread(s), {clients} clients: "
                            f"{row['sentences_per_s']:.1f} sentences/s ({row['x_offline']:.2f}x offline "
                            f"{offline:.1f}), p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, "
                            f"mean batch {row['mean_batch']:.1f}",
                            flush=True,
                        )
                finally:
                    server.stop()
                save(args, record)  # what is measured so far (an interrupted run keeps it)
    record.pop("partial", None)
    save(args, record)


def save(args, record: dict) -> None:
    """Write the record (goals from the rows so far) to `--output`.json/.md and, for the default output, the
    `serve` section of RESULTS.md."""
    record["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    goals = []
    for row in record["rows"]:
        if row["clients"] == max(args.clients):
            goals.append(
                f"{row['engine']} {row['precision']}, {row['threads']} thread(s), {row['clients']} clients: "
                f"{row['x_offline']:.2f}x offline (goal >= 0.8)"
            )
        if row["engine"] == "onnx" and row["clients"] == max(args.clients):
            loop = record["pipeline_loop"][str(row["threads"])]
            goals.append(
                f"onnx int8 served, {row['threads']} thread(s): {row['sentences_per_s'] / loop:.2f}x the pipeline() "
                "loop (goal >= 4)"
            )
    record["goals"] = goals
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
