"""The SDXL refiner's fixtures: a tiny refiner made with diffusers, and the ensemble of experts' images.

    /tmp/torchvenv/bin/python -m tools.refiner_fixtures        (torch venv; never run in CI)

Writes, under tests/fixtures/:

* ``tiny-pt-refiner/``: a small random SDXL refiner saved by ``StableDiffusionXLImg2ImgPipeline.save_pretrained``
  (safetensors): ``text_encoder_2`` only (tiny-pt's text_encoder_2 architecture, its own weights), a UNet
  whose added time ids are 5 (original size, crop top-left, aesthetic score:
  ``projection_class_embeddings_input_dim`` = 5 x 8 + 48) with the refiner's block layout (no cross-attention
  in the first and last blocks), tiny-pt's VAE (so the base's latents are the refiner's), tiny-pt's
  ``tokenizer_2`` and scheduler; ``requires_aesthetics_score=True``, ``force_zeros_for_empty_prompt=False``.
* ``tiny-pt-refiner-reference/reference.{npz,json}``: diffusers' ensemble of experts on tiny-pt + the refiner:
  ``StableDiffusionXLPipeline(denoising_end=s, output_type="latent")``, then
  ``StableDiffusionXLImg2ImgPipeline(image=latents, denoising_start=s)``, 10 steps, guidance 5, 64x64, two
  images, for each case of :data:`CASES` (switch point, sampler, negative prompt). The initial noise is the
  engine's for seeds 41 and 42: tests/fixtures/tiny-pt-img2img/noise.npz (``python -m tools.img2img_noise``,
  the runtime's venv), handed to the base pipeline as ``latents`` (it multiplies them by ``init_noise_sigma``,
  as the engine does).

Deterministic: fixed torch seeds, one torch thread.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLPipeline,
)
from transformers import CLIPTextConfig, CLIPTokenizer

from tools.fixtures_common import FIXTURES, check_saved, plain_config, seeded_component, versions, write_npz

BASE = FIXTURES / "tiny-pt"
REFINER = FIXTURES / "tiny-pt-refiner"
REFERENCE = FIXTURES / "tiny-pt-refiner-reference"
NOISE = FIXTURES / "tiny-pt-img2img" / "noise.npz"

# The refiner's UNet: SDXL refiner's layout (DownBlock2D, CrossAttn x 2, DownBlock2D; 5 time ids; cross-attention
# over text_encoder_2's 48 channels only), small. Another layout than tiny-pt's base UNet, so a mix-up shows.
REFINER_UNET = dict(
    sample_size=16,
    block_out_channels=(16, 32, 32, 32),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1,
    attention_head_dim=(2, 2, 4, 4),
    transformer_layers_per_block=(1, 2, 1, 1),
    use_linear_projection=True,
    norm_num_groups=8,
    cross_attention_dim=48,  # text_encoder_2's hidden size: the refiner has no text_encoder
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=5 * 8 + 48,  # 5 time ids x 8 + text_embeds (projection_dim 48)
)
REFINER_SEEDS = dict(text_encoder_2=21, unet=22)

SETTINGS = dict(prompt="a red circle", guidance_scale=5.0, num_inference_steps=10)
SIZE = 64
# case -> (switch point s: denoising_end of the base, denoising_start of the refiner; sampler; negative prompt).
CASES = {"euler_08": (0.8, "Euler", ""), "euler_05": (0.5, "Euler", ""),
         "euler_065_negative": (0.65, "Euler", "a blue square"), "dpmk_08": (0.8, "DPM++ 2M Karras", "")}
SCHEDULERS = {"Euler": (EulerDiscreteScheduler, {}),
              "DPM++ 2M Karras": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2,
                                                                "use_karras_sigmas": True})}


def save_refiner() -> None:
    """Build, save and check tests/fixtures/tiny-pt-refiner/ (replaced if present)."""
    shutil.rmtree(REFINER, ignore_errors=True)
    te2_config = CLIPTextConfig.from_json_file(BASE / "text_encoder_2" / "config.json")
    models = {"text_encoder_2": seeded_component("text_encoder_2", {"text_encoder_2": te2_config},
                                                 REFINER_SEEDS["text_encoder_2"]),
              "unet": seeded_component("unet", {"unet": REFINER_UNET}, REFINER_SEEDS["unet"])}
    vae = AutoencoderKL.from_pretrained(BASE / "vae", dtype=torch.float32)
    scheduler = EulerDiscreteScheduler.from_pretrained(BASE / "scheduler")
    pipe = StableDiffusionXLImg2ImgPipeline(vae=vae, text_encoder=None, tokenizer=None,
                                            tokenizer_2=CLIPTokenizer.from_pretrained(BASE / "tokenizer_2"),
                                            scheduler=scheduler, requires_aesthetics_score=True,
                                            force_zeros_for_empty_prompt=False, add_watermarker=False, **models)
    pipe.save_pretrained(REFINER, safe_serialization=True)
    for name in ("vocab.json", "merges.txt"):  # transformers 5 omits them; the engine's tokenizer reads them
        shutil.copyfile(BASE / "tokenizer_2" / name, REFINER / "tokenizer_2" / name)
    for name, model in models.items():
        check_saved(model, REFINER / name)


def ensemble_case(base, refiner, noise: np.ndarray, switch: float, sampler: str,
                  negative: str) -> tuple[np.ndarray, dict]:
    """One case's (2, 64, 64, 3) uint8 images (round(np x 255)) and its metadata."""
    cls, overrides = SCHEDULERS[sampler]
    config = plain_config(base.scheduler.config)
    base.scheduler = cls.from_config(config, **overrides)
    refiner.scheduler = cls.from_config(config, **overrides)
    common = dict(**SETTINGS, negative_prompt=negative or None, num_images_per_prompt=2)
    latents = base(**common, width=SIZE, height=SIZE, latents=torch.from_numpy(noise.copy()), denoising_end=switch,
                   output_type="latent").images
    timesteps = [float(t) for t in base.scheduler.timesteps]
    images = refiner(**common, image=latents, denoising_start=switch, output_type="np").images
    cutoff = int(round(1000 - switch * 1000))
    start = sum(t >= cutoff for t in timesteps)  # the first refiner step: diffusers' denoising_end / _start rule
    assert [float(t) for t in refiner.scheduler.timesteps] == timesteps and refiner.scheduler.begin_index == start
    meta = dict(switch_at=switch, sampler=sampler, scheduler=cls.__name__, overrides=overrides,
                negative_prompt=negative, cutoff=cutoff, refiner_start=start, timesteps=timesteps)
    return np.round(images * 255).astype(np.uint8), meta


def refiner_conditioning(refiner) -> dict[str, np.ndarray]:
    """The refiner's conditioning for SETTINGS' prompt and an empty negative prompt (``None``: encoded, as its
    force_zeros_for_empty_prompt is false) and its time ids at 64x64 with the default aesthetic scores, float32:
    ``encode_prompt`` and ``_get_add_time_ids`` of StableDiffusionXLImg2ImgPipeline."""
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = refiner.encode_prompt(SETTINGS["prompt"], device="cpu",
                                                                          negative_prompt=None)
        time_ids, negative_time_ids = refiner._get_add_time_ids(
            (SIZE, SIZE), (0, 0), (SIZE, SIZE), 6.0, 2.5, (SIZE, SIZE), (0, 0), (SIZE, SIZE), dtype=torch.float32,
            text_encoder_projection_dim=refiner.text_encoder_2.config.projection_dim)
    return {"prompt_embeds": embeds, "negative_prompt_embeds": negative, "pooled_prompt_embeds": pooled,
            "negative_pooled_prompt_embeds": negative_pooled, "add_time_ids": time_ids,
            "add_neg_time_ids": negative_time_ids}


def write_reference() -> None:
    """tests/fixtures/tiny-pt-refiner-reference/reference.{npz,json} from the saved models."""
    REFERENCE.mkdir(parents=True, exist_ok=True)
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    base = StableDiffusionXLPipeline.from_pretrained(BASE, dtype=torch.float32, add_watermarker=False)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pretrained(REFINER, dtype=torch.float32, add_watermarker=False)
    assert refiner.config.requires_aesthetics_score and not refiner.config.force_zeros_for_empty_prompt
    for pipe in (base, refiner):
        pipe.set_progress_bar_config(disable=True)
    arrays = {f"refiner_{k}": v.numpy().astype(np.float32) for k, v in refiner_conditioning(refiner).items()}
    cases = {}
    for key, (switch, sampler, negative) in CASES.items():
        arrays[f"{key}_images"], cases[key] = ensemble_case(base, refiner, noise, switch, sampler, negative)
    write_npz(REFERENCE / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv, once), then python -m tools.refiner_fixtures",
                versions=versions(), torch_threads=1, base="tests/fixtures/tiny-pt",
                refiner="tests/fixtures/tiny-pt-refiner",
                settings=SETTINGS, size=[SIZE, SIZE], seeds=[int(s) for s in seeds],
                scheduler_config=plain_config(base.scheduler.config), cases=cases,
                notes=["base: StableDiffusionXLPipeline(denoising_end=switch_at, output_type='latent', "
                       "latents=noise); it runs the steps whose timestep >= cutoff = round(1000 - 1000 switch_at).",
                       "refiner: StableDiffusionXLImg2ImgPipeline(image=those latents, denoising_start=switch_at): "
                       "no noise added, the steps from refiner_start on, its scheduler restarted there "
                       "(set_begin_index; DPM++'s first refiner step first order).",
                       "An empty negative prompt is passed as None: the base (force_zeros_for_empty_prompt true) "
                       "zeros it, the refiner (false) encodes ''.",
                       "Refiner time ids: (64, 64, 0, 0, 6.0) for the prompt, (64, 64, 0, 0, 2.5) for the negative "
                       "(aesthetic_score, negative_aesthetic_score defaults).",
                       "<case>_images (2, 64, 64, 3) uint8, round(np * 255).",
                       "refiner_*: the refiner's encode_prompt(prompt, negative_prompt=None) (1, 77, 48) and (1, 48) "
                       "float32, and _get_add_time_ids at 64x64 with the default scores (1, 5)."])
    (REFERENCE / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


# image case -> (img2img strength, switch point: 0 = the refiner alone, as a plain img2img model; sampler)
IMAGE_CASES = {"refiner_alone_05": (0.5, 0.0, "Euler"), "refiner_alone_03_dpmk": (0.3, 0.0, "DPM++ 2M Karras"),
               "ensemble_07_switch_08": (0.7, 0.8, "Euler")}


def write_image_reference() -> None:
    """tests/fixtures/tiny-pt-refiner-reference/images.{npz,json}: the refiner on input pictures (make_fixtures'
    img2img_pictures). Switch 0: ``StableDiffusionXLImg2ImgPipeline`` of the refiner alone at the strength (the
    refiner as a plain img2img model). Else the ensemble from an image: tiny-pt's img2img pipeline at the strength
    with ``denoising_end``, its latents to the refiner with ``denoising_start``. Noise: the engine's (seeds 41, 42),
    image latents the posterior's mean (fixtures_img2img.Img2ImgNoise)."""
    import PIL.Image

    from tools.fixtures_img2img import Img2ImgNoise, img2img_pictures

    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    base = StableDiffusionXLImg2ImgPipeline.from_pretrained(BASE, dtype=torch.float32, add_watermarker=False)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pretrained(REFINER, dtype=torch.float32, add_watermarker=False)
    assert not base.config.requires_aesthetics_score and refiner.config.requires_aesthetics_score
    for pipe in (base, refiner):
        pipe.set_progress_bar_config(disable=True)
    pictures = img2img_pictures()
    arrays, cases = {"pictures": pictures}, {}
    common = {**SETTINGS, "prompt": [SETTINGS["prompt"]] * 2, "negative_prompt": ["a blue square"] * 2}
    config = plain_config(base.scheduler.config)  # once: a case's scheduler config must not leak into the next
    for key, (strength, switch, sampler) in IMAGE_CASES.items():
        cls, overrides = SCHEDULERS[sampler]
        base.scheduler, refiner.scheduler = cls.from_config(config, **overrides), cls.from_config(config, **overrides)
        images = [PIL.Image.fromarray(p) for p in pictures]
        with Img2ImgNoise(noise) as patched:
            if switch == 0:
                out = refiner(**common, image=images, strength=strength, output_type="np").images
            else:
                latents = base(**common, image=images, strength=strength, denoising_end=switch,
                               output_type="latent").images
                out = refiner(**common, image=latents, denoising_start=switch, output_type="np").images
        assert patched.calls == 1, patched.calls  # one noise draw: the first pipeline's
        steps = SETTINGS["num_inference_steps"]
        arrays[f"{key}_images"] = np.round(out * 255).astype(np.uint8)
        cases[key] = dict(strength=strength, switch_at=switch, sampler=sampler, scheduler=cls.__name__,
                          overrides=overrides, start_step=steps - min(int(steps * strength), steps))
    write_npz(REFERENCE / "images.npz", arrays)
    meta = dict(made_by="python -m tools.refiner_fixtures images (after tools.img2img_noise)", versions=versions(),
                torch_threads=1, settings={**SETTINGS, "negative_prompt": "a blue square"}, size=[SIZE, SIZE],
                seeds=[int(s) for s in seeds], cases=cases,
                notes=["pictures (2, 64, 64, 3): fixtures_img2img.img2img_pictures(); "
                       "<case>_images (2, 64, 64, 3) uint8.",
                       "switch_at 0: the refiner's img2img pipeline alone; else tiny-pt's img2img pipeline with "
                       "denoising_end, then the refiner with denoising_start on its latents."])
    (REFERENCE / "images.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def main() -> None:
    torch.set_num_threads(1)  # the same float32 sums whatever the machine's core count
    save_refiner()
    write_reference()
    print(f"wrote {REFINER} and {REFERENCE}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["images"]:
        torch.set_num_threads(1)
        write_image_reference()
    else:
        main()
