"""The persistent compilation cache: a restart compiles nothing that was compiled before.

Both starts run in fresh processes on folders of this test only: the model is built into its
own model cache before the first (measured) start, so building it is not counted, whatever an
earlier run left on the machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START_ENGINE = """
import json, jax
from sdxl_engine.config import EngineConfig, apply_jax_options
config = EngineConfig.load({"model": "tiny-random"})
apply_jax_options(config)
counts = {"hits": 0, "misses": 0, "backend_compiles": 0}
def on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits": counts["hits"] += 1
    if event == "/jax/compilation_cache/cache_misses": counts["misses"] += 1
def on_duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration": counts["backend_compiles"] += 1
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
from sdxl_engine.engine import Engine
log = []
engine = Engine(config, log=log.append).start()
print(json.dumps({**counts, "compile_s": engine.startup["compile_s"], "log": log}))
"""


def start(cache_dir: Path, model_dir: Path) -> dict:
    env = {**os.environ, "SDXL_COMPILE_CACHE_DIR": str(cache_dir), "SDXL_MODEL_CACHE_DIR": str(model_dir),
           "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # JAX's own variable would win over the one set here
    out = subprocess.run([sys.executable, "-c", START_ENGINE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restart_hits_the_cache_and_compiles_nothing(tmp_path):
    from sdxl_engine.builtin import model_path

    models = tmp_path / "models"
    model_path("tiny-random", str(models))  # built here, outside the measured starts
    cold = start(tmp_path / "cache", models)
    assert cold["misses"] >= 1 and cold["backend_compiles"] >= 1
    assert any((tmp_path / "cache").iterdir())
    warm = start(tmp_path / "cache", models)
    # JAX's backend-compile event wraps cache reads too, so count misses: none means no XLA compile ran.
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"] + cold["hits"], (cold, warm)
    # The log says so: one line per compiled size.
    assert [line for line in cold["log"] if "compile cache: miss (0 hits, 1 misses)" in line]
    assert [line for line in warm["log"] if "compile cache: hit (1 hits, 0 misses)" in line]
