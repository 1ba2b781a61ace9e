"""What program/compiling.py promises about JAX's persistent compilation cache."""

import json
import subprocess
import sys

from tests.helpers import ROOT

# In a fresh process (JAX keeps its cache decision per process): a small program compiled four times, each time
# from a new function (so nothing comes from JAX's in-memory caches), with the hit count after each compile.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from sdxl_engine.program.compiling import cache_counts, persistent_cache_off

def compile_once():
    jax.jit(lambda x: jnp.sin(x) @ x.T * 3).lower(jnp.ones((8, 8), jnp.float32)).compile()
    return cache_counts()["hits"]

cache_counts()
hits = [compile_once(), compile_once()]  # a miss that stores, then a hit: the cache is in use
with persistent_cache_off():
    hits.append(compile_once())
hits.append(compile_once())
print(json.dumps(hits))
"""


def test_a_compile_inside_persistent_cache_off_is_not_served_by_the_cache(tmp_path):
    """The executable cache stores only fresh compiles (an executable JAX's cache served, re-serialized, loses
    kernels on XLA:CPU): inside ``persistent_cache_off`` a program the cache holds is compiled again, even after
    this process has used the cache, and after the block the cache serves it again."""
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "jax")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, 1, 1, 2]
