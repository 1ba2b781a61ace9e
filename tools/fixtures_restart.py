"""``python -m tools.make_fixtures restart``: tests/fixtures/restart-steps.json and .npz.

A1111's "Restart" sampler (AUTOMATIC1111/stable-diffusion-webui ``modules/sd_samplers_extra.py`` ``restart_sampler``,
registered in ``modules/sd_samplers_kdiffusion.py`` as ``('Restart', sd_samplers_extra.restart_sampler, ['restart'],
{'scheduler': 'karras', "second_order": True})``; Xu et al. 2023, "Restart Sampling for Improving Generative
Processes"). A1111 is no package, so :func:`restart_sampler` is its loop re-implemented here in torch line by line
(``restart_list`` None, s_noise 1), with k-diffusion's helpers it calls (``get_sigmas_karras``, ``to_d``,
``append_zero``) and k-diffusion's ``DiscreteEpsDDPMDenoiser`` / ``DiscreteVDDPMDenoiser`` (``sigma_to_t``,
``t_to_sigma``, the scalings) as A1111's ``CompVisDenoiser`` / ``CompVisVDenoiser`` wrap the model (``quantize``
False: A1111's ``enable_quantization`` default). Its ``torch.randn_like`` (A1111 swaps in its own ``TorchHijack``) is
replaced by a noise source that hands out fixed arrays and records the step each draw comes before.

Step cases (:data:`CASES`): the fake deterministic model of two-call-steps (``tanh(0.7 x_in) (0.5 + t / 1000) + 0.1
bias`` as the eps or v output), SDXL base's scheduler config with changes, A1111's sigmas of the schedule type for the
step count (``KDiffusionSampler.get_sigmas``: Karras for Restart's Automatic, over the model's sigma_min/max), from
``start * sigmas[0]``; ``<case>_samples`` (steps + 1, *SHAPE): x before the first step and at the start of each next
one (after its jump's noise, where it has one), the last the result. The noise before step j is ``noise[j - 1]``
(the engine adds it as step j - 1's noise). Image cases (:data:`IMAGE_CASES`): tiny-pt's UNet, text encoders and VAE
(diffusers' ``StableDiffusionXLPipeline.encode_prompt``, its added time ids, CFG on eps as the pipeline does), the
loop from ``latents * sigmas[0]``, the jumps' noise restart-noise.npz's (``python -m tools.restart_noise`` first: the
engine's step noise of seeds 11, 12 at the steps it adds it), decoded as the pipeline does.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionXLPipeline

from tools.fixtures_common import plain_config, sdxl_base_configs, versions, write_npz
from tools.fixtures_samplers import case_config

SHAPE = (1, 4, 3, 2)  # latents of a 1-image batch, not square (two-call-steps')
# (case name, steps, A1111 schedule type, changes to SDXL base's scheduler config). Under 20 steps Restart is Heun on
# the sigmas; 20..35 one stretch of 9 restart steps; from 36 two of steps // 4.
CASES = [
    ("restart-8", 8, "karras", {}),
    ("restart-19", 19, "karras", {}),
    ("restart-20", 20, "karras", {}),
    ("restart-21", 21, "karras", {}),
    ("restart-27", 27, "karras", {}),
    ("restart-35", 35, "karras", {}),
    ("restart-36", 36, "karras", {}),
    ("restart-50", 50, "karras", {}),
    ("restart-24-exponential", 24, "exponential", {}),
    ("restart-24-uniform", 24, "uniform", {}),
    ("restart-24-sgm-uniform", 24, "sgm_uniform", {}),
    ("restart-24-simple", 24, "simple", {}),
    ("restart-22-v", 22, "karras", {"prediction_type": "v_prediction"}),
    ("restart-20-cosine", 20, "karras", {"beta_schedule": "squaredcos_cap_v2"}),
]
# name -> (prompt, negative prompt, guidance, steps, height, width, latents seed): tiny-pt, 2 images
IMAGE_CASES = {"restart_image": ("a red circle", "a blue square", 5.0, 20, 64, 64, 53),
               "restart36_image": ("a red circle", "a blue square", 5.0, 36, 64, 96, 59)}


# ---- k-diffusion (k_diffusion/sampling.py, external.py) ------------------------------------------------------------
def append_zero(x):
    return torch.cat([x, x.new_zeros([1])])


def get_sigmas_karras(n, sigma_min, sigma_max, rho=7.0, device="cpu"):
    ramp = torch.linspace(0, 1, n)
    min_inv_rho = sigma_min ** (1 / rho)
    max_inv_rho = sigma_max ** (1 / rho)
    sigmas = (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho
    return append_zero(sigmas).to(device)


def get_sigmas_exponential(n, sigma_min, sigma_max, device="cpu"):
    sigmas = torch.linspace(math.log(sigma_max), math.log(sigma_min), n, device=device).exp()
    return append_zero(sigmas)


def to_d(x, sigma, denoised):
    return (x - denoised) / sigma


class Denoiser:
    """k-diffusion's DiscreteEpsDDPMDenoiser (``v`` False) or DiscreteVDDPMDenoiser on ``model(x_in, t) -> output``."""

    def __init__(self, model, alphas_cumprod: torch.Tensor, v: bool = False):
        self.sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
        self.log_sigmas = self.sigmas.log()
        self.model, self.v = model, v

    def sigma_to_t(self, sigma):
        log_sigma = sigma.log()
        dists = log_sigma - self.log_sigmas[:, None]
        low_idx = dists.ge(0).cumsum(dim=0).argmax(dim=0).clamp(max=self.log_sigmas.shape[0] - 2)
        high_idx = low_idx + 1
        low, high = self.log_sigmas[low_idx], self.log_sigmas[high_idx]
        w = (low - log_sigma) / (low - high)
        w = w.clamp(0, 1)
        t = (1 - w) * low_idx + w * high_idx
        return t.view(sigma.shape)

    def t_to_sigma(self, t):
        t = t.float()
        low_idx, high_idx, w = t.floor().long(), t.ceil().long(), t.frac()
        log_sigma = (1 - w) * self.log_sigmas[low_idx] + w * self.log_sigmas[high_idx]
        return log_sigma.exp()

    def __call__(self, x, sigma):
        sigma = sigma.reshape(-1)[:1].expand(x.shape[0])
        s = sigma[:, None, None, None]
        if self.v:
            c_skip, c_out, c_in = 1 / (s**2 + 1), -s / (s**2 + 1) ** 0.5, 1 / (s**2 + 1) ** 0.5
            return self.model(x * c_in, self.sigma_to_t(sigma)) * c_out + x * c_skip
        return x + self.model(x * (1 / (s**2 + 1) ** 0.5), self.sigma_to_t(sigma)) * -s


def a1111_sigmas(denoiser: Denoiser, schedule_type: str, steps: int) -> torch.Tensor:
    """KDiffusionSampler.get_sigmas with A1111's schedulers (modules/sd_schedulers.py) over the model's sigma_min and
    sigma_max (``use_old_karras_scheduler_sigmas`` False): karras, exponential, uniform, sgm_uniform, simple."""
    sigma_min, sigma_max = denoiser.sigmas[0].item(), denoiser.sigmas[-1].item()
    if schedule_type == "karras":
        return get_sigmas_karras(steps, sigma_min, sigma_max)
    if schedule_type == "exponential":
        return get_sigmas_exponential(steps, sigma_min, sigma_max)
    if schedule_type == "uniform":  # DiscreteSchedule.get_sigmas(n)
        return append_zero(denoiser.t_to_sigma(torch.linspace(len(denoiser.sigmas) - 1, 0, steps)))
    if schedule_type == "sgm_uniform":
        start = denoiser.sigma_to_t(torch.tensor(sigma_max))
        end = denoiser.sigma_to_t(torch.tensor(sigma_min))
        sigs = [denoiser.t_to_sigma(ts) for ts in torch.linspace(start, end, steps + 1)[:-1]]
        sigs += [0.0]
        return torch.FloatTensor(sigs)
    if schedule_type == "simple":
        sigs = []
        ss = len(denoiser.sigmas) / steps
        for x in range(steps):
            sigs += [float(denoiser.sigmas[-(1 + int(x * ss))])]
        sigs += [0.0]
        return torch.FloatTensor(sigs)
    raise ValueError(schedule_type)


# ---- A1111's modules/sd_samplers_extra.py restart_sampler ------------------------------------------------------------
class Draws:
    """A1111's ``torch.randn_like`` in the loop: draw k returns the array for the step it comes before (``noise(j)``)
    and records (j, the jump's scale)."""

    def __init__(self, noise):
        self.noise, self.calls, self.step = noise, [], 0

    def __call__(self, x, scale):
        self.calls.append((self.step, float(scale)))
        return self.noise(self.step)


@torch.no_grad()
def restart_sampler(model, x, sigmas, draws: Draws, s_noise=1.0, restart_list=None, record=None):
    """A1111's restart_sampler, its lines in order (``extra_args``, ``callback``, ``disable`` dropped; ``draws`` in
    place of ``torch.randn_like``; ``record(x)`` at the start of each step after its noise, and at the end)."""
    s_in = x.new_ones([x.shape[0]])
    step_id = 0

    def heun_step(x, old_sigma, new_sigma, second_order=True):
        nonlocal step_id
        denoised = model(x, old_sigma * s_in)
        d = to_d(x, old_sigma, denoised)
        dt = new_sigma - old_sigma
        if new_sigma == 0 or not second_order:
            # Euler method
            x = x + d * dt
        else:
            # Heun's method
            x_2 = x + d * dt
            denoised_2 = model(x_2, new_sigma * s_in)
            d_2 = to_d(x_2, new_sigma, denoised_2)
            d_prime = (d + d_2) / 2
            x = x + d_prime * dt
        step_id += 1
        return x

    steps = sigmas.shape[0] - 1
    if restart_list is None:
        if steps >= 20:
            restart_steps = 9
            restart_times = 1
            if steps >= 36:
                restart_steps = steps // 4
                restart_times = 2
            sigmas = get_sigmas_karras(steps - restart_steps * restart_times, sigmas[-2].item(), sigmas[0].item(),
                                       device=sigmas.device)
            restart_list = {0.1: [restart_steps + 1, restart_times, 2]}
        else:
            restart_list = {}

    restart_list = {int(torch.argmin(abs(sigmas - key), dim=0)): value for key, value in restart_list.items()}

    step_list = []
    for i in range(len(sigmas) - 1):
        step_list.append((sigmas[i], sigmas[i + 1]))
        if i + 1 in restart_list:
            restart_steps, restart_times, restart_max = restart_list[i + 1]
            min_idx = i + 1
            max_idx = int(torch.argmin(abs(sigmas - restart_max), dim=0))
            if max_idx < min_idx:
                sigma_restart = get_sigmas_karras(restart_steps, sigmas[min_idx].item(), sigmas[max_idx].item(),
                                                  device=sigmas.device)[:-1]
                while restart_times > 0:
                    restart_times -= 1
                    step_list.extend(zip(sigma_restart[:-1], sigma_restart[1:]))

    last_sigma = None
    for old_sigma, new_sigma in step_list:
        if last_sigma is None:
            last_sigma = old_sigma
        elif last_sigma < old_sigma:
            x = x + draws(x, (old_sigma**2 - last_sigma**2) ** 0.5) * s_noise * (old_sigma**2 - last_sigma**2) ** 0.5
        if record is not None:
            record(x)
        draws.step += 1
        x = heun_step(x, old_sigma, new_sigma)
        last_sigma = new_sigma
    if record is not None:
        record(x)
    return x, step_list


# ---- the cases -------------------------------------------------------------------------------------------------------
def alphas_cumprod(config: dict) -> torch.Tensor:
    """The config's alphas_cumprod as diffusers' schedulers make it (float32)."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler.from_config(config).alphas_cumprod.to(torch.float32)


def fake_model(bias: torch.Tensor):
    def model(x, t):
        return torch.tanh(0.7 * x) * (0.5 + t.to(torch.float32)[:, None, None, None] / 1000) + 0.1 * bias

    return model


def step_case(row, base: dict, start: np.ndarray, bias: np.ndarray, noise: np.ndarray) -> tuple[dict, dict]:
    name, steps, schedule_type, changes = row
    config = case_config(base, changes)
    denoiser = Denoiser(fake_model(torch.from_numpy(bias)), alphas_cumprod(config),
                        v=config.get("prediction_type") == "v_prediction")
    sigmas = a1111_sigmas(denoiser, schedule_type, steps)
    draws = Draws(lambda j: torch.from_numpy(noise[j - 1]))
    samples = []
    x = torch.from_numpy(start) * sigmas[0]
    _, step_list = restart_sampler(denoiser, x, sigmas, draws, record=lambda x: samples.append(x.clone()))
    case = dict(name=name, steps=steps, schedule_type=schedule_type, changes=changes,
                sigmas=[float(s) for s in sigmas], step_list=[[float(a), float(b)] for a, b in step_list],
                noise_draws=draws.calls)
    return {f"{name}_samples": torch.stack(samples).numpy()}, case


def image_case(out: Path, name: str) -> tuple[dict, dict]:
    """A1111's Restart on tiny-pt (its diffusers parts): ({key: array}, metadata)."""
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    prompt, negative, guidance, steps, height, width, seed = IMAGE_CASES[name]
    config = plain_config(pipe.scheduler.config)
    with np.load(out / "restart-noise.npz") as data:
        jumps, noise, seeds = data[f"{name}_steps"].tolist(), data[f"{name}_noise"], data["seeds"].tolist()
    embeds, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
        prompt, device="cpu", num_images_per_prompt=2, do_classifier_free_guidance=True, negative_prompt=negative)
    time_ids = pipe._get_add_time_ids((height, width), (0, 0), (height, width), dtype=embeds.dtype,
                                      text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
    hidden = torch.cat([negative_embeds, embeds])
    added = {"text_embeds": torch.cat([negative_pooled, pooled]), "time_ids": time_ids.repeat(4, 1)}

    def unet(x, t):  # CFG on the eps as diffusers' pipeline combines it
        out = pipe.unet(torch.cat([x, x]), torch.cat([t, t]), encoder_hidden_states=hidden,
                        added_cond_kwargs=added).sample
        uncond, cond = out.chunk(2)
        return uncond + guidance * (cond - uncond)

    denoiser = Denoiser(unet, alphas_cumprod(config), v=config["prediction_type"] == "v_prediction")
    sigmas = a1111_sigmas(denoiser, "karras", steps)  # Restart's Automatic
    draws = Draws(lambda j: torch.from_numpy(noise[jumps.index(j - 1)]))
    f = pipe.vae_scale_factor
    latents = np.random.RandomState(seed).standard_normal((2, 4, height // f, width // f)).astype(np.float32)
    with torch.no_grad():
        x, step_list = restart_sampler(denoiser, torch.from_numpy(latents) * sigmas[0], sigmas, draws)
        decoded = pipe.vae.decode(x / pipe.vae.config.scaling_factor).sample
    images = (decoded / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert [j - 1 for j, _ in draws.calls] == jumps, (draws.calls, jumps)
    arrays = {f"{name}_latents": latents, f"{name}_images": np.round(images * 255).astype(np.uint8)}
    meta = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                width=width, height=height, scheduler_config=config, seeds=seeds,
                sigmas=[float(s) for s in sigmas], step_list=[[float(a), float(b)] for a, b in step_list],
                noise_draws=draws.calls, latents=f"numpy RandomState({seed}).standard_normal((2, 4, {height // f}, "
                                                 f"{width // f}))", images="uint8, round(np * 255)")
    return arrays, meta


NOTES = [
    "restart_sampler: A1111's modules/sd_samplers_extra.py loop re-implemented in torch (restart_list None, s_noise "
    "1); the model k-diffusion's DiscreteEpsDDPMDenoiser / DiscreteVDDPMDenoiser (fractional sigma_to_t).",
    "Step cases: SDXL base's scheduler config with the case's changes; A1111's sigmas of schedule_type for steps "
    "(sigmas, before restart_sampler's own Karras main list); step_list: the (sigma, sigma') of each Heun step; "
    "<case>_samples (steps + 1, 1, 4, 3, 2) float32: x before the first step, at the start of each next one after "
    "its jump's noise, the result last; the model output tanh(0.7 x_in) (0.5 + t / 1000) + 0.1 bias (eps, or v for "
    "v_prediction); noise_draws: (step j the draw comes before, its scale), the draw noise[j - 1].",
    "Image cases: tiny-pt's text encoders (encode_prompt), UNet (CFG on eps, guidance 5) and VAE, A1111's Karras "
    "sigmas over the model's sigma range, latents * sigmas[0]; the draw before step j restart-noise.npz's noise of "
    "step j - 1 (the engine's step noise of seeds 11, 12); images round(clamp(decoded / 2 + 0.5) * 255) uint8.",
]


def cmd_restart(out: Path) -> None:
    """``restart``: out/restart-steps.json and .npz (see the module docstring)."""
    torch.set_num_threads(1)
    base = sdxl_base_configs()["scheduler"]
    rng = np.random.RandomState(29)
    start = rng.standard_normal(SHAPE).astype(np.float32)
    bias = rng.standard_normal(SHAPE).astype(np.float32)
    noise = rng.standard_normal((max(row[1] for row in CASES), *SHAPE)).astype(np.float32)
    arrays, cases = {"start": start, "bias": bias, "noise": noise}, []
    for row in CASES:
        case_arrays, case = step_case(row, base, start, bias, noise)
        arrays.update(case_arrays)
        cases.append(case)
    meta = dict(made_by="python -m tools.make_fixtures restart", versions=versions(), torch_threads=1,
                base_config=base, shape=list(SHAPE), cases=cases, notes=NOTES)
    for name in IMAGE_CASES:
        case_arrays, meta[f"{name}_case"] = image_case(out, name)
        arrays.update(case_arrays)
    write_npz(out / "restart-steps.npz", arrays)
    text = json.dumps(meta, indent=1, default=str)
    text = re.sub(r"\[[-+.,\seE\d]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # numbers: one line
    (out / "restart-steps.json").write_text(text + "\n")
