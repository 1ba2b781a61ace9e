"""``python -m tools.make_fixtures tcd``: tests/fixtures/tcd-steps.json and .npz.

diffusers' TCDScheduler (Trajectory Consistency Distillation; the engine's "TCD" sampler) over a matrix of scheduler
configs, step counts and gammas (its step's ``eta``) (:data:`CASES`): its timesteps, and a whole sampling loop with
the fake deterministic model of tools/fixtures_two_calls.py from fixed start latents, its step noise (``randn_tensor``)
replaced by fixed arrays handed out in call order (``noise``: row k the draw of call k), so the stochastic part is
compared exactly. Also set_timesteps with ``strength`` (:data:`STRENGTH_CASES`: TCD's own rule), the class's
``__init__`` defaults, and tiny-pt's pipeline images with TCD (:data:`IMAGE_CASES`) on given latents, the step noise
the engine's (tests/fixtures/lcm-noise.npz, ``python -m tools.lcm_noise``: the same seeds, steps and shape).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionXLPipeline, TCDScheduler

from tools.fixtures_common import EngineNoise, plain_config, sdxl_base_configs, versions, write_npz
from tools.fixtures_samplers import case_config, init_defaults
from tools.fixtures_two_calls import fake_model

# (case name, changes to SDXL base's scheduler_config.json ("minimal": only _class_name), steps, gamma, custom
# timesteps or None)
CASES = [
    ("tcd-4-gamma-0.3", {}, 4, 0.3, None),
    ("tcd-4-gamma-0", {}, 4, 0.0, None),
    ("tcd-4-gamma-1", {}, 4, 1.0, None),
    ("tcd-8-gamma-0.5", {}, 8, 0.5, None),
    ("tcd-6-gamma-0.7", {}, 6, 0.7, None),
    ("tcd-1-gamma-1", {}, 1, 1.0, None),  # Hyper-SDXL's unified LoRA at 1 step (its card: eta=1.0)
    ("tcd-1-gamma-0.3", {}, 1, 0.3, None),
    ("tcd-2-gamma-0.3", {}, 2, 0.3, None),
    ("tcd-16-gamma-0.3", {}, 16, 0.3, None),
    ("tcd-v", {"prediction_type": "v_prediction"}, 4, 0.3, None),
    ("tcd-sample", {"prediction_type": "sample"}, 4, 0.5, None),
    ("tcd-original-4", {"original_inference_steps": 4}, 4, 0.3, None),
    ("tcd-original-30", {"original_inference_steps": 30}, 6, 0.3, None),
    ("tcd-clip-sample", {"clip_sample": True, "clip_sample_range": 0.5}, 4, 0.3, None),  # unused by TCD's step
    ("tcd-trailing-in-config", {"timestep_spacing": "trailing"}, 4, 0.3, None),  # unused
    ("tcd-scaling-0.1", {"timestep_scaling": 0.1}, 4, 0.3, None),  # unused
    ("tcd-linear", {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02}, 4, 0.3, None),
    ("tcd-minimal", "minimal", 4, 0.3, None),
    ("tcd-custom-trailing-4", {}, 4, 0.3, [999, 749, 499, 249]),  # the engine's "trailing" schedule type
    ("tcd-custom-trailing-3", {}, 3, 0.6, [999, 666, 332]),
]
# set_timesteps(steps, strength=strength) (or timesteps=custom) on SDXL base's config: (name, steps, strength, custom)
STRENGTH_CASES = [("strength-4-0.5", 4, 0.5, None), ("strength-8-0.3", 8, 0.3, None),
                  ("strength-5-0.75", 5, 0.75, None), ("strength-custom-0.5", None, 0.5, [999, 749, 499, 249])]
SHAPE = (1, 4, 3, 2)  # latents of a 1-image batch, not square
# tiny-pt's pipeline with TCDScheduler.from_config of its config, 64x64, 2 images, latents RandomState(31), step noise
# lcm-noise.npz's: name -> (prompt, negative prompt, guidance, steps, eta)
IMAGE_CASES = {"tcd_image": ("a red circle", "a blue square", 5.0, 4, 0.3),
               "tcd_image_nocfg": ("a red circle", "", 1.0, 4, 0.3)}


def trajectory(config: dict, steps: int, gamma: float, custom, start: np.ndarray, bias: np.ndarray,
               noise: np.ndarray):
    """TCDScheduler from ``config``, ``steps`` steps (or ``custom`` timesteps) of the fake model at eta ``gamma``.

    Returns (scheduler, samples (steps + 1, *SHAPE): the sample before the first step and after each, noise calls)."""
    sched = TCDScheduler.from_config(config)
    if custom is None:
        sched.set_timesteps(steps)
    else:
        sched.set_timesteps(timesteps=custom)
    sample = torch.from_numpy(start) * sched.init_noise_sigma
    samples, b = [sample], torch.from_numpy(bias)
    with EngineNoise(noise, "scheduling_tcd") as patched:
        for t in sched.timesteps:
            output = fake_model(sched.scale_model_input(sample, t), t, b)
            sample = sched.step(output, t, sample, eta=gamma).prev_sample.to(torch.float32)
            samples.append(sample)
    return sched, torch.stack(samples).numpy(), patched.calls


def image_cases(out: Path) -> tuple[dict, dict]:
    """diffusers' images for IMAGE_CASES on out/tiny-pt with the engine's step noise: ({key: array}, metadata)."""
    with np.load(out / "lcm-noise.npz") as data:
        seeds, noise = data["seeds"], data["noise"]
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    config = plain_config(pipe.scheduler.config)
    pipe.scheduler = TCDScheduler.from_config(config)
    latents = np.random.RandomState(31).standard_normal((2, 4, 16, 16)).astype(np.float32)
    arrays, meta = {"tcd_image_latents": latents}, {}
    for key, (prompt, negative, guidance, steps, eta) in IMAGE_CASES.items():
        assert len(noise) == steps - 1
        with EngineNoise(noise, "scheduling_tcd") as patched:
            images = pipe(prompt, negative_prompt=negative or None, guidance_scale=guidance, eta=eta,
                          num_inference_steps=steps, width=64, height=64, num_images_per_prompt=2, output_type="np",
                          latents=torch.from_numpy(latents)).images
        assert patched.calls == steps - 1, patched.calls
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                         eta=eta, timesteps=[int(t) for t in pipe.scheduler.timesteps])
    meta.update(width=64, height=64, scheduler_config=config, seeds=[int(s) for s in seeds],
                latents="numpy RandomState(31).standard_normal((2, 4, 16, 16))",
                noise="tests/fixtures/lcm-noise.npz (python -m tools.lcm_noise): randn_tensor of step k returns "
                      "its noise[k]; called steps - 1 times (none on the last step)", images="uint8, round(np * 255)")
    return arrays, meta


NOTES = [
    "Each case's model config: base_config with its changes ('minimal': only _class_name); resolved: "
    "TCDScheduler's own fields of the scheduler's config.",
    "Each case: TCDScheduler.from_config(config), set_timesteps(steps) (or set_timesteps(timesteps=custom)); the "
    "sample starts at start * init_noise_sigma (1); step k: output = tanh(0.7 x) * (0.5 + t / 1000) + 0.1 bias with "
    "x = scale_model_input(sample, t) (= sample), then step(output, t, sample, eta=gamma); <case>_samples[k + 1] is "
    "step k's prev_sample (diffusers' x-space, float32). randn_tensor's call k returns noise[k] (noise_calls: how "
    "many times it was called).",
    "strength cases: set_timesteps(steps, strength=s) or set_timesteps(timesteps=custom, strength=s) on base_config.",
    "image cases: tiny-pt's StableDiffusionXLPipeline (float32) with TCDScheduler.from_config of its config, "
    "pipe(..., eta=eta) on tcd_image_latents; <case>_images (2, 64, 64, 3) uint8.",
    "Suggested tolerance: float32, |engine - diffusers| <= 1e-5 * (1 + |diffusers|) per step.",
]


def cmd_tcd(out: Path) -> None:
    """``tcd``: out/tcd-steps.json and .npz (see the module docstring)."""
    torch.set_num_threads(1)
    base = sdxl_base_configs()["scheduler"]
    rng = np.random.RandomState(37)
    start = rng.standard_normal(SHAPE).astype(np.float32)
    bias = rng.standard_normal(SHAPE).astype(np.float32)
    noise = rng.standard_normal((max(row[2] for row in CASES), *SHAPE)).astype(np.float32)
    arrays, cases, fields = {"start": start, "bias": bias, "noise": noise}, [], init_defaults(TCDScheduler)
    for name, changes, steps, gamma, custom in CASES:
        sched, samples, calls = trajectory(case_config(base, changes), steps, gamma, custom, start, bias, noise)
        arrays[f"{name}_samples"] = samples
        cases.append(dict(name=name, steps=steps, gamma=gamma, custom=custom, changes=changes, noise_calls=calls,
                          resolved={k: v for k, v in sched.config.items() if k in fields},
                          timesteps=[int(t) for t in sched.timesteps.numpy()]))
    strength = []
    for name, steps, s, custom in STRENGTH_CASES:
        sched = TCDScheduler.from_config(base)
        sched.set_timesteps(steps, strength=s) if custom is None else sched.set_timesteps(timesteps=custom, strength=s)
        strength.append(dict(name=name, steps=steps, strength=s, custom=custom,
                             timesteps=[int(t) for t in sched.timesteps.numpy()]))
    meta = dict(made_by="python -m tools.make_fixtures tcd", versions=versions(), torch_threads=1, base_config=base,
                shape=list(SHAPE), cases=cases, strength_cases=strength,
                class_defaults={"TCDScheduler": fields}, notes=NOTES)
    image_arrays, meta["image_cases"] = image_cases(out)
    arrays.update(image_arrays)
    write_npz(out / "tcd-steps.npz", arrays)
    text = json.dumps(meta, indent=1, default=str)
    text = re.sub(r"\[[-+.,\seE\d]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # numbers: one line
    (out / "tcd-steps.json").write_text(text + "\n")
