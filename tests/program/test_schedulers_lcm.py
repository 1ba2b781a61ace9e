"""The LCM sampler: schedulers.py's coefficients against diffusers' LCMScheduler, and its refusals.

References: tests/fixtures/sampler-steps.{json,npz} (``make_fixtures samplers``): the LCM cases' timesteps,
``get_scalings_for_boundary_condition_discrete``'s c_skip and c_out per step, and whole ``step``
trajectories (which tests/program/test_schedulers.py checks step by step with the other samplers' cases).
Tolerance: float32, relative 1e-5 on the scalings (computed in float32 by torch, float64 here).
"""

import json
import math
import re

import numpy as np
import pytest

from sdxl_engine.program.schedulers import (
    FIELDS,
    PER_SAMPLER,
    SAMPLERS,
    TooManySteps,
    UnsupportedSchedulerConfig,
    check_scheduler_config,
    get_sampler,
    make_schedule,
    sampler_config,
)
from tests.helpers import FIXTURES

STEPS = json.loads((FIXTURES / "sampler-steps.json").read_text())
LCM_CASES = {case["name"]: case for case in STEPS["cases"] if case["sampler"] == "LCM"}
BASE = STEPS["base_config"]


def model_config(case: dict) -> dict:
    """The raw scheduler_config.json of a sampler-steps case (fixtures_samplers.case_config)."""
    if case["changes"] == "minimal":
        return {"_class_name": BASE["_class_name"]}
    return {**BASE, **case["changes"]}


def test_lcm_is_a_sampler_by_its_a1111_name():
    assert "LCM" in SAMPLERS and get_sampler("lcm") == "LCM" and get_sampler(None) == "Euler"
    assert set(LCM_CASES) >= {"lcm-sdxl", "lcm-1-step", "lcm-2-steps", "lcm-8-steps", "lcm-v", "lcm-clip-sample",
                              "lcm-trailing-in-config", "lcm-original-30"}


def test_four_steps_on_sdxl_base_are_999_759_499_259():
    schedule = make_schedule("LCM", BASE, 4)
    assert schedule.timesteps.tolist() == [999, 759, 499, 259] == LCM_CASES["lcm-sdxl"]["timesteps"]
    assert schedule.sigmas[-1] == 0 and schedule.final_scale == 1.0


@pytest.mark.parametrize("name", LCM_CASES)
def test_coefficients_are_diffusers_scalings(name):
    """a sqrt(s^2 + 1) = c_skip and b = c_out (diffusers' boundary-condition scalings, timestep_scaling honoured),
    d = the next step's sigma and 0 on the last step (no noise after it), e = c_out only with clip_sample, init
    scale sqrt(s_0^2 + 1) (x-space init_noise_sigma 1)."""
    case = LCM_CASES[name]
    schedule = make_schedule("LCM", model_config(case), case["steps"])
    sigmas = schedule.sigmas.astype(np.float64)
    assert schedule.timesteps.tolist() == case["timesteps"]
    np.testing.assert_allclose(schedule.a * (sigmas[:-1] ** 2 + 1) ** 0.5, case["c_skip"], rtol=1e-5)
    np.testing.assert_allclose(schedule.b, case["c_out"], rtol=1e-5)
    assert np.array_equal(schedule.d[:-1], schedule.sigmas[1:-1]) and (schedule.d[:-1] > 0).all()
    assert schedule.d[-1] == 0
    assert (schedule.c == 0).all()
    clip = sampler_config("LCM", model_config(case))["clip_sample"]
    assert np.array_equal(schedule.e, schedule.b if clip else np.zeros_like(schedule.b))
    assert schedule.clip_range == (case["resolved"]["clip_sample_range"] if clip else math.inf)
    assert case["init_noise_sigma"] == 1.0
    assert schedule.init_scale == pytest.approx((sigmas[0] ** 2 + 1) ** 0.5, rel=1e-6)


def test_timestep_scaling_moves_c_skip_as_diffusers_does():
    """timestep_scaling 0.1 makes c_skip 100x larger at a given timestep (c_skip ~ 0.25 / (10 t)^2 by default)."""
    plain, scaled = LCM_CASES["lcm-sdxl"], LCM_CASES["lcm-timestep-scaling-0.1"]
    assert scaled["c_skip"][-1] > 90 * plain["c_skip"][-1]
    ours = make_schedule("LCM", model_config(scaled), 4)
    np.testing.assert_allclose(ours.a * (ours.sigmas[:-1].astype(np.float64) ** 2 + 1) ** 0.5, scaled["c_skip"],
                               rtol=1e-5)


def test_timestep_spacing_and_set_alpha_to_one_change_nothing():
    """LCMScheduler reads neither (its timesteps come from original_inference_steps; no previous timestep is < 0)."""
    plain = make_schedule("LCM", BASE, 4)
    for changes in ({"timestep_spacing": "trailing"}, {"timestep_spacing": "linspace", "steps_offset": 3},
                    {"set_alpha_to_one": True}):
        other = make_schedule("LCM", {**BASE, **changes}, 4)
        for field in ("timesteps", "sigmas", "a", "b", "d"):
            assert np.array_equal(getattr(other, field), getattr(plain, field)), (changes, field)
    assert "unused" in FIELDS["timestep_spacing"] and "unused" in FIELDS["set_alpha_to_one"]


def test_more_steps_than_original_inference_steps_are_refused_by_name():
    """diffusers raises too (its steps are a subset of that schedule); the engine says how many it can take."""
    assert make_schedule("LCM", BASE, 50).timesteps[-1] == 19
    with pytest.raises(TooManySteps) as err:
        make_schedule("LCM", BASE, 51)
    assert str(err.value) == ("LCM runs at most 50 steps for this model (its scheduler's original_inference_steps), "
                              "got 51")
    with pytest.raises(TooManySteps, match=r"^LCM runs at most 8 steps for this model .*, got 9$"):
        make_schedule("LCM", {**BASE, "original_inference_steps": 8}, 9)
    assert make_schedule("Euler", {**BASE, "original_inference_steps": 8}, 9).timesteps.shape == (9,)


@pytest.mark.parametrize("changes, field, why", [
    ({"rescale_betas_zero_snr": True, "prediction_type": "v_prediction"}, "rescale_betas_zero_snr",
     "its terminal alpha 0"),
    ({"original_inference_steps": 2000}, "original_inference_steps", "choose 1 to num_train_timesteps (1000)"),
])
def test_what_lcm_cannot_follow_refuses_lcm_per_request_not_the_model(changes, field, why):
    config = {**BASE, **changes}
    assert field in PER_SAMPLER
    check_scheduler_config(config)  # the model loads: the other samplers follow it
    make_schedule("Euler", config, 4)
    named = rf"^{field}=.* is not supported \(sampler 'LCM'\): {re.escape(why)}"
    with pytest.raises(UnsupportedSchedulerConfig, match=named):
        make_schedule("LCM", config, 4)


def test_thresholding_is_refused_for_lcm_too():
    with pytest.raises(UnsupportedSchedulerConfig, match=r"^thresholding=True is not supported \(sampler 'LCM'\)"):
        make_schedule("LCM", {**BASE, "thresholding": True}, 4)
