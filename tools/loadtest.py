"""Bounded load test of a running demo, over loopback only.

    python -m tools.loadtest --url http://127.0.0.1:7860/ --clients 8 --seconds 60 [--pid PID]

N client threads (1..64), each with its own gradio_client connection, call ``/generate`` in a
loop for T seconds (1..600); a call still running at the deadline is waited for (at most
``--timeout`` seconds), then the command stops by itself. It prints (and with ``--json``
writes) one report: calls, throughput (calls/s and images/s), p50/p95/max latency in seconds as
the client sees it (queue included), errors grouped by kind, and the server's resident memory
(RSS, MB) before and after. The server process is ``--pid`` or, if omitted, found as the
process listening on the URL's port (needs psutil). Only loopback URLs are accepted: this is
not a tool for loading someone else's server.

    python -m tools.loadtest --replicas 1,2 --clients 4 --seconds 20 --device-s 1.5 [--bench]

compares replica counts in one run: it starts ``python app.py`` itself (once without Ray, for
its start time; then ``--replicas N`` for each N, every replica the same CPU share), loads each
with ``--device-s`` seconds of simulated device time per request (the TEST-ONLY
``fault:slow=S`` marker, ``SDXL_FAULT_INJECTION=1``: two CPU cores cannot show accelerator
scaling), kills one replica by its pid under load in the largest run (``--no-kill`` skips it),
and with ``--bench`` rewrites the scale-out section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from gradio_client import Client

from tools.report import write_section

MAX_CLIENTS = 64
MAX_SECONDS = 600.0
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ROOT = Path(__file__).resolve().parents[1]  # where app.py is
PAGE_UP = "[app] Running on local URL"
ENGINE_READY = "[sdxl_engine] ready in"
REPLICA_READY = re.compile(r"\[sdxl_engine\] Serve replica (\w+) ready \(pid (\d+)\)")
REPLICA_START = re.compile(r"pid=(\d+)\)\S* .*\[sdxl_engine\] ready in ([\d.]+) s")  # after the time, level, logger


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
        import psutil  # optional (requirements-dev.txt): without it the server's memory is not sampled
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


def client_headers(index: int) -> dict[str, str]:
    """Client ``index``'s own address (198.18.x.y, the benchmarking range of RFC 2544) in X-Forwarded-For.

    The server counts each address as one client (max_requests_per_client); it believes the header
    only from a trusted proxy, so start it with ``--trusted-proxies 127.0.0.1`` (:data:`APP_ARGS`):
    otherwise every client of this tool is 127.0.0.1, one client.
    """
    return {"X-Forwarded-For": f"198.18.{index // 250}.{index % 250 + 1}"}


APP_ARGS = ("--trusted-proxies", "127.0.0.1")  # for client_headers


def error_kind(err: BaseException) -> str:
    """A short, stable name for a failed call: busy, app_error, timeout, connection or the type."""
    name = type(err).__name__
    text = str(err)
    # Gradio's own "queue full", or the service's line full (its 503 refusal, which the page's events send as
    # an AppError with the service's text: sdxl_engine/service/service.py).
    if name == "QueueError" or "Queue is full" in text or text.startswith("the server cannot take this request now"):
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
            client = Client(url, verbose=False, headers=client_headers(index))
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


# ---- scale-out: replica counts compared, one replica lost --------------------------------------

def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServedApp:
    """``python app.py ARGS`` in a subprocess on a free loopback port, its log kept and timed.

    ``seen(text)`` gives the seconds from the spawn until a log line first contained ``text``.
    """

    def __init__(self, args: list[str], env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.lines: list[tuple[float, str]] = []  # (seconds since spawn, line)
        self.started = time.perf_counter()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(self.port), *APP_ARGS, *args],
                                     cwd=ROOT,
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.started, line.rstrip("\n")))

    @property
    def log(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def seen(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def wait_for(self, text: str, timeout: float = 300.0) -> float:
        """Seconds from the spawn until ``text`` appeared in the log. Raises RuntimeError if the app
        exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while (at := self.seen(text)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"app never logged {text!r}:\n" + self.log[-4000:])
            time.sleep(0.1)
        return at

    def replica_pids(self) -> dict[str, int]:
        """{Serve replica id: pid} of every replica that logged its start so far."""
        return {m[1]: int(m[2]) for _, line in list(self.lines) if (m := REPLICA_READY.search(line))}

    def replica_start_s(self, pid: int) -> float | None:
        """The start-up time (load + compile + warm-up, seconds) that replica ``pid`` logged."""
        return next((float(m[2]) for _, line in list(self.lines)
                     if (m := REPLICA_START.search(line)) and int(m[1]) == pid), None)

    def stop(self, timeout: float = 90.0) -> tuple[int | None, float]:
        """SIGTERM, wait; (exit status or None if it had to be killed, seconds it took)."""
        t0 = time.perf_counter()
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self._reader.join(5)
        return code, time.perf_counter() - t0


def slow_request(device_s: float) -> dict:
    """/generate keywords for a request with ``device_s`` seconds of simulated device time (2 real steps)."""
    return {"prompt": f"a red circle on a blue background fault:slow={device_s:g}", "num_inference_steps": 2}


@dataclasses.dataclass
class Call:
    """One client call: when it started and ended (perf_counter), and the replica or the error."""

    t0: float
    t1: float
    ok: bool
    replica: str = ""
    error: str = ""


def replica_loss(app: ServedApp, clients: int = 4, device_s: float = 2.0, timeout: float = 240.0) -> dict:
    """Kill one replica of ``app`` by its pid (SIGKILL) under load; report what the clients saw.

    ``clients`` loop on requests with ``device_s`` of simulated device time (enough to keep every
    replica busy). Once each replica served at least one call, one is killed; the load goes on until
    a replica that did not exist before serves a call (the replacement), or ``timeout`` seconds.

    Returns: the victim, ``in_flight`` (calls running at the kill: outcome and seconds from the kill
    to their end), ``errors_after`` (calls sent after the kill that failed), ``survivor_ok`` (calls
    the surviving replicas completed after the kill and before the replacement served: the ones
    queued there at the kill count, since a survivor busy with those cannot start new ones sooner),
    ``replacement_serves_s`` (kill -> first call served by the replacement), ``replacement_start_s`` (its own
    start-up as it logged it) and ``first_start_s`` (the killed replica's start-up, for comparison).
    """

    calls: list[Call] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(index: int) -> None:
        client = Client(app.url, verbose=False, headers=client_headers(index))
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                _, info = client.submit(**slow_request(device_s), seed=index * 100_000 + n,
                                        api_name="/generate").result(timeout=120)
                call = Call(t0, time.perf_counter(), True, replica=info.get("replica", ""))
            except Exception as err:  # noqa: BLE001 - every failure is recorded with its message
                call = Call(t0, time.perf_counter(), False, error=f"{type(err).__name__}: {err}")
            with lock:
                calls.append(call)
            n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    before = set(app.replica_pids())
    deadline = time.monotonic() + 120
    while not before <= {c.replica for c in list(calls) if c.ok}:
        if time.monotonic() > deadline:
            stop.set()
            raise RuntimeError(f"not every replica served within 120 s: {before}, calls {calls}")
        time.sleep(0.1)
    before |= {c.replica for c in list(calls) if c.ok}
    time.sleep(device_s / 2)  # into the next round: every replica is in the middle of a request
    victim, pid = sorted(app.replica_pids().items())[0]
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while not any(c.ok and c.replica not in before for c in list(calls)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(150)
    new = sorted((c for c in calls if c.ok and c.replica not in before), key=lambda c: c.t1)
    replaced_at = new[0].t1 if new else None
    replacement = new[0].replica if new else ""
    in_flight = [c for c in calls if c.t0 < killed < c.t1]
    after = [c for c in calls if c.t0 >= killed]
    return {
        "replicas_before": sorted(before), "victim": victim, "victim_pid": pid,
        "in_flight": [{"ok": c.ok, "replica": c.replica, "error": c.error[:200],
                       "ended_after_kill_s": round(c.t1 - killed, 2)} for c in in_flight],
        "errors_after": [c.error[:200] for c in after if not c.ok],
        "survivor_ok": sum(1 for c in calls if c.ok and c.replica in before and c.t1 > killed
                           and (replaced_at is None or c.t1 < replaced_at)),
        "calls_after_kill": len(after),
        "replacement": replacement,
        "replacement_serves_s": round(replaced_at - killed, 2) if replaced_at else None,
        "count_back_s": _count_back_s(app, len(before), killed),
        "replacement_start_s": app.replica_start_s(app.replica_pids().get(replacement, -1)),
        "first_start_s": app.replica_start_s(pid),
    }


def _count_back_s(app: ServedApp, count: int, since: float) -> float | None:
    """Seconds from ``since`` (perf_counter) until the front logged all ``count`` replicas ready again."""
    text = f"[replicas] {count} of {count} replicas ready at"
    times = [app.started + t for t, line in list(app.lines) if text in line]  # the line starts with its time
    return next((round(t - since, 2) for t in times if t > since), None)


def compare_replicas(counts: tuple[int, ...] = (1, 2), clients: int = 4, seconds: float = 20.0, device_s: float = 1.5,
                     kill: bool = True, log=print) -> dict:
    """Start the app once without Ray, then with ``--replicas N`` for each N; load each; kill a replica in the largest.

    Every replica gets the same CPU share (``--replica-resources {"CPU": cores // max(counts)}``),
    so the runs differ only in how many there are. Returns the report (see the module docstring).
    """
    cpus = max(1, (os.cpu_count() or 1) // max(counts))
    resources = json.dumps({"CPU": cpus})
    report: dict = {"clients": clients, "seconds": seconds, "simulated_device_s": device_s,
                    "replica_resources": resources,
                    "machine": f"{platform.machine()} {os.cpu_count()} cores",
                    "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    log("[loadtest] python app.py (no Ray): start time")
    app = ServedApp([])
    try:
        ready = app.wait_for(ENGINE_READY)
        report["start_default"] = {"page_s": round(app.seen(PAGE_UP), 2), "ready_s": round(ready, 2),
                                   "compile_cache": _cache_words(app.log)}
    finally:
        exit_status, _ = app.stop()
    report["start_default"]["exit"] = exit_status
    for n in counts:
        log(f"[loadtest] python app.py --replicas {n}: start, {clients} clients for {seconds:g} s")
        app = ServedApp(["--replicas", str(n), "--replica-resources", resources], env={"SDXL_FAULT_INJECTION": "1"})
        run_report: dict = {}
        try:
            all_ready = app.wait_for(f"[replicas] {n} of {n} replicas ready")
            ray_up = app.seen("[replicas] Ray ")
            first = app.seen("[replicas] first replica ready")
            run_report["start"] = {"page_s": round(app.seen(PAGE_UP), 2), "ray_up_s": round(ray_up, 2),
                                   "ray_init_s": _ray_init_s(app.log), "first_replica_s": round(first, 2),
                                   "replica_cold_start_s": round(first - ray_up, 2),
                                   "all_replicas_s": round(all_ready, 2), "compile_cache": _cache_words(app.log)}
            run_report["load"] = run(app.url, clients, seconds, pid=app.proc.pid, timeout=120,
                                     request=slow_request(device_s))
            if kill and n == max(counts) and n > 1:
                log(f"[loadtest] killing one of {n} replicas under load")
                run_report["replica_loss"] = replica_loss(app, clients, device_s=max(device_s, 2.0))
        finally:
            run_report["exit"], run_report["stop_s"] = app.stop()
            run_report["stop_s"] = round(run_report["stop_s"], 2)
        report["runs"][str(n)] = run_report
    base = report["runs"][str(min(counts))]["load"]["throughput_calls_per_s"]
    for n in counts:
        load = report["runs"][str(n)]["load"]
        load["speedup"] = round(load["throughput_calls_per_s"] / base, 3) if base else None
    return report


def _ray_init_s(log: str) -> float | None:
    """Seconds ``ray.init`` took, as the front logged it (``[replicas] Ray 2.60.0: ... in 8.9 s; ...``)."""
    match = re.search(r"\[replicas\] Ray \S+: .* in ([\d.]+) s;", log)
    return float(match.group(1)) if match else None


def _cache_words(log: str) -> list[str]:
    """How each program the log reports was made: ``loaded`` (executable cache), ``compiled``
    (stored in the executable cache), or the persistent compilation cache's ``hit`` / ``miss``."""
    return [made if made == "loaded" else cache or "compiled"
            for made, cache in re.findall(r"\[sdxl_engine\] (loaded|compiled) .*?"
                                          r"(?:compile cache: (hit|miss|not used)|$)", log, flags=re.MULTILINE)]


def scaleout_markdown(report: dict) -> str:
    """The docs/benchmarks.md section for a :func:`compare_replicas` report."""
    runs = report["runs"]
    lines = [f"Run: {report.get('time', time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))} · {report['machine']} · "
             f"model `tiny-shapes` · {report['clients']} clients for {report['seconds']:g} s per run · each request "
             f"{report['simulated_device_s']:g} s of simulated device time (`fault:slow`) + 2 real steps · "
             f"each replica `{report['replica_resources']}` · `python -m tools.loadtest --replicas "
             f"{','.join(runs)} --clients {report['clients']} --seconds {report['seconds']:g} "
             f"--device-s {report['simulated_device_s']:g} --bench`",
             "", "| replicas | calls ok | failed | calls/s | images/s | p50 s | p95 s | throughput vs 1 replica |",
             "|---|---|---|---|---|---|---|---|"]
    for n, run_report in runs.items():
        load = run_report["load"]
        lines.append(f"| {n} | {load['calls_ok']} | {load['calls_failed']} | {load['throughput_calls_per_s']:.3f} | "
                     f"{load['throughput_images_per_s']:.3f} | {load['latency_p50_s']:.2f} | "
                     f"{load['latency_p95_s']:.2f} | **{load['speedup']:.2f}x** |")
    start = report["start_default"]
    lines += ["", "| start, seconds from the command (same run) | page up | engine ready | compile cache |",
              "|---|---|---|---|",
              f"| `python app.py` (no Ray imported) | {start['page_s']} | {start['ready_s']} | "
              f"{', '.join(start['compile_cache'])} |"]
    for n, run_report in runs.items():
        st = run_report["start"]
        lines.append(f"| `python app.py --replicas {n}` (`ray.init` {st['ray_init_s']} s) | {st['page_s']} | first "
                     f"replica {st['first_replica_s']} ({st['replica_cold_start_s']} s after Ray was up), all "
                     f"{st['all_replicas_s']} | {', '.join(st['compile_cache'])} |")
    loss = next((r["replica_loss"] for r in runs.values() if "replica_loss" in r), None)
    if loss:
        def outcome(call: dict) -> str:
            what = f"served by `{call['replica']}`" if call["ok"] else "error " + call["error"].split(": ", 1)[-1]
            return f"{what} ({call['ended_after_kill_s']} s after the kill)"

        cold = next(r["start"]["replica_cold_start_s"] for r in runs.values() if "replica_loss" in r)
        lines += ["", f"Replica loss (in the {max(runs, key=int)}-replica run, {report['clients']} clients, requests "
                      f"of 2 s simulated device time): replica `{loss['victim']}` (pid {loss['victim_pid']}) killed "
                      "with SIGKILL once every replica had served.", "",
                  "| what | measured |", "|---|---|",
                  f"| the {len(loss['in_flight'])} calls in flight at the kill (running or queued) | "
                  + "; ".join(outcome(c) for c in loss["in_flight"]) + " |",
                  f"| calls sent after the kill that failed | {len(loss['errors_after'])} of "
                  f"{loss['calls_after_kill']} |",
                  f"| calls served by the survivor before the replacement served | {loss['survivor_ok']} |",
                  f"| kill → the front counts {len(loss['replicas_before'])} ready replicas again (the replacement "
                  f"`{loss['replacement']}` is up) | **{loss['count_back_s']} s** |",
                  f"| kill → the replacement's first call done (its 2 s of device time included) | "
                  f"{loss['replacement_serves_s']} s |",
                  f"| a replica's cold start in this run (Ray up → first replica ready: process, imports, load, "
                  f"compile, warm-up) | {cold} s |",
                  f"| engine start-up inside the replica (load + compile + warm-up), as logged: killed / replacement | "
                  f"{loss['first_start_s']} s / {loss['replacement_start_s']} s |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Bounded loopback load test of the demo's /generate endpoint.")
    parser.add_argument("--url", default="http://127.0.0.1:7860/")
    parser.add_argument("--clients", type=int, default=4, help=f"concurrent clients, 1..{MAX_CLIENTS}")
    parser.add_argument("--seconds", type=float, default=20.0, help=f"duration, up to {MAX_SECONDS:g}")
    parser.add_argument("--pid", type=int, default=None, help="server process id (default: found from the port)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one call may take")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps of every call")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the report to this file")
    parser.add_argument("--replicas", default=None,
                        help="compare replica counts, e.g. 1,2: starts python app.py --replicas N itself "
                             "(--url unused)")
    parser.add_argument("--device-s", type=float, default=1.5,
                        help="with --replicas: simulated device seconds per request")
    parser.add_argument("--no-kill", action="store_true", help="with --replicas: skip killing a replica")
    parser.add_argument("--bench", action="store_true",
                        help="with --replicas: rewrite docs/benchmarks.md's scale-out section")
    args = parser.parse_args(argv)
    if args.replicas:
        try:
            counts = tuple(sorted({int(n) for n in args.replicas.split(",")}))
        except ValueError:
            parser.error(f"--replicas takes counts such as 1,2, got {args.replicas!r}")
        check_args("http://127.0.0.1/", args.clients, args.seconds)
        report = compare_replicas(counts, args.clients, args.seconds, args.device_s, kill=not args.no_kill)
        text = json.dumps(report, indent=2)
        print(text)
        if args.json_path:
            Path(args.json_path).write_text(text + "\n")
        if args.bench:
            write_section(ROOT / "docs/benchmarks.md", "scaleout", scaleout_markdown(report))
        return 0
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
