"""A request's ``eta`` (A1111's; make_schedule's ``eta``) against its references.

DDIM: diffusers 0.42.1's DDIMScheduler.step(eta=...) on fixed arrays (tests/fixtures/ddim-eta-steps.{json,npz},
``make_fixtures ddim-eta``: the step noise given as ``variance_noise``), every step fed diffusers' own sample. TCD: its
gamma is TCDScheduler.step's ``eta`` (tests/fixtures/tcd-steps: gammas 0 to 1). Euler a, DPM++ 2M SDE and DPM++ 3M SDE:
k-diffusion's sample_euler_ancestral, sample_dpmpp_2m_sde and sample_dpmpp_3m_sde (k_diffusion/sampling.py, with
``get_ancestral_step``) written from their code in numpy float64 at that eta (DPM++ SDE and DPM2 a:
tests/program/test_schedulers_two_calls.py). Tolerance: float32, |engine - reference| <= 1e-5 x (1 + |reference|) per
step (whole runs 1e-4), as the other scheduler tests.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from sdxl_engine.program.generate import denoised, sampler_update
from sdxl_engine.program.schedulers import (
    ETA_DEFAULTS,
    SAMPLERS,
    TCD_GAMMA,
    _ddim,
    _tcd_schedule,
    make_schedule,
    sampler_config,
)
from tests.helpers import FIXTURES, case_config, close_rel

DDIM = json.loads((FIXTURES / "ddim-eta-steps.json").read_text())
DDIM_CASES = {case["name"]: case for case in DDIM["cases"]}
TCD = json.loads((FIXTURES / "tcd-steps.json").read_text())
BASE = json.loads((FIXTURES / "sampler-steps.json").read_text())["base_config"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def ddim_arrays():
    with np.load(FIXTURES / "ddim-eta-steps.npz") as data:
        return dict(data)


def same(one, other) -> bool:
    """Whether two schedules' arrays are equal to the bit."""
    return all(np.array_equal(getattr(one, f.name), getattr(other, f.name))
               for f in dataclasses.fields(one) if isinstance(getattr(one, f.name), np.ndarray))


# ---- DDIM: diffusers' step(eta=...) --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DDIM_CASES)
def test_ddim_eta_every_step_matches_diffusers(name, ddim_arrays):
    """x' = a x + b x0 + d z + e (clip(x0) - x0) with make_schedule("DDIM", ..., eta) is diffusers' ``step(eta=eta,
    variance_noise=z)`` at every step (x-space: the sample times sqrt(sigma^2 + 1)): std_dev_t = eta sqrt(variance)
    as d, the direction sqrt(1 - alphā_prev - std^2) eps in a, the carry to the next timestep (linspace), the last
    step's noise where alphā_prev is the first alphā (set_alpha_to_one False, unless the step is at timestep 0
    already) and none where it is 1."""
    case = DDIM_CASES[name]
    config, n = case_config(DDIM, case), case["steps"]
    schedule = make_schedule("DDIM", config, n, eta=case["eta"])
    assert schedule.timesteps.astype(int).tolist() == case["timesteps"]
    prediction = sampler_config("DDIM", config)["prediction_type"]
    samples, outputs, noise = ddim_arrays[f"{name}_samples"], ddim_arrays["model_outputs"], ddim_arrays["noise"]
    scale = (schedule.sigmas.astype(np.float64) ** 2 + 1) ** 0.5
    for k in range(n):
        x = np.float32(samples[k] * scale[k])
        x0 = np.asarray(denoised(x, outputs[k], schedule.sigmas[k], prediction))
        zero = np.zeros_like(x)
        out = sampler_update(x, x0, zero, noise[k], schedule.a[k], schedule.b[k], schedule.c[k], schedule.d[k],
                             schedule.e[k], np.float32(schedule.clip_range))
        ours = np.asarray(out) * (schedule.final_scale if k == n - 1 else 1 / scale[k + 1])
        close_rel(ours, samples[k + 1], f"{name} step {k}", RTOL)
    assert schedule.d[:-1].all() if case["eta"] > 0 and n > 1 else not schedule.d[:-1].any()
    if config.get("set_alpha_to_one"):  # the last step to alphā 1 (sigma 0): no noise, as diffusers' variance 0
        assert schedule.d[-1] == 0


def test_ddim_eta_none_and_0_are_todays_ddim_and_eta_is_the_ancestral_step():
    """eta None and 0 give the deterministic DDIM to the bit (no noise); DDIM's std at eta is k-diffusion's
    get_ancestral_step sigma_up of s -> s_prev at that eta (the two are one formula in sigma space), times the carry."""
    for spacing in ("leading", "linspace", "trailing"):
        config = {**BASE, "timestep_spacing": spacing}
        plain = make_schedule("DDIM", config, 9)
        assert same(plain, make_schedule("DDIM", config, 9, eta=0.0)) and not plain.d.any()
        _, sigmas, s_prev, carry = _ddim(sampler_config("DDIM", config), 9)
        s = sigmas[:-1]
        for eta in (0.25, 1.0):
            noisy = make_schedule("DDIM", config, 9, eta=eta)
            down, up = zip(*(get_ancestral_step(a, b, eta) for a, b in zip(s, s_prev, strict=True)))
            np.testing.assert_allclose(noisy.d, np.asarray(up) * carry, rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(noisy.a, np.asarray(down) / s * carry, rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(noisy.a + noisy.b, carry, rtol=1e-6)


# ---- TCD: gamma is step(eta=...) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in TCD["cases"] if c["custom"] is None], ids=lambda c: c["name"])
def test_tcd_eta_is_its_gamma(case):
    """make_schedule("TCD", ..., eta=gamma) is the schedule diffusers' step(eta=gamma) matches
    (tests/program/test_schedulers_tcd.py checks _tcd_schedule at each fixture gamma against diffusers); eta None is
    TCD_GAMMA."""
    config = case_config(TCD, case)
    ours = make_schedule("TCD", config, case["steps"], eta=case["gamma"])
    assert same(ours, _tcd_schedule(sampler_config("TCD", config), case["steps"], gamma=case["gamma"]))
    if case["gamma"] == TCD_GAMMA:
        assert same(ours, make_schedule("TCD", config, case["steps"]))


def test_tcd_eta_reaches_the_trailing_and_custom_timesteps():
    """The trailing schedule type and a model's custom timesteps take the gamma too."""
    trailing = [make_schedule("TCD", BASE, 4, "trailing", eta=g) for g in (0.0, 0.3, 0.9)]
    assert not trailing[0].d.any() and trailing[1].d[:-1].all()
    assert not np.array_equal(trailing[1].a, trailing[2].a)
    assert same(trailing[1], make_schedule("TCD", BASE, 4, "trailing"))
    custom = {**BASE, "custom_timesteps": [999, 749, 499, 249]}
    assert not np.array_equal(make_schedule("TCD", custom, 4, eta=0.9).a, make_schedule("TCD", custom, 4).a)


# ---- Euler a, DPM++ 2M SDE, DPM++ 3M SDE: k-diffusion -------------------------------------------------------------
def get_ancestral_step(sigma_from, sigma_to, eta=1.0):
    """k-diffusion's get_ancestral_step (k_diffusion/sampling.py), float64."""
    if not eta:
        return sigma_to, 0.0
    sigma_up = min(sigma_to, eta * (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
    return (sigma_to**2 - sigma_up**2) ** 0.5, sigma_up


def k_euler_ancestral(sigmas, x, denoised, noise, eta):
    """sample_euler_ancestral(eta, s_noise 1) on given x0s: each step's sample."""
    out = []
    for i, x0 in enumerate(denoised):
        sigma_down, sigma_up = get_ancestral_step(sigmas[i], sigmas[i + 1], eta)
        x = x + (x - x0) / sigmas[i] * (sigma_down - sigmas[i])
        if sigmas[i + 1] > 0:
            x = x + noise[i] * sigma_up
        out.append(x)
    return out


def k_dpmpp_sde_multistep(sigmas, x, denoised, noise, eta, solver_type="midpoint", third=False):
    """sample_dpmpp_2m_sde(eta, solver_type) or, ``third``, sample_dpmpp_3m_sde(eta) (s_noise 1) on given x0s: each
    step's sample. t = -log sigma, h = t' - t, h_eta = h (eta + 1)."""
    out, hist, hs = [], [], []
    for i, x0 in enumerate(denoised):
        if sigmas[i + 1] == 0:
            x = x0
        else:
            h = math.log(sigmas[i]) - math.log(sigmas[i + 1])
            h_eta = h * (eta + 1)
            x = sigmas[i + 1] / sigmas[i] * math.exp(-eta * h) * x - math.expm1(-h_eta) * x0
            phi_2 = math.expm1(-h_eta) / h_eta + 1
            if third and len(hist) >= 2:
                r0, r1 = hs[-1] / h, hs[-2] / h
                d1_0, d1_1 = (x0 - hist[-1]) / r0, (hist[-1] - hist[-2]) / r1
                d1, d2 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1), (d1_0 - d1_1) / (r0 + r1)
                x = x + phi_2 * d1 - (phi_2 / h_eta - 0.5) * d2
            elif hist and (third or solver_type == "heun"):
                x = x + phi_2 * (x0 - hist[-1]) / (hs[-1] / h)
            elif hist:  # midpoint
                x = x + 0.5 * -math.expm1(-h_eta) * (x0 - hist[-1]) / (hs[-1] / h)
            if eta:
                x = x + noise[i] * sigmas[i + 1] * math.sqrt(-math.expm1(-2 * h * eta))
        out.append(x)
        hist.append(x0)
        hs.append(math.log(sigmas[i]) - math.log(sigmas[i + 1]) if sigmas[i + 1] else math.inf)
    return out


def engine_run(schedule, x, denoised, noise):
    """The program's update (generate.sampler_update) with the schedule's coefficients on given x0s."""
    out, x0_prev, x0_prev2 = [], np.zeros_like(x), np.zeros_like(x)
    for k, x0 in enumerate(denoised):
        x = np.asarray(sampler_update(x, x0, x0_prev, noise[k], schedule.a[k], schedule.b[k], schedule.c[k],
                                      schedule.d[k], x0_prev2=x0_prev2, c2=schedule.c2[k]), np.float64)
        out.append(x)
        x0_prev, x0_prev2 = x0, x0_prev
    return out


@pytest.mark.parametrize("eta", [0.0, 0.3, 0.75, 1.0])
@pytest.mark.parametrize("sampler, config, steps, schedule_type", [
    ("Euler a", {}, 10, None), ("Euler a", {}, 7, "karras"),
    ("DPM++ 2M SDE", {}, 10, "karras"), ("DPM++ 2M SDE", {"solver_type": "heun"}, 10, "karras"),
    ("DPM++ 2M SDE", {}, 16, None),
    ("DPM++ 3M SDE", {"solver_type": "heun"}, 16, "karras"),  # where diffusers' orders are k-diffusion's
], ids=lambda v: str(v))
def test_eta_is_k_diffusions(sampler, config, steps, schedule_type, eta):
    """make_schedule(sampler, ..., eta)'s update is k-diffusion's sampler at that eta on the schedule's sigmas, with the
    same x0s and noise: Euler a get_ancestral_step's (sigma_down, sigma_up); the SDEs a = (s'/s)^(1 + eta), the noise
    s' sqrt(1 - exp(-2 eta h)), phi_2 and phi_3 at h_eta = (1 + eta) h (3M with heun and 16 steps, where diffusers'
    step orders, which the engine keeps, are k-diffusion's; tests/program/test_schedulers.py). eta 1 is the default."""
    schedule = make_schedule(sampler, {**BASE, **config}, steps, schedule_type, eta=eta)
    sigmas = schedule.sigmas.astype(np.float64)
    rng = np.random.RandomState(11)
    denoised, noise = rng.standard_normal((2, steps, 8))
    start = rng.standard_normal(8) * sigmas[0]
    ours = engine_run(schedule, start, denoised, noise)
    if sampler == "Euler a":
        theirs = k_euler_ancestral(sigmas, start, denoised, noise, eta)
    else:
        solver_type = {**BASE, **config}.get("solver_type", "midpoint")
        third = sampler == "DPM++ 3M SDE"
        theirs = k_dpmpp_sde_multistep(sigmas, start, denoised, noise, eta, solver_type, third=third)
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        close_rel(a, b, f"{sampler} eta {eta} step {k}", 1e-4)
    assert schedule.d.any() == (eta > 0)
    if eta == 1.0:
        assert same(schedule, make_schedule(sampler, {**BASE, **config}, steps, schedule_type))


def test_dpm_sde_eta_0_is_k_diffusions_ode_step_and_the_history_keeps_eta():
    """DPM++ 2M SDE at eta 0 is DPM++ 2M's update (a = s'/s, no noise; the ODE's midpoint coefficients); img2img's
    restart of the history (Schedule.starting_at) keeps the request's eta."""
    sde, ode = make_schedule("DPM++ 2M SDE", BASE, 12, eta=0.0), make_schedule("DPM++ 2M", BASE, 12)
    for name in ("a", "b", "c", "d"):
        np.testing.assert_allclose(getattr(sde, name), getattr(ode, name), rtol=1e-6, atol=1e-7)
    half = make_schedule("DPM++ 3M SDE", BASE, 12, eta=0.5)
    started = half.starting_at(4)
    assert np.array_equal(started.a, half.a) and np.array_equal(started.d, half.d)
    assert not np.array_equal(started.a, make_schedule("DPM++ 3M SDE", BASE, 12).starting_at(4).a)


# ---- every sampler: what eta changes, what it refuses ------------------------------------------------------------
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_eta_changes_only_the_samplers_that_take_one(sampler):
    """The samplers of ETA_DEFAULTS run their default without an eta (to the bit) and another schedule with another
    eta; the others (A1111's functions without an ``eta``) ignore it: the same schedule whatever eta."""
    plain = make_schedule(sampler, BASE, 8)
    if sampler in ETA_DEFAULTS:
        assert same(plain, make_schedule(sampler, BASE, 8, eta=ETA_DEFAULTS[sampler]))
        other = 0.5 if ETA_DEFAULTS[sampler] != 0.5 else 0.9
        assert not same(plain, make_schedule(sampler, BASE, 8, eta=other))
    else:
        for eta in (0.0, 0.5, 1.0):
            assert same(plain, make_schedule(sampler, BASE, 8, eta=eta))


@pytest.mark.parametrize("eta", [-0.1, 1.01, math.nan, math.inf, "0.5", True])
def test_eta_outside_0_to_1_is_refused(eta):
    with pytest.raises(ValueError, match="eta must be a number from 0 to 1"):
        make_schedule("DDIM", BASE, 4, eta=eta)
