"""The device mesh: one ``data`` axis over every visible device; params replicated, batch sharded.

Each device runs its share of the request's images start to finish (text encoders, denoising
loop, VAE decode) with no cross-device traffic, as the blog's pmap did on a TPU v5e-4, but
expressed as ``jax.jit`` over ``NamedSharding`` (the pattern of jax's SPMD MNIST example).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sdxl_engine.config import ConfigError

DATA_AXIS = "data"


class ShardingError(ConfigError):
    """The batch cannot be split evenly over the devices: a setting (images_per_request) this machine cannot honour."""


def make_mesh(devices=None) -> Mesh:
    """A 1-D mesh named ``data`` over ``devices`` (default: all of ``jax.devices()``)."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def default_batch(device_count: int) -> int:
    """Images per request when the config says 0: 4 if the devices divide 4, else one per device."""
    return 4 if 4 % device_count == 0 else device_count


def check_batch(batch: int, mesh: Mesh) -> None:
    """Raise ShardingError unless ``batch`` images divide evenly over the mesh's devices."""
    n = mesh.devices.size
    if batch < 1 or batch % n:
        raise ShardingError(f"images_per_request ({batch}) must be a positive multiple of the device count ({n})")


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding for arrays every device holds whole (params, sigmas, step count)."""
    return NamedSharding(mesh, P())


def device_summary(mesh: Mesh) -> str:
    """e.g. ``4 × cpu`` or ``4 × TPU v5 lite``: device count and kind, for the page."""
    dev = mesh.devices.flat[0]
    kind = dev.platform if dev.platform == "cpu" else getattr(dev, "device_kind", dev.platform)
    return f"{mesh.devices.size} × {kind}"
