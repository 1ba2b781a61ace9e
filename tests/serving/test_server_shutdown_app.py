"""Stopping and admission: stop signals (nested, repeated), the shutdown message, the per-client cap.

The servers here are ``tests/serve_harness.py``: the app's own ``server.serve`` (signal handling,
Guard, RequestGate) around a one-endpoint page, a client of a real service (its line, the per-client cap, the
shutdown refusal) whose calls end when the test says so (a file appears), so nothing depends on timing.
"""

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.service.service import SHUTTING_DOWN, over_limit_message
from sdxl_engine.serving.server import StopSignals
from tests.helpers import LOG_LINE, ROOT, RunningApp, log_message, wait_until

pytestmark = pytest.mark.e2e

HARNESS = ROOT / "tests" / "serve_harness.py"
PORTS = iter(range(7810, 7830))  # this test file's own ports
STOPS = 100


class Harness:
    """``serve_harness.py`` in a subprocess; its output lines arrive in :attr:`lines`."""

    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, str(HARNESS), *args], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False",
                                          **(env or {})})
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def until(self, text: str, timeout: float = 120) -> list[str]:
        """The lines up to and including the first one containing ``text`` (AssertionError after ``timeout`` s)."""
        seen, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout} s; output:\n{''.join(self.log[-40:])}") from None
            assert line is not None, f"exited ({self.proc.poll()}) before {text!r}:\n{''.join(self.log[-40:])}"
            seen.append(line)
            if text in line:
                return seen

    def signal(self, signum=signal.SIGTERM) -> None:
        os.kill(self.proc.pid, signum)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


PROXY = {"SDXL_TRUSTED_PROXIES": "127.0.0.1"}  # so a test's X-Forwarded-For stands for another client address


def forwarded(address: str) -> dict:
    return {"X-Forwarded-For": address}


@pytest.fixture
def page(tmp_path):
    """A served page (``serve_harness.py page``) behind a trusted proxy (loopback), so X-Forwarded-For
    names the client: (harness, url, folder whose files end held calls)."""
    port = next(PORTS)
    harness = Harness("page", str(port), str(tmp_path), env=PROXY)
    try:
        harness.until("[app] Running on local URL")
        yield harness, f"http://127.0.0.1:{port}/", tmp_path
    finally:
        (tmp_path / "all").touch()
        harness.close()


def _spin(seconds: float) -> None:
    """Busy-wait ``seconds`` (microseconds: far below what time.sleep resolves)."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def test_a_burst_of_signals_at_each_stop_never_hangs():
    """Each stop gets two SIGTERMs microseconds apart, as GNU timeout sends them (to the child, then
    to its group), at a random point of the serving loop's poll: every stop drains, logs "stopped"
    and returns 0. The second signal then often lands while the first one's handler runs, which is
    how the old handler (``threading.Event.set``, which takes the Event's lock) deadlocked."""
    harness = Harness("stops", "0", str(STOPS))
    rng = random.Random(19)
    try:
        for stop in range(STOPS):
            harness.until("[app] Running on local URL")
            time.sleep(rng.uniform(0.0, 0.25))  # where in the 0.2 s poll the signals land: not a wait for anything
            harness.signal()
            _spin(rng.uniform(10e-6, 45e-6))  # about the time the first handler takes to start and run
            harness.signal()
            lines = harness.until("serve returned", timeout=60)
            assert lines[-1].strip() == "serve returned 0", (stop, lines)
            assert any(log_message(line) == "[app] stopped" for line in lines), (stop, lines)
            assert sum("second stop signal ignored" in line for line in lines) <= 1, lines
        assert harness.proc.wait(60) == 0
    finally:
        harness.close()


def test_a_stop_signal_during_the_imports_is_a_clean_stop(tmp_path):
    """SIGTERM 1 s after ``python app.py`` starts (still importing Gradio and JAX): the two stop lines and
    status 0, as for a stop while the model loads; it was a silent 143 (the default kill)."""
    from tests.helpers import free_port

    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(free_port())], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False",
                                 "HOME": str(tmp_path)})
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (proc.returncode, out[-2000:], err[-2000:])
    logged = [log_message(line) for line in err.splitlines() if LOG_LINE.fullmatch(line)]
    assert logged == ["[app] stopping: a stop signal came before the server started", "[app] stopped"], err
    assert "Traceback" not in err and "error:" not in err and out == "", (out, err)


def test_the_guard_is_in_place_from_the_first_connection(tmp_path):
    """A client hammering the port while the server starts never gets an answer the guard would refuse: the
    routes, middleware and key checks go in before the server listens (their set-up takes 3 s here), so every
    answer to ``POST /gradio_api/upload`` of a file that is not an image is the guard's refusal, never Gradio's own."""
    import socket

    port = next(PORTS)
    harness = Harness("page", str(port), str(tmp_path), env={"HARNESS_SET_UP_S": "3"})
    answers, up = [], threading.Event()

    def hammer():
        while not up.is_set() and harness.proc.poll() is None:
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/gradio_api/upload", files={"files": b"x"}, timeout=5)
                answers.append((response.status_code, response.text))
            except httpx.TransportError:  # not listening yet
                time.sleep(0.005)

    thread = threading.Thread(target=hammer, daemon=True)
    try:
        thread.start()
        harness.until("[app] Running on local URL")
        time.sleep(0.5)  # a few more answers once it is up
        up.set()
        thread.join(30)
        assert answers, "the hammer never got an answer"
        # The guard's answer (the one upload route open takes images only), never Gradio's own upload.
        assert {status for status, _ in answers} == {415}, sorted(set(answers))[:5]
        assert all("PNG, JPEG or WebP images only" in text for _, text in answers), sorted(set(answers))[:5]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        up.set()
        harness.close()


def test_the_third_signal_exits_at_once_with_128_plus_its_number(page):
    from gradio_client import Client

    harness, url, _ = page
    held = Client(url, verbose=False).submit("hold:never", api_name="/generate")
    wait_until(lambda: _running(url), "the call running")
    assert not held.done()
    gap = 2 * StopSignals.BURST_S  # signals closer than that to the first are the first stop's burst
    harness.signal()
    assert "(1 running, 0 waiting)" in harness.until("[app] stopping")[-1]  # it keeps the drain open (60 s)
    time.sleep(gap)
    harness.signal()
    harness.until("[app] second stop signal ignored: already stopping (a third one exits at once)")
    time.sleep(gap)
    harness.signal()
    assert harness.proc.wait(30) == 128 + signal.SIGTERM
    harness.lines.get(timeout=30)  # the reader has seen the end
    log = "".join(harness.log)
    assert ("[app] SIGTERM a third time: exiting at once, without finishing the calls still running "
            "(exit status 143)") in log
    assert "[app] stopped" not in log and log.count("second stop signal ignored") == 1


def _service(url: str) -> dict:
    """The harness's service now: its calls ``waiting`` in line and ``running`` (Gradio's queue holds none)."""
    return httpx.get(url + "harness/service", timeout=30).json()


def _waiting(url: str) -> int:
    return _service(url)["waiting"]


def _running(url: str, n: int = 1) -> bool:
    return _service(url)["running"] == n


def _refusals(log: str, client: str = "") -> int:
    """The service's log lines refusing a client over its cap (``client``'s only, if given)."""
    return log.count(f"[app] request refused: client {client}") if client else log.count(
        "[app] request refused: client ")


def _call_result(url: str, event_id: str, headers: dict | None = None) -> tuple[str, str]:
    """(the SSE event name, its data) that ends a raw call's result stream (``complete`` or ``error``)."""
    import json

    event = ""
    with httpx.stream("GET", url + f"gradio_api/call/generate/{event_id}", timeout=30, headers=headers) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                return event, json.loads(line[5:])
    raise AssertionError("the stream ended without a result")


def _join(url: str, session: str, prompt: str, headers: dict | None = None) -> str:
    """The page's queue/join for one call (raw HTTP); returns its event id."""
    config = httpx.get(url + "config", timeout=30).json()
    fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
    join = httpx.post(url + "gradio_api/queue/join", timeout=30, headers=headers, json={
        "data": [prompt], "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None})
    assert join.status_code == 200, join.text
    return join.json()["event_id"]


def _browser_join(url: str, session: str, prompt: str, headers: dict | None = None) -> dict:
    """What the page's JavaScript does for one call: queue/join, then its session's event stream;
    returns the stream's process_completed message."""
    event_id = _join(url, session, prompt, headers)
    return _completion(url, session, event_id, headers)


def _completion(url: str, session: str, event_id: str, headers: dict | None = None) -> dict:
    """The process_completed message of ``event_id``, read from its session's event stream."""
    import json

    deadline = time.monotonic() + 60  # the stream sends a heartbeat every few seconds while the call waits
    with httpx.stream("GET", url + f"gradio_api/queue/data?session_hash={session}", timeout=30,
                      headers=headers) as stream:
        for line in stream.iter_lines():
            assert time.monotonic() < deadline, f"{event_id}: no result within 60 s"
            if line.startswith("data:") and (message := json.loads(line[5:]))["msg"] == "process_completed":
                assert message["event_id"] == event_id
                return message
    raise AssertionError("the stream ended without process_completed")


def test_every_client_is_told_the_server_is_shutting_down(page):
    """While a call in flight keeps the drain open, a new call gets "shutting down" from gradio_client
    (AppError, not QueueError "Queue is full"), raw HTTP (503) and the page's own protocol."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    harness, url, folder = page
    first, second = Client(url, verbose=False), Client(url, verbose=False)
    running = first.submit("hold:first", api_name="/generate")
    wait_until(lambda: _running(url), "the first call running")
    harness.signal()
    harness.until("[app] stopping")
    with pytest.raises(AppError) as refused:
        second.submit("a red circle", api_name="/generate").result(timeout=60)
    assert str(refused.value) == SHUTTING_DOWN
    raw = httpx.post(url + "gradio_api/call/generate", json={"data": ["a red circle"]}, timeout=30)
    assert (raw.status_code, raw.text, raw.headers["retry-after"]) == (503, SHUTTING_DOWN, "60")
    message = _browser_join(url, "browser-tab-1", "a red circle")
    assert message["success"] is False and message["output"]["error"] == SHUTTING_DOWN
    (folder / "first").touch()
    assert running.result(timeout=60) == "done: hold:first"  # accepted before the signal: served
    assert harness.proc.wait(60) == 0
    assert "[app] stopped" in "".join(harness.log)


def test_a_result_reaches_its_client_though_the_event_loop_lags_at_the_close(tmp_path):
    """The drain closes only once the accepted call's result is written to its client's stream: with Gradio's event
    loop stalled 0.5 s between queueing the completion and the stream sending it (serve_harness
    HARNESS_LOOP_LAG_S, as on a loaded machine), the client still gets its result, not Gradio's "Server stopped
    unexpectedly" (gradio_client: KeyError 'unexpected_error'), and the process exits 0."""
    from gradio_client import Client

    port = next(PORTS)
    harness = Harness("page", str(port), str(tmp_path), env={"HARNESS_LOOP_LAG_S": "0.5"})
    try:
        harness.until("[app] Running on local URL")
        url = f"http://127.0.0.1:{port}/"
        running = Client(url, verbose=False).submit("hold:first", api_name="/generate")
        wait_until(lambda: _running(url), "the call running")
        harness.signal()
        harness.until("[app] stopping")
        (tmp_path / "first").touch()
        assert running.result(timeout=60) == "done: hold:first"
        assert harness.proc.wait(60) == 0
    finally:
        harness.close()


def test_one_client_cannot_hold_the_queue(page):
    """Default cap 2: client A's third call is refused at once with the cap's message (gradio_client,
    the page's protocol, raw HTTP; each client its own address) while B's call runs; B's call ends
    normally; after A's calls end (served, failed or cancelled), A again gets exactly 2 places."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    harness, url, folder = page
    message = over_limit_message(2)
    a = Client(url, verbose=False, headers=forwarded("198.51.100.1"))
    b = Client(url, verbose=False, headers=forwarded("198.51.100.2"))
    b_job = b.submit("hold:b", api_name="/generate")
    wait_until(lambda: _running(url), "B's call running")
    a_jobs = [a.submit(f"hold:a{i}", api_name="/generate") for i in (1, 2)]
    wait_until(lambda: _waiting(url) == 2, "A's two calls queued")
    with pytest.raises(AppError) as refused:
        a.submit("hold:a3", api_name="/generate").result(timeout=60)  # refused at once, while B's call is still running
    assert str(refused.value) == message and not b_job.done()
    tab, tab_from = "browser-tab-a", forwarded("198.51.100.3")  # the page's protocol, an address with two calls
    for i in (1, 2):
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
        assert httpx.post(url + "gradio_api/queue/join", timeout=30, headers=tab_from, json={
            "data": [f"hold:t{i}"], "fn_index": fn_index, "session_hash": tab}).status_code == 200
    assert _browser_join(url, tab, "hold:t3", tab_from)["output"]["error"] == message
    raw = [httpx.post(url + "gradio_api/call/generate", json={"data": [f"hold:r{i}"]}, timeout=30,
                      headers=forwarded("198.51.100.4")) for i in (1, 2, 3)]
    assert [r.status_code for r in raw] == [200, 200, 200]  # each call is taken; the service answers in its stream
    event, data = _call_result(url, raw[2].json()["event_id"], forwarded("198.51.100.4"))
    assert (event, data["error"]) == ("error", message)
    # No way round.
    assert httpx.post(url + "gradio_api/run/generate", json={"data": ["x"]}, timeout=30).status_code == 404
    # Waiting: A's two and the two raw calls; the tab's two went when its stream closed (a client that leaves).
    wait_until(lambda: _waiting(url) == 4, "the tab's calls out of the line")
    assert not b_job.done()
    (folder / "b").touch()
    assert b_job.result(timeout=60) == "done: hold:b"
    for name in ("a1", "a2", "r1", "r2"):
        (folder / name).touch()
    assert [job.result(timeout=60) for job in a_jobs] == ["done: hold:a1", "done: hold:a2"]
    # The tab's places were freed.
    assert _browser_join(url, tab, "again", tab_from)["output"]["data"] == ["done: again"]
    with pytest.raises(AppError, match="refused: the prompt says fail"):
        a.predict("fail", api_name="/generate")  # a call that fails frees its place too
    wait_until(lambda: _waiting(url) == 0, "the queue empty")
    blocker = b.submit("hold:b2", api_name="/generate")  # B's again: A's next calls wait behind it
    wait_until(lambda: _running(url), "B's second call running")
    cancelled = a.submit("hold:a5", api_name="/generate")
    wait_until(lambda: _waiting(url) == 1, "A's fifth call queued")
    cancelled.cancel()  # (Gradio cancels a session's calls of this event, so none of A's is running)
    wait_until(lambda: _waiting(url) == 0, "A's fifth call cancelled")
    again = [a.submit(f"hold:a{i}", api_name="/generate") for i in (6, 7)]  # two places again, not fewer
    wait_until(lambda: _waiting(url) == 2, "A's sixth and seventh calls queued")
    with pytest.raises(AppError) as refused:
        a.submit("hold:a8", api_name="/generate").result(timeout=60)  # and not more
    assert str(refused.value) == message
    for name in ("b2", "a6", "a7"):
        (folder / name).touch()
    assert blocker.result(timeout=60) == "done: hold:b2"
    assert [job.result(timeout=60) for job in again] == ["done: hold:a6", "done: hold:a7"]
    log = "".join(harness.log)
    assert _refusals(log) == 4 and "Traceback" not in log


def test_made_up_sessions_get_no_more_places_and_forwarding_counts_only_behind_a_trusted_proxy(page, tmp_path):
    """Raw queue/join calls, each under a new random session hash, as the page sends them: one address
    gets 2 places however many sessions it makes up, the others it sends are refused at once, and a
    client from another address still gets in. A queued call whose event stream closes is dropped
    (Gradio's own clean-up), which frees its place. Without a trusted proxy, X-Forwarded-For is the
    client's own text: three "addresses" from one peer are one client."""
    import secrets

    from gradio_client import Client

    harness, url, folder = page
    message = over_limit_message(2)
    b = Client(url, verbose=False, headers=forwarded("198.51.100.2"))
    running = b.submit("hold:b", api_name="/generate")
    wait_until(lambda: _running(url), "B's call running")
    a = forwarded("198.51.100.1")
    joins = [(session, _join(url, session, f"hold:a{i}", a))
             for i, session in enumerate(secrets.token_hex(5) for _ in range(17))]
    wait_until(lambda: _waiting(url) == 2, "two of A's calls queued")
    time.sleep(0.5)
    assert _waiting(url) == 2  # and no more: fifteen were refused without taking a place
    assert _completion(url, *joins[2], a)["output"]["error"] == message
    c = Client(url, verbose=False, headers=forwarded("198.51.100.3")).submit("hold:c", api_name="/generate")
    wait_until(lambda: _waiting(url) == 3, "C's call queued")  # another client is not told the queue is full
    with httpx.stream("GET", url + f"gradio_api/queue/data?session_hash={joins[0][0]}", timeout=30,
                      headers=a) as stream:
        next(stream.iter_lines())  # the stream is open; closing it is A leaving
    wait_until(lambda: _waiting(url) == 2, "A's left call dropped from the line")
    replacement = secrets.token_hex(5)
    replacement_id = _join(url, replacement, "hold:a-again", a)  # the place A's left call held is A's again
    wait_until(lambda: _waiting(url) == 3, "A's new call queued")
    for name in ("b", "c", "a1", "a-again"):
        (folder / name).touch()
    assert running.result(timeout=60) == "done: hold:b" and c.result(timeout=60) == "done: hold:c"
    assert _completion(url, replacement, replacement_id, a)["output"]["data"] == ["done: hold:a-again"]
    assert _refusals("".join(harness.log), "198.51.100.1") == 15

    port = next(PORTS)  # the same page with no trusted proxy
    direct = Harness("page", str(port), str(tmp_path))
    try:
        direct.until("[app] Running on local URL")
        url = f"http://127.0.0.1:{port}/"
        ids = [(session, _join(url, session, f"hold:d{i}", forwarded(f"198.51.100.{10 + i}")))
               for i, session in enumerate(secrets.token_hex(5) for _ in range(3))]
        assert _completion(url, *ids[2])["output"]["error"] == message
        assert _refusals("".join(direct.log), "127.0.0.1") == 1
    finally:
        (tmp_path / "d0").touch()
        (tmp_path / "d1").touch()
        direct.close()


def test_max_requests_per_client_is_a_setting_at_least_1():
    assert EngineConfig().max_requests_per_client == 2
    assert EngineConfig.load(environ={"SDXL_MAX_REQUESTS_PER_CLIENT": "5"}).max_requests_per_client == 5
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=f"^max_requests_per_client must be at least 1, got {bad}$"):
            EngineConfig.load(environ={"SDXL_MAX_REQUESTS_PER_CLIENT": bad})
    result = subprocess.run([sys.executable, str(ROOT / "app.py"), "--max-requests-per-client", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: bad setting: max_requests_per_client must be at least 1, got 0"


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} not installed (apt-get install chromium)")
def test_the_page_shows_the_shutdown_message(page):
    """The browser's own client, during a drain: the error pop-up says "shutting down", not "busy"."""
    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    harness, url, folder = page
    running = Client(url, verbose=False).submit("hold:first", api_name="/generate")
    wait_until(lambda: _running(url), "the first call running")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            tab = browser.new_page()
            tab.goto(url)
            box = tab.get_by_role("textbox").first  # the prompt (the second is the output)
            box.wait_for(timeout=60_000)
            harness.signal()
            harness.until("[app] stopping")
            box.fill("a red circle")
            box.press("Enter")
            tab.get_by_text(SHUTTING_DOWN).first.wait_for(timeout=60_000)
            assert tab.get_by_text("This application is currently busy").count() == 0
        finally:
            browser.close()
    (folder / "first").touch()
    assert running.result(timeout=60) == "done: hold:first"
    assert harness.proc.wait(60) == 0


def test_a_stop_while_the_engine_compiles_exits_0(tmp_path):
    """SIGTERM while the first program compiles (a fresh compile cache) ends with "[app] stopped"
    and status 0: the process does not tear JAX down under the compiling thread (that segfaulted,
    status 139, after "stopped"; or, before serve, the default kill gave 143 and no line)."""
    app = RunningApp(env={"SDXL_COMPILE_CACHE_DIR": str(tmp_path / "jax")}, wait_for="[sdxl_engine] compiling")
    app.proc.send_signal(signal.SIGTERM)
    status = app.proc.wait(120)
    deadline = time.monotonic() + 30  # the reader thread still has the last lines to take
    while "[app] stopped" not in "".join(app.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = "".join(app.log)
    assert status == 0, log
    assert "[app] stopped" in log and "Traceback" not in log, log
