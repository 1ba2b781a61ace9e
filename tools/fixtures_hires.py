"""Hires fix references: diffusers' two pipelines chained as AUTOMATIC1111's latent hires fix, on tiny-pt, for
tests/program/test_generate_hires.py.

    .venv/bin/python -m tools.hires_noise     (the runtime's venv: the engine's noise)
    /tmp/torchvenv/bin/python -m tools.fixtures_hires    (the torch venv; never the runtime's)

Each case (:data:`CASES`), 2 images, "a red circle", negative "a blue square", guidance 5, first pass 10 steps:

1. ``StableDiffusionXLPipeline(output_type="latent")`` at 64x64 from ``latents`` = noise.npz's ``noise`` (the
   engine's first noise; the pipeline multiplies it by ``init_noise_sigma``): its final latents.
2. ``F.interpolate(latents, size=(24, 24), mode, antialias)`` as A1111's ``sample_hr_pass`` (``align_corners``
   unset): 16x16 -> 24x24 latents (96x96 pixels, scale 1.5; tiny-pt's VAE factor is 4).
3. ``StableDiffusionXLImg2ImgPipeline(image=those latents)`` (4 channels: no VAE encode, no preprocessing) with
   ``num_inference_steps`` = the second pass's schedule length and a ``strength`` whose ``get_timesteps`` starts
   at the engine's start step (checked), its ``randn_tensor`` returning noise.npz's ``hires_noise`` (one call,
   checked): the images.

``python -m tools.fixtures_hires pixels`` writes pixels.{npz,json}: hires fix with A1111's pixel upscalers
(:data:`PIXEL_CASES`): step 1 with ``output_type="np"``, its images as uint8 (``round(x * 255)``, the engine's
txt2img images), resized by A1111's ``images.resize_image(0, ...)`` chain (:func:`a1111_resize`, written out here),
then step 3 on those pictures (encoded by the VAE, the posterior's mean).

Also writes torch's ``F.interpolate`` of fixed random latents for every A1111 latent upscaler at several sizes
(``resize_*``), which the test compares with latent_upscale.resize_matrix.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

from tools.fixtures_common import FIXTURES, plain_config, versions, write_npz
from tools.fixtures_img2img import IMG2IMG_SCHEDULERS, Img2ImgNoise

FOLDER = FIXTURES / "tiny-pt-hires"
SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0)
STEPS = 10  # the first pass's
SIZE, HIRES_SIZE = 64, 96  # pixels, square
# case -> (A1111 sampler, A1111 latent upscaler, hires strength, hires steps (0: diffusers' rule on STEPS))
CASES = {"euler_latent_07": ("Euler", "Latent", 0.7, 0),
         "euler_latent_07_6steps": ("Euler", "Latent", 0.7, 6),
         "dpmk_bicubic_06_5steps": ("DPM++ 2M Karras", "Latent (bicubic)", 0.6, 5),
         "euler_nearest_exact_05": ("Euler", "Latent (nearest-exact)", 0.5, 0)}
# A1111's latent upscalers (modules/shared.py latent_upscale_modes): name -> (torch mode, antialias)
UPSCALERS = {"Latent": ("bilinear", False), "Latent (antialiased)": ("bilinear", True),
             "Latent (bicubic)": ("bicubic", False), "Latent (bicubic antialiased)": ("bicubic", True),
             "Latent (nearest)": ("nearest", False), "Latent (nearest-exact)": ("nearest-exact", False)}
RESIZES = ((16, 24), (16, 20), (13, 29), (40, 60))  # (in, out) sides of the resize checks


def interpolate(latents: torch.Tensor, size: int, upscaler: str) -> torch.Tensor:
    """A1111's ``sample_hr_pass`` latent resize: ``F.interpolate(samples, size=..., mode, antialias)``."""
    mode, antialias = UPSCALERS[upscaler]
    return F.interpolate(latents, size=(size, size), mode=mode, antialias=antialias)


def second_pass(steps: int, strength: float, hires_steps: int) -> tuple[int, int]:
    """(schedule length, start step): A1111's rule for hires_steps > 0, diffusers' get_timesteps for 0 (the
    engine's schedulers.hires_schedule, written out here so the fixture does not import the runtime)."""
    if hires_steps:
        total = int(hires_steps / min(strength, 0.999))
        return total, total - hires_steps
    return steps, steps - min(int(steps * strength), steps)


def resize_checks() -> dict[str, np.ndarray]:
    """``resize_<in>_<out>_input`` (1, 2, in, in) float32 fixed random latents and ``resize_<in>_<out>_<upscaler
    index>`` (1, 2, out, out): torch's interpolate of them for each of :data:`UPSCALERS`, in order."""
    rng, arrays = np.random.RandomState(5), {}
    for n_in, n_out in RESIZES:
        x = rng.standard_normal((1, 2, n_in, n_in)).astype(np.float32)
        arrays[f"resize_{n_in}_{n_out}_input"] = x
        for k, name in enumerate(UPSCALERS):
            arrays[f"resize_{n_in}_{n_out}_{k}"] = interpolate(torch.from_numpy(x), n_out, name).numpy()
    return arrays


# case -> (A1111 sampler, A1111 pixel upscaler, hires strength, hires steps)
PIXEL_CASES = {"euler_lanczos_05": ("Euler", "Lanczos", 0.5, 0),
               "dpmk_nearest_06_5steps": ("DPM++ 2M Karras", "Nearest", 0.6, 5)}


def a1111_resize(image, width: int, height: int, upscaler: str):
    """A1111's ``images.resize_image(0, image, width, height, upscaler_name)`` for its built-in upscalers None,
    Lanczos and Nearest (``Upscaler.upscale``: the upscaler to int(side x scale), Lanczos to that rounded down to
    a multiple of 8, then Lanczos to the target), copied from modules/upscaler.py and modules/images.py."""
    from PIL import Image

    lanczos = Image.Resampling.LANCZOS
    own = {"None": None, "Lanczos": lanczos, "Nearest": Image.Resampling.NEAREST}[upscaler]
    scale = max(width / image.width, height / image.height)
    if scale > 1.0:
        dest_w, dest_h = int((image.width * scale) // 8 * 8), int((image.height * scale) // 8 * 8)
        for i in range(3):
            if image.width >= dest_w and image.height >= dest_h and (i > 0 or scale != 1):
                break
            shape = image.size
            if own is not None:
                image = image.resize((int(image.width * scale), int(image.height * scale)), resample=own)
            if shape == image.size:
                break
        if image.size != (dest_w, dest_h):
            image = image.resize((dest_w, dest_h), resample=lanczos)
    if image.size != (width, height):
        image = image.resize((width, height), resample=lanczos)
    return image


def pipelines():
    """(seeds, noise, hires noise, tiny-pt's txt2img pipeline, an img2img pipeline on its components, the
    scheduler config) for both commands, with one torch thread (the same float32 sums on any machine)."""
    torch.set_num_threads(1)
    with np.load(FOLDER / "noise.npz") as data:
        seeds, noise, hires_noise = data["seeds"], data["noise"], data["hires_noise"]
    base = StableDiffusionXLPipeline.from_pretrained(FIXTURES / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    refine = StableDiffusionXLImg2ImgPipeline(**base.components, requires_aesthetics_score=False)
    for pipe in (base, refine):
        pipe.set_progress_bar_config(disable=True)
    return seeds, noise, hires_noise, base, refine, plain_config(base.scheduler.config)


def main_pixels() -> None:
    """pixels.{npz,json}: the :data:`PIXEL_CASES` (module docstring)."""
    from PIL import Image

    seeds, noise, hires_noise, base, refine, config = pipelines()
    arrays, meta = {}, {}
    for key, (sampler, upscaler, strength, hires_steps) in PIXEL_CASES.items():
        cls, overrides = IMG2IMG_SCHEDULERS[sampler]
        base.scheduler = cls.from_config(config, **overrides)
        first = base(**SETTINGS, num_inference_steps=STEPS, height=SIZE, width=SIZE, num_images_per_prompt=2,
                     latents=torch.from_numpy(noise.copy()), output_type="np").images  # (2, 64, 64, 3) in [0, 1]
        first = np.round(first * 255).astype(np.uint8)
        upscaled = [a1111_resize(Image.fromarray(image), HIRES_SIZE, HIRES_SIZE, upscaler) for image in first]
        total, start = second_pass(STEPS, strength, hires_steps)
        strength_d = min(1.0, (total - start + 0.5) / total)
        refine.scheduler = cls.from_config(config, **overrides)
        with Img2ImgNoise(hires_noise) as patched:
            images = refine(**{**SETTINGS, "prompt": [SETTINGS["prompt"]] * 2,  # a prompt per picture
                               "negative_prompt": [SETTINGS["negative_prompt"]] * 2},
                            image=upscaled, strength=strength_d, num_inference_steps=total, output_type="np").images
        assert patched.calls == 1 and patched.encodes == 1, (patched.calls, patched.encodes)
        assert images.shape == (2, HIRES_SIZE, HIRES_SIZE, 3), images.shape
        arrays[f"{key}_first"] = first
        arrays[f"{key}_upscaled"] = np.stack([np.asarray(image) for image in upscaled])
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(sampler=sampler, scheduler=cls.__name__, overrides=overrides, upscaler=upscaler,
                         hires_strength=strength, hires_steps=hires_steps, schedule_steps=total, start_step=start,
                         diffusers_strength=strength_d,
                         timesteps=[float(t) for t in refine.scheduler.timesteps[start:]])
    write_npz(FOLDER / "pixels.npz", arrays)
    from PIL import __version__ as pillow

    meta = dict(made_by="python -m tools.hires_noise (runtime venv), then python -m tools.fixtures_hires pixels",
                versions={**versions(), "pillow": pillow}, torch_threads=1, model="tests/fixtures/tiny-pt",
                settings=SETTINGS, steps=STEPS, size=[SIZE, SIZE], hires_size=[HIRES_SIZE, HIRES_SIZE],
                seeds=[int(s) for s in seeds], cases=meta,
                notes=["<case>_first (2, 64, 64, 3) uint8: the first pass's images, round(np x 255); <case>_upscaled "
                       "(2, 96, 96, 3): a1111_resize of them; <case>_images (2, 96, 96, 3): the img2img pipeline's "
                       "images of <case>_upscaled (posterior mean, noise.npz's hires_noise), round(np x 255)."])
    (FOLDER / "pixels.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {FOLDER}/pixels.*")


def main() -> None:
    seeds, noise, hires_noise, base, refine, config = pipelines()
    arrays, meta = resize_checks(), {}
    for key, (sampler, upscaler, strength, hires_steps) in CASES.items():
        cls, overrides = IMG2IMG_SCHEDULERS[sampler]
        base.scheduler = cls.from_config(config, **overrides)
        latents = base(**SETTINGS, num_inference_steps=STEPS, height=SIZE, width=SIZE, num_images_per_prompt=2,
                       latents=torch.from_numpy(noise.copy()), output_type="latent").images  # (2, 4, 16, 16)
        f = base.vae_scale_factor
        upscaled = interpolate(latents, HIRES_SIZE // f, upscaler)  # (2, 4, 24, 24)
        total, start = second_pass(STEPS, strength, hires_steps)
        # diffusers' strength whose get_timesteps runs the last total - start steps: int(total x s) = total - start
        strength_d = min(1.0, (total - start + 0.5) / total)
        refine.scheduler = cls.from_config(config, **overrides)
        with Img2ImgNoise(hires_noise) as patched:
            images = refine(**SETTINGS, image=upscaled, strength=strength_d, num_inference_steps=total,
                            num_images_per_prompt=2, output_type="np").images
        assert patched.calls == 1 and patched.encodes == 0, (patched.calls, patched.encodes)
        ran = refine.scheduler.timesteps[start:]
        assert images.shape == (2, HIRES_SIZE, HIRES_SIZE, 3), images.shape
        arrays[f"{key}_latents"] = latents.numpy()
        arrays[f"{key}_upscaled"] = upscaled.numpy()
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(sampler=sampler, scheduler=cls.__name__, overrides=overrides, upscaler=upscaler,
                         hires_strength=strength, hires_steps=hires_steps, schedule_steps=total, start_step=start,
                         diffusers_strength=strength_d, timesteps=[float(t) for t in ran])
    write_npz(FOLDER / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.hires_noise (runtime venv), then python -m tools.fixtures_hires",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt", settings=SETTINGS, steps=STEPS,
                size=[SIZE, SIZE], hires_size=[HIRES_SIZE, HIRES_SIZE], seeds=[int(s) for s in seeds], cases=meta,
                upscalers=list(UPSCALERS), resizes=[list(r) for r in RESIZES],
                notes=["<case>_latents (2, 4, 16, 16): the first pass's final latents (output_type='latent'); "
                       "<case>_upscaled (2, 4, 24, 24): F.interpolate of them; <case>_images (2, 96, 96, 3) uint8, "
                       "round(np * 255).",
                       "noise.npz: noise, the first pass's latents before init_noise_sigma; hires_noise, the img2img "
                       "pipeline's randn_tensor, added by scheduler.add_noise at timesteps[start_step].",
                       "start_step: A1111's rule (total = int(hires_steps / min(strength, 0.999)), the last "
                       "hires_steps run) when hires_steps > 0, else 10 - int(10 x strength); diffusers_strength: "
                       "the img2img strength whose get_timesteps starts there.",
                       "resize_<in>_<out>_<k>: torch's interpolate of resize_<in>_<out>_input with upscalers[k]."])
    (FOLDER / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {FOLDER}")


if __name__ == "__main__":
    import sys

    main_pixels() if sys.argv[1:] == ["pixels"] else main()
