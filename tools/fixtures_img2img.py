"""``python -m tools.make_fixtures img2img``: tests/fixtures/tiny-pt-img2img/reference.{npz,json}.

tiny-pt's ``StableDiffusionXLImg2ImgPipeline`` images with Euler, DPM++ 2M Karras and DDIM at two strengths each
(:data:`IMG2IMG_CASES`), from two fixed pictures (:func:`img2img_pictures`, which the inpainting, hires and
refiner fixtures reuse), the image latents the VAE posterior's mean and the noise the engine's
(:class:`Img2ImgNoise`; ``python -m tools.img2img_noise``, the runtime's venv, first: it writes
tests/fixtures/tiny-pt-img2img/noise.npz).
"""

from __future__ import annotations

import json
from pathlib import Path

import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as sdxl_img2img
import numpy as np
import PIL.Image
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

from tools.fixtures_common import plain_config, versions, write_npz

# ``img2img``: tiny-pt's StableDiffusionXLImg2ImgPipeline, 64x64, 2 images (one picture each), 10 steps; case ->
# (A1111 sampler name, strength). The prompt, negative prompt and guidance are IMG2IMG_SETTINGS'.
IMG2IMG_CASES = {"euler_03": ("Euler", 0.3), "euler_075": ("Euler", 0.75),
                 "dpmk_03": ("DPM++ 2M Karras", 0.3), "dpmk_075": ("DPM++ 2M Karras", 0.75),
                 "ddim_03": ("DDIM", 0.3), "ddim_075": ("DDIM", 0.75)}
IMG2IMG_SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0,
                        num_inference_steps=10)
IMG2IMG_SCHEDULERS = {"Euler": (EulerDiscreteScheduler, {}),
                      "DPM++ 2M Karras": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++",
                                                                        "solver_order": 2, "use_karras_sigmas": True}),
                      "DDIM": (DDIMScheduler, {})}


def img2img_pictures() -> np.ndarray:
    """(2, 64, 64, 3) uint8: two fixed pictures (a colour ramp with a disc; a checker with a bar), no randomness."""
    y, x = np.mgrid[0:64, 0:64].astype(np.float64)
    ramp = np.stack([x * 4, y * 4, 255 - (x + y) * 2], -1)
    ramp[(x - 40) ** 2 + (y - 24) ** 2 < 12**2] = (250, 240, 30)
    checker = np.where(((x // 8 + y // 8) % 2)[..., None] == 1, (200, 60, 60), (30, 90, 200)).astype(np.float64)
    checker[28:36, 8:56] = (245, 245, 245)
    return np.clip(np.stack([ramp, checker]), 0, 255).astype(np.uint8)


class Img2ImgNoise:
    """Replaces the img2img pipeline's ``randn_tensor`` with the engine's noise (called once, checked) and its
    ``retrieve_latents`` with the posterior's mean (``sample_mode="argmax"``, the engine's convention)."""

    def __init__(self, noise: np.ndarray):
        self.noise, self.calls, self.encodes = noise, 0, 0

    def randn(self, shape, generator=None, device=None, dtype=None, **kwargs):
        assert tuple(shape) == self.noise.shape and dtype == torch.float32, (shape, dtype)
        self.calls += 1
        return torch.from_numpy(self.noise.copy())

    def latents(self, encoder_output, generator=None, sample_mode="sample"):
        self.encodes += 1
        return self.saved[1](encoder_output, generator, sample_mode="argmax")

    module = sdxl_img2img  # the pipeline module whose two functions are replaced (a subclass names another)

    def __enter__(self):
        self.saved = self.module.randn_tensor, self.module.retrieve_latents
        self.module.randn_tensor, self.module.retrieve_latents = self.randn, self.latents
        return self

    def __exit__(self, *exc):
        self.module.randn_tensor, self.module.retrieve_latents = self.saved


def cmd_img2img(out: Path) -> None:
    """``img2img``: out/tiny-pt-img2img/reference.{npz,json} (see the module docstring)."""
    torch.set_num_threads(1)
    folder = out / "tiny-pt-img2img"
    with np.load(folder / "noise.npz") as data:
        seeds, noise = data["seeds"], data["noise"]
    pipe = sdxl_img2img.StableDiffusionXLImg2ImgPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32,
                                                                         add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    assert not pipe.config.requires_aesthetics_score  # time ids as txt2img's: (h, w, 0, 0, h, w)
    config = plain_config(pipe.scheduler.config)
    pictures = img2img_pictures()
    arrays, meta = {"pictures": pictures}, {}
    steps = IMG2IMG_SETTINGS["num_inference_steps"]
    for key, (sampler, strength) in IMG2IMG_CASES.items():
        cls, overrides = IMG2IMG_SCHEDULERS[sampler]
        pipe.scheduler = cls.from_config(config, **overrides)
        with Img2ImgNoise(noise) as patched:
            images = pipe(**IMG2IMG_SETTINGS, image=[PIL.Image.fromarray(p) for p in pictures], strength=strength,
                          num_images_per_prompt=2, output_type="np").images
        assert patched.calls == 1 and patched.encodes == 1, (patched.calls, patched.encodes)
        start = steps - min(int(steps * strength), steps)
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(sampler=sampler, scheduler=cls.__name__, overrides=overrides, strength=strength,
                         start_step=start, timesteps=[float(t) for t in pipe.scheduler.timesteps[start:]],
                         begin_index=getattr(pipe.scheduler, "begin_index", None))
    write_npz(folder / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.make_fixtures img2img",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt", settings=IMG2IMG_SETTINGS,
                size=[64, 64], scheduler_config=config, seeds=[int(s) for s in seeds], cases=meta,
                notes=["pictures (2, 64, 64, 3) uint8: img2img_pictures(), image i the input of output image i, "
                       "given as PIL images (VaeImageProcessor: x / 255, 2x - 1; no resize at 64x64).",
                       "Image latents: retrieve_latents with sample_mode='argmax' (the posterior's mean) x "
                       "scaling_factor; the pipeline's default samples the posterior.",
                       "Noise: randn_tensor in prepare_latents returns noise.npz's noise (the engine's initial "
                       "noise of seeds 41, 42), added by scheduler.add_noise at timesteps[start_step].",
                       "start_step: steps - min(int(steps x strength), steps) (get_timesteps); <case>_images "
                       "(2, 64, 64, 3) uint8, round(np * 255)."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
