"""Shared fixtures: one engine per test session (4 CPU devices, tiny random SDXL); an ``e2e`` test is also ``slow``.

No test may depend on what an earlier run left on this machine: the model cache, the
compilation cache and Gradio's temp folder point into one fresh folder for the session
(removed at exit), unless the environment names them already (.ci/run does, with folders
of its own). Every app the tests start inherits them.
"""

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, TRUST_LOOPBACK, Programs, RunningApp

# Before anything reads them (sdxl_engine.config reads XDG_CACHE_HOME at import, Gradio reads
# GRADIO_TEMP_DIR at import).
SESSION_DIR = Path(tempfile.mkdtemp(prefix="sdxl-tests-"))
atexit.register(shutil.rmtree, SESSION_DIR, True)
for _name, _sub in (("SDXL_MODEL_CACHE_DIR", "models"), ("SDXL_COMPILE_CACHE_DIR", "jax"),
                    ("GRADIO_TEMP_DIR", "gradio"), ("XDG_CACHE_HOME", "xdg-cache")):
    os.environ.setdefault(_name, str(SESSION_DIR / _sub))
# Every program this session and its apps compile goes through LLVM at optimisation level 1 instead of XLA's 3:
# the same bytes (every reference the tests hold was made at XLA's default, and they pass under it; level 0 changes
# jax.random's bits), about a third less compile time and the same run time at the tests' sizes (docs/benchmarks.md,
# "Test time"). Compiling is most of what the tests wait for. The app's users keep XLA's default; a level named in
# XLA_FLAGS already stays.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()
# Python may keep the bytecode of what it imports (the checkout's __pycache__ folders, git-ignored) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): the session starts about 60 Python processes that import the app
# (about 10 s of CPU each on the 2-core CI machine), and without it each compiles the project's modules again,
# about 2 s more per process (docs/benchmarks.md, "Test time"). Children inherit this; this process keeps the flag
# off too.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
# Under pytest-xdist (pyproject's addopts) each worker's apps get their own Gradio temp folder: the guard and
# delivery tests count the files in it, and another worker's app would add some of its own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["GRADIO_TEMP_DIR"] = str(Path(os.environ["GRADIO_TEMP_DIR"]) / os.environ["PYTEST_XDIST_WORKER"])
# This process's temporary files go there too (the apps it starts keep the system's): gradio_client leaves an
# empty folder in the temp folder for every file it downloads (``tempfile.gettempdir() / token_hex(20)``, never
# removed), thousands per run.
(SESSION_DIR / "tmp").mkdir()
tempfile.tempdir = str(SESSION_DIR / "tmp")

from sdxl_engine.config import EngineConfig, apply_jax_options  # noqa: E402

# Before any test touches JAX: 4 CPU devices, as the app presents them.
apply_jax_options(EngineConfig.load({"cpu_devices": 4}, environ={
    k: v for k, v in os.environ.items() if k == "SDXL_COMPILE_CACHE_DIR"}))


# Bytes of memory one test worker may need: a 512x512 request on the app peaked at about 9.5 GB (the largest test
# asks 256x256 now), the apps of a busy file at a few (16 GB in use at most on 2 workers, measured).
WORKER_MEMORY = 11 * 2**30


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per CPU this process may use, as many as the memory holds
    (2 on the 2-core, 23 GB CI machine; 1 where memory is short). PYTEST_XDIST_AUTO_NUM_WORKERS overrides it;
    ``-n 0`` runs the tests in this process."""
    import psutil

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(len(os.sched_getaffinity(0)), psutil.virtual_memory().total // WORKER_MEMORY))


def pytest_collection_modifyitems(config, items):
    """Every ``e2e`` test is slow (it starts ``python app.py``, a Ray cluster or a browser), so
    ``pytest -m "not slow"`` runs the unit and engine tests only; slow ones elsewhere carry the mark themselves.

    Then the files run heaviest first: those with a slow test, then those with an engine test, then the rest, each
    file's tests together and in their order. pytest-xdist hands a worker the next file when it is free
    (pyproject's ``--dist loadfile --no-loadscope-reorder``), so the long files start early and the quick ones fill
    the end, instead of one long file running alone after the rest are done."""
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.slow)
    weight: dict = {}
    for item in items:
        level = 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("engine") else 2
        weight[item.path] = min(level, weight.get(item.path, 2))
    items.sort(key=lambda item: weight[item.path])  # stable: a file's tests keep their order


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


@pytest.fixture(scope="session")
def tiny_pt():
    """tests/fixtures/tiny-pt (diffusers' PyTorch layout, with reference outputs), loaded once per session."""
    from sdxl_engine.checkpoint.loading import load_folder

    return load_folder(FIXTURES / "tiny-pt", "tiny-pt", "float32")


@pytest.fixture(scope="session")
def tiny_pt_programs(tiny_pt):
    """tiny-pt's programs on 2 CPU devices, one per ProgramShape for the session: every test comparing its
    images with diffusers' uses these (with helpers.TINY_PT_MAX_STEPS) instead of compiling its own."""
    import jax

    from sdxl_engine.program.sharding import make_mesh

    return Programs(tiny_pt, make_mesh(jax.devices()[:2]))


@pytest.fixture(scope="session")
def app_server():
    app = RunningApp(env=TRUST_LOOPBACK)  # the load test's clients have their own addresses (tools/loadtest.py)
    yield app
    app.stop()


class _Lines(logging.Handler):
    """A handler that keeps each record's message in a list."""

    def __init__(self, lines: list[str]):
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def runtime_log(caplog):
    """The messages the runtime logs while the test runs (its ``sdxl_engine.*`` loggers, INFO and up), in order:
    a list, filled as they are logged (no handler is configured in the test process: serving.logs is the app's)."""
    caplog.set_level(logging.INFO, logger="sdxl_engine")  # put back at the test's end
    lines: list[str] = []
    handler, logger = _Lines(lines), logging.getLogger("sdxl_engine")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
