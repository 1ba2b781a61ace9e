"""Restart (A1111's ``restart_sampler``) as Heun steps on its step list with noise jumps, against A1111's loop.

References: tests/fixtures/restart-steps.{json,npz} (``make_fixtures restart``: A1111's modules/sd_samplers_extra.py
``restart_sampler`` re-implemented in torch, k-diffusion's denoiser wrappers, A1111's sigmas per schedule type, the fake
deterministic model of two-call-steps, the noise before step j the fixture's ``noise[j - 1]``). The engine's side is
the program's own step (generate.sampler_step, two calls, jitted, ``i`` traced) with the fake model in JAX.
Tolerance: float32, |engine - reference| <= 1e-5 x (1 + |reference|) per step, as the other samplers' tests.
"""

import json
import math

import numpy as np
import pytest

from sdxl_engine.program.schedulers import (
    TWO_CALLS,
    _karras,
    make_schedule,
    refiner_start,
    restart_steps,
    sampler_config,
)
from tests.helpers import FIXTURES, case_config
from tests.program.test_schedulers_two_calls import close, step_function

STEPS = json.loads((FIXTURES / "restart-steps.json").read_text())
CASES = {case["name"]: case for case in STEPS["cases"]}


@pytest.fixture(scope="module")
def arrays():
    with np.load(FIXTURES / "restart-steps.npz") as data:
        return dict(data)


def schedule_of(case: dict):
    return make_schedule("Restart", case_config(STEPS, case), case["steps"], case["schedule_type"])


# ---- the step list: A1111's (sigma, sigma') pairs and its jumps -----------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_step_list_and_jumps_are_a1111s(name):
    """Each step's sigma and sigma' (the second call's; 0 for an Euler step to x0, with no second call) are
    A1111's step_list's; the steps whose d is not 0 are the ones before A1111's draws, d its jump's scale; n steps for
    n (the restart steps take the main list's place); a two-call schedule."""
    case = CASES[name]
    n, schedule = case["steps"], schedule_of(case)
    pairs = np.asarray(case["step_list"])
    assert len(schedule.timesteps) == n == len(pairs) and schedule.two_calls and "Restart" in TWO_CALLS
    close(schedule.sigmas[:n], pairs[:, 0], "sigmas")
    calls = schedule.second.f != 0  # all but the last; sgm_uniform's main list ends nearest 0.1 at its final 0, so
    assert np.array_equal(calls, pairs[:, 1] > 0) and schedule.sigmas[n] == 0  # its main list's last step is Euler's
    close(schedule.second.sigmas, pairs[:, 1], "second calls' sigmas")
    jumps = [j - 1 for j, _ in case["noise_draws"]]
    assert np.flatnonzero(schedule.d).tolist() == jumps
    close(schedule.d[jumps], [scale for _, scale in case["noise_draws"]], "the jumps' noise")
    assert schedule.init_scale == pytest.approx(case["sigmas"][0], rel=1e-6)  # k-diffusion's x * sigmas[0]
    assert not (schedule.second.d.any() or schedule.second.d2.any() or schedule.c.any() or schedule.e.any())


def test_restart_steps_on_fixed_sigmas():
    """restart_steps on a hand-made list: under 20 steps the sigmas' own pairs; at 20 the main list is Karras over 11
    steps from sigmas[-2] to sigmas[0], and after the step ending at its sigma nearest 0.1 (index lo) the 10 Karras
    sigmas from the one nearest 2 (index hi) down to sigmas[lo] run as 9 steps; at 40 two stretches of 10 steps over
    a main list of 20."""
    sigmas = np.concatenate([np.geomspace(10.0, 0.05, 12), [0.0]])
    old, new = restart_steps(sigmas)
    assert np.array_equal(old, sigmas[:-1]) and np.array_equal(new, sigmas[1:])
    for steps, restart, times in ((20, 9, 1), (40, 10, 2)):
        sigmas = np.concatenate([np.geomspace(10.0, 0.05, steps), [0.0]])
        main = np.concatenate([_karras(0.05, 10.0, steps - restart * times), [0.0]])
        lo, hi = int(np.argmin(np.abs(main - 0.1))), int(np.argmin(np.abs(main - 2.0)))
        stretch = _karras(main[lo], main[hi], restart + 1)
        old, new = restart_steps(sigmas)
        want_old = [*main[:lo], *list(stretch[:-1]) * times, *main[lo:-1]]
        want_new = [*main[1 : lo + 1], *list(stretch[1:]) * times, *main[lo + 1 :]]
        assert len(old) == steps
        np.testing.assert_allclose(old, want_old, rtol=1e-12)
        np.testing.assert_allclose(new, want_new, rtol=1e-12)
        assert old[lo] == main[hi] and new[lo - 1] == main[lo] and new[lo + restart - 1] == main[lo]  # exact ends


def test_coefficients_are_heuns_on_each_pair_and_the_jump_after_the_step_before():
    """On the fixture's 36-step list: a = 1 + dt/2s, b = -dt/2s, the second call from Euler's x (mid_a = s'/s,
    mid_b = 1 - s'/s) at s' with f = dt/2s' (dt = s' - s), its timestep k-diffusion's sigma_to_t of s'; the last step
    x0 (a 0, b 1); d = sqrt(s_{j+1}^2 - s'_j^2) where step j + 1 starts higher than step j ends, else 0."""
    case = CASES["restart-36"]
    schedule, pairs = schedule_of(case), np.asarray(case["step_list"], np.float64)
    s, s2 = pairs[:-1, 0], pairs[:-1, 1]
    dt = s2 - s
    for got, want, what in ((schedule.a[:-1], 1 + dt / (2 * s), "a"), (schedule.b[:-1], -dt / (2 * s), "b"),
                            (schedule.second.a[:-1], s2 / s, "mid_a"), (schedule.second.b[:-1], 1 - s2 / s, "mid_b"),
                            (schedule.second.f[:-1], dt / (2 * s2), "f")):
        close(got, want, what)
    assert (schedule.a[-1], schedule.b[-1], schedule.second.f[-1], schedule.second.g[-1]) == (0, 1, 0, 0)
    up = np.sqrt(np.maximum(pairs[1:, 0] ** 2 - pairs[:-1, 1] ** 2, 0))
    close(schedule.d[:-1], up, "d")
    assert (up > 1).sum() == 2 and schedule.d[-1] == 0
    joined = schedule.d[:-1] == 0  # no jump: the second call's timestep is the next step's
    close(schedule.second.timesteps[:-1][joined], schedule.timesteps[1:][joined], "second calls' timesteps")


# ---- every step of A1111's loop with a fake model ------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_every_step_matches_a1111(name, arrays):
    """The program's step on A1111's x at the start of step j gives A1111's x at the start of step j + 1: both calls,
    their sigmas and timesteps, the last Euler step and, after the step before a jump, the jump's noise (A1111's draw
    noise[j], the engine's z of step j)."""
    case = CASES[name]
    n, schedule = case["steps"], schedule_of(case)
    prediction = sampler_config("Restart", case_config(STEPS, case))["prediction_type"]
    step = step_function(schedule, prediction, arrays["bias"])
    samples, noise = arrays[f"{name}_samples"], arrays["noise"]
    assert len(samples) == n + 1
    for j in range(n):
        got = np.asarray(step(j, samples[j], noise[j], noise[j] * 0))
        if "cosine" in name:  # from sigma 20 291 the fake model's x is in the tens of thousands: float32's rounding of
            # such values (1e-3) is what any float32 run carries, so 1e-6 of the largest, not per element (measured
            # 7e-8; as test_schedulers_two_calls' cosine DPM2 a)
            assert np.abs(got - samples[j + 1]).max() <= 1e-6 * np.abs(samples[j + 1]).max(), (name, j)
        else:
            close(got, samples[j + 1], f"{name} step {j}")


@pytest.mark.parametrize("name", ["restart-20", "restart-36", "restart-22-v"])
def test_a_whole_loop_matches_a1111(name, arrays):
    """The program's steps fed their own output from start x init_scale end where A1111's loop ends."""
    case = CASES[name]
    schedule = schedule_of(case)
    prediction = sampler_config("Restart", case_config(STEPS, case))["prediction_type"]
    step = step_function(schedule, prediction, arrays["bias"])
    x = arrays["start"] * np.float32(schedule.init_scale)
    for j in range(case["steps"]):
        x = np.asarray(step(j, x, arrays["noise"][j], x * 0))
    close(x, arrays[f"{name}_samples"][-1], f"Restart after {case['steps']} steps", rtol=1e-4)


# ---- schedule types, the refiner's switch ----------------------------------------------------------------------------
def test_automatic_is_karras_and_the_spacings_are_heuns_sigmas():
    """Restart's Automatic is A1111's Karras (its ``'scheduler': 'karras'``); a spacing type restarts over
    HeunDiscreteScheduler's sigmas with that spacing (under 20 steps: those sigmas as they are)."""
    base = STEPS["base_config"]
    for steps in (8, 24):
        automatic, karras = make_schedule("Restart", base, steps), make_schedule("Restart", base, steps, "karras")
        for field in ("timesteps", "sigmas", "a", "b", "d"):
            assert np.array_equal(getattr(automatic, field), getattr(karras, field)), field
    heun = make_schedule("Heun", base, 8, "trailing")
    restart = make_schedule("Restart", base, 8, "trailing")
    close(restart.sigmas, heun.sigmas, "trailing sigmas")
    assert np.flatnonzero(make_schedule("Restart", base, 24, "trailing").d).size == 1


def test_refiner_switch_is_the_first_step_below_the_cutoff():
    """Restart's timesteps jump back up: the refiner takes over at the first step below the cutoff (A1111 switches at a
    step), not at the count of timesteps above it; for falling timesteps the two are the same."""
    timesteps = make_schedule("Restart", STEPS["base_config"], 20).timesteps
    assert (np.diff(timesteps) > 0).any()
    cutoff = 1000 - 0.5 * 1000
    first = int(np.argmax(timesteps < cutoff))
    assert refiner_start(timesteps, 0.5) == first < int(np.sum(timesteps >= cutoff))
    falling = make_schedule("Heun", STEPS["base_config"], 20).timesteps
    assert refiner_start(falling, 0.5) == int(np.sum(falling >= cutoff))
    assert refiner_start(timesteps, 0.0) == 0 and refiner_start(np.array([999.0, 995.0]), 0.01) == 2


def test_jump_noise_scale_is_the_variance_gap():
    """x at sigma' plus sqrt(s^2 - sigma'^2) z is at sigma s: the jump's variance adds up (A1111's s_noise 1)."""
    schedule = make_schedule("Restart", STEPS["base_config"], 20)
    j = int(np.flatnonzero(schedule.d)[0])
    assert math.isclose(schedule.second.sigmas[j] ** 2 + schedule.d[j] ** 2, schedule.sigmas[j + 1] ** 2, rel_tol=1e-5)
