"""Heun, DPM2, DPM++ SDE and DPM2 a (schedulers.TWO_CALLS: two model calls per step) against diffusers and k-diffusion
(Restart, the fifth, against A1111's loop: test_schedulers_restart.py; here only on A1111's schedule types at 6 steps,
where it is Heun on their sigmas).

References: tests/fixtures/two-call-steps.{json,npz} (``make_fixtures two-call-samplers``: diffusers'
HeunDiscreteScheduler, KDPM2DiscreteScheduler, DPMSolverSDEScheduler and KDPM2AncestralDiscreteScheduler over a matrix
of scheduler configs, a whole sampling loop with a fake deterministic model, DPMSolverSDEScheduler's Brownian tree and
KDPM2AncestralDiscreteScheduler's torch.randn replaced by fixed arrays); A1111's schedule types against k-diffusion's
``sample_heun``, ``sample_dpm_2``, ``sample_dpmpp_sde`` and ``sample_dpm_2_ancestral`` written here in numpy.
The engine's side is the program's own step (generate.sampler_step, jitted, ``i`` traced) with the fake model in JAX.
Tolerance: float32, |engine - reference| <= 1e-5 x (1 + |reference|) per step, as tests/program/test_schedulers.py.
"""

import json
import math
import types

import numpy as np
import pytest

from sdxl_engine.program.schedulers import (
    CLASS_DEFAULTS,
    FIELDS,
    SAMPLER_CLASSES,
    SCHEDULE_TYPES,
    TWO_CALLS,
    UnsupportedSchedulerConfig,
    check_scheduler_config,
    make_schedule,
    sampler_config,
)
from tests.helpers import FIXTURES, case_config, close_rel

STEPS = json.loads((FIXTURES / "two-call-steps.json").read_text())
DIFFUSERS = tuple(s for s in TWO_CALLS if s != "Restart")  # the two-call samplers with a diffusers class
CASES = {case["name"]: case for case in STEPS["cases"]}
RTOL = 1e-5


@pytest.fixture(scope="module")
def arrays():
    with np.load(FIXTURES / "two-call-steps.npz") as data:
        return dict(data)


def model_config(case: dict) -> dict:
    return case_config(STEPS, case)


def close(got, want, what, rtol=RTOL):
    close_rel(got, want, what, rtol)


def fake_x0(bias, prediction: str):
    """The fixture's fake model (tools/fixtures_two_calls.fake_model) as the program's ``x0_of``: its output on
    x / sqrt(sigma^2 + 1) at the timestep, turned into x0 by the program's own :func:`denoised`."""
    import jax.numpy as jnp

    from sdxl_engine.program.generate import denoised

    def x0_of(x, sigma, t):
        out = jnp.tanh(0.7 * (x / jnp.sqrt(sigma**2 + 1))) * (0.5 + t / 1000) + 0.1 * bias
        return denoised(x, out, sigma, prediction)

    return x0_of


def inputs_of(schedule) -> types.SimpleNamespace:
    """The schedule's arrays as the program reads them (ProgramInputs' fields, unpadded, as JAX arrays)."""
    import jax.numpy as jnp

    fields = {**schedule.padded(len(schedule.timesteps)), "clip_range": np.float32(schedule.clip_range),
              "num_steps": np.int32(len(schedule.timesteps))}
    return types.SimpleNamespace(**{k: jnp.asarray(v) for k, v in fields.items()})


def step_function(schedule, prediction: str, bias):
    """The program's step (sampler_step with two_calls), jitted with ``i`` traced:
    ``(i, x, z, w) -> x_{i+1}``, z and w the step's two draws (where the schedule uses them)."""
    import jax

    from sdxl_engine.program.generate import sampler_step

    inputs, x0_of = inputs_of(schedule), fake_x0(bias, prediction)

    @jax.jit
    def step(i, x, z, w):
        def noise(draw, coefficient):
            return w if draw else z

        return sampler_step(x0_of, noise, inputs, i, (x, *(x * 0 for _ in range(4))), two_calls=True)[0]

    return step


def diffusers_noise(schedule, arrays, k: int, sampler: str = "DPM++ SDE"):
    """(z, w) that make the engine's step k add diffusers' injected noise: DPMSolverSDEScheduler's call 2k got
    noise[2k] (the first call's increment, the engine's z) and call 2k + 1 noise[2k + 1] with s_up' (the engine adds
    d z + d2 w: w solves it); KDPM2AncestralDiscreteScheduler's draw k (step k's, at its second call) noise[k], the
    engine's z (d = s_up, no w)."""
    noise = arrays["noise"]
    if sampler == "DPM2 a":
        return noise[k], np.zeros_like(noise[k])
    z, d, d2 = noise[2 * k], float(schedule.d[k]), float(schedule.second.d2[k])
    if d2 == 0:
        return z, np.zeros_like(z)
    up = math.hypot(d, d2)
    return z, ((up * noise[2 * k + 1] - d * z) / d2).astype(np.float32)


# ---- from_config: the class defaults and what each sampler reads ---------------------------------------------
def test_class_defaults_are_diffusers_init_signatures():
    recorded = STEPS["class_defaults"]
    assert set(recorded) == {SAMPLER_CLASSES[s][0] for s in TWO_CALLS}  # Restart's config class is Heun's
    for cls, defaults in recorded.items():
        assert CLASS_DEFAULTS[cls] == defaults, cls
        assert set(defaults) <= set(FIELDS), f"{cls}: no stated treatment for {set(defaults) - set(FIELDS)}"


@pytest.mark.parametrize("name", CASES)
def test_sampler_config_is_from_config(name):
    case = CASES[name]
    ours = sampler_config(case["sampler"], model_config(case))
    for field, value in case["resolved"].items():
        assert ours[field] == value, (field, ours[field], value)


# ---- schedules: both calls' timesteps and sigmas ---------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_schedule_matches_diffusers(name):
    """diffusers' 2n - 1 model calls: call 2k is step k's first (timesteps, sigmas), call 2k + 1 its second
    (second.timesteps); the last step has no second call (f and g 0); DPM++ SDE's mid sigmas are its noise
    sampler's."""
    case = CASES[name]
    n = case["steps"]
    schedule = make_schedule(case["sampler"], model_config(case), n)
    theirs = np.asarray(case["timesteps"])
    assert len(theirs) == 2 * n - 1 and schedule.two_calls
    close(schedule.timesteps, theirs[0::2], "first calls' timesteps")
    close(schedule.second.timesteps[: n - 1], theirs[1::2], "second calls' timesteps")
    calls = (schedule.second.f != 0) | (schedule.second.g != 0)
    assert calls[: n - 1].all() and not calls[n - 1]
    close(schedule.sigmas[:n], np.asarray(case["sigmas"])[0 : 2 * n : 2], "sigmas")
    assert schedule.sigmas[n] == 0 and case["sigmas"][-1] == 0
    assert schedule.init_scale == pytest.approx(case["init_noise_sigma"], rel=1e-6)
    if case["sampler"] == "Heun":
        close(schedule.second.sigmas[: n - 1], schedule.sigmas[1:n], "Heun's second call at the next sigma")
    if "noise_calls" in case:  # (s, m) then (s, s') per step
        calls = np.asarray(case["noise_calls"])
        close(schedule.second.sigmas[: n - 1], calls[0::2, 1], "mid sigmas")
        close(schedule.sigmas[1:n], calls[1::2, 1], "the noise's sigma_next")
    if case["sampler"] == "DPM2 a":  # one draw per step but the last, at its second call; none where d is 0
        assert case["noise_draws"] == [2 * k + 1 for k in range(n - 1)]
        assert (schedule.d[: n - 1] > 0).all() and schedule.d[n - 1] == 0 and not schedule.second.d2.any()
        assert not schedule.second.d.any()  # the second call's input is noise-free: the draw comes after it


# ---- every step of a whole loop with a fake model ----------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_every_step_matches_diffusers(name, arrays):
    """The program's step on diffusers' own sample at the start of step k (call 2k's input) gives diffusers' sample
    after the step's last call (2k + 1, or 2k for the last step): both model calls, their timesteps and sigmas, the
    interleaving, the skipped last call and, for DPM++ SDE, the deterministic part with diffusers' noise."""
    case = CASES[name]
    n, sampler = case["steps"], case["sampler"]
    config = model_config(case)
    schedule = make_schedule(sampler, config, n)
    step = step_function(schedule, sampler_config(sampler, config)["prediction_type"], arrays["bias"])
    samples = arrays[f"{name}_samples"]
    assert len(samples) == 2 * n
    for k in range(n):
        z, w = (diffusers_noise(schedule, arrays, k, sampler) if sampler in ("DPM++ SDE", "DPM2 a")
                else (samples[0] * 0, samples[0] * 0))
        got = np.asarray(step(k, samples[2 * k], z, w))
        close(got, samples[min(2 * k + 2, 2 * n - 1)], f"{name} step {k}")


@pytest.mark.parametrize("sampler", DIFFUSERS)
def test_a_whole_loop_matches_diffusers(sampler, arrays):
    """The program's steps fed their own output from start x init_scale end where diffusers' loop ends."""
    name = {"Heun": "heun-leading", "DPM2": "dpm2-leading", "DPM++ SDE": "sde-leading",
            "DPM2 a": "dpm2a-leading"}[sampler]
    case = CASES[name]
    n = case["steps"]
    schedule = make_schedule(sampler, model_config(case), n)
    step = step_function(schedule, "epsilon", arrays["bias"])
    x = arrays["start"] * np.float32(schedule.init_scale)
    for k in range(n):
        z, w = (diffusers_noise(schedule, arrays, k, sampler) if sampler in ("DPM++ SDE", "DPM2 a")
                else (x * 0, x * 0))
        x = np.asarray(step(k, x, z, w))
    close(x, arrays[f"{name}_samples"][-1], f"{sampler} after {n} steps", rtol=1e-4)


# ---- A1111's schedule types: k-diffusion's samplers on their sigmas -------------------------------------------
def k_diffusion(sampler: str, sigmas, x, model, noise, eta: float = 1.0) -> np.ndarray:
    """k-diffusion's ``sample_heun`` (s_churn 0), ``sample_dpm_2``, ``sample_dpmpp_sde`` (``eta``, s_noise 1, r 1/2)
    and ``sample_dpm_2_ancestral`` (``eta``, s_noise 1) written from its code in numpy float64: ``model(x, sigma) ->
    denoised``; ``noise[i]`` = (the noise sampler's draw for (s, m), for (s, s')) of step i (DPM2 a: the first, for
    (s, s')). The final sample."""
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        denoised = model(x, s)
        d = (x - denoised) / s
        if sampler == "DPM2 a":
            sigma_down, sigma_up = _ancestral_step(s, s_next, eta)
            if sigma_down == 0:  # Euler method
                x = x + d * (sigma_down - s)
            else:  # DPM-Solver-2
                mid = math.exp(math.log(s) + 0.5 * (math.log(sigma_down) - math.log(s)))  # log-space lerp
                x_2 = x + d * (mid - s)
                x = x + (x_2 - model(x_2, mid)) / mid * (sigma_down - s)
            x = x + noise[i][0] * sigma_up
        elif s_next == 0:  # Euler method
            x = x + d * (s_next - s)
        elif sampler in ("Heun", "Restart"):  # Restart under 20 steps: Heun on the sigmas
            x_2 = x + d * (s_next - s)
            d_2 = (x_2 - model(x_2, s_next)) / s_next
            x = x + (d + d_2) / 2 * (s_next - s)
        elif sampler == "DPM2":
            mid = math.exp(math.log(s) + 0.5 * (math.log(s_next) - math.log(s)))  # log-space lerp
            x_2 = x + d * (mid - s)
            x = x + (x_2 - model(x_2, mid)) / mid * (s_next - s)
        else:  # DPM-Solver++ (stochastic), sigma_fn(t) = exp(-t), t_fn(sigma) = -log(sigma)
            t, t_next = -math.log(s), -math.log(s_next)
            h = t_next - t
            mid = math.exp(-(t + h / 2))
            sd, su = _ancestral_step(s, mid, eta)
            x_2 = (sd / s) * x - math.expm1(t + math.log(sd)) * denoised + noise[i][0] * su
            sd, su = _ancestral_step(s, s_next, eta)
            x = (sd / s) * x - math.expm1(t + math.log(sd)) * model(x_2, mid) + noise[i][1] * su
    return x


def _ancestral_step(sigma_from, sigma_to, eta=1.0):
    """k-diffusion's ``get_ancestral_step(sigma_from, sigma_to, eta)`` (k_diffusion/sampling.py): sigma_up =
    min(sigma_to, eta sqrt(sigma_to^2 (sigma_from^2 - sigma_to^2) / sigma_from^2)), sigma_down = sqrt(sigma_to^2 -
    sigma_up^2); (sigma_to, 0) where eta is 0."""
    if not eta:
        return sigma_to, 0.0
    up = min(sigma_to, eta * (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
    return (sigma_to**2 - up**2) ** 0.5, up


@pytest.mark.parametrize("schedule_type", [t for t in SCHEDULE_TYPES if t != "automatic"])
@pytest.mark.parametrize("sampler", TWO_CALLS)
def test_every_schedule_type_runs_k_diffusions_sampler(sampler, schedule_type, arrays):
    """Each of A1111's schedule types (and the spacings) on SDXL base's config: the program's steps from start x
    init_scale reach k-diffusion's sampler's final sample on the same sigmas with the same fake model (its
    timestep each sigma's ``sigma_to_t``, as the schedule's; DPM++ SDE's two draws per step the engine's z and
    rho z + sqrt(1 - rho^2) w; DPM2 a's one draw the engine's z)."""
    base = STEPS["base_config"]
    schedule = make_schedule(sampler, base, 6, schedule_type)
    assert schedule.two_calls and schedule.sigmas[-1] == 0 and (np.diff(schedule.sigmas) < 0).all()
    engine, reference = against_k_diffusion(sampler, base, schedule, arrays)
    close(engine, reference, f"{sampler} {schedule_type}", rtol=1e-4)


@pytest.mark.parametrize("eta", [0.0, 0.35, 0.8])
@pytest.mark.parametrize("schedule_type", [None, "karras"])
@pytest.mark.parametrize("sampler", ["DPM++ SDE", "DPM2 a"])
def test_eta_is_k_diffusions(sampler, schedule_type, eta, arrays):
    """A request's eta (A1111's, passed as the k-diffusion function's ``eta``): make_schedule(..., eta) runs
    k-diffusion's sample_dpmpp_sde / sample_dpm_2_ancestral at that eta (get_ancestral_step's eta in both of DPM++
    SDE's ancestral steps; DPM2 a's midpoint between s and the eta's sigma_down); eta 0 adds no noise at all, and
    another eta moves the images."""
    base = STEPS["base_config"]
    schedule = make_schedule(sampler, base, 6, schedule_type, eta=eta)
    engine, reference = against_k_diffusion(sampler, base, schedule, arrays, eta)
    close(engine, reference, f"{sampler} {schedule_type} eta {eta}", rtol=1e-4)
    noise = [schedule.d, schedule.second.d, schedule.second.d2]
    assert any(x.any() for x in noise) == (eta > 0)
    default = against_k_diffusion(sampler, base, make_schedule(sampler, base, 6, schedule_type), arrays)[0]
    assert np.abs(engine - default).max() > 1e-3  # eta 1 (the default) is another sampler


def test_dpm2_ancestral_from_a_cosine_schedules_sigma_20000_is_k_diffusions_not_diffusers_nan(arrays):
    """A cosine schedule, trailing: the first sigma is 20 291, where diffusers' KDPM2AncestralDiscreteScheduler's
    float32 sigma_down = sqrt(s'^2 - s_up^2) cancels to 0 and its midpoint is NaN (so the fixtures have no such case);
    the engine's float64 coefficients (sigma_down = s'^2 / s, 2.9e-4) reach k-diffusion's sample_dpm_2_ancestral in
    float64, finite, through a second call whose f is in the thousands. Tolerance 1e-4 of the largest value, not per
    element: the fake model's x0 from sigma 20 291 is in the tens of thousands (it is no denoiser), and float32's
    rounding of such values, amplified by f, is what any float32 run of the sampler carries (measured 1.9 on 44 183)."""
    config = {**STEPS["base_config"], "beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}
    schedule = make_schedule("DPM2 a", config, 4)
    assert schedule.sigmas[0] > 20000 and abs(schedule.second.f[0]) > 1000
    engine, reference = against_k_diffusion("DPM2 a", config, schedule, arrays)
    assert np.isfinite(engine).all()
    assert np.abs(engine - reference).max() <= 1e-4 * np.abs(reference).max()


def against_k_diffusion(sampler: str, config: dict, schedule, arrays, eta: float = 1.0):
    """(the program's steps' final sample, k-diffusion's sampler's) from start x init_scale on the schedule's sigmas
    with the fake model (its timestep each sigma's ``sigma_to_t``, as the schedule's; DPM++ SDE's two draws per step
    the engine's z and rho z + sqrt(1 - rho^2) w; DPM2 a's one draw the engine's z)."""
    from sdxl_engine.program.schedulers import _alphas_cumprod, _sigma_to_t  # the schedule's own sigma -> t

    n = len(schedule.timesteps)
    cfg = sampler_config(sampler, config)
    ac = _alphas_cumprod({**cfg, "rescale_betas_zero_snr": False})
    log_sigmas = np.log(((1 - ac) / ac) ** 0.5)
    step = step_function(schedule, "epsilon", arrays["bias"])
    rng = np.random.RandomState(5)
    z, w = rng.standard_normal((2, n, *arrays["start"].shape)).astype(np.float32)
    x = arrays["start"] * np.float32(schedule.init_scale)
    first, sigmas = x.astype(np.float64), schedule.sigmas.astype(np.float64)
    for k in range(n):
        x = np.asarray(step(k, x, z[k], w[k]))
    timesteps = dict(zip(schedule.sigmas[:n].tolist(), schedule.timesteps.tolist(), strict=True))

    def model(x, sigma):
        t = timesteps.get(np.float32(sigma).item(), float(_sigma_to_t(np.asarray([sigma]), log_sigmas)[0]))
        out = np.tanh(0.7 * x / (sigma**2 + 1) ** 0.5) * (0.5 + t / 1000) + 0.1 * arrays["bias"]
        return x - sigma * out

    rho = lambda k: schedule.d[k] / max(math.hypot(schedule.d[k], schedule.second.d2[k]), 1e-30)  # noqa: E731
    noise = [(z[k], rho(k) * z[k] + math.sqrt(max(1 - rho(k) ** 2, 0.0)) * w[k]) for k in range(n)]
    return x, k_diffusion(sampler, sigmas, first, model, noise, eta)


# ---- DPM++ SDE's noise: a Brownian tree's law ------------------------------------------------------------------
def test_dpmpp_sde_noise_has_the_brownian_trees_correlation():
    """The program's two draws of a step (z = normal(fold_in(key(seed), k + 1)), w = the same key folded with 1)
    make the second increment z' = (d z + d2 w) / s_up' correlated with z by rho = sqrt((s - m) / (s - s')), as
    k-diffusion's BrownianTreeNoiseSampler's increments over [m, s] and [s', s] are, and the steps' draws are
    independent (measured on 2^16 values per draw: |error| < 0.02)."""
    import jax.numpy as jnp

    from sdxl_engine.program.generate import step_noise

    schedule = make_schedule("DPM++ SDE", STEPS["base_config"], 6)
    seeds, shape = jnp.asarray([3], jnp.uint32), (4, 128, 128)
    corr = lambda a, b: float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])  # noqa: E731
    for k in (0, 3):
        s, s_next, mid = (float(x) for x in (schedule.sigmas[k], schedule.sigmas[k + 1], schedule.second.sigmas[k]))
        z, w = (np.asarray(step_noise(seeds, k, shape, draw=draw)) for draw in (0, 1))
        d, d2 = float(schedule.d[k]), float(schedule.second.d2[k])
        second = (d * z + d2 * w) / math.hypot(d, d2)
        assert abs(corr(z, second) - math.sqrt((s - mid) / (s - s_next))) < 0.02
        assert abs(corr(z, w)) < 0.02 and abs(np.std(second) - 1) < 0.02
    assert abs(corr(step_noise(seeds, 0, shape), step_noise(seeds, 1, shape))) < 0.02


# ---- what these samplers refuse --------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["DPM2", "DPM++ SDE", "DPM2 a"])
def test_sample_prediction_refuses_dpm2_and_dpmpp_sde_per_request_not_the_model(sampler):
    """diffusers' KDPM2DiscreteScheduler, DPMSolverSDEScheduler and KDPM2AncestralDiscreteScheduler raise
    NotImplementedError for a sample-predicting model; Heun and the other samplers run it."""
    config = {**STEPS["base_config"], "prediction_type": "sample"}
    check_scheduler_config(config)
    with pytest.raises(UnsupportedSchedulerConfig, match="prediction_type"):
        make_schedule(sampler, config, 4)
    assert make_schedule("Heun", config, 4).two_calls


def test_one_call_samplers_have_no_second_call():
    for sampler in SAMPLER_CLASSES:
        assert make_schedule(sampler, STEPS["base_config"], 4).two_calls == (sampler in TWO_CALLS), sampler
