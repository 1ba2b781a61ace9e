"""One UNet-sized 3x3 convolution in a loop on 4 CPU devices, timed: XLA:CPU's convolution from one JAX to another.

    python -m tools.xla_cpu_conv                              # this interpreter's JAX (the engine's: 0.12)
    /work/venv-blog/bin/python -m tools.xla_cpu_conv          # the blog's stack (jax 0.10.2)
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python -m tools.xla_cpu_conv   # without YNNPACK fusions
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_convolution python -m tools.xla_cpu_conv
                                                              # YNNPACK for all but convolutions

The kernel the 64² comparison with the blog's pipeline spends most of its time in (tools/vs_blog.py ``--profile``):
a 3x3 convolution on (2, 16, 16, 32) float32 channels-last activations, as tiny-shapes' UNet runs it with CFG, one
program per device under ``pmap`` over 4 CPU devices, 200 times in a ``fori_loop`` with a ``tanh`` between. Prints
the JAX version and the medians of 7 timed calls after one warm-up as one JSON line: wall milliseconds, and the
process's CPU milliseconds (all its threads: what a call costs the cores that the 4 devices share). ``--devices 1``
runs the same loop on one device with no program beside it. Imports only JAX and NumPy, so either interpreter runs
it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

DEVICES = 4


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--size", type=int, default=16, help="height and width of the activations")
    p.add_argument("--loops", type=int, default=200)
    p.add_argument("--devices", type=int, default=DEVICES, help="CPU devices, one program on each (default 4)")
    args = p.parse_args(argv)
    devices = args.devices
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np

    def body(x, w):
        def step(_, x):
            return jnp.tanh(jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)),
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return jax.lax.fori_loop(0, args.loops, step, x)

    program = jax.pmap(body)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((devices, 2, args.size, args.size, args.channels), np.float32))
    w = jnp.asarray(0.05 * rng.standard_normal((devices, 3, 3, args.channels, args.channels), np.float32))
    program(x, w).block_until_ready()
    times, cpu = [], []
    for _ in range(7):
        c0, t0 = time.process_time(), time.perf_counter()
        program(x, w).block_until_ready()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(json.dumps({"jax": jax.__version__, "xla_flags": os.environ["XLA_FLAGS"].strip(),
                      "shape": [2, args.size, args.size, args.channels], "loops": args.loops, "devices": devices,
                      "median_ms": round(1e3 * float(np.median(times)), 2),
                      "cpu_median_ms": round(1e3 * float(np.median(cpu)), 2)}))


if __name__ == "__main__":
    main()
