"""Bounded load test of a running demo, over loopback only.

    python -m sdxl_engine.loadtest --url http://127.0.0.1:7860/ --clients 8 --seconds 60 [--pid PID]

N client threads (1..64), each with its own gradio_client connection, call ``/generate`` in a
loop for T seconds (1..600); a call still running at the deadline is waited for (at most
``--timeout`` seconds), then the command stops by itself. It prints (and with ``--json``
writes) one report: calls, throughput (calls/s and images/s), p50/p95/max latency in seconds as
the client sees it (queue included), errors grouped by kind, and the server's resident memory
(RSS, MB) before and after. The server process is ``--pid`` or, if omitted, found as the
process listening on the URL's port (needs psutil). Only loopback URLs are accepted: this is
not a tool for loading someone else's server.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

MAX_CLIENTS = 64
MAX_SECONDS = 600.0
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class LoadTestError(ValueError):
    """Arguments outside the tool's bounds (non-loopback URL, too many clients, too long)."""


def check_args(url: str, clients: int, seconds: float) -> None:
    """Raise LoadTestError unless ``url`` is loopback, 1 <= clients <= 64 and 0 < seconds <= 600."""
    host = (urlsplit(url).hostname or "").lower()
    if host not in LOOPBACK:
        raise LoadTestError(f"refusing {url!r}: only loopback URLs (127.0.0.1, localhost, ::1) may be load-tested")
    if not 1 <= clients <= MAX_CLIENTS:
        raise LoadTestError(f"clients must be between 1 and {MAX_CLIENTS}, got {clients}")
    if not 0 < seconds <= MAX_SECONDS:
        raise LoadTestError(f"seconds must be in (0, {MAX_SECONDS:g}], got {seconds}")


def server_rss_mb(pid: int | None) -> float | None:
    """Resident memory of process ``pid`` in MB (from /proc, so no dependency); None if unknown."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.M)
    return int(match.group(1)) / 1024 if match else None


def find_server_pid(url: str) -> int | None:
    """PID of the process listening on the URL's port (psutil, when installed), else None."""
    try:
        import psutil
    except ImportError:
        return None
    port = urlsplit(url).port or 80
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.AccessDenied, OSError):
        return None
    return None


def error_kind(err: BaseException) -> str:
    """A short, stable name for a failed call: busy, app_error, timeout, connection or the type."""
    name = type(err).__name__
    text = str(err)
    if name == "QueueError" or "Queue is full" in text:
        return "busy"
    if name == "AppError":
        return "app_error: " + text[:60]
    if isinstance(err, TimeoutError) or "Timeout" in name:
        return "timeout"
    if isinstance(err, (ConnectionError, OSError)) or "Connect" in name:
        return "connection"
    return name


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run(url: str, clients: int = 4, seconds: float = 20.0, pid: int | None = None, timeout: float = 120.0,
        request: dict | None = None) -> dict:
    """Run the load test and return the report (see the module docstring for its fields).

    Args:
        url: the demo's loopback URL.
        clients: concurrent clients, 1..64.
        seconds: how long clients start new calls, in (0, 600].
        pid: the server's process id, for memory; found from the port if None.
        timeout: seconds one call may take before it counts as a ``timeout`` error.
        request: /generate keyword arguments (default: a short prompt, 4 steps, seed per call).

    Raises:
        LoadTestError: arguments out of bounds or a non-loopback URL.
    """
    from gradio_client import Client

    check_args(url, clients, seconds)
    pid = pid if pid is not None else find_server_pid(url)
    request = request or {"prompt": "a red circle on a blue background", "num_inference_steps": 4}
    latencies: list[float] = []
    images = [0]
    errors: Counter = Counter()
    lock = threading.Lock()
    rss_before = server_rss_mb(pid)
    start = time.perf_counter()
    deadline = start + seconds

    def worker(index: int) -> None:
        try:
            client = Client(url, verbose=False)
        except Exception as err:  # noqa: BLE001 - every failure is counted by kind
            with lock:
                errors[error_kind(err)] += 1
            return
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                gallery, _ = client.submit(**request, seed=index * 100_000 + n, api_name="/generate").result(timeout)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    images[0] += len(gallery)
            except Exception as err:  # noqa: BLE001
                with lock:
                    errors[error_kind(err)] += 1
                if error_kind(err) == "busy":
                    time.sleep(0.5)  # what a polite client does when told to retry
            n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + timeout + 30)
    elapsed = time.perf_counter() - start
    rss_after = server_rss_mb(pid)
    ok = len(latencies)
    return {
        "url": url, "clients": clients, "seconds": seconds, "elapsed_s": round(elapsed, 2),
        "calls_ok": ok, "calls_failed": sum(errors.values()),
        "throughput_calls_per_s": round(ok / elapsed, 3), "throughput_images_per_s": round(images[0] / elapsed, 3),
        "latency_p50_s": _round(percentile(latencies, 50)), "latency_p95_s": _round(percentile(latencies, 95)),
        "latency_max_s": _round(max(latencies) if latencies else None),
        "errors": dict(errors), "server_pid": pid,
        "server_rss_mb_before": _round(rss_before, 1), "server_rss_mb_after": _round(rss_after, 1),
        "server_rss_growth_mb": _round(rss_after - rss_before, 1) if rss_before and rss_after else None,
    }


def _round(value, digits: int = 4):
    return None if value is None else round(value, digits)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Bounded loopback load test of the demo's /generate endpoint.")
    parser.add_argument("--url", default="http://127.0.0.1:7860/")
    parser.add_argument("--clients", type=int, default=4, help=f"concurrent clients, 1..{MAX_CLIENTS}")
    parser.add_argument("--seconds", type=float, default=20.0, help=f"duration, up to {MAX_SECONDS:g}")
    parser.add_argument("--pid", type=int, default=None, help="server process id (default: found from the port)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one call may take")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps of every call")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    try:
        report = run(args.url, args.clients, args.seconds, args.pid, args.timeout,
                     {"prompt": "a red circle on a blue background", "num_inference_steps": args.steps})
    except LoadTestError as err:
        parser.error(str(err))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
