"""Shared fixtures: one engine per test session (4 CPU devices, tiny random SDXL).

No test may depend on what an earlier run left on this machine: the model cache, the
compilation cache and Gradio's temp folder point into one fresh folder for the session
(removed at exit), unless the environment names them already (.ci/run does, with folders
of its own). Every app the tests start inherits them.
"""

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Before anything reads them (sdxl_engine.config reads XDG_CACHE_HOME at import, Gradio reads
# GRADIO_TEMP_DIR at import).
SESSION_DIR = Path(tempfile.mkdtemp(prefix="sdxl-tests-"))
atexit.register(shutil.rmtree, SESSION_DIR, True)
for _name, _sub in (("SDXL_MODEL_CACHE_DIR", "models"), ("SDXL_COMPILE_CACHE_DIR", "jax"),
                    ("GRADIO_TEMP_DIR", "gradio"), ("XDG_CACHE_HOME", "xdg-cache")):
    os.environ.setdefault(_name, str(SESSION_DIR / _sub))

from sdxl_engine.config import EngineConfig, apply_jax_options  # noqa: E402

# Before any test touches JAX: 4 CPU devices, as the app presents them.
apply_jax_options(EngineConfig.load({"cpu_devices": 4}, environ={
    k: v for k, v in os.environ.items() if k == "SDXL_COMPILE_CACHE_DIR"}))


def pytest_configure(config):
    config.addinivalue_line("markers", "device: needs an accelerator and real weights; skipped by default")


@pytest.fixture(scope="session")
def engine():
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": "tiny-random", "cpu_devices": 4}, environ={
        k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


@pytest.fixture(scope="session")
def tiny_shapes_engine():
    """The shipped, trained tiny-shapes model (its images have meaning: colours, shapes), one per session;
    tests/fixtures/tiny-shapes-reference.npz holds the images the previous engine made with it."""
    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.local import Engine

    config = EngineConfig.load({"model": "tiny-shapes"}, environ={
        k: v for k, v in os.environ.items() if k in ("SDXL_MODEL_CACHE_DIR", "SDXL_COMPILE_CACHE_DIR")})
    return Engine(config, log=lambda *_: None).start()


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


class RunningApp:
    """``python app.py`` in a subprocess on a free loopback port, as a user starts it."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 240, wait_for: str = "[sdxl_engine] ready"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = []
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(self.port), *args],
                                     cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        import threading

        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def client(self):
        """A gradio_client Client for this app."""
        from gradio_client import Client

        return Client(self.url, verbose=False)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def app_server():
    app = RunningApp()
    yield app
    app.stop()
