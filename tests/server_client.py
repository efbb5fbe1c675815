"""What every server test asks of a running `ridgefill serve` (the conformance suite's servers, llama.cpp's server
tests): requests over loopback with the server's key or none, completions at temperature 0 with no other sampling
field, RidgeFill's counters read from /metrics. A test's server is a dataclass with `base`, `key` and `name` that
inherits this."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class ServerClient:
    base: str  # http://127.0.0.1:PORT
    key: str
    name: str  # the model name clients send

    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def request(self, method: str, path: str, body: dict | bytes | None = None, key: str | None = "",
                headers: dict | None = None, timeout: float = 300.0) -> tuple[int, dict, bytes]:
        """(status, headers, body); key "" (default): the server's key, None: no key."""
        key = self.key if key == "" else key
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                **(headers or {})}
        req = urllib.request.Request(self.base + path, data, sent, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()

    def post(self, path: str, body: dict | bytes, key: str | None = "", **kw) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body, key, **kw)
        try:
            return status, json.loads(data or b"{}")
        except ValueError:
            return status, {"raw": data.decode(errors="replace")}

    def complete(self, prompt, max_tokens: int, **fields) -> dict:
        """A completion with temperature 0 and no other sampling field (the server's defaults otherwise)."""
        status, body = self.post("/v1/completions", {"model": self.name, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, **fields})
        assert status == 200, body
        return body

    def metrics(self) -> dict[str, float]:
        """RidgeFill's lines of /metrics (no key: it is open), by name."""
        status, _, data = self.request("GET", "/metrics", key=None)
        assert status == 200
        return {line.split()[0]: float(line.split()[1]) for line in data.decode().splitlines()
                if line.startswith("ridgefill_") and " " in line}
