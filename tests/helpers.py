"""Helpers the test files share (import them as ``from tests.helpers import RunningApp``; pyproject.toml's
pytest ``pythonpath`` puts the repository root on the path): the repository root, the fixtures folder, a
free port, a quick request and the check that an app serves it, a held generation and a wait on a condition,
``python app.py`` in a subprocess, and a model's compiled programs shared by shape. Fixtures live in
tests/conftest.py."""

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import uuid
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


# One line of the app's log (serving.logs): ISO time with milliseconds and offset, level, logger, message.
LOG_LINE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d) (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                      r"([\w.]+): (.*)")


def log_message(line: str) -> str:
    """The message of a line of the app's log, without its time, level and logger; another line (an ``error:``
    line, a library's own output) as it is. Without the line's end."""
    line = line.rstrip("\n")
    match = LOG_LINE.fullmatch(line)
    return match[4] if match else line


class Hold:
    """A generation that lasts until released, on an app started with the test-only fault switch
    (``SDXL_FAULT_INJECTION=1`` and ``SDXL_FAULT_HOLD_DIR=folder``; sdxl_engine/engine/faults.py): its prompt carries
    ``fault:hold=<name>``; leaving the ``with`` block (or :meth:`release`) creates the file the engine waits for, so a
    failing test never leaves a shared app held."""

    def __init__(self, folder, prompt: str = "a red circle"):
        self.path = Path(folder) / uuid.uuid4().hex[:12]
        self.prompt = f"{prompt} fault:hold={self.path.name}"

    def held(self) -> bool:
        """Whether the generation has reached its hold (on the device stage: faults.device_delay's ``NAME.held``)."""
        return self.path.with_name(self.path.name + ".held").exists()

    def release(self) -> float:
        """Let the generation run; returns time.monotonic() at release."""
        self.path.touch()
        return time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.release()


def close_rel(got, want, what: str, rtol: float = 1e-5) -> None:
    """Assert |got - want| <= rtol (1 + |want|) everywhere (float64); a NaN on either side is a mismatch. The
    scheduler fixtures' step-by-step comparisons against diffusers."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bad = ~(np.abs(got - want) <= rtol * (1 + np.abs(want)))
    assert not bad.any(), f"{what}: max |diff| {np.abs(got - want).max():.3g} (at {np.argwhere(bad)[0]})"


def case_config(steps: dict, case: dict) -> dict:
    """A scheduler fixture case's model scheduler config: the fixture's base config with the case's changes, or
    the class name alone for a "minimal" case (every field the class's default)."""
    base, changes = steps["base_config"], case["changes"]
    return {"_class_name": base["_class_name"]} if changes == "minimal" else {**base, **changes}


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition()`` until true; AssertionError naming ``what`` after a generous ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} (not within {timeout:g} s)"
        time.sleep(0.05)


def wait_processing(job, timeout: float = 60.0) -> None:
    """Wait until a gradio_client ``job`` runs on the server (PROCESSING, or PROGRESS: the page reports stages)."""
    from gradio_client.utils import Status

    wait_until(lambda: job.status().code in (Status.PROCESSING, Status.PROGRESS), "the request never started",
               timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A quick valid /generate request (2 steps) and the check that an app still serves it.
QUICK = dict(prompt="a red circle", seed=1, num_inference_steps=2)


def assert_serves(client, timeout: float = 120) -> dict:
    """One QUICK request through ``client`` gives 4 images with seeds 1-4 within ``timeout``
    seconds (else TimeoutError); returns the info JSON."""
    gallery, info = client.submit(api_name="/generate", **QUICK).result(timeout=timeout)
    assert len(gallery) == 4 and info["seeds"] == [1, 2, 3, 4]
    return info


# For an app whose test stands for several clients: each has its own X-Forwarded-For address
# (RunningApp.client(address=...)), believed from loopback (the per-client cap counts addresses).
TRUST_LOOPBACK = {"SDXL_TRUSTED_PROXIES": "127.0.0.1"}


class RunningApp:
    """``python app.py`` in a subprocess on a free loopback port, as a user starts it."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 240,
                 wait_for: str = "[sdxl_engine] ready"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = []
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(self.port), *args],
                                     cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.log.append(line)
            if wait_for in line:
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("app exited before ready:\n" + "".join(self.log))
        if wait_for not in self.log[-1]:
            self.stop()
            raise RuntimeError("app not ready in time:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def client(self, address: str | None = None):
        """A gradio_client Client for this app; with ``address``, one that client address's (X-Forwarded-For,
        which counts only for an app started with ``--trusted-proxies 127.0.0.1``: :data:`TRUST_LOOPBACK`)."""
        from gradio_client import Client

        return Client(self.url, verbose=False, headers=None if address is None else {"X-Forwarded-For": address})

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# The loop bound of every tiny-pt program the tests compile: the reference cases take at most 10 steps, and
# one bound for all means one program per (size, CFG) for the whole session (the padded loop runs the
# request's steps only, as the engine's program does under its max_inference_steps).
TINY_PT_MAX_STEPS = 10


class Programs:
    """The engine's compiled programs for one model on one mesh, compiled once per ProgramShape and shared
    by every case of that shape (the cases differ only in per-request inputs: prompts, latents, guidance,
    schedule, parameters of the same shapes), as the engine shares them between requests."""

    def __init__(self, model, mesh):
        import jax

        from sdxl_engine.program.sharding import replicated

        self.model, self.mesh = model, mesh
        self.params = jax.device_put(model.params, replicated(mesh))
        self._compiled = {}

    def __getitem__(self, shape):
        from sdxl_engine.program.compiling import compile_program

        if shape not in self._compiled:
            self._compiled[shape] = compile_program(self.model, self.params, shape, self.mesh)
        return self._compiled[shape]


class FullDiskFile:
    """A file opened for writing whose first write stores ``room`` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        import errno

        self.f.write(bytes(data[:self.room]))
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def mounted_apis(monkeypatch, tmp_path, limits, pngs_for, info_for, lines: list[str]):
    """The protocol APIs (serving.apis.mount) on a FastAPI app with ``core.generate`` replaced: each call's seeds
    are 7, 8, ...; ``pngs_for(call, seeds)`` gives its PNG bytes (written under ``tmp_path``) and ``info_for(call,
    seeds)`` its info record. ``lines``: the messages logged (conftest's ``runtime_log``). Returns (TestClient,
    the calls, ``lines``)."""
    import types

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sdxl_engine.serving.apis import a1111, access_for, mount, openai_images
    from sdxl_engine.serving.apis.core import Generated

    calls = []

    async def generate(requests, request, call, front, owner, job_id=None):
        calls.append(call)
        seeds = [7 + i for i in range(call.images or 4)]
        pngs = pngs_for(call, seeds)
        return Generated(pngs, seeds, info_for(call, seeds), [f"seed{seed}" for seed in seeds])

    monkeypatch.setattr(a1111, "generate", generate)
    monkeypatch.setattr(openai_images, "generate", generate)
    ready = threading.Event()
    ready.set()
    engine = types.SimpleNamespace(model=types.SimpleNamespace(name="tiny-shapes"), limits=limits, ready=ready,
                                   error=None, config=types.SimpleNamespace(refiner=""))
    app = FastAPI()
    mount(app, types.SimpleNamespace(engine=engine), access_for("", share=False, public_api=False, mcp=False), {},
          log=lambda line: None)
    return TestClient(app), calls, lines


class StepEngine:
    """A stand-in engine for service tests (tests/service, the jobs API): the engine contract's generate, each
    denoising step waiting for :meth:`go` (one step each), images that encode the seed (pixel value = seed % 256)
    so the test can tell which call made them. ``reports``: the steps it reports to ``on_step`` (None: every
    one), as the engine batches its reports on fast devices (an event for step k: every step up to k ran)."""

    batch = 2

    def __init__(self, steps_per_go: int = 1, reports: tuple[int, ...] | None = None):
        from sdxl_engine.engine.validation import Limits

        self.ready = threading.Event()
        self.ready.set()
        self.error = None
        self.startup, self.stage, self.started, self.device_summary = {}, "ready", 0.0, "1 x cpu"
        self.model = types.SimpleNamespace(name="step-model", dtype="float32")  # the contract's model (its name)
        self.limits = Limits(max_seed=2**31 - 1, max_steps=50, sizes=((48, 32), (64, 64)), default_size=(48, 32),
                             default_steps=3, default_guidance=5.0)
        self.gate = threading.Semaphore(0)
        self.calls: list = []  # the GenerateRequests it was called with
        self.steps_seen = 0
        self.reports = reports

    def go(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def generate(self, request, ready_timeout=None, progress=None, arrived=None, on_step=None, should_stop=None):
        from sdxl_engine.engine.contract import GenerateResult
        from sdxl_engine.engine.steps import StepEvent, Stopped

        self.calls.append(request)
        progress("on device")
        steps = request.num_inference_steps
        for step in range(1, steps + 1):
            while not self.gate.acquire(timeout=0.01):
                if should_stop():
                    raise Stopped(f"stopped after step {step - 1}")
            self.steps_seen += 1
            if self.reports is not None and step not in self.reports:
                continue
            on_step(StepEvent(step, steps, np.zeros((self.batch, 4, 6, 3), np.uint8), 0.01 * step))
            if should_stop():
                raise Stopped(f"stopped after step {step}")
        seeds = [(request.seed + i) % (self.limits.max_seed + 1) for i in range(self.batch)]
        images = np.stack([np.full((request.height, request.width, 3), s % 256, np.uint8) for s in seeds])
        return GenerateResult(images, seeds, request, {"latency": 0.1, "queue": 0.0, "prep": 0.0, "device": 0.1,
                                                       "post": 0.0}, [], 1, "1 x cpu", "stand-in")


EXTRA_FIELDS = ("image", "mask", "soft_mask", "strength", "start_step", "outpaint", "refiner_switch_at", "hires_scale",
                "hires_strength", "hires_steps", "hires_upscaler", "hires_sampler", "hires_prompt",
                "hires_negative_prompt")


def extra_fields(request) -> dict:
    """The GenerateRequest fields beyond text to image that a service request (service.request.Request) sets: those
    of :data:`EXTRA_FIELDS` that are not None (``soft_mask`` with a mask)."""
    engine = request.engine
    return {name: getattr(engine, name) for name in EXTRA_FIELDS if getattr(engine, name) is not None
            and (name != "soft_mask" or engine.mask is not None)}


def page_generate(engine, prompt, negative_prompt="", seed=-1, guidance_scale=None, num_inference_steps=None, width=0,
                  height=0, style="(No style)", sampler=None, progress=None, outputs_dir: str = "",
                  files_dir: str | None = None, **inputs):
    """One /generate event as the page runs it (serving/handler.api_function over a real service.Service of
    ``engine``, saving to ``outputs_dir``), its gallery files written under ``files_dir`` (Gradio's upload folder
    when None): (gallery items, info, history record). ``progress(fraction, desc=..., unit=...)`` hears the
    event's reports; ``inputs``: /generate's later inputs by name (apis/tools.generate_inputs: ``schedule_type``,
    ``model``...). Raises what the event raises (gr.Error)."""
    import asyncio
    import os
    from types import SimpleNamespace

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.service.service import Service
    from sdxl_engine.serving import handler, history

    config = EngineConfig.load(environ={})
    service = Service(engine, slots=1, limit=4, outputs_dir=outputs_dir)
    pending = history.Pending()
    generate = handler.api_function(service, config, pending)
    request = SimpleNamespace(session_hash="test-session", client=SimpleNamespace(host="127.0.0.1"), headers={})
    report = progress if progress is not None else (lambda *_, **__: None)
    values = dict(prompt=prompt, negative_prompt=negative_prompt, seed=seed, guidance_scale=guidance_scale,
                  num_inference_steps=num_inference_steps, width=width, height=height, style=style, sampler=sampler,
                  **inputs)
    before = os.environ.get("GRADIO_TEMP_DIR")
    try:
        if files_dir is not None:
            os.environ["GRADIO_TEMP_DIR"] = str(files_dir)

        async def run():
            return [out async for out in generate(**values, request=request, progress=report)]

        gallery, info = asyncio.run(run())[-1]
    finally:
        service.close()
        if files_dir is not None:
            if before is None:
                os.environ.pop("GRADIO_TEMP_DIR", None)
            else:
                os.environ["GRADIO_TEMP_DIR"] = before
    return gallery, info, pending.pop("test-session")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` RGB pixels, with one tiny IDAT: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
