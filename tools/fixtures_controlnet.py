"""ControlNet references: two small ControlNets made from tiny-pt's UNet and diffusers' SDXL ControlNet pipelines'
images with them, for tests/models/test_controlnet_module.py and tests/program/test_generate_controlnet.py.

    .venv-torch/bin/python -m tools.fixtures_controlnet      (the torch venv; never the runtime's)

Needs tests/fixtures/tiny-pt/ and tiny-pt-img2img/noise.npz (the engine's initial noise of seeds
41 and 42). Writes tests/fixtures/tiny-pt-controlnet/:

* ``cn-a/``, ``cn-b/``: ``ControlNetModel.from_unet(tiny-pt's UNet, conditioning_embedding_out_channels=(8, 16,
  32))`` (two stride-2 convs: tiny-pt's VAE factor 4), seeds 11 and 12; the zero convolutions
  (``controlnet_down_blocks.*``, ``controlnet_mid_block``) and the conditioning embedding's ``conv_out`` given
  PyTorch's default random init (zero, they would add nothing), x 3, the ``conv_out`` x 10 more (its output then
  about conv_in's), every 1-D parameter moved (``randomized``); saved by
  ``save_pretrained`` in float16 (half the bytes); the references use them loaded back in float32.
* ``reference.npz``: ``controls`` (2, 64, 64, 3) uint8 (the two control images: tools/fixtures_img2img.py's
  pictures), the module case (``module_*``: one ``cn-a`` call's inputs and its 10 residuals), and ``<case>_images``
  (2, 64, 64, 3) uint8 for :data:`CASES`: 2 images (one prompt, ``num_images_per_prompt`` 2), 10 Euler steps,
  "a red circle", negative "a blue square", guidance 5, the noise the engine's.
* ``reference.json``: each case's units, as the engine is asked (A1111's start/end) and as diffusers was
  (``control_guidance_start/end`` chosen so that both rules keep the same steps: A1111 skips step i when
  i/N < start or i/N > end, diffusers when i/N < start or (i+1)/N > end), each step's keep, versions.
"""

from __future__ import annotations

import json
import shutil

import diffusers.pipelines.controlnet.pipeline_controlnet_inpaint_sd_xl as cn_inpaint
import diffusers.pipelines.controlnet.pipeline_controlnet_sd_xl_img2img as cn_img2img
import numpy as np
import PIL.Image
import torch
from diffusers import (
    ControlNetModel,
    StableDiffusionXLControlNetImg2ImgPipeline,
    StableDiffusionXLControlNetInpaintPipeline,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLPipeline,
)

from tools.fixtures_common import FIXTURES, randomized, versions, write_npz
from tools.fixtures_img2img import Img2ImgNoise, img2img_pictures
from tools.fixtures_inpaint import masks

FOLDER = FIXTURES / "tiny-pt-controlnet"
NOISE = FIXTURES / "tiny-pt-img2img" / "noise.npz"
SEEDS = {"cn-a": 11, "cn-b": 12}
SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0, num_inference_steps=10)
STEPS = SETTINGS["num_inference_steps"]
# case -> pipeline ("txt2img", "img2img", "inpaint4": tiny-pt's 4-channel UNet), strength, units: (net, control
# image index, scale, A1111 start, A1111 end, diffusers start, diffusers end)
CASES = {
    "one": ("txt2img", None, [("cn-a", 0, 0.8, 0.0, 1.0, 0.0, 1.0)]),
    "start_end": ("txt2img", None, [("cn-a", 0, 1.5, 0.1, 0.3, 0.1, 0.4)]),
    "two": ("txt2img", None, [("cn-a", 0, 0.7, 0.0, 1.0, 0.0, 1.0), ("cn-b", 1, 0.5, 0.0, 0.8, 0.0, 0.9)]),
    "img2img": ("img2img", 0.75, [("cn-a", 1, 1.0, 0.0, 1.0, 0.0, 1.0)]),
    "inpaint4": ("inpaint4", 0.75, [("cn-a", 0, 1.0, 0.0, 1.0, 0.0, 1.0)]),
    "inpaint_full": ("inpaint4", 1.0, [("cn-a", 1, 0.9, 0.0, 1.0, 0.0, 1.0)]),
}


def a1111_keep(i: int, n: int, start: float, end: float) -> bool:
    """sd-webui-controlnet hook.py guidance_schedule_handler: skipped when i/N < start or i/N > end."""
    return not (i / n < start or i / n > end)


def diffusers_keep(i: int, n: int, start: float, end: float) -> bool:
    """diffusers' controlnet_keep: skipped when i/N < start or (i+1)/N > end."""
    return not (i / n < start or (i + 1) / n > end)


def make_controlnet(unet, seed: int) -> ControlNetModel:
    """ControlNetModel.from_unet with its zero-initialised convs given random weights (see the module docstring)."""
    torch.manual_seed(seed)
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16, 32))
    zero = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zero:
            conv.reset_parameters()
            conv.weight.mul_(3.0)  # strong enough that a unit's scale, start and end show in 64x64 images
        # the image's embedding as large as conv_in's latents (a trained ControlNet's is; x1 left the image's effect
        # on the images at 0.01/255)
        net.controlnet_cond_embedding.conv_out.weight.mul_(10.0)
    return randomized(net, seed)


class CnNoise(Img2ImgNoise):
    """Img2ImgNoise on the ControlNet img2img pipeline's module (noise and posterior mean)."""

    module = cn_img2img


class CnInpaintNoise(Img2ImgNoise):
    module = cn_inpaint


def save_controlnets(unet) -> dict[str, ControlNetModel]:
    """cn-a/ and cn-b/ in float16; returns them loaded back in float32 (what the references use)."""
    nets = {}
    for name, seed in SEEDS.items():
        shutil.rmtree(FOLDER / name, ignore_errors=True)
        make_controlnet(unet, seed).half().save_pretrained(FOLDER / name, safe_serialization=True)
        nets[name] = ControlNetModel.from_pretrained(FOLDER / name, torch_dtype=torch.float32).eval()
    return nets


def module_case(net: ControlNetModel) -> dict[str, np.ndarray]:
    """One call of ``net``: fixed random inputs (2 rows, 16x16 latents, a 64x64 image in [0, 1]) and its residuals."""
    rng = np.random.RandomState(5)
    inputs = dict(sample=rng.randn(2, 4, 16, 16).astype(np.float32), timestep=np.array([500.0, 21.0], np.float32),
                  hidden=rng.randn(2, 77, 80).astype(np.float32), text_embeds=rng.randn(2, 48).astype(np.float32),
                  time_ids=np.array([[64, 64, 0, 0, 64, 64]] * 2, np.float32),
                  cond=rng.rand(2, 3, 64, 64).astype(np.float32))
    with torch.no_grad():
        down, mid = net(torch.from_numpy(inputs["sample"]), torch.from_numpy(inputs["timestep"]),
                        encoder_hidden_states=torch.from_numpy(inputs["hidden"]),
                        controlnet_cond=torch.from_numpy(inputs["cond"]), conditioning_scale=0.7,
                        added_cond_kwargs={"text_embeds": torch.from_numpy(inputs["text_embeds"]),
                                           "time_ids": torch.from_numpy(inputs["time_ids"])}, return_dict=False)
    out = {f"module_{k}": v for k, v in inputs.items()}
    out.update({f"module_down_{k}": d.numpy() for k, d in enumerate(down)})
    out["module_mid"] = mid.numpy()
    return out


def main() -> None:
    torch.set_num_threads(1)  # the same float32 sums whatever the machine's core count
    base = StableDiffusionXLPipeline.from_pretrained(FIXTURES / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    nets = save_controlnets(base.unet)
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    controls = img2img_pictures()
    pictures, mask = img2img_pictures()[::-1].copy(), masks()
    arrays = {"controls": controls, **module_case(nets["cn-a"])}
    meta = {}
    parts = dict(vae=base.vae, text_encoder=base.text_encoder, text_encoder_2=base.text_encoder_2,
                 tokenizer=base.tokenizer, tokenizer_2=base.tokenizer_2, scheduler=base.scheduler)
    for key, (kind, strength, units) in CASES.items():
        net = [nets[u[0]] for u in units]
        net = net[0] if len(net) == 1 else net
        one = len(units) == 1
        control = [PIL.Image.fromarray(controls[u[1]]) for u in units]
        kw = dict(controlnet_conditioning_scale=units[0][2] if one else [u[2] for u in units],
                  control_guidance_start=units[0][5] if one else [u[5] for u in units],
                  control_guidance_end=units[0][6] if one else [u[6] for u in units])
        control = control[0] if one else control
        common = dict(**SETTINGS, num_images_per_prompt=2, height=64, width=64, output_type="np", **kw)
        if kind == "txt2img":
            pipe = StableDiffusionXLControlNetPipeline(**parts, unet=base.unet, controlnet=net, add_watermarker=False)
            pipe.set_progress_bar_config(disable=True)
            images = pipe(image=control, latents=torch.from_numpy(noise.copy()), **common).images
            runs = STEPS
        elif kind == "img2img":
            pipe = StableDiffusionXLControlNetImg2ImgPipeline(**parts, unet=base.unet, controlnet=net,
                                                              add_watermarker=False)
            pipe.set_progress_bar_config(disable=True)
            with CnNoise(noise) as patched:
                images = pipe(image=[PIL.Image.fromarray(p) for p in pictures], control_image=control,
                              strength=strength, **common).images
            assert patched.calls == 1, patched.calls
            runs = min(int(STEPS * strength), STEPS)
        else:
            pipe = StableDiffusionXLControlNetInpaintPipeline(**parts, unet=base.unet, controlnet=net,
                                                              add_watermarker=False)
            pipe.set_progress_bar_config(disable=True)
            with CnInpaintNoise(noise) as patched:
                images = pipe(image=[PIL.Image.fromarray(p) for p in pictures],
                              mask_image=[PIL.Image.fromarray(m, mode="L") for m in mask], control_image=control,
                              strength=strength, **common).images
            assert patched.calls == 1, patched.calls
            runs = min(int(STEPS * strength), STEPS)
        keeps = []
        for u in units:
            a = [a1111_keep(i, runs, u[3], u[4]) for i in range(runs)]
            d = [diffusers_keep(i, runs, u[5], u[6]) for i in range(runs)]
            assert a == d, (key, u, a, d)  # the fixture's diffusers start/end give A1111's steps
            keeps.append(a)
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(pipeline=type(pipe).__name__, strength=strength, start_step=STEPS - runs, runs=runs,
                         units=[dict(model=u[0], control=u[1], weight=u[2], guidance_start=u[3], guidance_end=u[4],
                                     diffusers_start=u[5], diffusers_end=u[6], keep=k)
                                for u, k in zip(units, keeps)])
    write_npz(FOLDER / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.fixtures_controlnet",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt",
                settings=SETTINGS, size=[64, 64],
                seeds=[int(s) for s in seeds], cases=meta,
                notes=["controls (2, 64, 64, 3) uint8: img2img_pictures(); a unit's control image is one picture for "
                       "both images. img2img/inpaint init images: img2img_pictures() reversed (image i of the "
                       "output from picture i); masks: tools.fixtures_inpaint.masks().",
                       "Noise: noise.npz of tiny-pt-img2img (seeds 41, 42): txt2img's latents (x init_noise_sigma "
                       "by the pipeline), img2img's and inpainting's randn_tensor (one call, checked); image latents "
                       "the posterior's mean.",
                       "module_*: cn-a (float32) on fixed inputs, conditioning_scale 0.7: module_down_0..8, "
                       "module_mid, channels-first."])
    (FOLDER / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {FOLDER}")


if __name__ == "__main__":
    main()
