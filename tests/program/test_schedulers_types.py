"""Schedule types (A1111's ``scheduler``): their sigmas against A1111's / k-diffusion's formulas
(tests/fixtures/schedule-types.json, written by ``python -m tools.schedule_reference``: numpy ports of
modules/sd_schedulers.py and k_diffusion/sampling.py, SDXL base's scheduler config), at 20 and 7 steps; automatic is
each sampler's schedule unchanged; the refusals name the field."""

import json

import numpy as np
import pytest

from sdxl_engine.program.schedulers import (
    SAMPLERS,
    SCHEDULE_TYPES,
    SPACING_TYPES,
    TWO_CALLS,
    UnknownScheduleType,
    UnsupportedScheduleType,
    get_schedule_type,
    make_schedule,
    sampler_config,
    schedule_sigmas,
)
from tests.helpers import FIXTURES, ROOT

SDXL = json.loads((ROOT / "sdxl_engine/checkpoint/configs/sdxl-base-1.0/scheduler/scheduler_config.json").read_text())
REFERENCE = json.loads((FIXTURES / "schedule-types.json").read_text())["sigmas"]
CASES = [(int(n), name) for n, types in REFERENCE.items() for name in types]


def training_sigmas() -> np.ndarray:
    from sdxl_engine.program.schedulers import _alphas_cumprod

    ac = _alphas_cumprod(sampler_config("Euler", SDXL))
    return ((1 - ac) / ac) ** 0.5


def test_the_fixture_covers_every_schedule_type_but_automatic_at_20_and_7_steps():
    assert sorted(REFERENCE) == ["20", "7"]
    assert all(sorted(types) == sorted(set(SCHEDULE_TYPES) - {"automatic", *SPACING_TYPES})  # A1111's: sigmas
               for types in REFERENCE.values())


@pytest.mark.parametrize("steps, name", CASES)
def test_schedule_sigmas_are_a1111s(steps, name):
    """A1111 float32 torch against the engine's float64 numpy: 1e-5 relative (seen: 2e-6)."""
    want = np.array(REFERENCE[str(steps)][name])
    got = schedule_sigmas(name, training_sigmas(), steps)
    assert got.shape == (steps,)
    np.testing.assert_allclose(got, want[:-1], rtol=1e-5, atol=0)
    assert want[-1] == 0.0


@pytest.mark.parametrize("sampler", ["Euler", "Euler a", "DPM++ 2M"])
@pytest.mark.parametrize("steps, name", CASES)
def test_each_sampler_runs_the_schedule_types_sigmas_and_ends_at_zero(sampler, steps, name):
    schedule = make_schedule(sampler, SDXL, steps, name)
    np.testing.assert_allclose(schedule.sigmas, REFERENCE[str(steps)][name], rtol=1e-5, atol=0)
    # the timesteps are k-diffusion's sigma_to_t of those sigmas: the top one is the last training timestep
    assert schedule.timesteps.shape == (steps,) and schedule.timesteps[0] == pytest.approx(999, abs=0.5)
    assert np.all(np.diff(schedule.timesteps) <= 0)


def test_euler_karras_coefficients_follow_the_sigmas():
    """Euler's update x' = (s'/s) x + (1 - s'/s) x0 on A1111's Karras sigmas: a by hand from the fixture."""
    sigmas = np.array(REFERENCE["7"]["karras"])
    schedule = make_schedule("Euler", SDXL, 7, "karras")
    np.testing.assert_allclose(schedule.a, sigmas[1:] / sigmas[:-1], rtol=1e-5)
    np.testing.assert_allclose(schedule.b, 1 - sigmas[1:] / sigmas[:-1], rtol=1e-5, atol=1e-7)
    # SDXL's config spaces timesteps "leading": diffusers' init_noise_sigma is sqrt(sigma_max^2 + 1)
    assert schedule.init_scale == pytest.approx((sigmas[0] ** 2 + 1) ** 0.5, rel=1e-6)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_automatic_is_the_samplers_own_schedule_exactly(sampler):
    own, automatic = make_schedule(sampler, SDXL, 20), make_schedule(sampler, SDXL, 20, "automatic")
    for field in ("timesteps", "sigmas", "a", "b", "c", "c2", "d", "e"):
        assert np.array_equal(getattr(own, field), getattr(automatic, field)), field
    assert (own.init_scale, own.final_scale) == (automatic.init_scale, automatic.final_scale)


def test_dpmpp_2m_with_karras_is_dpmpp_2m_karras():
    for steps in (7, 20):
        split, named = make_schedule("DPM++ 2M", SDXL, steps, "karras"), make_schedule("DPM++ 2M Karras", SDXL, steps)
        for field in ("timesteps", "sigmas", "a", "b", "c", "c2", "d", "e"):
            assert np.array_equal(getattr(split, field), getattr(named, field)), field
        np.testing.assert_allclose(named.sigmas, REFERENCE[str(steps)]["karras"], rtol=1e-5)
    assert not np.array_equal(make_schedule("DPM++ 2M", SDXL, 7).sigmas, make_schedule("DPM++ 2M", SDXL, 7,
                                                                                          "karras").sigmas)


@pytest.mark.parametrize("sampler", ["DPM++ 3M SDE", "UniPC"])
def test_the_multistep_samplers_take_a1111s_sigmas(sampler):
    """DPM++ 3M SDE ("DPM++ 3M SDE Karras" / "Exponential" in A1111's older names) and UniPC on A1111's Karras and
    exponential sigmas: those sigmas, whole timesteps, the sampler's own multistep coefficients (third order / the
    corrector where c2 is not 0) on them, and other coefficients than the automatic spacing's."""
    for schedule_type in ("karras", "exponential"):
        typed, own = make_schedule(sampler, SDXL, 7, schedule_type), make_schedule(sampler, SDXL, 7)
        np.testing.assert_allclose(typed.sigmas, REFERENCE["7"][schedule_type], rtol=1e-5)
        assert typed.sigmas[-1] == 0 and np.array_equal(typed.timesteps, np.round(typed.timesteps))
        assert (typed.c2[2:-2] != 0).all() and not np.allclose(typed.b, own.b)


@pytest.mark.parametrize("sampler", TWO_CALLS)
def test_the_two_call_samplers_take_a1111s_sigmas(sampler):
    """Heun, DPM2 and DPM++ SDE on every A1111 schedule type with a reference: those sigmas, the final 0, fractional
    timesteps (k-diffusion's sigma_to_t), their second calls between them (tests/program/test_schedulers_two_calls.py
    runs k-diffusion's samplers on them)."""
    for schedule_type in REFERENCE["7"]:
        typed = make_schedule(sampler, SDXL, 7, schedule_type)
        np.testing.assert_allclose(typed.sigmas, REFERENCE["7"][schedule_type], rtol=1e-5)
        mid = typed.second.sigmas[:-1]
        assert typed.sigmas[-1] == 0 and ((mid <= typed.sigmas[:-2]) & (mid >= typed.sigmas[1:-1])).all()


def test_names_labels_and_aliases():
    assert [get_schedule_type(n) for n in (None, "", "Automatic", "KARRAS", "SGM Uniform", "SGMUniform", "beta")] == [
        "automatic", "automatic", "automatic", "karras", "sgm_uniform", "sgm_uniform", "beta"]
    with pytest.raises(UnknownScheduleType) as err:
        get_schedule_type("polyexponential")
    assert str(err.value) == ("unknown schedule type 'polyexponential'; choose one of automatic, uniform, karras, "
                              "exponential, sgm_uniform, simple, beta, leading, linspace, trailing")


@pytest.mark.parametrize("sampler, name", [("DDIM", "karras"), ("LCM", "uniform"), ("DPM++ 2M Karras", "beta")])
def test_samplers_with_their_own_timesteps_refuse_another_schedule_type(sampler, name):
    with pytest.raises(UnsupportedScheduleType):
        make_schedule(sampler, SDXL, 4, name)
