"""A judge service for the peer comparison: rewards that take time, as a remote verifier's do.

Many RL tasks are scored by a service rather than a local function: an LLM judge, a code
sandbox, a proof checker. Its answer takes a fraction of a second to seconds, with a long
tail. This module is that service, made a real server so both frameworks pay for it the
same way: an HTTP server (stdlib, one thread per request) that answers
``POST /judge {"completion", "reference"}`` with ``{"reward": integer_match(...)}`` after
a latency drawn from a log-normal distribution (``--median-ms``, ``--sigma``) by a seeded
generator, so every side of a comparison draws the same sequence of latencies.
``POST /reset`` restarts that sequence and the statistics, ``GET /stats`` returns them.

The clients, one per framework, each as its framework's users would write it:

- ``judged_integer_match(completion, reference)``: a SeamlessFlow reward function
  (synchronous; the trajectory service runs it in one of its verifier threads, up to
  ``SF_TRAJECTORY_VERIFY_CONCURRENCY`` at once). Reached as the dotted path
  ``peer_judge:judged_integer_match`` with this directory on ``PYTHONPATH``.
- ``trl_judge_reward``: a TRL reward function (asynchronous: TRL awaits it on its event
  loop thread with the whole batch, and it asks for every sample at once).

Both read the server's address from ``PEER_JUDGE_URL``.

    .venv/bin/python loadtests/peer_judge.py --median-ms 500 [--sigma 0.5] [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

URL_ENV = "PEER_JUDGE_URL"


def _score(completion: str, reference: str) -> float:
    from seamlessflow.rewards import integer_match

    return float(integer_match(completion, reference))


class JudgeState:
    """The latency generator and what was served since the last reset."""

    def __init__(self, median_s: float, sigma: float, seed: int) -> None:
        self.median_s, self.sigma, self.seed = median_s, sigma, seed
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.rng = random.Random(self.seed)
            self.latencies: list[float] = []

    def draw(self) -> float:
        with self.lock:
            if self.median_s <= 0:
                latency = 0.0
            else:
                latency = self.rng.lognormvariate(math.log(self.median_s), self.sigma)
            self.latencies.append(latency)
            return latency

    def stats(self) -> dict[str, Any]:
        with self.lock:
            drawn = sorted(self.latencies)
        if not drawn:
            return {"requests": 0}

        def quantile(q: float) -> float:
            return drawn[min(len(drawn) - 1, int(q * len(drawn)))]

        return {
            "requests": len(drawn),
            "mean_s": sum(drawn) / len(drawn),
            "p50_s": quantile(0.5),
            "p99_s": quantile(0.99),
            "max_s": drawn[-1],
        }


def make_server(host: str, port: int, state: JudgeState) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length)
            if self.path == "/reset":
                state.reset()
                self._reply(200, {"ok": True})
                return
            if self.path != "/judge":
                self._reply(404, {"error": f"no route {self.path}"})
                return
            try:
                body = json.loads(raw)
                completion, reference = str(body["completion"]), str(body["reference"])
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, {"error": f"bad judge request: {exc}"})
                return
            time.sleep(state.draw())
            self._reply(200, {"reward": _score(completion, reference)})

        def do_GET(self) -> None:
            if self.path == "/stats":
                self._reply(200, state.stats())
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would cost more than the answer

    class Server(ThreadingHTTPServer):
        # a batch's requests arrive at once; the stdlib's backlog of 5 would drop SYNs and
        # make clients retry after a second, a latency no real judge service has
        request_queue_size = 1024
        daemon_threads = True

    return Server((host, port), Handler)


# --------------------------------------------------------------------------- clients


def _judge_url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        raise RuntimeError(f"{URL_ENV} is not set: where is the judge service?")
    return url.rstrip("/")


def judged_integer_match(completion: str, reference: str) -> float:
    """SeamlessFlow reward function: the judge service's verdict (blocking call)."""
    body = json.dumps({"completion": completion, "reference": reference}).encode()
    request = urllib.request.Request(
        f"{_judge_url()}/judge", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return float(json.loads(response.read())["reward"])


async def _ask(host: str, port: int, completion: str, reference: str) -> float:
    body = json.dumps({"completion": completion, "reference": reference}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /judge HTTP/1.1\r\nhost: judge\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"judge answered {head.splitlines()[0]!r}")
    return float(json.loads(payload)["reward"])


async def trl_judge_reward(
    completions: list[Any], reference: list[str], **_: Any
) -> list[float | None]:
    """TRL reward function: every sample of the batch asked at once."""
    address = urlsplit(_judge_url())
    host, port = address.hostname or "127.0.0.1", address.port or 80
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    scores = await asyncio.gather(
        *(_ask(host, port, t, r) for t, r in zip(texts, reference, strict=True))
    )
    return [*scores]


def reset(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{url}/reset", data=b"{}"), timeout=10).close()


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as response:
        return dict(json.loads(response.read()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A judge service with log-normal latency.")
    parser.add_argument("--median-ms", type=float, required=True)
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    args = parser.parse_args(argv)
    if args.median_ms < 0 or args.sigma < 0:
        parser.error("--median-ms and --sigma must be >= 0")
    server = make_server(
        args.host, args.port, JudgeState(args.median_ms / 1000, args.sigma, args.seed)
    )
    host, port = server.server_address[:2]
    print(f"http://{host}:{port}", flush=True)  # the parent reads the address from here
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
