"""TCD (diffusers' TCDScheduler, Trajectory Consistency Distillation) against diffusers.

References: tests/fixtures/tcd-steps.{json,npz} (``make_fixtures tcd``: TCDScheduler over a matrix of scheduler configs,
step counts and gammas, a whole sampling loop with the fake deterministic model of two-call-steps, its step noise
replaced by fixed arrays; set_timesteps with ``strength``). The engine's side is the program's own step
(generate.sampler_step, jitted, ``i`` traced) with the fake model in JAX, in sigma space: diffusers' x-space sample
times sqrt(sigma^2 + 1). Tolerance: float32, |engine - diffusers| <= 1e-5 x (1 + |diffusers|) per step, as
tests/program/test_schedulers.py.
"""

import json
import types

import numpy as np
import pytest

from sdxl_engine.program.schedulers import (
    CLASS_DEFAULTS,
    FIELDS,
    OWN_TIMESTEPS,
    SCHEDULE_TYPES,
    TCD_GAMMA,
    TooManySteps,
    UnsupportedSchedulerConfig,
    UnsupportedScheduleType,
    _tcd,
    _tcd_schedule,
    make_schedule,
    sampler_config,
)
from tests.helpers import FIXTURES, case_config, close_rel

STEPS = json.loads((FIXTURES / "tcd-steps.json").read_text())
CASES = {case["name"]: case for case in STEPS["cases"]}
RTOL = 1e-5


@pytest.fixture(scope="module")
def arrays():
    with np.load(FIXTURES / "tcd-steps.npz") as data:
        return dict(data)


def model_config(case: dict) -> dict:
    return case_config(STEPS, case)


def close(got, want, what, rtol=RTOL):
    close_rel(got, want, what, rtol)


def schedule_of(case: dict):
    """The engine's TCD schedule of a case at its gamma (custom timesteps: the ``trailing`` ones)."""
    cfg = sampler_config("TCD", model_config(case))
    custom = None if case["custom"] is None else np.asarray(case["custom"], np.int64)
    return _tcd_schedule(cfg, case["steps"], custom, gamma=case["gamma"])


def step_function(schedule, prediction: str, bias):
    """The program's one-call step, jitted with ``i`` traced: ``(i, x, z) -> x_{i+1}`` (sigma space), the fake model
    (tools/fixtures_two_calls.fake_model) on x / sqrt(sigma^2 + 1) turned into x0 by the program's ``denoised``."""
    import jax
    import jax.numpy as jnp

    from sdxl_engine.program.generate import denoised, sampler_step

    fields = {**schedule.padded(len(schedule.timesteps)), "clip_range": np.float32(schedule.clip_range),
              "num_steps": np.int32(len(schedule.timesteps))}
    inputs = types.SimpleNamespace(**{k: jnp.asarray(v) for k, v in fields.items()})

    def x0_of(x, sigma, t):
        out = jnp.tanh(0.7 * (x / jnp.sqrt(sigma**2 + 1))) * (0.5 + t / 1000) + 0.1 * bias
        return denoised(x, out, sigma, prediction)

    @jax.jit
    def step(i, x, z):
        return sampler_step(x0_of, lambda draw, coefficient: z, inputs, i, (x, *(x * 0 for _ in range(4))))[0]

    return step


# ---- from_config --------------------------------------------------------------------------------------------------
def test_class_defaults_are_diffusers_init_signature():
    assert CLASS_DEFAULTS["TCDScheduler"] == STEPS["class_defaults"]["TCDScheduler"]
    assert set(CLASS_DEFAULTS["TCDScheduler"]) <= set(FIELDS)


@pytest.mark.parametrize("name", CASES)
def test_sampler_config_is_from_config(name):
    case = CASES[name]
    ours = sampler_config("TCD", model_config(case))
    for field, value in case["resolved"].items():
        assert ours[field] == value, (field, ours[field], value)


# ---- timesteps ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_timesteps_match_diffusers(name):
    """set_timesteps(steps) (LCM's original_inference_steps grid), or the custom timesteps, as diffusers'; the
    engine's "trailing" schedule type is the custom-timestep cases' call."""
    case = CASES[name]
    schedule = schedule_of(case)
    assert schedule.timesteps.tolist() == case["timesteps"]
    if case["custom"] is not None:
        assert make_schedule("TCD", model_config(case), case["steps"], "trailing").timesteps.tolist() == case["custom"]


@pytest.mark.parametrize("case", STEPS["strength_cases"], ids=lambda c: c["name"])
def test_strength_timesteps_match_diffusers(case):
    """TCD's own strength rule in set_timesteps (the grid cut to int(original x strength) points; custom timesteps'
    last int(n x strength)); diffusers' SDXL pipelines call it at strength 1 (the engine's img2img_start cuts)."""
    cfg = sampler_config("TCD", STEPS["base_config"])
    custom = None if case["custom"] is None else np.asarray(case["custom"])
    assert _tcd(cfg, case["steps"], custom, case["strength"]).tolist() == case["timesteps"]


def test_more_steps_than_the_grid_is_refused_as_diffusers_does():
    cfg = sampler_config("TCD", {**STEPS["base_config"], "original_inference_steps": 4})
    with pytest.raises(TooManySteps, match="at most 4 steps"):
        make_schedule("TCD", cfg, 5)
    with pytest.raises(TooManySteps, match="at most 2 steps"):  # diffusers: original x strength < steps
        _tcd(cfg, 3, strength=0.5)
    assert make_schedule("TCD", cfg, 5, "trailing").timesteps.tolist() == [999, 799, 599, 399, 199]  # custom: no cap


# ---- every step of a whole loop with a fake model ------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_every_step_matches_diffusers(name, arrays):
    """The program's step on diffusers' own sample at step k (in sigma space) gives diffusers' sample after it, with
    diffusers' injected noise as the step's z: gamma's intermediate timestep s, the noise back to the next timestep,
    none on the last step, and the end at timestep 0's noise level."""
    case = CASES[name]
    n = case["steps"]
    schedule = schedule_of(case)
    step = step_function(schedule, sampler_config("TCD", model_config(case))["prediction_type"], arrays["bias"])
    samples, noise = arrays[f"{name}_samples"], arrays["noise"]
    assert len(samples) == n + 1
    scale = np.sqrt(schedule.sigmas.astype(np.float64) ** 2 + 1)  # x-space -> sigma space
    for k in range(n):
        x = (samples[k] * scale[k]).astype(np.float32)
        got = np.asarray(step(k, x, noise[k])) / scale[k + 1]
        close(got, samples[k + 1], f"{name} step {k}")
    drawn = int(np.count_nonzero(schedule.d))
    assert drawn == case["noise_calls"], (drawn, case["noise_calls"])  # the steps diffusers draws noise on


@pytest.mark.parametrize("name", ["tcd-4-gamma-0.3", "tcd-8-gamma-0.5", "tcd-v", "tcd-custom-trailing-4"])
def test_a_whole_loop_matches_diffusers(name, arrays):
    """The program's steps fed their own output from start x init_scale, times final_scale at the end, are
    diffusers' last sample (what its pipeline decodes)."""
    case = CASES[name]
    schedule = schedule_of(case)
    step = step_function(schedule, sampler_config("TCD", model_config(case))["prediction_type"], arrays["bias"])
    x = arrays["start"] * np.float32(schedule.init_scale)
    for k in range(case["steps"]):
        x = np.asarray(step(k, x, arrays["noise"][k]))
    close(x * schedule.final_scale, arrays[f"{name}_samples"][-1], f"{name} after {case['steps']} steps", rtol=1e-4)


def test_the_engines_gamma_is_tcds_default_and_one_step_ignores_it():
    """make_schedule runs gamma TCD_GAMMA (TCDScheduler.step's default eta 0.3); at one step gamma changes
    nothing (the step goes to timestep 0 whatever gamma: Hyper-SD's eta=1.0 card call is the engine's)."""
    base = STEPS["base_config"]
    assert TCD_GAMMA == 0.3
    for name in ("tcd-4-gamma-0.3", "tcd-16-gamma-0.3", "tcd-original-4"):
        case = CASES[name]
        ours, theirs = make_schedule("TCD", model_config(case), case["steps"]), schedule_of(case)
        assert all(np.array_equal(getattr(ours, f), getattr(theirs, f)) for f in ("timesteps", "sigmas", "a", "b", "d"))
    one = [_tcd_schedule(sampler_config("TCD", base), 1, gamma=g) for g in (0.0, 0.3, 1.0)]
    assert all(np.array_equal(s.a, one[0].a) and np.array_equal(s.d, one[0].d) for s in one)
    four = [_tcd_schedule(sampler_config("TCD", base), 4, gamma=g) for g in (0.0, 0.3, 1.0)]
    assert not np.array_equal(four[0].a, four[1].a) and not np.array_equal(four[1].d, four[2].d)
    assert not four[0].d.any() and four[1].d[:-1].all() and four[1].d[-1] == 0  # gamma 0: DDIM, no noise
    with pytest.raises(ValueError, match="gamma"):
        _tcd_schedule(sampler_config("TCD", base), 4, gamma=1.5)


# ---- schedule types and refusals: as LCM's ---------------------------------------------------------------------
@pytest.mark.parametrize("schedule_type", [None, *SCHEDULE_TYPES])
def test_every_schedule_type_is_taken_or_refused_as_lcm(schedule_type):
    """TCD takes what LCM takes (automatic; trailing as custom timesteps) and refuses the rest the same way."""
    base = STEPS["base_config"]
    outcomes = []
    for sampler in ("LCM", "TCD"):
        try:
            make_schedule(sampler, base, 4, schedule_type)
            outcomes.append("runs")
        except UnsupportedScheduleType as err:
            outcomes.append("refused")
            assert "LCM and TCD trailing" in str(err)
    assert outcomes[0] == outcomes[1], outcomes
    assert (outcomes[0] == "runs") == (schedule_type in (None, "automatic", "trailing"))
    assert "TCD" in OWN_TIMESTEPS


def test_zero_terminal_snr_refuses_tcd_per_request_as_lcm():
    config = {**STEPS["base_config"], "rescale_betas_zero_snr": True}
    for sampler in ("LCM", "TCD"):
        with pytest.raises(UnsupportedSchedulerConfig, match="rescale_betas_zero_snr"):
            make_schedule(sampler, config, 4)
    make_schedule("Euler", config, 4)


def test_hyper_sd_one_step_loras_recipe_is_its_cards_call(arrays):
    """The Hyper-SDXL 1-step LoRA's recipe (TCD, 1 step, its schedule type) on SDXL base's config steps as the card's
    ``TCDScheduler.from_config(...)``, ``num_inference_steps=1, eta=1.0`` (the fixture case tcd-1-gamma-1)."""
    from sdxl_engine.checkpoint import recipes

    recipe = recipes.find("Hyper-SDXL-1step-lora.safetensors", lora=True)
    case = CASES["tcd-1-gamma-1"]
    assert not recipe.note and "eta=1.0" in recipe.source
    schedule = make_schedule(recipe.defaults["sampler"], model_config(case), recipe.defaults["num_inference_steps"],
                             recipe.defaults["schedule_type"])
    assert schedule.timesteps.tolist() == case["timesteps"] == [999]
    step = step_function(schedule, "epsilon", arrays["bias"])
    x = arrays["start"] * np.float32(schedule.init_scale)
    close(np.asarray(step(0, x, arrays["noise"][0])) * schedule.final_scale, arrays["tcd-1-gamma-1_samples"][-1],
          "Hyper-SDXL 1-step LoRA")
