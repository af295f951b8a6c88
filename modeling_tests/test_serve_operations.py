"""`hf-variants-serve` as an operator runs it: real server processes, real clients (httpx, urllib, raw sockets), each
defect found before production reproduced by what the client sees and what the server logs.

The engine is the tiny trained baseline behind the fault-injecting start (`serve_helpers.FAULTS_PRELUDE`): batches
that hold until the test releases them (`HOLD:NAME`), that stop only when the batcher cancels them at a real decoding
step (`STEPS`), a preparation that holds (`PREPHOLD`): every situation is constructed and waited for by its log line
or its metric, never by a sleep with a thin margin.

- The operations server (JSON logs, keys with their own limits, short connection timeouts, a low concurrency cap):
  other settings not held back by a held batch; a timed-out request's batch stopped and the next requests served; a
  real decoding stopped at its step when the client leaves (499); a client hanging up mid-body (499, no
  traceback); a too-large body answered 413 to urllib and to a chunked sender; idle and slow connections closed
  (408 for slow headers); `/health` answered while a request is prepared; 429 over --max_concurrent_requests and
  over a key's requests and characters a minute; request ids echoed and logged; JSON log lines; liveness while
  loading.
- The drain server: a connection over --max_connections refused with a JSON 503; SIGTERM with requests in flight:
  the one that can finish within --graceful_timeout_s answers 200, the held ones a JSON 503, exit status 0, no
  traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import ServerProcess, metric_values
from trained_tiny import save_en_de_baseline

from hf_variants.inference import DecodeOptions, Translator

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf-variants[serve]'")

MAIN_KEY = "main-key-0123456789abcdef"
RATE_KEY = "rate-key-0123456789abcdef"
CHARS_KEY = "chars-key-0123456789abcdef"


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-ops") / "model"
    save_en_de_baseline(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    return Translator.from_pretrained(str(model_dir), num_threads=1)


def auth(key: str = MAIN_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ops_args(model_dir, folder) -> list[str]:
    keys = folder / "keys.txt"
    keys.write_text(f"{MAIN_KEY}\n{RATE_KEY} requests_per_minute=2\n{CHARS_KEY} characters_per_minute=50\n")
    args = ["--model", str(model_dir), "--num_threads", "1", "--api_key_file", str(keys), "--log_format", "json"]
    args += ["--request_timeout_s", "10", "--idle_timeout_s", "1", "--header_timeout_s", "1", "--body_timeout_s", "2"]
    args += ["--max_concurrent_requests", "3", "--max_body_bytes", "4096", "--max_sentence_tokens", "40"]
    return args + ["--max_wait_ms", "20"]


@pytest.fixture(scope="module")
def ops(model_dir, tmp_path_factory):
    """The operations server on the default HTTP parser and event loop (httptools and uvloop, installed by the
    serve extra)."""
    folder = tmp_path_factory.mktemp("ops")
    env = {"FAULT_DIR": str(folder), "FAULT_LOAD_DELAY": "2"}
    with ServerProcess(ops_args(model_dir, folder), faults=True, env=env) as process:
        process.folder = folder
        process.early = [httpx.get(f"{process.url}/health/{probe}", timeout=10) for probe in ("live", "ready")]
        process.health = process.wait_ready()
        assert "HTTP: httptools, event loop: uvloop" in process.log()
        yield process


@pytest.fixture(scope="module")
def ops_h11(model_dir, tmp_path_factory):
    """The same server on h11 (pure Python) and asyncio's event loop."""
    folder = tmp_path_factory.mktemp("ops-h11")
    args = ops_args(model_dir, folder) + ["--http", "h11", "--loop", "asyncio"]
    with ServerProcess(args, faults=True, env={"FAULT_DIR": str(folder)}) as process:
        process.folder = folder
        process.wait_ready()
        assert "HTTP: h11, event loop: asyncio" in process.log()
        yield process


@pytest.fixture(params=["httptools", "h11"])
def either(request):
    """The connection handling's tests run on both HTTP parsers."""
    return request.getfixturevalue("ops" if request.param == "httptools" else "ops_h11")


def release(server, name: str) -> None:
    (server.folder / name).write_text("go")


def post(server, body: dict, key: str = MAIN_KEY, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/translate", json=body, headers=auth(key), timeout=120, **kwargs)


def metrics(server) -> dict:
    return metric_values(httpx.get(f"{server.url}/metrics", headers=auth(), timeout=30).text)


def log_records(server) -> list[dict]:
    """The server's JSON log lines (the lines before the logging was set up and the fault lines excluded)."""
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


def access_records(server, request_id: str | None = None) -> list[dict]:
    records = [r for r in log_records(server) if r["logger"] == "hf_variants.serve.access"]
    return [r for r in records if request_id is None or r.get("request_id") == request_id]


def wait_for_access(server, request_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not (found := access_records(server, request_id)):
        assert time.monotonic() < deadline, f"no access line for {request_id}:\n{server.log()[-3000:]}"
        time.sleep(0.02)
    return found[0]


# ------------------------------------------------------------------------------------------------- front doors
def test_liveness_answers_while_loading_and_readiness_once_ready(ops):
    live, ready = ops.early
    assert live.status_code == 200 and live.json() == {"status": "alive", "state": "loading"}
    assert ready.status_code == 503 and ready.json() == {"status": "loading"}
    assert ops.health["languages"] == {"source": ["en"], "target": ["de"]}
    assert httpx.get(f"{ops.url}/health/live", timeout=10).json() == {"status": "alive", "state": "ready"}
    assert httpx.get(f"{ops.url}/languages", timeout=10).json() == {
        "source": ["en"],
        "target": ["de"],
        "default_target": "de",
    }


def test_the_loaded_model_is_frozen_out_of_the_garbage_collectors_scans_before_ready(ops):
    """A full collection over the model's objects paused every request in flight for 200+ ms; the server freezes what
    it loaded (gc.freeze) once warmed up, before it answers ready."""
    messages = [r["message"] for r in log_records(ops)]
    frozen = next(i for i, m in enumerate(messages) if "frozen out of the garbage collector's scans" in m)
    ready = next(i for i, m in enumerate(messages) if m.startswith("Ready: "))
    assert frozen < ready
    assert int(messages[frozen].split()[0]) > 10_000  # torch, transformers and the model: far more than this


def test_a_forked_process_makes_other_request_ids():
    """The ids come from a generator seeded once: a process forked from the server (a manager preloading the app)
    seeds its own again, else it would give its parent's next ids."""
    from hf_variants.serve.access import new_request_id

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out without running anything of pytest's
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    assert re.fullmatch("[0-9a-f]{32}", child) and child != new_request_id()


def test_request_ids_are_echoed_and_logged_as_json(ops, reference):
    response = httpx.post(
        f"{ops.url}/translate", json={"text": "A dog runs."}, headers={**auth(), "X-Request-ID": "client-id.42"}
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-id.42"
    assert response.json()["translations"] == [reference.translate(["A dog runs."])[0].text]
    made = httpx.get(f"{ops.url}/health/ready", headers={"X-Request-ID": "bad id with spaces"})
    assert made.headers["x-request-id"] != "bad id with spaces" and len(made.headers["x-request-id"]) == 32
    line = wait_for_access(ops, "client-id.42")
    assert line["status"] == 200 and line["path"] == "/translate" and line["sentences"] == 1
    assert line["key"] == __import__("hashlib").sha256(MAIN_KEY.encode()).hexdigest()[:8]
    assert isinstance(line["duration_ms"], float) and line["level"] == "INFO"
    wait_for_access(ops, made.headers["x-request-id"])
    # the ids the server makes: 32 hex digits, a new one for every request
    made_ids = {httpx.get(f"{ops.url}/health/live").headers["x-request-id"] for _ in range(20)}
    assert len(made_ids) == 20 and all(re.fullmatch("[0-9a-f]{32}", i) for i in made_ids)
    # every line the server wrote after setting up its logs is one JSON object
    lines = ops.log().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("{"))
    assert all(line.startswith("{") or line.startswith("fault: ") for line in lines[first:]), lines[first:]


# -------------------------------------------------------------------------------------------------- defects 1, 2
def test_a_held_batch_of_other_settings_does_not_hold_back_a_plain_request(ops, reference):
    """Defect 1: a request of non-default settings whose batch does not end (held) must not hold back a plain one."""
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, ops, {"text": "HOLD:hol A man rides a bike.", "num_beams": 2})
        ops.wait_for_log("fault: HOLD:hol waiting")
        plain = post(ops, {"text": "A dog runs."})
        assert not held.done()
        release(ops, "hol")
        assert held.result().status_code == 200
    assert plain.status_code == 200 and plain.json()["translations"] == [reference.translate(["A dog runs."])[0].text]


def test_a_timed_out_request_stops_its_batch_and_the_next_requests_are_served(ops, reference):
    """Defect 2: after a 504, the request's batch no longer holds the engine: it is stopped at its next step (the
    fault's held batch sees the cancel flag), and three requests of the same settings sent next get 200."""
    before = metrics(ops).get("hf_variants_serve_batches_stopped_total", 0)
    timed_out = post(ops, {"text": "HOLD:never A man rides a bike."})
    assert timed_out.status_code == 504 and timed_out.json()["error"]["limit"] == "request_timeout_s"
    ops.wait_for_log("fault: HOLD:never cancelled")
    sentences = ["A dog runs.", "Two men talk.", "A woman sings."]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda s: post(ops, {"text": s}), sentences))
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json()["translations"][0] for a in answers] == [r.text for r in reference.translate(sentences)]
    assert metrics(ops)["hf_variants_serve_batches_stopped_total"] == before + 1


def test_a_client_that_leaves_stops_the_real_decoding_at_its_step(ops, reference):
    """The torch engine's generate() asks the cancel flag at every step: the fault holds the decoding at step 2
    until the batcher cancels it; the client leaving does, and the decoding stops right there (the flag asked 3
    times: 2 steps and the check after generate(), where the whole translation takes more steps), 499 logged."""
    sentence = "STEPS A man rides a bike down the road."
    assert len(reference.translate([sentence])[0].hypotheses[0].tokens) > 4
    body = json.dumps({"text": sentence}).encode()
    head = f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {MAIN_KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nX-Request-ID: leaving-client\r\n\r\n"
    with socket.create_connection(urlparts(ops.url)) as sock:
        sock.sendall(head.encode() + body)
        ops.wait_for_log("fault: held at decoding step 2")
    log = ops.wait_for_log("fault: stopped after")
    assert "fault: stopped after 3 asks" in log
    line = wait_for_access(ops, "leaving-client")
    assert line["status"] == 499 and line["error"] == "client_closed"


# ---------------------------------------------------------------------------------------------- defects 4 to 7
def test_a_client_hanging_up_mid_body_is_a_499_without_traceback(either):
    """Defect 4: a client that sends half its body and hangs up is a 499 in the access log, not a 500."""
    with socket.create_connection(urlparts(either.url)) as sock:
        head = f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {MAIN_KEY}\r\n"
        head += "Content-Type: application/json\r\nContent-Length: 1000\r\nX-Request-ID: half-body\r\n\r\n"
        sock.sendall(head.encode() + b'{"text": "A man')
    line = wait_for_access(either, "half-body")
    assert line["status"] == 499 and line["error"] == "client_closed"
    assert "Traceback" not in either.log() and "internal_error" not in either.log()


def urlparts(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_a_too_large_body_gets_its_413_whatever_the_client(either):
    """Defect 5: urllib sends the whole body before it reads: it gets the 413 (3 of 3), as does a chunked sender. The
    body (16 MB) is more than the sockets' buffers hold: the server answers while the client is still sending."""
    body = json.dumps({"text": ["A man rides a bike. " * 20] * 20000}).encode()  # the limit is 4096
    for _ in range(3):
        sent = urllib.request.Request(
            f"{either.url}/translate", data=body, headers={"Content-Type": "application/json", **auth()}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(sent, timeout=60)
        assert refused.value.code == 413
        assert json.loads(refused.value.read())["error"]["limit"] == "max_body_bytes"
    chunks = iter([b'{"text": "', b"a" * 30000, b'"}'])
    chunked = httpx.post(
        f"{either.url}/translate", content=chunks, headers={"Content-Type": "application/json", **auth()}, timeout=60
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["limit"] == "max_body_bytes"


def test_idle_and_slow_connections_are_closed(either):
    """Defect 6: connections that send nothing are closed after --idle_timeout_s; headers sent a byte at a time get
    a 408 after --header_timeout_s; both counted in the metrics."""
    before = metrics(either)
    idle = [socket.create_connection(urlparts(either.url)) for _ in range(20)]
    for sock in idle:
        sock.settimeout(60)
        assert sock.recv(100) == b""  # closed by the server
        sock.close()
    with socket.create_connection(urlparts(either.url)) as slow:
        slow.settimeout(60)
        answer = b""
        for byte in b"GET /health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 1000:
            try:
                slow.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
            if _readable(slow):
                break
        while chunk := slow.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"header_timeout_s"' in answer
    after = metrics(either)
    idle_key, slow_key = (
        f'hf_variants_serve_errors_total{{kind="{k}"}}' for k in ("idle_timeout_s", "header_timeout_s")
    )  # noqa: E501
    assert after[idle_key] - before.get(idle_key, 0) >= 20 and after[slow_key] - before.get(slow_key, 0) == 1


def read_all(sock) -> bytes:
    sock.settimeout(60)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_headers_over_16_kib_get_a_431_and_a_large_body_in_the_same_write_does_not(either):
    """A request's headers are capped at 16 KiB on both parsers (httptools has no cap of its own; h11's is a plain
    400): 40 KB of headers sent at once get a JSON 431, 12 KB pass; headers and a 30 KB body in one write are the
    body's 413, not a 431."""
    before = metrics(either)
    head = "GET /health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    with socket.create_connection(urlparts(either.url)) as sock:
        sock.sendall((head + "".join(f"X-Big-{i}: {'x' * 1000}\r\n" for i in range(40))).encode())
        refused = read_all(sock)
    assert refused.startswith(b"HTTP/1.1 431 ") and b'"header_bytes"' in refused
    with socket.create_connection(urlparts(either.url)) as sock:
        sock.sendall((head + "".join(f"X-Big-{i}: {'x' * 1000}\r\n" for i in range(12)) + "\r\n").encode())
        answers = read_answers(sock, 1)
    assert answers[0].status == 200 and json.loads(answers[0].body)["status"] == "ready"
    body = json.dumps({"text": "a " * 15000}).encode()
    request = f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {MAIN_KEY}\r\n"
    request += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(urlparts(either.url)) as sock:
        sock.sendall(request.encode() + body)
        too_large = read_all(sock)
    assert too_large.startswith(b"HTTP/1.1 413 ") and b'"max_body_bytes"' in too_large
    key = 'hf_variants_serve_errors_total{kind="header_bytes"}'
    assert metrics(either)[key] - before.get(key, 0) == 1


class _Answer:
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body


def read_answers(sock, count: int) -> list[_Answer]:
    """`count` HTTP answers read in turn from one connection (each by its Content-Length)."""
    reader = sock.makefile("rb")
    answers = []
    for _ in range(count):
        status = int(reader.readline().split()[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        answers.append(_Answer(status, reader.read(length)))
    return answers


def test_pipelined_requests_are_answered_in_order_then_the_idle_connection_closes(either, reference):
    """Three requests written at once on one keep-alive connection (a probe, a translation with its body, a probe)
    are answered in order; the connection then stays open until --idle_timeout_s (1 s) closes it."""
    body = json.dumps({"text": "A man rides a bike."}).encode()
    requests = b"GET /health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    requests += f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {MAIN_KEY}\r\n".encode()
    requests += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    requests += b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(urlparts(either.url)) as sock:
        sock.settimeout(60)
        sock.sendall(requests)
        ready, translated, live = read_answers(sock, 3)
        assert sock.recv(100) == b""  # closed by the server once idle
    assert (ready.status, translated.status, live.status) == (200, 200, 200)
    assert json.loads(ready.body)["status"] == "ready" and json.loads(live.body)["status"] == "alive"
    assert json.loads(translated.body)["translations"] == [reference.translate(["A man rides a bike."])[0].text]


def _readable(sock) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def test_health_answers_while_a_large_body_is_prepared(ops):
    """Defect 7: a body is parsed, checked and tokenized off the event loop: while its preparation is held, /health
    answers; then the body's long sentence is refused (413)."""
    long_sentence = "PREPHOLD " + "a man rides a bike " * 40
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(post, ops, {"text": [long_sentence] * 4})
        ops.wait_for_log("fault: prepare held")
        health = httpx.get(f"{ops.url}/health/ready", timeout=30)
        assert health.status_code == 200 and not sent.done()
        release(ops, "prephold")
        refused = sent.result()
    assert refused.status_code == 413 and refused.json()["error"]["limit"] == "max_sentence_tokens"


# --------------------------------------------------------------------------------------------------- limits
def test_the_concurrency_cap_answers_429_with_retry_after(ops):
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(post, ops, {"text": f"HOLD:cap A dog number {i} runs."}) for i in range(3)]
        deadline = time.monotonic() + 60
        while metrics(ops).get("hf_variants_serve_requests_in_flight", 0) < 4:  # the three, and this scrape
            assert time.monotonic() < deadline
            time.sleep(0.02)
        over = post(ops, {"text": "One more."})
        release(ops, "cap")
        assert [h.result().status_code for h in held] == [200, 200, 200]
    assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
    assert over.json()["error"]["limit"] == "max_concurrent_requests"


def test_a_keys_own_limits_answer_429_and_leave_the_other_keys_alone(ops):
    first, second, third = (post(ops, {"text": "A dog runs."}, key=RATE_KEY) for _ in range(3))
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert third.json()["error"]["limit"] == "requests_per_minute" and int(third.headers["retry-after"]) >= 1
    assert post(ops, {"text": "A dog runs."}).status_code == 200  # the main key has no limit
    forty = "A man rides a bike down the old roads."  # 38 characters
    assert post(ops, {"text": forty}, key=CHARS_KEY).status_code == 200
    over = post(ops, {"text": forty}, key=CHARS_KEY)
    assert over.status_code == 429 and over.json()["error"]["limit"] == "characters_per_minute"
    too_many = post(ops, {"text": [forty, forty]}, key=CHARS_KEY)
    assert too_many.status_code == 413 and too_many.json()["error"]["limit"] == "characters_per_minute"


# ---------------------------------------------------------------------------------------------- the drain server
@pytest.fixture(scope="module")
def draining(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drain")
    args = ["--model", str(model_dir), "--num_threads", "1", "--graceful_timeout_s", "5", "--max_connections", "5"]
    args += ["--max_wait_ms", "20", "--idle_timeout_s", "120"]
    with ServerProcess(args, faults=True, env={"FAULT_DIR": str(folder)}) as process:
        process.folder = folder
        process.wait_ready()
        yield process


def test_sigterm_drains_then_answers_the_rest_503_and_exits_0(draining, reference):
    """Defect 3 (and the connection cap): 3 held requests and one of other settings in flight, plus this test's
    metrics connection, fill --max_connections 5: a sixth connection is refused with a JSON 503. SIGTERM: the request
    released right after finishes (200), the held ones get a JSON 503 once --graceful_timeout_s passed, and the
    server exits 0 without a traceback."""
    server = draining
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=server.url, timeout=60) as scrape:
        held = [pool.submit(post, server, {"text": f"HOLD:never Dog {i} runs."}) for i in range(3)]
        finishing = pool.submit(post, server, {"text": "HOLD:finish A man rides a bike.", "num_beams": 2})
        deadline = time.monotonic() + 60
        while metric_values(scrape.get("/metrics").text)["hf_variants_serve_requests_in_flight"] < 5:
            assert time.monotonic() < deadline, server.log()[-3000:]  # the four, and this scrape
            time.sleep(0.05)
        server.wait_for_log("fault: HOLD:finish waiting")
        with socket.create_connection(urlparts(server.url)) as extra:
            extra.settimeout(60)
            refused = b""
            while chunk := extra.recv(4096):
                refused += chunk
        server.process.send_signal(signal.SIGTERM)
        server.wait_for_log("Draining:")
        release(server, "finish")
        finished = finishing.result()
        answers = [h.result() for h in held]
        status = server.process.wait(60)
    assert refused.startswith(b"HTTP/1.1 503 ") and b'"max_connections"' in refused
    assert finished.status_code == 200
    assert finished.json()["translations"] == [
        reference.translate(["HOLD:finish A man rides a bike."], DecodeOptions(num_beams=2))[0].text
    ]
    for answer in answers:
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "stopping"
    log = server.log()
    assert status == 0 and "Traceback" not in log and "Internal Server Error" not in log
    assert "Drain timeout" in log and "Cancel" not in log  # uvicorn never had to cancel a task
