"""bench-serve's engine-neutral load client (backends/load.py) against a loopback server the test starts: streamed
completions, seeded Poisson arrivals, time to first token from the first chunk with text, and a failed request as
one line."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from ridgefill.backends.load import arrivals, drive_completions
from ridgefill.errors import RidgefillError

DELAY = 0.05  # seconds the fake server waits before its first chunk with text


class Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.seen.append(body)
        if body["prompt"] == "fail":
            payload = b'{"error": "bad prompt"}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        # a role-only first chunk (no text), then one token per chunk, the last with its finish reason
        n = body["max_tokens"] if body["prompt"] != "short" else 2  # "short" stops early (end of sequence)
        chunks = [{"text": ""}] + [{"text": f"t{i}"} for i in range(n)]
        chunks[-1]["finish_reason"] = "length" if body["prompt"] != "short" else "stop"
        for i, choice in enumerate(chunks):
            if i == 1:
                time.sleep(DELAY)
            self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server():
    Fake.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_arrivals_are_seeded_poisson_and_infinite_rate_sends_at_once():
    a, b = arrivals(2000, 4.0, seed=3), arrivals(2000, 4.0, seed=3)
    assert a == b and a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert arrivals(2000, 4.0, seed=4) != a
    assert arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_streamed_completions_are_timed_per_request(server):
    out = drive_completions(server, "m", ["a", "b", "short"], float("inf"), 4, seed=0, time_limit=30,
                            extra_body={"logit_bias": {"2": -100}})
    assert [o["output_tokens"] for o in out] == [4, 4, 2]  # "length": max_tokens; "stop": the chunks with text
    for o in out:
        assert DELAY * 0.9 <= o["ttft"] <= o["latency"] and o["start"] >= 0
    assert {s["prompt"] for s in Fake.seen} == {"a", "b", "short"}
    assert all(s["stream"] is True and s["temperature"] == 0.0 and s["max_tokens"] == 4
               and s["logit_bias"] == {"2": -100} and s["model"] == "m" for s in Fake.seen)


def test_a_failed_request_fails_the_run_in_one_line(server):
    with pytest.raises(RidgefillError, match=r"^1 of 2 requests failed at inf requests/s \(the first: HTTP 400: "
                                             r"\{\"error\": \"bad prompt\"\}\): see the server's log$"):
        drive_completions(server, "m", ["a", "fail"], float("inf"), 2, seed=0, time_limit=30)


def test_a_run_past_the_time_limit_is_one_line(server):
    with pytest.raises(RidgefillError, match=r"took over --time-limit 0.01 s"):
        drive_completions(server, "m", ["a"], 1000.0, 2, seed=0, time_limit=0.01)


def test_failures_as_vllms_client_reports_them_are_the_same_one_line():
    """vLLM's benchmark client gives an error string per request ("" for a success): the same line as ours."""
    from ridgefill.backends.load import check_failures

    check_failures(["", "", ""], 0.5)  # none failed
    with pytest.raises(RidgefillError, match=r"^2 of 3 requests failed at 0.5 requests/s \(the first: Traceback "
                                             r"\(most recent call last\):\): see the server's log$"):
        check_failures(["", "Traceback (most recent call last):\n  File ...\nValueError: x\n", "boom"], 0.5)
