"""Samplers (sdxl_engine/schedulers.py) against diffusers' PyTorch schedulers."""

import json
from pathlib import Path

import numpy as np
import pytest

from sdxl_engine.schedulers import SAMPLERS, UnknownSampler, get_sampler, make_schedule

REF_DIR = Path(__file__).parent / "fixtures" / "tiny-pt-reference"
REF = json.loads((REF_DIR / "reference.json").read_text())
VARIANTS = {  # fixture variant -> (sampler, timestep_spacing)
    "euler-leading": ("Euler", None), "euler-trailing": ("Euler", "trailing"), "euler-linspace": ("Euler", "linspace"),
    "dpm++2m": ("DPM++ 2M", None), "dpm++2m-karras": ("DPM++ 2M Karras", None), "ddim": ("DDIM", None),
}


@pytest.fixture(scope="module")
def arrays():
    with np.load(REF_DIR / "arrays.npz") as data:
        return dict(data)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("steps", [1, 2, 4, 7, 10, 20, 50])
def test_timesteps_and_sigmas_match_diffusers(arrays, variant, steps):
    sampler, _ = VARIANTS[variant]
    schedule = make_schedule(sampler, REF["schedules"][variant]["config"], steps)
    np.testing.assert_allclose(schedule.timesteps, arrays[f"sched_{variant}_{steps}_timesteps"], rtol=1e-6)
    if f"sched_{variant}_{steps}_sigmas" in arrays:
        np.testing.assert_allclose(schedule.sigmas, arrays[f"sched_{variant}_{steps}_sigmas"], rtol=1e-5)
    init = REF["schedules"][variant]["init_noise_sigma"][str(steps)]
    if sampler == "Euler":
        assert schedule.init_scale == pytest.approx(init, rel=1e-5)
    else:  # diffusers' x-space noise (init_noise_sigma 1) is sqrt(sigma_0^2 + 1) in sigma space
        assert init == 1.0 and schedule.init_scale == pytest.approx((schedule.sigmas[0] ** 2 + 1) ** 0.5)
    padded = schedule.padded(50)
    assert padded["sigmas"].shape == (51,) and np.all(padded["a"][steps:] == 0)


def test_euler_is_the_first_order_update_and_dpm_uses_the_previous_prediction():
    config = REF["schedules"]["euler-leading"]["config"]
    euler = make_schedule("Euler", config, 10)
    s = euler.sigmas.astype(np.float64)
    np.testing.assert_allclose(euler.a, s[1:] / s[:-1], rtol=1e-6)
    np.testing.assert_allclose(euler.a + euler.b, 1, rtol=1e-6)
    assert not euler.c.any() and not euler.d.any()
    dpm = make_schedule("DPM++ 2M", config, 10)
    assert dpm.c[0] == 0 and dpm.c[-1] == 0 and (dpm.c[1:-1] < 0).all()  # first and last steps first order
    np.testing.assert_allclose(dpm.a + dpm.b + dpm.c, 1, rtol=1e-5)  # a fixed point stays fixed
    ancestral = make_schedule("Euler a", config, 10)
    assert (ancestral.d[:-1] > 0).all() and ancestral.d[-1] == 0
    np.testing.assert_allclose(ancestral.a**2 * s[:-1] ** 2 + ancestral.d**2, s[1:] ** 2, rtol=1e-5)  # variance kept


def test_sampler_names():
    assert SAMPLERS == ("Euler", "Euler a", "DPM++ 2M", "DPM++ 2M Karras", "DDIM")
    assert get_sampler(" dpm++  2m karras") == "DPM++ 2M Karras" and get_sampler(None) == "Euler"
    with pytest.raises(UnknownSampler, match="unknown sampler 'LMS'; choose one of Euler, Euler a, DPM"):
        get_sampler("LMS")
    with pytest.raises(UnknownSampler):
        get_sampler(3)
