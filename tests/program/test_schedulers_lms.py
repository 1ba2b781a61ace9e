"""LMS (schedulers.py's LMSDiscreteScheduler, k-diffusion's sample_lms, order 4) against diffusers and k-diffusion.

References: tests/fixtures/sampler-steps.{json,npz}, the ``lms-*`` cases (``make_fixtures samplers``: diffusers
0.42.1's ``LMSDiscreteScheduler.step`` trajectory on fixed model outputs, the fake model), which
test_schedulers.py also checks step by step with numpy; here the program's own step (generate.sampler_step, jitted,
``i`` traced, its carry of history entries) runs each case freely from the first sample, never fed diffusers'. On
A1111's schedule types and from a later step the reference is k-diffusion's ``sample_lms`` written in numpy below,
its coefficients by scipy's ``quad`` as k-diffusion's ``linear_multistep_coeff`` integrates them.
"""

import json
import math
import types

import numpy as np
import pytest

from sdxl_engine.program.schedulers import LMS_ORDER, lms_coefficient, make_schedule, sampler_config
from tests.helpers import FIXTURES, case_config

STEPS = json.loads((FIXTURES / "sampler-steps.json").read_text())
CASES = {case["name"]: case for case in STEPS["cases"] if case["sampler"] == "LMS"}
RTOL = 1e-5


@pytest.fixture(scope="module")
def steps_arrays():
    with np.load(FIXTURES / "sampler-steps.npz") as data:
        return dict(data)


def program_step(schedule, outputs: np.ndarray, prediction: str):
    """The program's step, jitted with ``i`` traced: ``(i, carry) -> carry`` on the 5-array carry, the model's
    output at step i ``outputs[i]`` (the fixture's fixed outputs: a fake model) turned into x0 by ``denoised``."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.program.generate import denoised, sampler_step

    n = len(schedule.timesteps)
    fields = {**schedule.padded(n), "clip_range": np.float32(schedule.clip_range), "num_steps": np.int32(n)}
    inputs = types.SimpleNamespace(**{k: jnp.asarray(v) for k, v in fields.items()})
    table = jnp.asarray(outputs)

    @jax.jit
    def step(i, carry):
        def x0_of(x, sigma, t):
            return denoised(x, table[i], sigma, prediction)

        return sampler_step(x0_of, lambda draw, coefficient: jnp.zeros_like(carry[0]), inputs, i, carry)

    return step


def free_run(schedule, outputs, prediction, start, first: int = 0) -> list[np.ndarray]:
    """Every sample x_1 .. x_n of the program's steps from ``start`` (sigma space) at step ``first``."""
    import jax.numpy as jnp

    step = program_step(schedule, outputs, prediction)
    carry = (jnp.asarray(start, jnp.float32), *(jnp.zeros_like(jnp.asarray(start, jnp.float32)) for _ in range(4)))
    samples = []
    for i in range(first, len(schedule.timesteps)):
        carry = step(np.int32(i), carry)
        samples.append(np.asarray(carry[0], np.float64))
    return samples


@pytest.mark.parametrize("name", CASES)
def test_the_programs_step_runs_diffusers_lms_trajectory(name, steps_arrays):
    """From diffusers' first sample, the program's jitted step (its history carry: the derivatives of the last
    three steps) reaches diffusers' ``LMSDiscreteScheduler.step(order=4)`` sample at every step to 1e-5 x (1 +
    |sample|), never fed diffusers' samples."""
    case = CASES[name]
    config = case_config(STEPS, case)
    schedule = make_schedule("LMS", config, case["steps"])
    prediction = sampler_config("LMS", config)["prediction_type"]
    want = steps_arrays[f"{name}_samples"].astype(np.float64)
    ours = free_run(schedule, steps_arrays["model_outputs"], prediction, want[0])
    worst = max(np.abs(a - b).max() / (1 + np.abs(b).max()) for a, b in zip(ours, want[1:], strict=True))
    print(f"{name}: worst relative difference over {case['steps']} steps {worst:.2g}")
    assert worst < RTOL, worst
    assert schedule.init_scale == pytest.approx(case["init_noise_sigma"], rel=1e-6)
    assert schedule.final_scale == 1.0 and (schedule.d == 0).all() and (schedule.e == 0).all()


def test_the_order_grows_to_four_and_no_further():
    """Step i combines min(i + 1, 4) derivatives: c (one back) from step 1, c2 from 2, c3 from 3 on, never a
    fifth; the entries are the derivatives (hx = 1/sigma, hx0 = -1/sigma); a restart (img2img's start, the refiner's
    switch) begins again at first order, as k-diffusion's sample_lms on the sigmas from there."""
    config = STEPS["base_config"]
    schedule = make_schedule("LMS", config, 12)
    assert schedule.c[0] == 0 and (schedule.c[1:] != 0).all()
    assert (schedule.c2[:2] == 0).all() and (schedule.c2[2:] != 0).all()
    assert (schedule.c3[:3] == 0).all() and (schedule.c3[3:] != 0).all()
    np.testing.assert_allclose(schedule.hx, 1 / schedule.sigmas[:-1], rtol=1e-6)
    np.testing.assert_allclose(schedule.hx0, -1 / schedule.sigmas[:-1], rtol=1e-6)
    started = schedule.starting_at(5)
    assert started.c[5] == started.c2[6] == started.c3[7] == 0 and started.c3[8] != 0
    for name in ("a", "b", "c", "c2", "c3"):
        np.testing.assert_array_equal(getattr(started, name)[:5], getattr(schedule, name)[:5])
    assert LMS_ORDER == 4


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_coefficients_integrate_the_lagrange_basis(order):
    """The L_j of one step sum to sigma' - sigma (the basis sums to 1) and each is scipy's quad of the basis
    polynomial, as diffusers' get_lms_coefficient and k-diffusion's linear_multistep_coeff compute it."""
    from scipy import integrate

    sigmas = np.array([14.6, 6.1, 2.2, 0.69, 0.17, 0.029, 0.0])
    i = 4
    coefficients = [lms_coefficient(sigmas, i, order, j) for j in range(order)]
    assert sum(coefficients) == pytest.approx(sigmas[i + 1] - sigmas[i], rel=1e-12)
    for j, ours in enumerate(coefficients):
        def basis(tau, j=j):
            return math.prod((tau - sigmas[i - k]) / (sigmas[i - j] - sigmas[i - k]) for k in range(order) if k != j)

        assert ours == pytest.approx(integrate.quad(basis, sigmas[i], sigmas[i + 1], epsrel=1e-12)[0], rel=1e-9)
    with pytest.raises(ValueError):
        lms_coefficient(sigmas, 2, 4, 0)  # only 3 sigmas so far


@pytest.mark.parametrize("schedule_type", ["karras", "exponential", "sgm_uniform", "uniform", "beta", "simple"])
def test_every_schedule_type_and_a_later_start_is_k_diffusions_sample_lms(schedule_type):
    """A1111's LMS with each schedule type is k-diffusion's sample_lms on A1111's sigmas: the program's step (x0s
    from a fake model of x and sigma, so a wrong history shows) reaches it to 1e-5; from step 4 (img2img: A1111 hands
    sample_lms the sigmas from there, a fresh history) :meth:`Schedule.starting_at` does the same."""
    import jax.numpy as jnp

    from sdxl_engine.program.generate import sampler_step

    steps = 11
    schedule = make_schedule("LMS", STEPS["base_config"], steps, schedule_type)
    sigmas = schedule.sigmas.astype(np.float64)
    rng = np.random.RandomState(3)
    start, bias = rng.standard_normal((1, 4, 3, 5)), rng.standard_normal((1, 4, 3, 5))  # non-square latents

    def no_noise(draw, coefficient):
        return jnp.zeros(start.shape, jnp.float32)

    def fake_x0(x, sigma):  # deterministic, depends on x and sigma as a model does
        return np.tanh(0.5 * x / np.sqrt(sigma**2 + 1)) + 0.1 * bias

    for first in (0, 4):
        run = schedule.starting_at(first)
        n = len(run.timesteps)
        fields = {**run.padded(n), "clip_range": np.float32(run.clip_range), "num_steps": np.int32(n)}
        inputs = types.SimpleNamespace(**{k: jnp.asarray(v) for k, v in fields.items()})
        x = jnp.asarray(start * sigmas[first], jnp.float32)
        carry, ours = (x, *(jnp.zeros_like(x) for _ in range(4))), []

        def x0_of(latents, sigma, t):
            return jnp.tanh(0.5 * latents / jnp.sqrt(sigma**2 + 1)) + 0.1 * jnp.asarray(bias, jnp.float32)

        for i in range(first, steps):
            carry = sampler_step(x0_of, no_noise, inputs, i, carry)
            ours.append(np.asarray(carry[0], np.float64))
        theirs = k_diffusion_lms(sigmas[first:], start * sigmas[first], fake_x0)
        worst = max(np.abs(a - b).max() / (1 + np.abs(b).max()) for a, b in zip(ours, theirs, strict=True))
        print(f"{schedule_type} from step {first}: worst relative difference {worst:.2g}")
        assert worst < 1e-5, (schedule_type, first, worst)


def k_diffusion_lms(sigmas: np.ndarray, x: np.ndarray, model, order: int = 4) -> list[np.ndarray]:
    """k-diffusion's ``sample_lms`` in numpy, each step's sample: d = (x - model(x, sigma))/sigma, the last ``order``
    kept, cur_order = min(i + 1, order), x += sum_j linear_multistep_coeff(cur_order, sigmas, i, j) d_{i-j}, the
    coefficients by scipy's quad (epsrel 1e-4, as k-diffusion)."""
    from scipy import integrate

    out, ds = [], []
    for i in range(len(sigmas) - 1):
        ds.append((x - model(x, sigmas[i])) / sigmas[i])
        ds = ds[-order:]
        cur = min(i + 1, order)

        def coeff(j, i=i, cur=cur):
            def fn(tau):
                return math.prod((tau - sigmas[i - k]) / (sigmas[i - j] - sigmas[i - k]) for k in range(cur) if k != j)

            return integrate.quad(fn, sigmas[i], sigmas[i + 1], epsrel=1e-4)[0]

        x = x + sum(coeff(j) * d for j, d in enumerate(reversed(ds)))
        out.append(x)
    return out


def test_the_programs_inputs_carry_lms_history_and_restart_it_at_the_refiners_switch():
    """ProgramInputs take c3, hx and hx0 from the schedule (Euler's: 0, 0, 1: its history entry is x0); from an
    image (img2img's start) and at the refiner's switch LMS's orders start afresh, c3 with them."""
    from sdxl_engine.program.generate import ProgramInputs

    ids = np.zeros((2, 77), np.int32)
    lms = make_schedule("LMS", STEPS["base_config"], 10)
    inputs = ProgramInputs.build(ids, ids, False, [1], 5.0, lms, 10, 16)
    np.testing.assert_array_equal(inputs.c3[:10], lms.c3)
    np.testing.assert_array_equal(inputs.hx[:10], lms.hx)
    np.testing.assert_array_equal(inputs.hx0[:10], lms.hx0)
    euler = ProgramInputs.build(ids, ids, False, [1], 5.0, make_schedule("Euler", STEPS["base_config"], 10), 10, 16)
    assert (euler.c3 == 0).all() and (euler.hx == 0).all() and (euler.hx0[:10] == 1).all()  # padded with 0 after
    refined = inputs.with_refiner(6, lms)
    assert refined.c[6] == refined.c2[7] == refined.c3[8] == 0 and refined.c3[9] != 0
    np.testing.assert_array_equal(refined.c3[:6], inputs.c3[:6])
    started = ProgramInputs.build(ids, ids, False, [1], 5.0, lms, 10, 16, start_step=3)
    assert started.c[3] == started.c3[5] == 0 and started.c3[6] != 0
