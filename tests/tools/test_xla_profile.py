"""tools/xla_profile.py (``python -m tools.vs_blog --profile``): kernels found by what they compute, timed per request.

A real profile of a small program on this process's CPU devices: a 3x3 convolution and a dense layer, 6 times
in a ``fori_loop``, two requests. The convolution and the dot must be found under keys that name them (not the
fusion's instance number), with 6 calls per request; and between two programs, the kernel only one has is first.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tools import xla_profile

STEPS = 6


def program(with_dense: bool):
    def body(i, x):
        y = jax.lax.conv_general_dilated(x, jnp.full((3, 3, 8, 8), 0.01), (1, 1), ((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if with_dense:
            y = jnp.tanh(y @ jnp.full((8, 8), 0.1))
        return y

    return jax.jit(lambda x: jax.lax.fori_loop(0, STEPS, body, x))


def profiled(fn, x, out, requests: int = 2):
    fn(x).block_until_ready()
    jax.profiler.start_trace(str(out))
    for _ in range(requests):
        fn(x).block_until_ready()
    jax.profiler.stop_trace()
    return xla_profile.kernel_times(next(out.rglob("*.xplane.pb")), fn.lower(x).compile().as_text(), requests)


def test_kernels_are_found_by_what_they_compute_with_their_calls_per_request(tmp_path):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 20, 8)), jnp.float32)  # non-square
    dense, plain = profiled(program(True), x, tmp_path / "a"), profiled(program(False), x, tmp_path / "b")
    conv = [k for k in dense if "conv" in k]  # a library fusion keyed by its convolution, or the conv thunk
    dot = [k for k in dense if " dot(" in k]
    assert conv and dot, sorted(dense)
    assert {dense[k]["calls"] for k in conv + dot} == {STEPS}
    assert all(dense[k]["ms"] > 0 for k in conv + dot)
    assert not [k for k in plain if " dot(" in k]
    table = xla_profile.compare({"dense": dense, "plain": plain}, top=50)
    assert table["total_ms"]["dense"] > 0 and table["total_ms"]["plain"] > 0
    rows = {row["kernel"]: row for row in table["kernels"]}
    assert rows[dot[0]]["plain"] == {"ms": 0.0, "calls": 0} and rows[dot[0]]["dense"]["calls"] == STEPS
    assert "| **all kernels** |" in xla_profile.markdown(64, table)
