"""Geometry: the size buckets and the batch's split over the devices."""

import jax
import pytest

from sdxl_engine.checkpoint.loading import size_buckets
from sdxl_engine.program.sharding import ShardingError, check_batch, make_mesh


def test_size_buckets_scaled_to_native():
    assert size_buckets(1024, 64)[:3] == ((1024, 1024), (1152, 896), (896, 1152))
    assert all(w % 8 == 0 and h % 8 == 0 for w, h in size_buckets(64, 8))


def test_batch_must_divide_over_devices():
    mesh = make_mesh(jax.devices()[:1] * 1)
    check_batch(4, mesh)
    if len(jax.devices()) >= 4:
        with pytest.raises(ShardingError, match=r"images_per_request \(3\) must be a positive multiple of the device "
                                                r"count \(4\)"):
            check_batch(3, make_mesh(jax.devices()[:4]))
