"""Samplers (sdxl_engine/program/schedulers.py and the program's step) against diffusers' PyTorch schedulers.

References: tests/fixtures/sampler-steps.{json,npz} (``make_fixtures samplers``: every sampler's
diffusers class over a matrix of scheduler configs, a whole ``scheduler.step`` trajectory on fixed
arrays) and tiny-pt-reference's schedules. Tolerance: float32, |engine - diffusers| <= 1e-5 x
(1 + |diffusers|) per step (float32 rounding of a few operations is ~1e-7 relative; a wrong
coefficient moves a step by far more).
"""

import json
import math
import re

import numpy as np
import pytest

from sdxl_engine.program.generate import denoised, history_entry, sampler_update
from sdxl_engine.program.schedulers import (
    CLASS_DEFAULTS,
    FIELDS,
    SAMPLER_CLASSES,
    SAMPLERS,
    UnknownSampler,
    UnsupportedSchedulerConfig,
    check_scheduler_config,
    get_sampler,
    make_schedule,
    sampler_config,
)
from tests.helpers import FIXTURES
from tests.program.test_schedulers_eta import k_dpmpp_sde_multistep

REF_DIR = FIXTURES / "tiny-pt-reference"
REF = json.loads((REF_DIR / "reference.json").read_text())
STEPS = json.loads((FIXTURES / "sampler-steps.json").read_text())
CASES = {case["name"]: case for case in STEPS["cases"]}
VARIANTS = {  # fixture variant -> (sampler, timestep_spacing)
    "euler-leading": ("Euler", None), "euler-trailing": ("Euler", "trailing"), "euler-linspace": ("Euler", "linspace"),
    "dpm++2m": ("DPM++ 2M", None), "dpm++2m-karras": ("DPM++ 2M Karras", None), "ddim": ("DDIM", None),
}
# diffusers steps x / sqrt(sigma^2 + 1) for these
X_SPACE = ("DPM++ 2M", "DPM++ 2M Karras", "DPM++ 2M SDE", "DPM++ 3M SDE", "UniPC", "DDIM", "LCM")
RTOL = 1e-5


@pytest.fixture(scope="module")
def arrays():
    with np.load(REF_DIR / "arrays.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def steps_arrays():
    with np.load(FIXTURES / "sampler-steps.npz") as data:
        return dict(data)


def model_config(case: dict) -> dict:
    """The raw scheduler_config.json of a sampler-steps case (fixtures_samplers.case_config)."""
    base, changes = STEPS["base_config"], case["changes"]
    if changes == "minimal":
        return {"_class_name": base["_class_name"]}
    config = {k: v for k, v in base.items() if changes.get(k) != STEPS["missing"]}
    config.update({k: v for k, v in changes.items() if v != STEPS["missing"]})
    return config


def close(got, want, what, inputs=0.0):
    """|got - want| <= RTOL (1 + |want|) + 8 float32 ulps of ``inputs`` (the step's sample: diffusers' own
    ``sample + derivative * dt`` rounds at its scale, which zero terminal SNR's sigma of 4096 makes visible)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bad = np.abs(got - want) > RTOL * (1 + np.abs(want)) + 8 * np.finfo(np.float32).eps * np.abs(inputs)
    assert not bad.any(), f"{what}: max |diff| {np.abs(got - want).max():.3g} (at {np.argwhere(bad)[0]})"


# ---- from_config: the class defaults and what each sampler reads ---------------------------------------------
def test_class_defaults_are_diffusers_init_signatures():
    """Every __init__ argument of every sampler's class, with diffusers' default, and a stated treatment (the
    two-call samplers' classes are recorded in two-call-steps.json: test_schedulers_two_calls.py; TCD's in
    tcd-steps.json: test_schedulers_tcd.py)."""
    recorded = STEPS["class_defaults"]
    two_calls = json.loads((FIXTURES / "two-call-steps.json").read_text())["class_defaults"]
    tcd = json.loads((FIXTURES / "tcd-steps.json").read_text())["class_defaults"]
    assert (set(recorded) | set(two_calls) | set(tcd) == set(CLASS_DEFAULTS)
            == {cls for cls, _ in SAMPLER_CLASSES.values()})
    for cls, defaults in recorded.items():
        assert CLASS_DEFAULTS[cls] == defaults, cls
        assert set(defaults) <= set(FIELDS), f"{cls}: no stated treatment for {set(defaults) - set(FIELDS)}"


@pytest.mark.parametrize("name", CASES)
def test_sampler_config_is_from_config(name):
    """A field missing from the model's config takes the class's default (DDIM: clip_sample True)."""
    case = CASES[name]
    ours = sampler_config(case["sampler"], model_config(case))
    for field, value in case["resolved"].items():
        assert ours[field] == value, (field, ours[field], value)
    if name == "ddim-clip-sample-missing":
        assert ours["clip_sample"] is True and "clip_sample" not in model_config(case)


# ---- schedules and every step on fixed arrays -----------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_schedule_matches_diffusers(name):
    case = CASES[name]
    schedule = make_schedule(case["sampler"], model_config(case), case["steps"])
    close(schedule.timesteps, case["timesteps"], "timesteps")  # fractional ones (Karras): float32 log-sigmas
    if case["sigmas"] is not None:  # DDIM has none; log_linear Euler has one past the last step, never used
        close(schedule.sigmas, case["sigmas"][: case["steps"] + 1], "sigmas")
    if case["sampler"] in X_SPACE:  # diffusers' x-space noise (init_noise_sigma 1) in sigma space
        assert case["init_noise_sigma"] == 1.0
        assert schedule.init_scale == pytest.approx((float(schedule.sigmas[0]) ** 2 + 1) ** 0.5, rel=1e-6)
    else:
        assert schedule.init_scale == pytest.approx(case["init_noise_sigma"], rel=1e-6)


def engine_trajectory(case: dict, steps_arrays: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(the engine's step k output, diffusers' prev_sample of step k, diffusers' sample k) for every step, each
    step fed diffusers' own sample k (so one wrong step shows as itself), in diffusers' space. DPM++ 3M SDE's
    third-order steps are compared with diffusers' corrected (:func:`diffusers_third_order_d2`). A case with a
    ``first_step`` (diffusers' set_begin_index) runs from there on :meth:`Schedule.starting_at`'s coefficients. The
    history entries are the program's (generate.history_entry: x0, LMS's derivative), three of them."""
    sampler, n, first = case["sampler"], case["steps"], case.get("first_step", 0)
    config = model_config(case)
    schedule = make_schedule(sampler, config, n).starting_at(first)
    prediction = sampler_config(sampler, config)["prediction_type"]
    samples, outputs = steps_arrays[f"{case['name']}_samples"], steps_arrays["model_outputs"]
    noise = steps_arrays.get(f"{case['name']}_noise")
    scale = (schedule.sigmas.astype(np.float64) ** 2 + 1) ** 0.5 if sampler in X_SPACE else np.ones(n + 1)
    samples = np.concatenate([np.zeros((first, *samples.shape[1:]), samples.dtype), samples])  # index = step
    noise = None if noise is None else np.concatenate([np.zeros((first, *noise.shape[1:]), noise.dtype), noise])
    pairs, x0_prev, x0_prev2 = [], np.zeros_like(samples[0]), np.zeros_like(samples[0])
    padded, history = schedule.padded(n), [np.zeros_like(samples[0])] * 3
    for k in range(first, n):
        x = np.float32(samples[k] * scale[k])  # sigma space
        x0 = np.asarray(denoised(x, outputs[k], schedule.sigmas[k], prediction))
        z = noise[k] if noise is not None else np.zeros_like(x)
        out = sampler_update(x, x0, history[0], z, schedule.a[k], schedule.b[k], schedule.c[k], schedule.d[k],
                             schedule.e[k], np.float32(schedule.clip_range), history[1], schedule.c2[k], history[2],
                             padded["c3"][k])
        history = [np.asarray(history_entry(x, x0, padded["hx"][k], padded["hx0"][k])), *history[:2]]
        last = k == n - 1
        ours = np.asarray(out) * (schedule.final_scale if last and sampler in X_SPACE else 1 / scale[k + 1])
        want = samples[k + 1]
        if sampler == "DPM++ 3M SDE" and schedule.c2[k] != 0:  # third order: diffusers' D2 factor is 1 less
            want = want + diffusers_third_order_d2(schedule.sigmas, k, x0, x0_prev, x0_prev2) / scale[k + 1]
        pairs.append((ours, want, samples[k]))
        x0_prev, x0_prev2 = x0, x0_prev
    return pairs


def diffusers_third_order_d2(sigmas, k: int, x0, x0_prev, x0_prev2) -> np.ndarray:
    """What diffusers 0.42.1's third-order sde-dpmsolver++ step lacks against k-diffusion's sample_dpmpp_3m_sde, in
    sigma space: D2 = (D1_0 - D1_1) / (r0 + r1) once. diffusers' ``multistep_dpm_solver_third_order_update`` has
    ``((1 - exp(-2h) - 2h) / (2h)^2 - 0.5) D2`` where k-diffusion has ``-phi_3 d2 = (... + 0.5) d2`` (phi_3 = phi_2 /
    2h - 1/2); the exact integral of the quadratic term is k-diffusion's, which tends to 0 with h as it must."""
    lam = -np.log(np.asarray(sigmas, np.float64))
    h, h0, h1 = lam[k + 1] - lam[k], lam[k] - lam[k - 1], lam[k - 1] - lam[k - 2]
    r0, r1 = h0 / h, h1 / h
    d1_0, d1_1 = (x0 - x0_prev) / r0, (x0_prev - x0_prev2) / r1
    return (d1_0 - d1_1) / (r0 + r1)


@pytest.mark.parametrize("name", CASES)
def test_every_step_matches_diffusers(name, steps_arrays):
    """x_{k+1} = a x + b x0 + c x0_prev + d z + e (clip(x0) - x0) with schedulers.py's coefficients and the
    program's denoised/sampler_update is diffusers' ``scheduler.step(...).prev_sample`` at every step."""
    for k, (ours, want, before) in enumerate(engine_trajectory(CASES[name], steps_arrays)):
        close(ours, want, f"{name} step {k}", before)


def test_restarting_the_history_is_starting_there():
    """Schedule.restarting_at (the refiner's switch) changes only the steps from the restart on, and those as
    starting_at (img2img's start, checked against diffusers' set_begin_index above) has them; both compose; a sampler
    without history is unchanged. DPM++ 2M's step at a restart is first order (c = 0), DPM++ 3M SDE's two steps
    from a restart first and second order (c2 = 0), UniPC's first without its corrector (c = c2 = 0) and its next
    with a first-order one (c2 = 0)."""
    config = {**STEPS["base_config"], "final_sigmas_type": "sigma_min"}
    for sampler in ("DPM++ 2M", "DPM++ 2M SDE", "DPM++ 3M SDE", "UniPC"):
        plain = make_schedule(sampler, config, 16)
        restarted, started = plain.restarting_at(7), plain.starting_at(7)
        for name in ("a", "b", "c", "c2", "d"):
            np.testing.assert_array_equal(getattr(restarted, name)[:7], getattr(plain, name)[:7])
            np.testing.assert_array_equal(getattr(restarted, name)[7:], getattr(started, name)[7:])
        assert restarted.c[7] == 0 and plain.c[7] != 0 and restarted.c[8] != 0
        assert restarted.c2[7] == restarted.c2[8] == 0 and (plain.c2[8] != 0) == (sampler in ("DPM++ 3M SDE", "UniPC"))
        both = started.restarting_at(11)
        assert both.restarts == (7, 11) and both.c[11] == 0 and np.array_equal(both.b[7:11], started.b[7:11])
    euler = make_schedule("Euler", config, 16)
    assert euler.restarting_at(7) is euler and euler.starting_at(7) is euler


def test_dpm_3m_sde_with_heun_and_15_steps_or_more_is_k_diffusions():
    """A1111's DPM++ 3M SDE is k-diffusion's sample_dpmpp_3m_sde. The engine's (diffusers' class, its third-order
    D2 as k-diffusion's) is it step for step where diffusers' step orders agree with k-diffusion's: solver_type heun
    (k-diffusion's second-order step is heun's phi_2 form) and 15 steps or more (under 15 diffusers' lower_order_final
    makes the last but one step second order). SDXL's config says midpoint: its second step differs (and under 15
    steps its last but one), which the schedule's own test against diffusers covers."""
    rng = np.random.RandomState(5)
    for solver_type, steps, same in (("heun", 16, True), ("midpoint", 16, False), ("heun", 8, False)):
        schedule = make_schedule("DPM++ 3M SDE", {**STEPS["base_config"], "solver_type": solver_type}, steps, "karras")
        sigmas = schedule.sigmas.astype(np.float64)
        denoised, noise = rng.standard_normal((2, steps, 8))
        x = start = rng.standard_normal(8) * sigmas[0]
        ours, x0_prev, x0_prev2 = [], np.zeros(8), np.zeros(8)
        for k in range(steps):
            x = np.asarray(sampler_update(x, denoised[k], x0_prev, noise[k], schedule.a[k], schedule.b[k],
                                          schedule.c[k], schedule.d[k], x0_prev2=x0_prev2, c2=schedule.c2[k]))
            ours.append(x)
            x0_prev, x0_prev2 = denoised[k], x0_prev
        # k-diffusion's sample_dpmpp_3m_sde at its default eta 1 (s_noise 1), written from its update in numpy
        theirs = k_dpmpp_sde_multistep(sigmas, start, denoised, noise, eta=1.0, third=True)
        worst = max(np.abs(a - b).max() / (1 + np.abs(b).max()) for a, b in zip(ours, theirs))
        assert (worst < 1e-5) == same, (solver_type, steps, worst)


def test_the_matrix_covers_what_the_survivors_hid():
    """The cases that see each formerly unseen slip: a second-order DPM++ step (0.5 / r), DDIM with carry != 1
    (linspace), clipping that bites (x0 beyond the range), and Euler a's noise term."""
    dpm = make_schedule("DPM++ 2M", model_config(CASES["dpm-leading"]), 10)
    assert (dpm.c[1:-1] != 0).all() and dpm.c[0] == 0 and dpm.c[-1] == 0
    ddim = make_schedule("DDIM", model_config(CASES["ddim-linspace"]), 7)
    assert np.abs(ddim.a / (ddim.a + ddim.b) - 1).max() > 1e-3  # carry != 1 somewhere
    clipped = make_schedule("DDIM", model_config(CASES["ddim-clip-sample-missing"]), 6)
    assert clipped.clip_range == 1.0 and (clipped.e > 0).all()
    assert make_schedule("DDIM", model_config(CASES["ddim-sdxl"]), 6).clip_range == math.inf
    ancestral = make_schedule("Euler a", model_config(CASES["euler-a-leading"]), 6)
    assert (ancestral.d[:-1] > 0).all() and ancestral.d[-1] == 0
    # lower_order_final stops at 15 steps (diffusers: len(timesteps) < 15): with a last sigma of sigma_min, 14
    # steps end first order, 15 second order (b, c of the last step 0.89 / 0 against 3.09 / -2.20).
    for steps, last in ((14, (0.891, 0.0)), (15, (3.092, -2.205))):
        dpm = make_schedule("DPM++ 2M", {**STEPS["base_config"], "final_sigmas_type": "sigma_min"}, steps)
        assert (dpm.b[-1], dpm.c[-1]) == pytest.approx(last, abs=1e-3), steps
    assert CASES["dpm-sigma-min-15"]["steps"] == 15


def test_ddim_without_clip_sample_in_the_config_clips_x0_as_diffusers(steps_arrays):
    """The issue's case: a config lacking clip_sample. diffusers (clip_sample True) and the engine agree, and the
    unclipped update (the old behaviour) does not."""
    case = CASES["ddim-clip-sample-missing"]
    pairs = engine_trajectory(case, steps_arrays)
    for ours, want, before in pairs:
        close(ours, want, "clipped DDIM", before)
    schedule = make_schedule("DDIM", model_config(case), case["steps"])
    x = np.float32(steps_arrays[f"{case['name']}_samples"][0] * (schedule.sigmas[0] ** 2 + 1) ** 0.5)
    x0 = np.asarray(denoised(x, steps_arrays["model_outputs"][0], schedule.sigmas[0], "epsilon"))
    assert np.abs(x0).max() > 1  # clipping changes this step
    unclipped = np.asarray(sampler_update(x, x0, x0, 0.0, schedule.a[0], schedule.b[0], 0.0, 0.0)) / (
        schedule.sigmas[1] ** 2 + 1) ** 0.5
    assert np.abs(unclipped - pairs[0][1]).max() > 1e-2


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
    assert padded["sigmas"].shape == (51,) and np.all(padded["a"][steps:] == 0) and padded["e"].shape == (50,)




# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field, sampler", [
    ({"thresholding": True}, "thresholding", "DPM++ 2M"),
    ({"use_beta_sigmas": True}, "use_beta_sigmas", "Euler"),
    ({"use_karras_sigmas": True, "use_exponential_sigmas": True}, "use_exponential_sigmas", "Euler"),
    ({"prediction_type": "flow_prediction"}, "prediction_type", "Euler"),
    ({"timestep_spacing": "karras"}, "timestep_spacing", "Euler"),
    ({"beta_schedule": "sigmoid"}, "beta_schedule", "Euler"),
    ({"final_sigmas_type": "denoise_to_zero"}, "final_sigmas_type", "Euler"),
    ({"interpolation_type": "cubic"}, "interpolation_type", "Euler"),
    ({"timestep_type": "edm"}, "timestep_type", "Euler"),
    ({"use_lu_lambdas": True}, "use_lu_lambdas", "DPM++ 2M"),
    ({"use_flow_sigmas": True}, "use_flow_sigmas", "DPM++ 2M"),
    ({"use_dynamic_shifting": True}, "use_dynamic_shifting", "DPM++ 2M"),
    ({"variance_type": "learned_range"}, "variance_type", "DPM++ 2M"),
    ({"solver_type": "bh3"}, "solver_type", "DPM++ 2M"),
])
def test_a_field_no_sampler_follows_refuses_the_model_naming_it(changes, field, sampler):
    config = {**STEPS["base_config"], **changes}
    named = rf"^{field}=.* is not supported \(\w+, sampler '{re.escape(sampler)}'\)"
    with pytest.raises(UnsupportedSchedulerConfig, match=named):
        check_scheduler_config(config)
    with pytest.raises(UnsupportedSchedulerConfig, match=rf"^{field}="):
        make_schedule(sampler, config, 4)


@pytest.mark.parametrize("changes, field", [
    ({"final_sigmas_type": "sigma_min", "use_karras_sigmas": True}, "final_sigmas_type"),
    ({"lower_order_final": False}, "lower_order_final")])
def test_what_only_unipc_cannot_follow_refuses_unipc_per_request_not_the_model(changes, field):
    """diffusers' UniPC divides by zero on these two (a repeated last Karras sigma, h = 0; a second-order last step
    to sigma 0), which every other sampler follows: the model loads, UniPC alone is refused, naming the field."""
    config = {**STEPS["base_config"], **changes}
    check_scheduler_config(config)
    make_schedule("DPM++ 3M SDE", config, 6)
    with pytest.raises(UnsupportedSchedulerConfig, match=rf"^{field}=.* is not supported \(sampler 'UniPC'\)"):
        make_schedule("UniPC", config, 6)


def test_sample_prediction_refuses_euler_a_per_request_not_the_model():
    """A sample-predicting model (SDXL-Lightning's 1-step x0 UNet) loads and runs with Euler; diffusers' Euler a has
    no sample prediction, so Euler a alone is refused, naming the field."""
    config = {**STEPS["base_config"], "prediction_type": "sample"}
    check_scheduler_config(config)
    make_schedule("Euler", config, 1)
    with pytest.raises(UnsupportedSchedulerConfig, match=r"^prediction_type='sample' is not supported \(sampler "
                                                         r"'Euler a'\): diffusers' Euler a does not implement it"):
        make_schedule("Euler a", config, 1)


def test_zero_terminal_snr_refuses_ddim_per_request_not_the_model():
    """schedulers.PER_SAMPLER: a ztsnr model loads; Euler follows its rescaled betas (sigma_max grows by
    orders of magnitude, as diffusers' rescale_zero_terminal_snr makes it), and only DDIM is refused, by name."""
    config = {**STEPS["base_config"], "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    check_scheduler_config(config)
    plain = make_schedule("Euler", {**config, "rescale_betas_zero_snr": False}, 4)
    rescaled = make_schedule("Euler", config, 4)
    assert rescaled.sigmas[0] > 100 * plain.sigmas[0]
    with pytest.raises(UnsupportedSchedulerConfig, match=r"^rescale_betas_zero_snr=True is not supported \(sampler "
                                                          r"'DDIM'\): DDIM's terminal alpha 0"):
        make_schedule("DDIM", config, 4)


def test_sdxl_and_shipped_configs_are_accepted():
    from sdxl_engine.checkpoint import builtin

    check_scheduler_config(dict(builtin.SDXL_SCHEDULER))
    check_scheduler_config(json.loads((FIXTURES / "tiny-pt" / "scheduler" / "scheduler_config.json").read_text()))
    check_scheduler_config({"_class_name": "DDIMScheduler"})  # every field the class default
    shapes = json.loads((builtin.TINY_SHAPES_DIR / "scheduler" / "scheduler_config.json").read_text())
    check_scheduler_config(shapes)
    assert make_schedule("DDIM", shapes, 8).clip_range == math.inf  # it says clip_sample false: its latents pass 1


def test_a_model_folder_with_a_refused_field_fails_to_load_naming_file_and_field(tmp_path):
    from sdxl_engine.checkpoint.loading import ModelLoadError, read_scheduler_config

    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({**STEPS["base_config"], "thresholding": True}))
    with pytest.raises(ModelLoadError, match=r"scheduler_config\.json: thresholding=True is not supported"):
        read_scheduler_config(tmp_path)
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(STEPS["base_config"]))
    assert read_scheduler_config(tmp_path) == STEPS["base_config"]


def test_sampler_names():
    assert SAMPLERS == ("Euler", "Euler a", "DPM++ 2M", "DPM++ 2M Karras", "DPM++ 2M SDE", "DPM++ 3M SDE", "UniPC",
                        "DDIM", "LCM", "Heun", "DPM2", "DPM++ SDE", "TCD", "DPM2 a", "LMS", "Restart")
    assert get_sampler("tcd") == "TCD"
    assert get_sampler("heun") == "Heun" and get_sampler("dpm++ sde") == "DPM++ SDE"
    assert get_sampler("dpm2  A") == "DPM2 a"
    assert get_sampler(" dpm++  2m karras") == "DPM++ 2M Karras" and get_sampler(None) == "Euler"
    assert get_sampler("restart") == "Restart"
    with pytest.raises(UnknownSampler, match="unknown sampler 'DPM adaptive'; choose one of Euler, Euler a, DPM"):
        get_sampler("DPM adaptive")
    with pytest.raises(UnknownSampler):
        get_sampler(3)


def test_ddim_on_a_config_saved_by_euler_takes_ddims_own_defaults(steps_arrays):
    """A scheduler_config.json written by EulerDiscreteScheduler has no clip_sample, set_alpha_to_one,
    sample_max_value, skip_prk_steps (leading, steps_offset 1): DDIMScheduler.from_config fills DDIM's __init__
    defaults, clip_sample True and set_alpha_to_one True, so x0 is clipped at every step and the last step
    lands on clip(x0) itself (final alpha 1: sigma 0). The engine follows every step; each of the three other
    clip_sample x set_alpha_to_one choices ends far from diffusers."""
    case = CASES["ddim-euler-saved-config"]
    config = model_config(case)
    assert not {"clip_sample", "set_alpha_to_one", "sample_max_value", "skip_prk_steps"} & set(config)
    assert config["steps_offset"] == 1 and config["timestep_spacing"] == "leading"
    assert case["resolved"]["clip_sample"] is True and case["resolved"]["set_alpha_to_one"] is True
    schedule = make_schedule("DDIM", config, case["steps"])
    assert schedule.timesteps.tolist() == [901, 801, 701, 601, 501, 401, 301, 201, 101, 1]
    assert schedule.clip_range == 1.0 and (schedule.e == 1).all()
    assert schedule.sigmas[-1] == 0 and schedule.a[-1] == 0 and schedule.final_scale == 1
    for k, (ours, want, before) in enumerate(engine_trajectory(case, steps_arrays)):
        close(ours, want, f"step {k}", before)
    want = steps_arrays[f"{case['name']}_samples"][-1]
    assert np.abs(want).max() <= 1  # the final sample is a clipped x0
    np.testing.assert_allclose(free_run(config, case["steps"], steps_arrays), want, rtol=1e-5, atol=1e-5)
    for clip, to_one in ((True, False), (False, True), (False, False)):
        ours = free_run({**config, "clip_sample": clip, "set_alpha_to_one": to_one}, case["steps"], steps_arrays)
        assert np.abs(ours - want).max() > 1e-2, (clip, to_one)


def free_run(config: dict, steps: int, steps_arrays: dict) -> np.ndarray:
    """The engine's DDIM from the fixture's start on its model outputs, never fed diffusers' samples; the final
    sample in diffusers' x-space."""
    schedule = make_schedule("DDIM", config, steps)
    x = np.float32(steps_arrays["start"] * schedule.init_scale)
    for k in range(steps):
        x0 = np.asarray(denoised(x, steps_arrays["model_outputs"][k], schedule.sigmas[k], "epsilon"))
        x = np.asarray(sampler_update(x, x0, x0, 0.0, schedule.a[k], schedule.b[k], 0.0, 0.0, schedule.e[k],
                                      np.float32(schedule.clip_range)))
    return x * schedule.final_scale
