"""Random weights for a whole model, made on the devices in the target dtype, cheap to compile.

For timing without a download (``sdxl-base-random``): SDXL base has 2,641 parameter tensors
(1,135 random, the rest norm scales and biases) in 77 distinct shapes. Two obvious ways are
slow on a CPU host, where XLA compiles one kernel per output:

* jitting the modules' own initialisers (``Component.init``): threefry and truncated normals
  for every tensor, thousands of lines of StableHLO for the UNet alone, minutes of XLA compile,
  and the compile's working memory came on top of the params;
* one jitted function returning all tensors: a compiled kernel per random tensor, so the
  compile grows with the tensor count (1,135 here).

(The figures: docs/benchmarks.md, "Full-size warm start" and "Figures behind choices in the code".)

So one jitted *fill* function makes every tensor, ``mean + std * u`` with ``u`` uniform on
[-sqrt 3, sqrt 3) (unit variance) from an integer hash of (seed, tensor index, element index):
the seed, index, mean and std are runtime arguments, so it compiles once per distinct shape
(77 kernels for SDXL base) and each call writes its tensor straight into its sharding, in the
target dtype (no float32 copy anywhere: the hash, scaling and cast fuse into one loop).

Each tensor gets the mean and standard deviation the modules' own initialisers give it
(:func:`init_spec`, from layers.py's rules; tests compare the two), so activations have the
usual scale. Values are not those of ``Component.init``: only the statistics match.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdxl_engine.models import Component

# CLIP's embeddings (clip.py): token 0.02, position 0.01, as transformers initialises them.
EMBEDDING_STD = {"token_embedding.weight": 0.02, "position_embedding.weight": 0.01}


def init_spec(key: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a parameter as the modules' own initialisers make it (layers.py).

    1-D: norms' ``weight`` 1, every ``bias`` 0 (constants, std 0). 2-D: CLIP's embeddings
    (:data:`EMBEDDING_STD`), else a Linear ``weight`` (out, in), std 1/sqrt(in). 4-D: a Conv2d
    ``weight`` (kh, kw, in, out), std 1/sqrt(kh kw in).

    Raises:
        ValueError: a parameter none of these rules covers (a new kind of layer: add its rule).
    """
    if len(shape) == 1:
        if key.endswith(".bias"):
            return 0.0, 0.0
        if key.endswith(".weight"):
            return 1.0, 0.0
    if len(shape) == 2 and key.endswith(".weight"):
        for suffix, std in EMBEDDING_STD.items():
            if key.endswith(suffix):
                return 0.0, std
        return 0.0, 1 / math.sqrt(shape[1])
    if len(shape) == 4 and key.endswith(".weight"):
        return 0.0, 1 / math.sqrt(math.prod(shape[:3]))
    raise ValueError(f"no initialiser rule for parameter {key!r} of shape {shape} (random_weights.init_spec)")


def fill(seed: jax.Array, index: jax.Array, mean: jax.Array, std: jax.Array, shape: tuple[int, ...],
         dtype) -> jax.Array:
    """A ``shape`` array of ``dtype``: mean + std * u, u uniform with unit variance, from a hash.

    Element i of tensor ``index`` hashes ``i * golden + (seed * c1 + index * c2)`` with MurmurHash3's
    32-bit finaliser; its top 24 bits make u. Scalars: ``seed``, ``index`` uint32; ``mean``,
    ``std`` float32. Jit it with ``shape`` and ``dtype`` static: one kernel per shape.
    """
    i = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    h = i * jnp.uint32(0x9E3779B9) + (seed * jnp.uint32(0x85EBCA77) + index * jnp.uint32(0xC2B2AE3D))
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    u = (h >> 8).astype(jnp.float32) * (2.0 ** -23) - 1.0  # uniform on [-1, 1): variance 1/3
    return (mean + (std * math.sqrt(3.0)) * u).astype(dtype)


def random_params(components: Mapping[str, Component], dtype, sharding=None,
                  seed: int = 0) -> dict[str, dict[str, jax.Array]]:
    """{component: {checkpoint key: array}} of random weights in ``dtype``, placed by ``sharding``.

    Args:
        components: the model's Components (their ``shapes``), by name.
        dtype: the parameters' dtype (e.g. ``jnp.bfloat16``).
        sharding: where every tensor is made (``out_shardings`` of the fill); None = the default device.
        seed: any uint32; tensors are numbered in component then key order.
    Raises:
        ValueError: see :func:`init_spec`.
    """
    make = jax.jit(fill, static_argnums=(4, 5), out_shardings=sharding)
    dtype, out, index = jnp.dtype(dtype), {}, 0
    for name, component in components.items():
        out[name] = {}
        for key, shape in component.shapes.items():
            mean, std = init_spec(key, shape)
            out[name][key] = make(np.uint32(seed), np.uint32(index), np.float32(mean), np.float32(std), tuple(shape),
                                  dtype)
            index += 1
    return out
