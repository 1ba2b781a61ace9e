"""``python -m tools.make_fixtures two-call-samplers``: tests/fixtures/two-call-steps.json and .npz.

The samplers that call the model twice per step (the engine's Heun, DPM2, DPM++ SDE, DPM2 a: diffusers'
HeunDiscreteScheduler, KDPM2DiscreteScheduler, DPMSolverSDEScheduler, KDPM2AncestralDiscreteScheduler), over a matrix
of scheduler configs
(:data:`CASES`): each class's timesteps (2n - 1 model calls), sigmas and init_noise_sigma, and a whole sampling loop
with a fake deterministic model (:func:`fake_model`, the tests write the same in JAX) from fixed start latents: the
sample after every call. DPMSolverSDEScheduler's Brownian tree is replaced by fixed arrays handed out in call order
(``<case>_noise``: (2n - 1, ...) row k the draw of call k; its (sigma, sigma_next) arguments recorded), so its
deterministic part is compared exactly; KDPM2AncestralDiscreteScheduler's
``randn_tensor`` likewise returns ``noise[j]`` at its j-th draw (one per step but the last, at the step's second call;
the model call of each draw recorded). Also each class's ``__init__`` defaults, and tiny-pt's pipeline images with
Heun, DPM2 and DPM2 a (:data:`IMAGE_CASES`) on given latents (DPM2 a's step noise the engine's seed rule's, from
tests/fixtures/lcm-noise.npz, ``python -m tools.lcm_noise``: its seeds' noise of 3 steps, a 4-step run's draws).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    DPMSolverSDEScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    StableDiffusionXLPipeline,
)
from diffusers.schedulers import scheduling_k_dpm_2_ancestral_discrete

from tools.fixtures_common import FIXTURES, plain_config, sdxl_base_configs, versions, write_npz
from tools.fixtures_samplers import case_config, init_defaults

CLASSES = {"Heun": HeunDiscreteScheduler, "DPM2": KDPM2DiscreteScheduler, "DPM++ SDE": DPMSolverSDEScheduler,
           "DPM2 a": KDPM2AncestralDiscreteScheduler}
# (case name, sampler, changes to SDXL base's scheduler_config.json ("minimal": only _class_name), steps)
CASES = [
    ("heun-leading", "Heun", {}, 6),
    ("heun-linspace", "Heun", {"timestep_spacing": "linspace"}, 5),
    ("heun-trailing", "Heun", {"timestep_spacing": "trailing"}, 5),
    ("heun-karras", "Heun", {"use_karras_sigmas": True}, 6),
    ("heun-karras-sigma-range", "Heun", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 5),
    ("heun-exponential", "Heun", {"use_exponential_sigmas": True, "timestep_spacing": "trailing"}, 5),
    ("heun-v-trailing", "Heun", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 5),
    ("heun-sample", "Heun", {"prediction_type": "sample"}, 4),
    ("heun-clip", "Heun", {"clip_sample": True, "clip_sample_range": 0.5}, 5),
    ("heun-zero-snr-in-config", "Heun", {"rescale_betas_zero_snr": True}, 5),  # not a Heun field: no effect
    ("heun-cosine", "Heun", {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}, 4),
    ("heun-minimal", "Heun", "minimal", 4),
    ("heun-1-step", "Heun", {}, 1),
    ("dpm2-leading", "DPM2", {}, 6),
    ("dpm2-linspace", "DPM2", {"timestep_spacing": "linspace"}, 5),
    ("dpm2-trailing", "DPM2", {"timestep_spacing": "trailing"}, 5),
    ("dpm2-karras", "DPM2", {"use_karras_sigmas": True}, 6),
    ("dpm2-karras-sigma-range", "DPM2", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 5),
    ("dpm2-exponential", "DPM2", {"use_exponential_sigmas": True}, 5),
    ("dpm2-v-trailing", "DPM2", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 5),
    ("dpm2-minimal", "DPM2", "minimal", 4),
    ("dpm2-1-step", "DPM2", {}, 1),
    ("sde-leading", "DPM++ SDE", {}, 6),
    ("sde-linspace", "DPM++ SDE", {"timestep_spacing": "linspace"}, 5),
    ("sde-trailing", "DPM++ SDE", {"timestep_spacing": "trailing"}, 5),
    ("sde-karras", "DPM++ SDE", {"use_karras_sigmas": True}, 6),
    ("sde-karras-sigma-range", "DPM++ SDE", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 5),
    ("sde-exponential", "DPM++ SDE", {"use_exponential_sigmas": True}, 5),
    ("sde-v-trailing", "DPM++ SDE", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 5),
    ("sde-minimal", "DPM++ SDE", "minimal", 4),
    ("dpm2a-leading", "DPM2 a", {}, 6),
    ("dpm2a-linspace", "DPM2 a", {"timestep_spacing": "linspace"}, 5),
    ("dpm2a-trailing", "DPM2 a", {"timestep_spacing": "trailing"}, 5),
    ("dpm2a-karras", "DPM2 a", {"use_karras_sigmas": True}, 6),
    ("dpm2a-karras-sigma-range", "DPM2 a", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 5),
    ("dpm2a-exponential", "DPM2 a", {"use_exponential_sigmas": True}, 5),
    ("dpm2a-v-trailing", "DPM2 a", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 5),
    ("dpm2a-minimal", "DPM2 a", "minimal", 4),
    ("dpm2a-1-step", "DPM2 a", {}, 1),
]
# No DPM2 a cosine case: KDPM2AncestralDiscreteScheduler's float32 sigma_down = sqrt(s'^2 - s_up^2) cancels to 0 after
# a first sigma of 20 291 and its log-lerp midpoint is NaN, so its samples are NaN from the second call on (the
# engine's float64 coefficients are k-diffusion's, tests/program/test_schedulers_two_calls.py).
SHAPE = (1, 4, 3, 2)  # latents of a 1-image batch, not square
# tiny-pt's pipeline with the sampler's class from tiny-pt's config: name -> (sampler, prompt, negative prompt,
# guidance, steps, latents seed); 64x64, 2 images. DPM2 a's noise: lcm-noise.npz's (4 steps: 3 draws).
IMAGE_CASES = {"heun_image": ("Heun", "a red circle", "a blue square", 5.0, 6, 41),
               "dpm2_image": ("DPM2", "a red circle", "a blue square", 5.0, 6, 43),
               "dpm2a_image": ("DPM2 a", "a red circle", "a blue square", 5.0, 4, 47)}


def fake_model(x: torch.Tensor, t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The fake model's output for the scaled input ``x`` at timestep ``t``: tanh(0.7 x) (0.5 + t / 1000) + 0.1 bias,
    float32 (tests/program/test_schedulers_two_calls.py has it in JAX)."""
    return torch.tanh(0.7 * x) * (0.5 + t.to(torch.float32) / 1000) + 0.1 * bias


class FixedNoise:
    """DPMSolverSDEScheduler's noise_sampler replaced: call k returns ``noise[k]`` and records its arguments."""

    def __init__(self, noise: np.ndarray):
        self.noise, self.calls = noise, []

    def __call__(self, sigma, sigma_next):
        self.calls.append((float(sigma), float(sigma_next)))
        return torch.from_numpy(self.noise[len(self.calls) - 1])


class FixedRandn:
    """KDPM2AncestralDiscreteScheduler's ``randn_tensor`` replaced: draw j returns ``noise[j]`` and records the
    model call (the scheduler's step_index) it was drawn at."""

    def __init__(self, noise: np.ndarray, sched):
        self.noise, self.sched, self.calls = noise, sched, []

    def __call__(self, shape, **kwargs):
        self.calls.append(int(self.sched.step_index))
        return torch.from_numpy(self.noise[len(self.calls) - 1])


def trajectory(sampler: str, config: dict, steps: int, start: np.ndarray, bias: np.ndarray, noise: np.ndarray):
    """diffusers' ``sampler`` from ``config``, ``steps`` steps of the fake model from ``start * init_noise_sigma``.

    Returns (scheduler, samples (calls + 1, *SHAPE): the sample before the first call and after each, noise
    sampler calls [(sigma, sigma_next)] (DPM++ SDE), the model calls of the draws [k] (DPM2 a), or None)."""
    sched = CLASSES[sampler].from_config(config)
    sched.set_timesteps(steps)
    fixed, module = None, scheduling_k_dpm_2_ancestral_discrete
    if sampler == "DPM++ SDE":
        fixed = sched.noise_sampler = FixedNoise(noise)
    if sampler == "DPM2 a":
        fixed = module.randn_tensor = FixedRandn(noise, sched)
    sample = torch.from_numpy(start) * sched.init_noise_sigma
    samples, b = [sample], torch.from_numpy(bias)
    for t in sched.timesteps:
        output = fake_model(sched.scale_model_input(sample, t), t, b)
        sample = sched.step(output, t, sample).prev_sample.to(torch.float32)
        samples.append(sample)
    return sched, torch.stack(samples).numpy(), None if fixed is None else fixed.calls


def step_case(row: tuple, base: dict, start: np.ndarray, bias: np.ndarray, noise: np.ndarray) -> tuple[dict, dict]:
    """One CASES row: ({key: array}, its entry of the JSON's cases)."""
    name, sampler, changes, steps = row
    sched, samples, calls = trajectory(sampler, case_config(base, changes), steps, start, bias, noise)
    fields = init_defaults(CLASSES[sampler])
    case = dict(name=name, sampler=sampler, steps=steps, changes=changes,
                resolved={k: v for k, v in sched.config.items() if k in fields},
                timesteps=[float(t) for t in sched.timesteps.numpy()],
                sigmas=[float(s) for s in sched.sigmas.numpy()], init_noise_sigma=float(sched.init_noise_sigma))
    if calls is not None:
        case["noise_draws" if sampler == "DPM2 a" else "noise_calls"] = calls
    return {f"{name}_samples": samples}, case


def image_case(out: Path, name: str) -> tuple[dict, dict]:
    """diffusers' images for IMAGE_CASES[name] on out/tiny-pt: ({key: array}, metadata)."""
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    sampler, prompt, negative, guidance, steps, seed = IMAGE_CASES[name]
    config = plain_config(pipe.scheduler.config)
    pipe.scheduler = CLASSES[sampler].from_config(config)
    noise = None
    if sampler == "DPM2 a":  # the engine's step noise for the seeds lcm-noise.npz names, in draw order
        with np.load(FIXTURES / "lcm-noise.npz") as data:
            noise, seeds = data["noise"], data["seeds"].tolist()
        assert len(noise) == steps - 1
        scheduling_k_dpm_2_ancestral_discrete.randn_tensor = draws = FixedRandn(noise, pipe.scheduler)
    latents = np.random.RandomState(seed).standard_normal((2, 4, 16, 16)).astype(np.float32)
    images = pipe(prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps, width=64,
                  height=64, num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
    arrays = {f"{name}_latents": latents, f"{name}_images": np.round(images * 255).astype(np.uint8)}
    meta = dict(sampler=sampler, prompt=prompt, negative_prompt=negative, guidance_scale=guidance,
                num_inference_steps=steps, width=64, height=64, scheduler_config=config,
                timesteps=[float(t) for t in pipe.scheduler.timesteps],
                latents=f"numpy RandomState({seed}).standard_normal((2, 4, 16, 16))", images="uint8, round(np * 255)")
    if noise is not None:
        assert len(draws.calls) == steps - 1
        meta.update(seeds=seeds, noise="lcm-noise.npz's noise[j] at randn_tensor's j-th draw (the engine's step noise "
                                       "of these seeds)", noise_draws=draws.calls)
    return arrays, meta


NOTES = [
    "Each case's model config: base_config with its changes ('minimal': only _class_name); resolved: the class's "
    "own fields of the scheduler's config.",
    "Each case: cls.from_config(config), set_timesteps(steps) (2 steps - 1 timesteps: the model calls); the sample "
    "starts at start * init_noise_sigma; call k: output = tanh(0.7 x) * (0.5 + t / 1000) + 0.1 bias with x = "
    "scale_model_input(sample, t), then step(output, t, sample); <case>_samples[k + 1] is call k's prev_sample "
    "(sigma space, float32). DPM++ SDE: its noise_sampler returns noise[k] at its k-th call (noise_calls: the "
    "(sigma, sigma_next) it was called with), in place of torchsde's Brownian tree. DPM2 a: its randn_tensor returns "
    "noise[j] at its j-th draw (noise_draws: the model call k of each, its step_index), in place of torch.randn.",
    "image cases: tiny-pt's StableDiffusionXLPipeline (float32) with the class's from_config of its config, on "
    "<case>_latents; <case>_images (2, 64, 64, 3) uint8. dpm2a_image: its randn_tensor returns lcm-noise.npz's "
    "noise[j] (2, 4, 16, 16) at its j-th draw, the engine's step noise of the case's seeds.",
    "Suggested tolerance: float32, |engine - diffusers| <= 1e-5 * (1 + |diffusers|) per step.",
]


def cmd_two_call_samplers(out: Path) -> None:
    """``two-call-samplers``: out/two-call-steps.json and .npz (see the module docstring)."""
    torch.set_num_threads(1)
    base = sdxl_base_configs()["scheduler"]
    rng = np.random.RandomState(23)
    start = rng.standard_normal(SHAPE).astype(np.float32)
    bias = rng.standard_normal(SHAPE).astype(np.float32)
    noise = rng.standard_normal((2 * max(row[3] for row in CASES), *SHAPE)).astype(np.float32)
    arrays, cases = {"start": start, "bias": bias, "noise": noise}, []
    for row in CASES:
        case_arrays, case = step_case(row, base, start, bias, noise)
        arrays.update(case_arrays)
        cases.append(case)
    meta = dict(made_by="python -m tools.make_fixtures two-call-samplers", versions=versions(), torch_threads=1,
                base_config=base, shape=list(SHAPE), cases=cases,
                class_defaults={cls.__name__: init_defaults(cls) for cls in CLASSES.values()}, notes=NOTES)
    for name in IMAGE_CASES:
        case_arrays, meta[f"{name}_case"] = image_case(out, name)
        arrays.update(case_arrays)
    write_npz(out / "two-call-steps.npz", arrays)
    text = json.dumps(meta, indent=1, default=str)
    text = re.sub(r"\[[-+.,\seE\d]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # numbers: one line
    (out / "two-call-steps.json").write_text(text + "\n")
