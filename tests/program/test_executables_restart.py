"""Restarts: the executable cache makes a warm start trace and compile nothing; the XLA cache stays.

XLA's persistent cache keeps serving everything else (the random-weight fills, other programs)
and the program too when the executable cache is off.

Every start runs in a fresh process on a compile cache folder of this test only; the model is
built into the session's fresh model cache before the first (measured) start, so building it is
not counted, whatever an earlier run left on the machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# Every test here starts fresh engine processes that compile (cold, then warm).
pytestmark = [pytest.mark.engine, pytest.mark.slow]

# Counts JAX's compile-path events per engine stage (the stage that was running when each fired).
START_ENGINE = """
import json, jax
from sdxl_engine.config import EngineConfig, apply_jax_options
config = EngineConfig.load({"model": "tiny-random"})
apply_jax_options(config)
from sdxl_engine.engine.local import Engine
log = []
engine = Engine(config, log=log.append)
EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses",
          "/jax/core/compile/jaxpr_trace_duration": "traces",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowers",
          "/jax/core/compile/backend_compile_duration": "backend_compiles"}
counts = {}
def on_event(event, *args, **kw):
    if event in EVENTS:
        stage = counts.setdefault(engine.stage.split(" ")[0], {})
        stage[EVENTS[event]] = stage.get(EVENTS[event], 0) + 1
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_event)
engine.start()
print(json.dumps({"counts": counts, "compile_s": engine.startup["compile_s"], "log": log}))
"""


def start(cache_dir: Path, model_dir: Path, **env) -> dict:
    env = {**os.environ, "SDXL_COMPILE_CACHE_DIR": str(cache_dir), "SDXL_MODEL_CACHE_DIR": str(model_dir), **env}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # JAX's own variable would win over the one set here
    out = subprocess.run([sys.executable, "-c", START_ENGINE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    total = {}
    for stage in result["counts"].values():
        for name, n in stage.items():
            total[name] = total.get(name, 0) + n
    result["total"] = total
    # The outcome lines, not the stage line.
    result["cache_lines"] = [line for line in result["log"] if "executable cache:" in line]
    return result


@pytest.fixture(scope="module")
def models():
    """The test session's own model cache (conftest.py: fresh per session) with tiny-random built
    in it, outside the measured starts."""
    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.config import EngineConfig

    folder = Path(EngineConfig.load().model_cache_dir)
    builtin.model_path("tiny-random", str(folder))
    return folder


def test_warm_start_traces_and_compiles_nothing_and_the_xla_cache_stays(tmp_path, models):
    cache = tmp_path / "cache"

    # 1. Cold: XLA compiles, the executables are stored (a program with progress on is three: prepare, advance,
    # finish, compiling.STAGES); one line says so.
    cold = start(cache, models)
    assert cold["total"].get("backend_compiles", 0) >= 1, cold["counts"]
    assert len(cold["cache_lines"]) == 1, cold["cache_lines"]
    assert "executable cache: miss: nothing stored yet; stored " in cold["cache_lines"][0]
    stored = list((cache / "executables").glob("*.xla"))
    assert len(stored) == 3 and all(p.stat().st_mode & 0o777 == 0o600 for p in stored)

    # 2. Warm: loaded; nothing lowered or compiled anywhere, nothing traced after loading the model
    # (loading traces only the modules' abstract shapes, nnx.eval_shape once per component).
    warm = start(cache, models)
    assert len(warm["cache_lines"]) == 1
    assert warm["cache_lines"][0].startswith("[sdxl_engine] loaded 64x64 x 4 images in ")
    assert "(executable cache: loaded " in warm["cache_lines"][0]
    assert not {"lowers", "backend_compiles", "hits", "misses"} & set(warm["total"]), warm["counts"]
    assert set(warm["counts"]) <= {"loading"}, warm["counts"]
    assert warm["counts"].get("loading", {}).get("traces", 0) <= 4, warm["counts"]
    assert warm["compile_s"] < cold["compile_s"]
    # ... and read them while the model loaded: the cold start recorded its three (starts.json), the warm one
    # deserialized them on threads from its first stage and its load took them.
    assert (cache / "executables" / "starts.json").stat().st_mode & 0o777 == 0o600
    assert not [line for line in cold["log"] if "reading the" in line or "read while" in line], cold["log"]
    assert "[sdxl_engine] loading model onto the devices (and reading the 3 executables the last start of this " \
           "configuration loaded) ..." in warm["log"]
    assert warm["cache_lines"][0].count("(preloaded)") == 3, warm["cache_lines"]
    ready = next(line for line in warm["log"] if line.startswith("[sdxl_engine] ready in "))
    assert ready.endswith("float32; 3 executables read while the model loaded)"), ready

    # 3. A tampered executable: refused without being read as a pickle, compiled again (fresh: XLA's
    # persistent cache is bypassed for what the executable cache stores), one line saying so.
    stored[0].write_bytes(stored[0].read_bytes()[:-1] + b"\0")
    tampered = start(cache, models)
    assert len(tampered["cache_lines"]) == 1, tampered["cache_lines"]
    line = tampered["cache_lines"][0]
    assert line.startswith("[sdxl_engine] compiled 64x64 x 4 images"), line
    assert f"executable cache: refused {stored[0].name}: its size or SHA-256 differs" in line  # though recorded
    assert tampered["total"].get("backend_compiles", 0) >= 1

    # 4. The fresh entry loads and runs (the warm-up request) in the next start.
    assert "loaded 64x64" in start(cache, models)["cache_lines"][0]


def test_executable_cache_off_keeps_the_xla_cache(tmp_path, models):
    cache = tmp_path / "cache"
    cold = start(cache, models, SDXL_EXECUTABLE_CACHE="0")
    warm = start(cache, models, SDXL_EXECUTABLE_CACHE="0")
    assert not (cache / "executables").exists()
    # the three stages of the program with progress on (compiling.STAGES), each its own XLA cache entry
    assert [line for line in cold["log"] if "compile cache: miss (0 hits, 3 misses)" in line]
    assert [line for line in warm["log"] if "compile cache: hit (3 hits, 0 misses)" in line]
    assert warm["total"].get("misses", 0) == 0 and not warm["cache_lines"]
