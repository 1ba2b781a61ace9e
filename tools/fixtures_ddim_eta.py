"""``python -m tools.make_fixtures ddim-eta``: tests/fixtures/ddim-eta-steps.json and .npz.

diffusers' DDIMScheduler with ``step(eta=...)`` (DDIM's stochastic form, Song et al. 2021 eq. 12; A1111's ``eta``,
the engine's GenerateRequest.eta) over a few scheduler configs, step counts and etas (:data:`CASES`): a whole
``scheduler.step`` trajectory on fixed arrays (model outputs and start latents from RandomState 41), the step noise
given as ``variance_noise`` (``noise``: row k the noise of step k), so the stochastic part is compared exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from diffusers import DDIMScheduler

from tools.fixtures_common import sdxl_base_configs, versions, write_npz
from tools.fixtures_samplers import case_config, init_defaults

# (case name, changes to SDXL base's scheduler_config.json, steps, eta)
CASES = [
    ("ddim-eta-1", {}, 6, 1.0),
    ("ddim-eta-0.5", {}, 6, 0.5),
    ("ddim-eta-0", {}, 6, 0.0),
    ("ddim-eta-linspace", {"timestep_spacing": "linspace"}, 7, 0.7),  # carry != 1
    ("ddim-eta-trailing", {"timestep_spacing": "trailing"}, 5, 1.0),
    ("ddim-eta-clip", {"clip_sample": True, "clip_sample_range": 0.8}, 6, 1.0),  # clipped x0, unclipped eps
    ("ddim-eta-v", {"prediction_type": "v_prediction"}, 5, 0.3),
    ("ddim-eta-alpha-to-one", {"set_alpha_to_one": True}, 4, 1.0),  # the last step to alpha 1: no noise
    ("ddim-eta-1-step", {}, 1, 1.0),
]
SHAPE = (1, 4, 2, 2)
MAX_STEPS = max(case[2] for case in CASES)


def trajectory(config: dict, steps: int, eta: float, outputs: np.ndarray, start: np.ndarray, noise: np.ndarray):
    """DDIMScheduler.from_config(config), set_timesteps(steps), from start * init_noise_sigma; step k gets
    outputs[k] and variance_noise noise[k]. Returns (scheduler, samples (steps + 1, *SHAPE))."""
    sched = DDIMScheduler.from_config(config)
    sched.set_timesteps(steps)
    sample = torch.from_numpy(start) * sched.init_noise_sigma
    samples = [sample]
    for k, t in enumerate(sched.timesteps):
        sample = sched.step(torch.from_numpy(outputs[k]), t, sample, eta=eta,
                            variance_noise=torch.from_numpy(noise[k])).prev_sample
        samples.append(sample)
    return sched, torch.stack(samples).numpy()


NOTES = [
    "Each case's model config: base_config with its changes; resolved: DDIMScheduler's own fields of its config.",
    "Each case: DDIMScheduler.from_config(config), set_timesteps(steps); the sample starts at start * "
    "init_noise_sigma (1); step k: step(model_outputs[k], t, sample, eta=eta, variance_noise=noise[k]); "
    "<case>_samples[k + 1] is step k's prev_sample (diffusers' x-space, float32).",
    "Suggested tolerance: float32, |engine - diffusers| <= 1e-5 * (1 + |diffusers|) per step.",
]


def cmd_ddim_eta(out: Path) -> None:
    """``ddim-eta``: out/ddim-eta-steps.json and out/ddim-eta-steps.npz (see the module docstring)."""
    torch.set_num_threads(1)
    base = sdxl_base_configs()["scheduler"]
    rng = np.random.RandomState(41)
    outputs = rng.standard_normal((MAX_STEPS, *SHAPE)).astype(np.float32)
    start = rng.standard_normal(SHAPE).astype(np.float32)
    noise = rng.standard_normal((MAX_STEPS, *SHAPE)).astype(np.float32)
    arrays = {"model_outputs": outputs, "start": start, "noise": noise}
    fields, cases = init_defaults(DDIMScheduler), []
    for name, changes, steps, eta in CASES:
        sched, samples = trajectory(case_config(base, changes), steps, eta, outputs, start, noise)
        arrays[f"{name}_samples"] = samples
        cases.append(dict(name=name, changes=changes, steps=steps, eta=eta,
                          resolved={k: v for k, v in sched.config.items() if k in fields},
                          timesteps=[int(t) for t in sched.timesteps]))
    meta = dict(made_by="python -m tools.make_fixtures ddim-eta", versions=versions(), torch_threads=1,
                base_config=base, shape=list(SHAPE), cases=cases, notes=NOTES)
    write_npz(out / "ddim-eta-steps.npz", arrays)
    text = json.dumps(meta, indent=1, default=str)
    text = re.sub(r"\[[-+.,\seE\d]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # numbers: one line
    (out / "ddim-eta-steps.json").write_text(text + "\n")
