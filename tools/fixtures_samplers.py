"""``python -m tools.make_fixtures samplers [--add CASE ...]``: tests/fixtures/sampler-steps.json and .npz.

For every sampler's diffusers class and a matrix of scheduler configs (:data:`SAMPLER_CASES`), the timesteps,
sigmas, init_noise_sigma and a whole ``scheduler.step`` trajectory on fixed small arrays (the sample after each
step; Euler a's noise per step), plus each class's ``__init__`` defaults, and tiny-pt's pipeline images with DDIM
from a config lacking ``clip_sample`` (:data:`DDIM_IMAGE_CASES`) and with LCM (:data:`LCM_IMAGE_CASES`), its step
noise the engine's: run ``python -m tools.lcm_noise`` (the runtime's venv) first, it writes
tests/fixtures/lcm-noise.npz, which this hands to LCMScheduler in order. ``--add`` makes only the named cases and
merges them, every other entry kept to the byte.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    StableDiffusionXLPipeline,
    UniPCMultistepScheduler,
)

from tools.fixtures_common import EngineNoise, plain_config, sdxl_base_configs, versions, write_npz

# ``samplers``: A1111 name -> (diffusers class, the from_config overrides the name stands for), as the engine maps them.
SAMPLER_CLASSES = {
    "Euler": (EulerDiscreteScheduler, {}),
    "Euler a": (EulerAncestralDiscreteScheduler, {}),
    "DPM++ 2M": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "DPM++ 2M Karras": (DPMSolverMultistepScheduler,
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "DPM++ 2M SDE": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    "DPM++ 3M SDE": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++", "solver_order": 3}),
    "UniPC": (UniPCMultistepScheduler, {"solver_order": 2, "predict_x0": True}),
    "DDIM": (DDIMScheduler, {}),
    "LCM": (LCMScheduler, {}),
    "LMS": (LMSDiscreteScheduler, {}),  # step(order=4), its default, as diffusers' pipelines call it
}
STEP_NOISE = ("Euler a", "DPM++ 2M SDE", "DPM++ 3M SDE", "LCM")  # the samplers that draw fresh noise in step()
DROP = "<missing>"  # a SAMPLER_CASES value: the field is removed from the model's config (the class default applies)
# SDXL base's fields that a config saved by EulerDiscreteScheduler lacks and DDIMScheduler reads (or, for
# skip_prk_steps, PNDM): from_config gives DDIM its own defaults, clip_sample True and set_alpha_to_one True.
EULER_SAVED_DROPS = ("clip_sample", "set_alpha_to_one", "sample_max_value", "skip_prk_steps")
# (case name, sampler, changes to SDXL base's scheduler_config.json, steps). Empty changes {} with "minimal" below
# means a config holding only _class_name: every field is the class's default.
SAMPLER_CASES = [
    ("euler-leading", "Euler", {}, 6),
    ("euler-linspace", "Euler", {"timestep_spacing": "linspace"}, 5),
    ("euler-trailing", "Euler", {"timestep_spacing": "trailing"}, 5),
    ("euler-karras-in-config", "Euler", {"use_karras_sigmas": True}, 6),
    ("euler-karras-sigma-range", "Euler", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 5),
    ("euler-exponential", "Euler", {"use_exponential_sigmas": True, "timestep_spacing": "trailing"}, 5),
    ("euler-final-sigma-min", "Euler", {"final_sigmas_type": "sigma_min"}, 5),
    ("euler-v-trailing", "Euler", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 5),
    ("euler-sample", "Euler", {"prediction_type": "sample"}, 4),
    ("euler-zero-snr", "Euler", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                 "timestep_spacing": "trailing"}, 5),
    ("euler-log-linear", "Euler", {"interpolation_type": "log_linear"}, 5),
    ("euler-continuous-v", "Euler", {"timestep_type": "continuous", "prediction_type": "v_prediction"}, 4),
    ("euler-cosine", "Euler", {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}, 4),
    ("euler-minimal", "Euler", "minimal", 4),
    ("euler-a-leading", "Euler a", {}, 6),
    ("euler-a-linspace", "Euler a", {"timestep_spacing": "linspace"}, 5),
    ("euler-a-trailing", "Euler a", {"timestep_spacing": "trailing"}, 5),
    ("euler-a-karras-in-config", "Euler a", {"use_karras_sigmas": True}, 5),  # not a field of Euler a: no effect
    ("euler-a-v-zero-snr", "Euler a", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                       "timestep_spacing": "trailing"}, 5),
    ("dpm-leading", "DPM++ 2M", {}, 10),
    ("dpm-linspace", "DPM++ 2M", {"timestep_spacing": "linspace"}, 7),
    ("dpm-trailing", "DPM++ 2M", {"timestep_spacing": "trailing"}, 7),
    ("dpm-karras-in-config", "DPM++ 2M", {"use_karras_sigmas": True}, 6),
    ("dpm-v", "DPM++ 2M", {"prediction_type": "v_prediction"}, 6),
    ("dpm-sample", "DPM++ 2M", {"prediction_type": "sample"}, 5),
    ("dpm-heun", "DPM++ 2M", {"solver_type": "heun"}, 7),
    ("dpm-sigma-min-16", "DPM++ 2M", {"final_sigmas_type": "sigma_min"}, 16),  # 15+ steps: the last is 2nd order
    ("dpm-sigma-min-6", "DPM++ 2M", {"final_sigmas_type": "sigma_min"}, 6),  # lower_order_final: 1st order
    ("dpm-sigma-min-15", "DPM++ 2M", {"final_sigmas_type": "sigma_min"}, 15),  # lower_order_final's edge: 2nd order
    ("dpm-sigma-min-no-lower-order-final", "DPM++ 2M", {"final_sigmas_type": "sigma_min",
                                                         "lower_order_final": False}, 6),
    ("dpm-euler-at-final", "DPM++ 2M", {"final_sigmas_type": "sigma_min", "euler_at_final": True}, 16),
    ("dpm-lambda-min-clipped", "DPM++ 2M", {"lambda_min_clipped": -2.5, "timestep_spacing": "linspace"}, 6),
    ("dpm-zero-snr", "DPM++ 2M", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                  "timestep_spacing": "trailing"}, 6),
    ("dpm-exponential", "DPM++ 2M", {"use_exponential_sigmas": True}, 6),
    ("dpm-order-3-sde-in-config", "DPM++ 2M", {"solver_order": 3, "algorithm_type": "sde-dpmsolver++"}, 6),
    ("dpm-karras", "DPM++ 2M Karras", {}, 8),
    ("dpm-sde-leading", "DPM++ 2M SDE", {}, 8),
    ("dpm-sde-heun", "DPM++ 2M SDE", {"solver_type": "heun"}, 7),
    ("dpm-sde-sigma-min-16", "DPM++ 2M SDE", {"final_sigmas_type": "sigma_min"}, 16),
    ("dpm-sde-karras-in-config", "DPM++ 2M SDE", {"use_karras_sigmas": True}, 6),
    ("dpm-sde-v-trailing", "DPM++ 2M SDE", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 6),
    # DPM++ 3M SDE: under 15 steps the last but one is second order (lower_order_second); with a final sigma_min and
    # 16 steps every step from the third on is third order, the last too.
    ("dpm-3m-sde-leading", "DPM++ 3M SDE", {}, 8),
    ("dpm-3m-sde-sigma-min-16", "DPM++ 3M SDE", {"final_sigmas_type": "sigma_min"}, 16),
    ("dpm-3m-sde-heun-karras", "DPM++ 3M SDE", {"solver_type": "heun", "use_karras_sigmas": True}, 7),
    ("dpm-3m-sde-v-trailing", "DPM++ 3M SDE", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 6),
    # UniPC (SDXL's solver_type midpoint is bh2 there)
    ("unipc-leading", "UniPC", {}, 8),
    ("unipc-bh1-linspace", "UniPC", {"solver_type": "bh1", "timestep_spacing": "linspace"}, 7),
    ("unipc-v-trailing", "UniPC", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 6),
    ("unipc-sample", "UniPC", {"prediction_type": "sample"}, 5),
    ("unipc-karras", "UniPC", {"use_karras_sigmas": True}, 6),
    ("unipc-exponential", "UniPC", {"use_exponential_sigmas": True}, 6),
    ("unipc-sigma-min-no-lower-order-final", "UniPC", {"final_sigmas_type": "sigma_min",
                                                        "lower_order_final": False}, 6),
    ("unipc-disable-corrector", "UniPC", {"disable_corrector": [1, 3]}, 7),
    ("unipc-zero-snr", "UniPC", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                 "timestep_spacing": "trailing"}, 6),
    ("unipc-minimal", "UniPC", "minimal", 5),
    # From a later step (img2img's start_step: set_begin_index, a fresh history): a fifth field, the first step.
    ("dpm-from-4", "DPM++ 2M", {}, 10, 4),
    ("dpm-3m-sde-from-3", "DPM++ 3M SDE", {"final_sigmas_type": "sigma_min"}, 16, 3),
    ("unipc-from-3", "UniPC", {}, 10, 3),
    ("dpm-karras-sigma-range", "DPM++ 2M Karras", {"sigma_min": 0.1, "sigma_max": 10.0}, 6),
    ("dpm-karras-trailing-v", "DPM++ 2M Karras", {"timestep_spacing": "trailing",
                                                  "prediction_type": "v_prediction"}, 6),
    ("ddim-sdxl", "DDIM", {}, 6),
    ("ddim-clip-sample-missing", "DDIM", {"clip_sample": DROP}, 6),  # from_config: DDIM's default True
    ("ddim-clip-range-2", "DDIM", {"clip_sample": True, "clip_sample_range": 2.0}, 5),
    ("ddim-linspace", "DDIM", {"timestep_spacing": "linspace"}, 7),  # carry != 1
    ("ddim-linspace-clip", "DDIM", {"timestep_spacing": "linspace", "clip_sample": True}, 6),
    ("ddim-trailing", "DDIM", {"timestep_spacing": "trailing"}, 5),
    ("ddim-alpha-to-one", "DDIM", {"set_alpha_to_one": True}, 5),
    ("ddim-v-clip", "DDIM", {"prediction_type": "v_prediction", "clip_sample": True}, 5),
    ("ddim-sample", "DDIM", {"prediction_type": "sample"}, 4),
    ("ddim-minimal", "DDIM", "minimal", 4),
    ("ddim-euler-saved-config", "DDIM", dict.fromkeys(EULER_SAVED_DROPS, DROP), 10),  # clip True, alpha 1
    ("lcm-sdxl", "LCM", {}, 4),
    ("lcm-1-step", "LCM", {}, 1),
    ("lcm-2-steps", "LCM", {}, 2),
    ("lcm-8-steps", "LCM", {}, 8),
    ("lcm-16-steps", "LCM", {}, 16),
    ("lcm-v", "LCM", {"prediction_type": "v_prediction"}, 4),
    ("lcm-sample", "LCM", {"prediction_type": "sample"}, 4),
    ("lcm-trailing-in-config", "LCM", {"timestep_spacing": "trailing"}, 4),  # LCM does not read it: no effect
    ("lcm-clip-sample", "LCM", {"clip_sample": True}, 4),
    ("lcm-clip-range-2-v", "LCM", {"clip_sample": True, "clip_sample_range": 2.0,
                                   "prediction_type": "v_prediction"}, 5),
    ("lcm-original-30", "LCM", {"original_inference_steps": 30}, 6),  # k = 33: timesteps from 989
    ("lcm-original-8-all", "LCM", {"original_inference_steps": 8}, 8),  # every one of the original steps
    ("lcm-timestep-scaling-0.1", "LCM", {"timestep_scaling": 0.1}, 4),  # c_skip large enough to matter
    ("lcm-alpha-to-one", "LCM", {"set_alpha_to_one": True}, 4),  # unused: no previous timestep is negative
    ("lcm-linear", "LCM", {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02}, 4),
    ("lcm-minimal", "LCM", "minimal", 4),
    # DMD2's recipe (checkpoint/recipes.py): the engine's config has original_inference_steps 4; diffusers runs the
    # model card's call, LCMScheduler with timesteps=[999, 749, 499, 249] (CARD_TIMESTEPS), checked here to step as
    # the card's own config (SDXL base's, original_inference_steps 50) does.
    ("lcm-dmd2", "LCM", {"original_inference_steps": 4}, 4),
    # LMS (LMSDiscreteScheduler, order 4): 1 to 16 steps (first, second, third order while the history fills), the
    # spacings, Karras and exponential sigmas (its Karras ones ignore sigma_min/sigma_max, its exponential ones read
    # them), the prediction types, a cosine schedule's large first sigma, and zero SNR in the config (not its field).
    ("lms-leading", "LMS", {}, 10),
    ("lms-1-step", "LMS", {}, 1),
    ("lms-2-steps", "LMS", {}, 2),
    ("lms-3-steps", "LMS", {}, 3),
    ("lms-16-steps", "LMS", {}, 16),
    ("lms-linspace", "LMS", {"timestep_spacing": "linspace"}, 7),
    ("lms-trailing", "LMS", {"timestep_spacing": "trailing"}, 6),
    ("lms-karras-in-config", "LMS", {"use_karras_sigmas": True}, 8),
    ("lms-karras-sigma-range", "LMS", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 6),
    ("lms-exponential", "LMS", {"use_exponential_sigmas": True}, 8),
    ("lms-exponential-sigma-range", "LMS", {"use_exponential_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 6),
    ("lms-v-trailing", "LMS", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 7),
    ("lms-v-karras", "LMS", {"prediction_type": "v_prediction", "use_karras_sigmas": True}, 12),
    ("lms-sample", "LMS", {"prediction_type": "sample"}, 5),
    ("lms-cosine", "LMS", {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}, 5),
    ("lms-zero-snr-in-config", "LMS", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                       "timestep_spacing": "trailing"}, 6),
    ("lms-minimal", "LMS", "minimal", 5),
]
# Cases whose diffusers run passes set_timesteps(timesteps=...) (a model card's custom timesteps), not a step count.
CARD_TIMESTEPS = {"lcm-dmd2": [999, 749, 499, 249]}
SAMPLER_SHAPE = (1, 4, 2, 2)  # latents of a 1-image batch; every update is elementwise
SAMPLER_MAX_STEPS = max(case[3] for case in SAMPLER_CASES)


def case_config(base: dict, changes) -> dict:
    """The model's raw scheduler config of one SAMPLER_CASES row."""
    if changes == "minimal":
        return {"_class_name": base["_class_name"]}
    config = {k: v for k, v in base.items() if changes.get(k) != DROP}
    config.update({k: v for k, v in changes.items() if v != DROP})
    return config


def init_defaults(cls) -> dict:
    """{argument: default} of ``cls.__init__`` (diffusers' from_config fills a missing field with these)."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}


def sampler_trajectory(sampler: str, config: dict, steps: int, model_outputs: np.ndarray, start: np.ndarray,
                       first: int = 0, timesteps: list[int] | None = None):
    """diffusers' scheduler for ``sampler`` from ``config``, run for ``steps`` steps on fixed arrays.

    The sample starts at ``start * init_noise_sigma``; step k's model output is ``model_outputs[k]``. ``first`` > 0:
    the run begins at step ``first`` (``set_begin_index``, as diffusers' img2img pipelines start).
    Returns (scheduler, samples (steps - first + 1, *SAMPLER_SHAPE), noise (steps - first, *SAMPLER_SHAPE) or None).
    Euler a's, the DPM++ SDEs' and LCM's noise of step k is torch.randn from a generator seeded 1000 + k, passed to
    step() the same way (LCM draws none on its last step: that row is recorded all the same, so an engine adding noise
    there is caught).
    """
    cls, overrides = SAMPLER_CLASSES[sampler]
    sched = cls.from_config(config, **overrides)
    if timesteps is None:
        sched.set_timesteps(steps)
    else:  # a model card's custom timesteps (CARD_TIMESTEPS)
        sched.set_timesteps(timesteps=timesteps)
    if first:
        sched.set_begin_index(first)
    sample = torch.from_numpy(start) * sched.init_noise_sigma
    samples, noises = [sample], []
    for k, t in enumerate(sched.timesteps):
        if k < first:
            continue
        sched.scale_model_input(sample, t)  # Euler's step index; the scaling itself is the UNet's input only
        output = torch.from_numpy(model_outputs[k])
        kwargs = {}
        if sampler in STEP_NOISE:
            kwargs["generator"] = torch.Generator().manual_seed(1000 + k)
            noises.append(torch.randn(SAMPLER_SHAPE, generator=torch.Generator().manual_seed(1000 + k),
                                      dtype=torch.float32))
        sample = sched.step(output, t, sample, **kwargs).prev_sample
        samples.append(sample)
    return sched, torch.stack(samples).numpy(), torch.stack(noises).numpy() if noises else None


# ``samplers``' image-level cases: tiny-pt's pipeline with DDIM from a config that lacks clip_sample (the class
# default True clips x0 every step); name -> (prompt, negative prompt, guidance, steps, the config's fields
# dropped, latents seed); 64x64, 2 images. ``ddim_euler_image``: a config as EulerDiscreteScheduler saves it
# (EULER_SAVED_DROPS), the empty negative prompt as None (diffusers' force_zeros_for_empty_prompt).
DDIM_IMAGE_CASES = {"ddim_image": ("a red circle", "a blue square", 5.0, 6, ("clip_sample",), 23),
                    "ddim_euler_image": ("a red circle", None, 4.0, 10, EULER_SAVED_DROPS, 31)}


def ddim_image_case(out: Path, name: str = "ddim_image") -> tuple[dict, dict]:
    """diffusers' images for DDIM_IMAGE_CASES[name] on out/tiny-pt: ({key: array}, metadata)."""
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    prompt, negative, guidance, steps, drops, seed = DDIM_IMAGE_CASES[name]
    config = {k: v for k, v in plain_config(pipe.scheduler.config).items() if k not in drops}
    pipe.scheduler = DDIMScheduler.from_config(config)
    latents = np.random.RandomState(seed).standard_normal((2, 4, 16, 16)).astype(np.float32)
    images = pipe(prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps, width=64,
                  height=64, num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
    arrays = {f"{name}_latents": latents, f"{name}_images": np.round(images * 255).astype(np.uint8)}
    meta = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                width=64, height=64, scheduler_config=config, clip_sample=pipe.scheduler.config.clip_sample,
                latents=f"numpy RandomState({seed}).standard_normal((2, 4, 16, 16))", images="uint8, round(np * 255)")
    if name != "ddim_image":  # the first case's metadata keeps the fields it was made with
        meta.update(set_alpha_to_one=pipe.scheduler.config.set_alpha_to_one,
                    timesteps=[int(t) for t in pipe.scheduler.timesteps])
    return arrays, meta


# ``samplers``' multistep image cases: tiny-pt's pipeline with a multistep sampler's class from tiny-pt's config (the
# engine's program carries the x0s of earlier steps); name -> (sampler, prompt, negative prompt, guidance, steps,
# latents seed); 64x64, 2 images. Deterministic samplers only (no step noise to hand over).
MULTISTEP_IMAGE_CASES = {"unipc_image": ("UniPC", "a red circle", "a blue square", 5.0, 8, 37),
                         "lms_image": ("LMS", "a red circle", "a blue square", 5.0, 8, 41)}


def multistep_image_case(out: Path, name: str) -> tuple[dict, dict]:
    """diffusers' images for MULTISTEP_IMAGE_CASES[name] on out/tiny-pt: ({key: array}, metadata)."""
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    sampler, prompt, negative, guidance, steps, seed = MULTISTEP_IMAGE_CASES[name]
    cls, overrides = SAMPLER_CLASSES[sampler]
    config = plain_config(pipe.scheduler.config)
    pipe.scheduler = cls.from_config(config, **overrides)
    latents = np.random.RandomState(seed).standard_normal((2, 4, 16, 16)).astype(np.float32)
    images = pipe(prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps, width=64,
                  height=64, num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
    arrays = {f"{name}_latents": latents, f"{name}_images": np.round(images * 255).astype(np.uint8)}
    meta = dict(sampler=sampler, prompt=prompt, negative_prompt=negative, guidance_scale=guidance,
                num_inference_steps=steps, width=64, height=64, scheduler_config=config,
                timesteps=[int(t) for t in pipe.scheduler.timesteps],
                latents=f"numpy RandomState({seed}).standard_normal((2, 4, 16, 16))", images="uint8, round(np * 255)")
    return arrays, meta


# ``samplers``' LCM image cases: tiny-pt's pipeline with LCMScheduler.from_config of its config, 64x64, 2 images
# on given latents, the step noise tools/lcm_noise.py's (the engine's rule). Prompt, negative prompt, guidance, steps.
LCM_IMAGE_CASES = {"lcm_image": ("a red circle", "", 1.0, 4),
                   "lcm_image_cfg": ("a red circle", "a blue square", 5.0, 4)}


def lcm_image_cases(out: Path) -> tuple[dict, dict]:
    """diffusers' images for LCM_IMAGE_CASES on out/tiny-pt with the engine's step noise: ({key: array}, metadata)."""
    with np.load(out / "lcm-noise.npz") as data:
        seeds, noise = data["seeds"], data["noise"]
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    config = plain_config(pipe.scheduler.config)
    pipe.scheduler = LCMScheduler.from_config(config)
    latents = np.random.RandomState(29).standard_normal((2, 4, 16, 16)).astype(np.float32)
    arrays, meta = {"lcm_image_latents": latents}, {}
    for key, (prompt, negative, guidance, steps) in LCM_IMAGE_CASES.items():
        assert len(noise) == steps - 1
        with EngineNoise(noise) as patched:
            images = pipe(prompt, negative_prompt=negative or None, guidance_scale=guidance,
                          num_inference_steps=steps, width=64, height=64, num_images_per_prompt=2, output_type="np",
                          latents=torch.from_numpy(latents)).images
        assert patched.calls == steps - 1, patched.calls
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                         cfg_applied=guidance > 1, timesteps=[int(t) for t in pipe.scheduler.timesteps])
    meta.update(width=64, height=64, scheduler_config=config, lcm_config=plain_config(pipe.scheduler.config),
                seeds=[int(s) for s in seeds], latents="numpy RandomState(29).standard_normal((2, 4, 16, 16))",
                noise="tests/fixtures/lcm-noise.npz (python -m tools.lcm_noise): randn_tensor of step k returns "
                      "its noise[k]; called steps - 1 times", images="uint8, round(np * 255)")
    return arrays, meta


def sampler_case(row: tuple, base: dict, model_outputs: np.ndarray, start: np.ndarray) -> tuple[dict, dict]:
    """One SAMPLER_CASES row: ({key: array}, its entry of the JSON's cases)."""
    name, sampler, changes, steps, *first = row
    config = case_config(base, changes)
    card = CARD_TIMESTEPS.get(name)
    sched, samples, noise = sampler_trajectory(sampler, config, steps, model_outputs, start, *first, timesteps=card)
    if card is not None:  # the model card's call, on SDXL base's own config, steps the same to the bit
        _, card_samples, card_noise = sampler_trajectory(sampler, base, steps, model_outputs, start, timesteps=card)
        assert np.array_equal(card_samples, samples) and np.array_equal(card_noise, noise), name
    arrays = {f"{name}_samples": samples}
    if noise is not None:
        arrays[f"{name}_noise"] = noise
    fields = init_defaults(SAMPLER_CLASSES[sampler][0])
    case = dict(name=name, sampler=sampler, steps=steps, changes=changes,
                resolved={k: v for k, v in sched.config.items() if k in fields},
                timesteps=[float(t) for t in sched.timesteps.numpy().astype(np.float32)],
                sigmas=[float(s) for s in sched.sigmas.numpy()] if hasattr(sched, "sigmas") else None,
                init_noise_sigma=float(sched.init_noise_sigma))
    if first:
        case["first_step"] = first[0]
    if card is not None:
        case["card_timesteps"] = card
    if sampler == "LCM":  # c_skip, c_out per step, and the alphā the noise brings the sample to
        scalings = [sched.get_scalings_for_boundary_condition_discrete(t) for t in sched.timesteps]
        case["c_skip"] = [float(c) for c, _ in scalings]
        case["c_out"] = [float(c) for _, c in scalings]
    return arrays, case


def _write_samplers(out: Path, arrays: dict, meta: dict) -> None:
    write_npz(out / "sampler-steps.npz", arrays)
    text = json.dumps(meta, indent=1, default=str)
    text = re.sub(r"\[[-+.,\seE\d]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # numbers: one line
    (out / "sampler-steps.json").write_text(text + "\n")


def cmd_samplers_add(out: Path, names: list[str]) -> None:
    """``samplers --add NAME ...``: compute only the named SAMPLER_CASES rows and image cases and merge
    them into out/sampler-steps.{json,npz}, every other entry kept as it is (to the byte: another CPU or
    torch build moves the last bits of the others, so a full run would rewrite them all)."""
    torch.set_num_threads(1)
    with np.load(out / "sampler-steps.npz") as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads((out / "sampler-steps.json").read_text())
    base = meta["base_config"]
    rows = {row[0]: row for row in SAMPLER_CASES}
    unknown = [n for n in names if n not in rows and n not in DDIM_IMAGE_CASES and n not in MULTISTEP_IMAGE_CASES]
    if unknown:
        raise SystemExit(f"unknown case {unknown}; SAMPLER_CASES, DDIM_IMAGE_CASES or MULTISTEP_IMAGE_CASES names")
    order = [row[0] for row in SAMPLER_CASES]
    cases = {case["name"]: case for case in meta["cases"]}
    for name in names:
        if name in rows:
            new_arrays, cases[name] = sampler_case(rows[name], base, arrays["model_outputs"], arrays["start"])
        elif name in MULTISTEP_IMAGE_CASES:
            new_arrays, meta[f"{name}_case"] = multistep_image_case(out, name)
        else:
            new_arrays, meta[f"{name}_case"] = ddim_image_case(out, name)
        arrays.update(new_arrays)
    meta["cases"] = sorted(cases.values(), key=lambda case: order.index(case["name"]))
    for cls, _ in SAMPLER_CLASSES.values():  # a class new to the file: its defaults (the others' kept as they are)
        meta["class_defaults"].setdefault(cls.__name__, init_defaults(cls))
    meta["notes"] = SAMPLER_NOTES
    _write_samplers(out, arrays, meta)


SAMPLER_NOTES = [
    "Each case's model config: base_config with its changes (a field set to `missing` removed; "
    "'minimal': only _class_name); resolved: the class's own fields of the scheduler's config.",
    "Each case: cls.from_config(config, **overrides of the sampler's name), set_timesteps(steps); the "
    "sample starts at start * init_noise_sigma, step k gets model_outputs[k]; <case>_samples[k + 1] is "
    "step k's prev_sample (float32, the scheduler's own space: sigma space for Euler and LMS, x-space for DPM++, "
    "UniPC, DDIM and LCM). <case>_noise[k]: Euler a's, the DPM++ SDEs' and LCM's step noise (torch.randn, generator "
    "seeded 1000 + k; LCM's last row is not used by diffusers, which adds no noise after the last step). LCM cases "
    "also record c_skip and c_out (get_scalings_for_boundary_condition_discrete) per step.",
    "Suggested tolerance: float32, |engine - diffusers| <= 1e-5 * (1 + |diffusers|) per step.",
    "ddim_image_case: tiny-pt's StableDiffusionXLPipeline (float32) with DDIMScheduler.from_config of its "
    "config less clip_sample, on ddim_image_latents; ddim_image_images (2, 64, 64, 3) uint8.",
    "ddim_euler_image_case: the same with its config less the fields a config saved by EulerDiscreteScheduler "
    "lacks (clip_sample, set_alpha_to_one, sample_max_value, skip_prk_steps: DDIM's defaults True, True), 10 "
    "steps, guidance 4, no negative prompt (force_zeros_for_empty_prompt), on ddim_euler_image_latents.",
    "unipc_image_case: tiny-pt's pipeline (float32) with UniPCMultistepScheduler.from_config of its config (the "
    "engine's UniPC overrides), on unipc_image_latents; unipc_image_images (2, 64, 64, 3) uint8.",
    "lms_image_case: the same with LMSDiscreteScheduler.from_config (step order 4, the pipeline's default), on "
    "lms_image_latents; lms_image_images (2, 64, 64, 3) uint8.",
    "lcm_image_cases: tiny-pt's pipeline (float32) with LCMScheduler.from_config of its config on "
    "lcm_image_latents, the step noise lcm-noise.npz's (the engine's seed rule for its seeds); "
    "<case>_images (2, 64, 64, 3) uint8.",
]


def cmd_samplers(out: Path) -> None:
    """``samplers``: out/sampler-steps.json and out/sampler-steps.npz (see the module docstring)."""
    torch.set_num_threads(1)
    base = sdxl_base_configs()["scheduler"]
    rng = np.random.RandomState(19)
    model_outputs = rng.standard_normal((SAMPLER_MAX_STEPS, *SAMPLER_SHAPE)).astype(np.float32)
    start = rng.standard_normal(SAMPLER_SHAPE).astype(np.float32)
    arrays = {"model_outputs": model_outputs, "start": start}
    cases = []
    for row in SAMPLER_CASES:
        case_arrays, case = sampler_case(row, base, model_outputs, start)
        arrays.update(case_arrays)
        cases.append(case)
    image_arrays, image_meta = ddim_image_case(out)
    arrays.update(image_arrays)
    euler_arrays, euler_meta = ddim_image_case(out, "ddim_euler_image")
    arrays.update(euler_arrays)
    lcm_arrays, lcm_meta = lcm_image_cases(out)
    arrays.update(lcm_arrays)
    multistep = {}
    for name in MULTISTEP_IMAGE_CASES:
        case_arrays, multistep[f"{name}_case"] = multistep_image_case(out, name)
        arrays.update(case_arrays)
    meta = dict(**multistep,
        made_by="python -m tools.lcm_noise (runtime venv), then python -m tools.make_fixtures samplers",
        ddim_image_case=image_meta, ddim_euler_image_case=euler_meta, lcm_image_cases=lcm_meta,
        versions=versions(), torch_threads=1,
        base_config=base, missing=DROP, shape=list(SAMPLER_SHAPE), cases=cases,
        class_defaults={cls.__name__: init_defaults(cls) for cls, _ in SAMPLER_CLASSES.values()},
        notes=SAMPLER_NOTES,
    )
    _write_samplers(out, arrays, meta)
