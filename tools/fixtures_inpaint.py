"""Inpainting references: diffusers' ``StableDiffusionXLInpaintPipeline`` images on tiny-pt (4-channel UNet) and on
tiny-pt-inpaint (tiny-pt with a 9-channel inpainting UNet), for tests/program/test_generate_inpaint.py.

    /tmp/torchvenv/bin/python -m tools.fixtures_inpaint      (the torch venv; never the runtime's)

Writes tests/fixtures/tiny-pt-inpaint/: a whole model folder (tiny-pt's text encoders, tokenizers, VAE and
scheduler with a random 9-channel UNet: latents, mask, masked-image latents; ``save_pretrained``, safetensors)
and ``reference.{npz,json}``: the pipeline's images for :data:`CASES`, 64x64, 2 images (one picture and one mask
each), 10 steps, from tools/fixtures_img2img.py's two fixed pictures and :func:`masks`.

As the img2img fixture (tools/fixtures_img2img.py), the pipeline's noise is the engine's
(tests/fixtures/tiny-pt-img2img/noise.npz, ``python -m tools.img2img_noise``: seeds 41 and 42, the same
64x64 latent shape) and its image latents the VAE posterior's mean (``retrieve_latents(..., sample_mode=
"argmax")``), the engine's conventions. The masks are given as PIL "L" images of the request's size, so
``VaeImageProcessor`` only binarizes them (< 0.5 -> 0, else 1); the pipeline then resizes them to latent size
with ``interpolate`` (nearest: every f-th pixel).
"""

from __future__ import annotations

import json
import shutil

import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_inpaint as sdxl_inpaint
import numpy as np
import PIL.Image
import torch
from diffusers import StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline, UNet2DConditionModel

from tools.fixtures_common import FIXTURES, plain_config, randomized, versions, write_npz
from tools.fixtures_img2img import IMG2IMG_SCHEDULERS, Img2ImgNoise, img2img_pictures

FOLDER = FIXTURES / "tiny-pt-inpaint"
NOISE = FIXTURES / "tiny-pt-img2img" / "noise.npz"
# case -> (UNet: "4" tiny-pt's own, "9" the inpainting UNet; A1111 sampler name; strength)
CASES = {"unet4_euler_075": ("4", "Euler", 0.75), "unet4_euler_1": ("4", "Euler", 1.0),
         "unet4_dpmk_06": ("4", "DPM++ 2M Karras", 0.6), "unet4_ddim_1": ("4", "DDIM", 1.0),
         "unet9_euler_075": ("9", "Euler", 0.75), "unet9_euler_1": ("9", "Euler", 1.0)}
SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0, num_inference_steps=10)
INPAINT_UNET = dict(in_channels=9, layers_per_block=1)  # tiny-pt's UNet config otherwise; one layer: a smaller file


def masks() -> np.ndarray:
    """(2, 64, 64) uint8, 255 = repaint: a rectangle off the centre (image 0), a disc (image 1); edges not on the
    VAE's 4-pixel grid, so the latent mask is the nearest pixels' (interpolate picks pixel 4j)."""
    y, x = np.mgrid[0:64, 0:64]
    rect = ((x >= 10) & (x < 43) & (y >= 18) & (y < 51)) * 255
    disc = ((x - 33) ** 2 + (y - 29) ** 2 < 17**2) * 255
    return np.stack([rect, disc]).astype(np.uint8)


class InpaintNoise(Img2ImgNoise):
    """Img2ImgNoise on the inpaint pipeline: its ``randn_tensor`` returns the engine's noise (called once, checked) and
    its ``retrieve_latents`` the posterior's mean (counted: the image and the masked image)."""

    module = sdxl_inpaint


def save_inpaint_model() -> None:
    """tests/fixtures/tiny-pt-inpaint/: tiny-pt with a random 9-channel UNet (seed 7), as diffusers saves an
    inpainting model (``StableDiffusionXLInpaintPipeline.save_pretrained``)."""
    base = StableDiffusionXLPipeline.from_pretrained(FIXTURES / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    torch.manual_seed(7)
    unet = randomized(UNet2DConditionModel.from_config({**base.unet.config, **INPAINT_UNET}), 7)
    pipe = StableDiffusionXLInpaintPipeline(vae=base.vae, text_encoder=base.text_encoder,
                                            text_encoder_2=base.text_encoder_2, tokenizer=base.tokenizer,
                                            tokenizer_2=base.tokenizer_2, unet=unet, scheduler=base.scheduler,
                                            add_watermarker=False)
    shutil.rmtree(FOLDER, ignore_errors=True)
    pipe.save_pretrained(FOLDER, safe_serialization=True)
    for name in ("tokenizer", "tokenizer_2"):  # tiny-pt's as they are (with vocab.json and merges.txt)
        shutil.rmtree(FOLDER / name)
        shutil.copytree(FIXTURES / "tiny-pt" / name, FOLDER / name)


def main() -> None:
    torch.set_num_threads(1)  # one thread: the same float32 sums whatever the machine's core count
    save_inpaint_model()
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    pipes = {"4": StableDiffusionXLInpaintPipeline.from_pretrained(FIXTURES / "tiny-pt", dtype=torch.float32,
                                                                   add_watermarker=False),
             "9": StableDiffusionXLInpaintPipeline.from_pretrained(FOLDER, dtype=torch.float32,
                                                                   add_watermarker=False)}
    assert pipes["9"].unet.config.in_channels == 9 and pipes["4"].unet.config.in_channels == 4
    pictures, mask = img2img_pictures(), masks()
    arrays, meta = {"pictures": pictures, "masks": mask}, {}
    steps = SETTINGS["num_inference_steps"]
    for key, (unet, sampler, strength) in CASES.items():
        pipe = pipes[unet]
        pipe.set_progress_bar_config(disable=True)
        config = plain_config(pipe.scheduler.config)
        cls, overrides = IMG2IMG_SCHEDULERS[sampler]
        pipe.scheduler = cls.from_config(config, **overrides)
        with InpaintNoise(noise) as patched:
            images = pipe(**SETTINGS, image=[PIL.Image.fromarray(p) for p in pictures],
                          mask_image=[PIL.Image.fromarray(m, mode="L") for m in mask], strength=strength,
                          height=64, width=64, num_images_per_prompt=2, output_type="np").images
        # One noise draw; encodes: the image (4-channel: always, for the blend; 9-channel: below strength 1) and
        # the masked image (both: prepare_mask_latents encodes it whenever there is one).
        assert patched.calls == 1, patched.calls
        start = steps - min(int(steps * strength), steps)
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(unet_in_channels=int(unet), sampler=sampler, scheduler=cls.__name__, overrides=overrides,
                         strength=strength, start_step=start, encodes=patched.encodes,
                         timesteps=[float(t) for t in pipe.scheduler.timesteps[start:]])
    write_npz(FOLDER / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.fixtures_inpaint",
                versions=versions(), torch_threads=1, models={"4": "tests/fixtures/tiny-pt",
                                                              "9": "tests/fixtures/tiny-pt-inpaint"},
                settings=SETTINGS, size=[64, 64], seeds=[int(s) for s in seeds], cases=meta,
                notes=["pictures (2, 64, 64, 3) uint8: tools.fixtures_img2img.img2img_pictures(); masks (2, 64, 64) "
                       "uint8, 255 = repaint: masks(); image i and mask i are the inputs of output image i.",
                       "Image latents and masked-image latents: the VAE posterior's mean x scaling_factor.",
                       "Noise: noise.npz of tiny-pt-img2img (the engine's initial noise of seeds 41, 42). Below "
                       "strength 1 the start latents are scheduler.add_noise(image latents, noise, t_start); at 1 "
                       "noise x init_noise_sigma. The 4-channel UNet's known region is re-noised with the same noise "
                       "to the next timestep after each step (clean at the last).",
                       "start_step: steps - min(int(steps x strength), steps); <case>_images (2, 64, 64, 3) uint8, "
                       "round(np * 255)."])
    (FOLDER / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {FOLDER}")


# soft-mask case -> (UNet, A1111 sampler name, strength); the masks blurred (soft_masks), not binarized
SOFT_CASES = {"soft_unet4_euler_075": ("4", "Euler", 0.75), "soft_unet9_euler_075": ("9", "Euler", 0.75)}


def soft_masks() -> np.ndarray:
    """(2, 64, 64) uint8: :func:`masks` blurred (Pillow's GaussianBlur, radius 4): grey levels along the edges."""
    import PIL.ImageFilter

    return np.stack([np.asarray(PIL.Image.fromarray(m, mode="L").filter(PIL.ImageFilter.GaussianBlur(4)))
                     for m in masks()])


def main_soft() -> None:
    """soft.{npz,json}: :data:`SOFT_CASES`, the pipeline's mask processor with ``do_binarize`` off (the engine's
    ``soft_mask``): the blurred masks' values blend the latents (4 channels) and fill the mask channel (9)."""
    torch.set_num_threads(1)
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    pictures, mask = img2img_pictures(), soft_masks()
    assert 0.2 < ((mask > 0) & (mask < 255)).mean() < 0.8  # grey edges
    arrays, meta = {"pictures": pictures, "masks": mask}, {}
    steps = SETTINGS["num_inference_steps"]
    for key, (unet, sampler, strength) in SOFT_CASES.items():
        pipe = StableDiffusionXLInpaintPipeline.from_pretrained(FIXTURES / "tiny-pt" if unet == "4" else FOLDER,
                                                                dtype=torch.float32, add_watermarker=False)
        pipe.mask_processor.register_to_config(do_binarize=False)
        pipe.set_progress_bar_config(disable=True)
        cls, overrides = IMG2IMG_SCHEDULERS[sampler]
        pipe.scheduler = cls.from_config(plain_config(pipe.scheduler.config), **overrides)
        with InpaintNoise(noise) as patched:
            images = pipe(**SETTINGS, image=[PIL.Image.fromarray(p) for p in pictures],
                          mask_image=[PIL.Image.fromarray(m, mode="L") for m in mask], strength=strength,
                          height=64, width=64, num_images_per_prompt=2, output_type="np").images
        assert patched.calls == 1, patched.calls
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(unet_in_channels=int(unet), sampler=sampler, strength=strength,
                         start_step=steps - min(int(steps * strength), steps))
    write_npz(FOLDER / "soft.npz", arrays)
    meta = dict(made_by="python -m tools.fixtures_inpaint soft (after tools.img2img_noise)", versions=versions(),
                torch_threads=1, settings=SETTINGS, size=[64, 64], seeds=[int(s) for s in seeds], cases=meta,
                notes=["masks (2, 64, 64) uint8: soft_masks(), masks() blurred; the mask processor's do_binarize off, "
                       "so the latent mask (nearest: pixel 4j) keeps the grey levels."])
    (FOLDER / "soft.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {FOLDER}/soft.*")


if __name__ == "__main__":
    import sys

    main_soft() if sys.argv[1:] == ["soft"] else main()
