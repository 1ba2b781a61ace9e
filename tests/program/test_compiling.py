"""What program/compiling.py promises about JAX's persistent compilation cache."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT

# In a fresh process (JAX keeps its cache decision per process): a small program compiled four times, each time
# from a new function (so nothing comes from JAX's in-memory caches), with the hit count after each compile.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from sdxl_engine.program.compiling import cache_counts, in_parallel, persistent_cache_off

def compile_once():
    jax.jit(lambda x: jnp.sin(x) @ x.T * 3).lower(jnp.ones((8, 8), jnp.float32)).compile()
    return cache_counts()["hits"]

def compile_twice_in_parallel():  # as a stepped program's stages compile: on threads of their own
    in_parallel({"a": compile_once, "b": compile_once})
    return cache_counts()["hits"]

cache_counts()
hits = [compile_once(), compile_once()]  # a miss that stores, then a hit: the cache is in use
with persistent_cache_off():
    hits.append(compile_twice_in_parallel())  # first: the threads are the first to ask whether the cache is used
    hits.append(compile_once())
hits.append(compile_once())
print(json.dumps(hits))
"""


def test_a_compile_inside_persistent_cache_off_is_not_served_by_the_cache(tmp_path):
    """The executable cache stores only fresh compiles (an executable JAX's cache served, re-serialized, loses
    kernels on XLA:CPU): inside ``persistent_cache_off`` a program the cache holds is compiled again, even after
    this process has used the cache, also on the threads that compile a stepped program's stages side by side,
    and after the block the cache serves it again."""
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "jax")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, 1, 1, 1, 2]


@pytest.mark.engine
def test_the_stepped_program_runs_the_tpu_flash_kernel_inside_shard_map_as_the_xla_path(engine, monkeypatch):
    """The program as a TPU compiles it: layers.attention's "auto" picks the Pallas flash kernel (run here in TPU
    interpret mode) for the UNet's and the VAE's self-attention, inside the program's shard_map (whose varying-axes
    check refused the kernel's outputs on the chip: compiling.CHECK_VMA), through all three stages of a program
    with progress on; its images are the XLA path's to within the kernel's float32 rounding."""
    import jax

    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip("this JAX has no TPU interpret mode for Pallas kernels")
    if jax.__version_info__ < (0, 11):  # measured with jax 0.10.2 on 4 CPU devices: it waited forever
        pytest.skip("jax < 0.11's TPU interpret mode inside a shard_map over several CPU devices deadlocks (its "
                    "host callbacks' ordering tokens); the kernel itself is checked in tests/models")
    from sdxl_engine.models import layers
    from sdxl_engine.program.compiling import SteppedExecutable, compile_program
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, tokenize
    from sdxl_engine.program.schedulers import make_schedule

    shape = ProgramShape(4, 128, 128, 4, step_hook=True)  # 16 x 16 latents: 256 tokens, which 256-token tiles take
    ids, _ = tokenize(engine.model, "a red circle")
    empty, _ = tokenize(engine.model, "")
    inputs = ProgramInputs.build(ids, empty, True, [3, 4, 5, 6], 5.0,
                                 make_schedule("Euler", engine.model.scheduler_config, 3), 3, shape.max_steps)
    xla = compile_program(engine.model, engine.params, shape, engine.mesh)
    expected = np.asarray(xla.executable(engine.params, inputs)[0])
    lengths = []
    flash = layers.flash_attention_tpu
    monkeypatch.setattr(layers, "flash_attention_tpu", lambda q, *a, **k: lengths.append(q.shape[1]) or flash(q, *a,
                                                                                                                **k))
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
    with pltpu.force_tpu_interpret_mode():
        tpu = compile_program(engine.model, engine.params, shape, engine.mesh)
        images = np.asarray(tpu.executable(engine.params, inputs)[0])
    assert isinstance(tpu.executable, SteppedExecutable) and 256 in lengths  # the UNet's self-attention took it
    assert images.shape == expected.shape == (4, 128, 128, 3)
    diff = np.abs(images.astype(int) - expected.astype(int))
    assert diff.max() <= 2, diff.max()
    assert np.abs(images.astype(int) - np.roll(expected, 1, axis=0).astype(int)).max() > 20  # the check can fail


@pytest.mark.engine
@pytest.mark.parametrize("flags", [{}, {"cfg": False}, {"init_image": True}, {"init_image": True, "inpaint": True},
                                   {"init_latents": True}, {"latents_out": True}])
def test_the_loop_state_structure_the_loader_rebuilds_is_what_prepare_returns(engine, flags):
    """A stepped program loads from the executable cache without tracing: its loop state's pytree comes from
    generate.loop_structure, which must be prepare's own (else the cache refuses to store it: no warm start)."""
    import jax

    from sdxl_engine.program.compiling import jit_stages
    from sdxl_engine.program.generate import ProgramInputs, ProgramShape, latent_shape, loop_structure

    shape = ProgramShape(4, 64, 64, 8, step_hook=True, **flags)
    abstract = ProgramInputs.abstract(shape, latent_shape(engine.model, 64, 64), engine.mesh)
    traced = jax.eval_shape(jit_stages(engine.model, shape, engine.mesh)["prepare"], engine.params, abstract)
    assert jax.tree.structure(traced) == jax.tree.structure(loop_structure(engine.model, shape))
