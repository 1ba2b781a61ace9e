"""Faults: engine exceptions, NaN output, a full queue, disconnects, SIGTERM, bad start-up.

Most tests share one ``python app.py`` started with the TEST-ONLY fault switch
(``SDXL_FAULT_INJECTION=1``, see sdxl_engine/engine/faults.py), a queue of 2, an unwritable compile
cache and output folder, and ``GRADIO_SHARE=True`` in its environment. The SIGTERM test stops
that process, so it is the last test of this module.
"""

import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.helpers import (
    QUICK,
    ROOT,
    TRUST_LOOPBACK,
    Hold,
    RunningApp,
    assert_serves,
    free_port,
    wait_processing,
    wait_until,
)

pytestmark = pytest.mark.e2e

OK = QUICK


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    """Where the tests release ``fault:hold`` generations (faults.py)."""
    return tmp_path_factory.mktemp("holds")


@pytest.fixture(scope="module")
def fault_app(tmp_path_factory, hold_dir):
    blocker = tmp_path_factory.mktemp("unwritable") / "a-file"
    blocker.write_text("a file, so nothing can be created below it (even by root)")
    app = RunningApp(env={
        **TRUST_LOOPBACK,  # the tests' clients stand for several addresses, each with its own places
        "SDXL_FAULT_INJECTION": "1", "SDXL_MAX_QUEUE_SIZE": "2", "GRADIO_SHARE": "True",
        "SDXL_COMPILE_CACHE_DIR": str(blocker / "jax"), "GRADIO_TEMP_DIR": str(blocker / "gradio"),
        "SDXL_FAULT_HOLD_DIR": str(hold_dir),
    })
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(fault_app):
    return fault_app.client()


def test_unwritable_cache_and_output_dirs_warn_and_the_app_serves(fault_app, client):
    log = "".join(fault_app.log)
    assert "[sdxl_engine] warning: compile cache" in log and "is not writable" in log
    assert "[app] warning: output folder" in log
    assert_serves(client)


def test_no_share_link_even_with_gradio_share_in_the_environment(fault_app):
    log = "".join(fault_app.log).lower()
    assert "public url" not in log and "share link" not in log


def test_exception_inside_the_engine_fails_that_request_only(fault_app, client):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=r"the engine failed on this request \(InjectedFault\).*Please retry"):
        client.predict(api_name="/generate", **{**OK, "prompt": "a red circle fault:raise"})
    # The traceback is in the server log (read by a thread: waited for).
    wait_until(lambda: "InjectedFault: injected fault" in "".join(fault_app.log), "no traceback in the log")
    assert_serves(client)


def test_non_finite_image_is_an_error_not_a_black_square(client):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=r"the model produced non-finite pixels \(NaN/inf\) for seeds \[1, 2, 3, 4\]"):
        client.predict(api_name="/generate", **{**OK, "prompt": "a red circle fault:nan"})
    assert_serves(client)


SLOTS = 3  # the page's requests at once: one on the devices, 1 + max_pending_compiles (2) in all (serving/main.py)


def waiting_behind(job) -> bool:
    """Whether ``job`` waits for the request ahead: in the service's line, or in a service slot for the devices
    (the engine's "waiting" stage: a slot beyond the first is for a request whose new size compiles meanwhile);
    the page says "Waiting for the request ahead" for both."""
    from gradio_client.utils import Status

    status = job.status()
    return status.code == Status.IN_QUEUE or any(
        "Waiting for the request ahead" in (getattr(unit, "desc", "") or "") for unit in status.progress_data or [])


def test_burst_beyond_the_queue_gets_busy_retry_not_a_hang(fault_app, client, hold_dir):
    """The service's line (max_queue_size 2 here) bounds every front: requests beyond it are refused at once with
    its message (gradio_client: AppError; a raw call: the error in its result stream; A1111: 503 with
    Retry-After), not left to hang."""
    from gradio_client.exceptions import AppError

    full = "the server cannot take this request now: 2 requests wait already (max_queue_size = 2); retry later"
    clients = [fault_app.client(address=f"198.51.100.{i}") for i in range(7)]
    with Hold(hold_dir) as hold:  # one generation runs until every other request has had its answer
        slow = client.submit(api_name="/generate", **{**OK, "prompt": hold.prompt})
        wait_processing(slow)
        # 1 running, 2 in the service's other slots waiting for the devices, a line of 2: the next 4 wait, the
        # rest are told to retry at once.
        burst = [c.submit(api_name="/generate", **OK) for c in clients]
        wait_until(lambda: sum(job.done() for job in burst) >= 3, "the requests over the line were not refused")
        raw = httpx.post(fault_app.url + "gradio_api/call/generate",
                         json={"data": ["a red circle", "", 1, 7, 2, 0, 0, "(No style)", "Euler"]}, timeout=30)
        assert raw.status_code == 200  # taken by Gradio, refused by the service: the error is the call's result
        text = httpx.get(fault_app.url + f"gradio_api/call/generate/{raw.json()['event_id']}", timeout=60).text
        assert "event: error" in text and full in text, text
        # the protocols enter the service's line too: the same bound (max_queue_size) holds for them
        a1111 = httpx.post(fault_app.url + "sdapi/v1/txt2img", timeout=30, headers={"X-Forwarded-For": "198.51.100.90"},
                           json={"prompt": "a red circle", "steps": 2, "width": 64, "height": 64})
        assert a1111.status_code == 503 and a1111.headers["retry-after"] == "5", a1111.text
        assert a1111.json()["detail"] == full
    outcomes = []
    for job in burst:
        try:
            outcomes.append(len(job.result(timeout=90)[0]))
        except AppError as err:
            assert str(err) == full
            outcomes.append("busy")
    assert len(slow.result(timeout=90)[0]) == 4
    assert outcomes.count(4) == SLOTS - 1 + 2 and outcomes.count("busy") == 3, outcomes
    assert_serves(client)


def test_queue_time_counts_the_wait_in_gradios_queue(fault_app, client, hold_dir):
    """Requests that wait behind a held generation (in the service, Gradio's queue running them as they come)
    report at least the time they were seen waiting
    (and no more than they took), in the info and the status line, through gradio_client and raw HTTP."""
    from sdxl_engine.serving import page

    second = fault_app.client(address="198.51.100.20")
    with Hold(hold_dir) as hold:
        slow = client.submit(api_name="/generate", **{**OK, "prompt": hold.prompt})
        wait_processing(slow)
        started = time.monotonic()
        waiting = second.submit(api_name="/generate", **OK)
        raw = httpx.post(fault_app.url + "gradio_api/call/generate", timeout=30,
                         headers={"X-Forwarded-For": "198.51.100.21"},
                         json={"data": ["a red circle", "", 1, 7, 2, 0, 0, "(No style)", "Euler"]}).json()["event_id"]
        wait_until(lambda: waiting_behind(waiting), "the second request never waited for the held one")
        seen = time.monotonic()  # the raw call was taken before (its event id came back): it waits too
        time.sleep(2.0)  # not a race: the held generation keeps both queued until released
        released = hold.release()
    _, info = waiting.result(timeout=60)
    waited = time.monotonic() - started
    assert released - seen <= info["timings_s"]["queue"] <= waited + 0.5, (info["timings_s"], released - seen, waited)
    assert f"queue {info['timings_s']['queue']:.2f} s" in page.status_line(info)
    text = httpx.get(fault_app.url + f"gradio_api/call/generate/{raw}", timeout=60).text
    # The completed event's data (a streamed /generate may send previews first, their info null).
    raw_info = json.loads([line for line in text.splitlines() if line.startswith("data: ")][-1][6:])[1]
    assert raw_info["timings_s"]["queue"] >= released - seen, (raw_info["timings_s"], released - seen)
    assert len(slow.result(timeout=60)[0]) == 4


def test_client_disconnecting_mid_generation_frees_its_slot(fault_app, client, hold_dir):
    config = httpx.get(fault_app.url + "config", timeout=30).json()
    fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
    session = uuid.uuid4().hex[:10]
    with Hold(hold_dir) as hold:
        join = httpx.post(fault_app.url + "gradio_api/queue/join", timeout=30, json={
            "data": [hold.prompt, "", 1, 7, 2, 0, 0, "(No style)", "Euler"], "fn_index": fn_index,
            "session_hash": session, "event_data": None, "trigger_id": None})
        assert join.status_code == 200
        with httpx.stream("GET", fault_app.url + f"gradio_api/queue/data?session_hash={session}", timeout=30) as stream:
            for line in stream.iter_lines():
                if "process_starts" in line:
                    # Gradio started the handler; hang up once the generation holds the devices (a hang-up before
                    # that takes the job out of the service's line, and nothing is left to wait behind: CI's flake)
                    wait_until(hold.held, "the generation never reached its hold")
                    break  # hang up without reading the result
        # The next request waits for the abandoned generation (it still holds the engine) ...
        job = client.submit(api_name="/generate", **QUICK)
        wait_until(lambda: waiting_behind(job), "the next request never waited for the abandoned one")
        assert not job.done()
    # ... and runs as soon as that one ends: the abandoned client's slot is free.
    gallery, info = job.result(timeout=60)
    assert len(gallery) == 4 and info["seeds"] == [1, 2, 3, 4]


def test_startup_failure_exits_non_zero_with_one_clear_line(tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model_index.json").write_text("{not json")
    # The refiner loads after the model: its error names --refiner, not --model (issue #47).
    cases = {("--model", str(tmp_path / "missing")): "is neither a built-in name, an existing directory nor a hub id",
             ("--model", str(corrupt)): "model_index.json: not readable JSON",
             ("--refiner", "nonexistent"): "ModelLoadError: --refiner 'nonexistent' is neither a built-in name"}
    procs = {args: subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--port", str(free_port()), *args], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={"GRADIO_ANALYTICS_ENABLED": "False",
                                                                       "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        for args in cases}
    for args, expected in cases.items():
        out, err = procs[args].communicate(timeout=240)
        assert procs[args].returncode == 1, (out, err)
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "the engine failed to start: ModelLoadError" in errors[0] and expected in errors[0]
        assert "Traceback" not in out + err


@pytest.mark.parametrize("args, env, expected", [
    (["--num-inference-steps", "many"], {}, "num_inference_steps must be a whole number, got 'many'"),
    (["--executable-cache", "maybe"], {},  # was read as "off" without a word (QA)
     "executable_cache must be a boolean (1, true, yes, on or 0, false, no, off), got 'maybe'"),
    ([], {"SDXL_EXECUTABLE_CACHE": "maybe"},
     "executable_cache must be a boolean (1, true, yes, on or 0, false, no, off), got 'maybe'"),
    ([], {"GRADIO_SERVER_PORT": "abc"},  # Gradio's import would end in a traceback (QA)
     "GRADIO_SERVER_PORT: 'abc' is not a TCP port (a whole number from 1 to 65535)"),
])
def test_bad_config_exits_2_with_one_line(args, env, expected):
    result = subprocess.run([sys.executable, str(ROOT / "app.py"), *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == f"error: bad setting: {expected}"


def test_settings_the_machine_cannot_honour_exit_2_with_one_line():
    """The same rule when only the running engine can tell: 2 images over 4 devices, a width the
    model cannot make (tiny-shapes works on 16-pixel blocks)."""
    cases = {("SDXL_IMAGES_PER_REQUEST", "2"): "error: bad setting: images_per_request (2) must be a positive "
                                                "multiple of the device count (4)",
             ("SDXL_WIDTH", "72"): "error: bad setting: width/height 72x64: the model 'tiny-shapes' needs multiples "
                                   "of 16 pixels"}
    procs = {key: subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(free_port())], cwd=ROOT,
                                   env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", key[0]: key[1]},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for key in cases}
    for key, expected in cases.items():
        out, err = procs[key].communicate(timeout=240)
        assert procs[key].returncode == 2, (key, out[-2000:], err[-2000:])
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(expected), errors
        assert "Traceback" not in out + err


def test_taken_port_exits_1_with_one_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot serve on 127.0.0.1:{port}: "), result.stderr


@pytest.mark.parametrize("port", ["99999", "0", "web"])
def test_bad_port_exits_2_with_argparse_message(port):
    result = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", port], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --port: " in result.stderr \
        and "is not a TCP port (a whole number from 1 to 65535)" in result.stderr


def test_sigterm_finishes_the_request_in_flight_then_exits_0(fault_app, client, request, hold_dir):
    """Last test of the module: it stops the shared fault app. One request runs (held until the
    server refuses new calls), one waits."""

    second = fault_app.client(address="198.51.100.30")
    with Hold(hold_dir) as hold:
        job = client.submit(api_name="/generate", **{**OK, "prompt": hold.prompt})
        wait_processing(job)
        waiting = second.submit(api_name="/generate", **{**OK, "seed": 9})
        wait_until(lambda: waiting_behind(waiting), "the second request never waited for the held one")
        fault_app.proc.terminate()  # SIGTERM
        request.addfinalizer(lambda: print("".join(fault_app.log[-30:])))
        late = []

        def refused() -> bool:  # new calls are refused (one sent before the signal is handled is served)
            late[:] = [httpx.post(fault_app.url + "gradio_api/call/generate", timeout=30,
                                  headers={"X-Forwarded-For": "198.51.100.31"},
                                  json={"data": ["a red circle", "", 1, 7, 2, 0, 0, "(No style)", "Euler"]})]
            assert late[0].status_code in (200, 503), (late[0].status_code, late[0].text)
            return late[0].status_code == 503 and "shutting down" in late[0].text

        wait_until(refused, "new calls were never refused after SIGTERM")
        assert late[0].headers["retry-after"] == "60"
    gallery, info = job.result(timeout=60)
    assert len(gallery) == 4 and info["seeds"] == [1, 2, 3, 4]
    assert waiting.result(timeout=60)[1]["seeds"] == [9, 10, 11, 12]  # accepted before SIGTERM: served too
    assert fault_app.proc.wait(60) == 0
    wait_until(lambda: "[app] stopped" in "".join(fault_app.log), "no '[app] stopped' line")
