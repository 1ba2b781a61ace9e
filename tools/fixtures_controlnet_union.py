"""ControlNet-Union references: a small ``ControlNetUnionModel`` made from tiny-pt's UNet and diffusers'
``StableDiffusionXLControlNetUnionPipeline`` images with it, for tests/models/test_controlnet_union_module.py and
tests/program/test_generate_controlnet_union.py.

    .venv-torch/bin/python -m tools.make_fixtures controlnet-union      (the torch venv; never the runtime's)

Needs tests/fixtures/tiny-pt/, tiny-pt-controlnet/reference.npz (its ``controls``, the img2img pictures) and
tiny-pt-img2img/noise.npz (the engine's initial noise of seeds 41 and 42). Writes
tests/fixtures/tiny-pt-controlnet-union/:

* ``union/``: ``ControlNetUnionModel`` with tiny-pt's UNet config (as ``from_unet`` makes it, and its conv_in,
  time embedding, down and mid blocks' weights), ``conditioning_embedding_out_channels=(8, 16, 32)`` (tiny-pt's VAE
  factor 4), 8 control types (ProMax's count), the union's transformer at the UNet's first width (16 channels, 2
  heads: xinsir's files have 320, SDXL's first width); seed 13; the zero convolutions, ``spatial_ch_projs`` and the
  conditioning embedding's ``conv_out`` given PyTorch's default init (x 3; ``conv_out`` x 10 more, as
  tiny-pt-controlnet's), every 1-D parameter moved (``randomized``); saved by ``save_pretrained`` in float16; the
  references use it loaded back in float32.
* ``reference.npz``: ``module_*`` (two calls on fixed 4-row inputs: one image of type 3, and two images of types 1
  and 3 at scales 0.7 and 0.5; their 10 residuals each) and ``<case>_images`` (2, 64, 64, 3) uint8 for
  :data:`CASES`: 2 images (one prompt, ``num_images_per_prompt`` 2), 10 Euler steps, "a red circle", negative "a
  blue square", guidance 5, the engine's noise; the control images are tiny-pt-controlnet's ``controls``.
* ``reference.json``: each case's control images, types and scale, versions.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import PIL.Image
import torch
from diffusers import ControlNetUnionModel, StableDiffusionXLControlNetUnionPipeline, StableDiffusionXLPipeline

from tools.fixtures_common import FIXTURES, randomized, versions, write_npz

FOLDER = FIXTURES / "tiny-pt-controlnet-union"
NOISE = FIXTURES / "tiny-pt-img2img" / "noise.npz"
CONTROLS = FIXTURES / "tiny-pt-controlnet" / "reference.npz"
SEED = 13
SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0, num_inference_steps=10)
# case -> (control image indices, their control types (diffusers' control_mode), scale)
CASES = {
    "one": ([0], [3], 0.8),  # canny / lineart ("hard edge")
    "one_depth": ([0], [1], 0.8),  # the same image as depth
    "two": ([0, 1], [1, 3], 0.7),  # depth on picture 0, hard edge on picture 1, one unit
}
UNET_KEYS = ("in_channels", "flip_sin_to_cos", "freq_shift", "down_block_types", "only_cross_attention",
             "block_out_channels", "layers_per_block", "downsample_padding", "mid_block_scale_factor", "act_fn",
             "norm_num_groups", "norm_eps", "cross_attention_dim", "attention_head_dim", "num_attention_heads",
             "use_linear_projection", "class_embed_type", "num_class_embeds", "upcast_attention",
             "resnet_time_scale_shift", "projection_class_embeddings_input_dim", "transformer_layers_per_block",
             "addition_embed_type", "addition_time_embed_dim")


def make_union(unet) -> ControlNetUnionModel:
    """``ControlNetUnionModel.from_unet``'s config and weights with the union's transformer at the UNet's first
    width (from_unet keeps 320 channels, which only SDXL's first width fits), the zero-initialised parts random."""
    torch.manual_seed(SEED)
    width = unet.config.block_out_channels[0]
    embedding = (8, 16, 32)
    net = ControlNetUnionModel(**{k: unet.config[k] for k in UNET_KEYS}, conditioning_embedding_out_channels=embedding,
                               num_control_type=8, num_trans_channel=width, num_trans_head=2, num_trans_layer=1,
                               num_proj_channel=width)
    net.conv_in.load_state_dict(unet.conv_in.state_dict())
    net.time_embedding.load_state_dict(unet.time_embedding.state_dict())
    net.down_blocks.load_state_dict(unet.down_blocks.state_dict(), strict=False)
    net.mid_block.load_state_dict(unet.mid_block.state_dict(), strict=False)
    zero = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out,
            net.spatial_ch_projs]
    with torch.no_grad():
        for layer in zero:
            layer.reset_parameters()
            layer.weight.mul_(3.0)  # strong enough that the scale and each control type show in 64x64 images
        net.controlnet_cond_embedding.conv_out.weight.mul_(10.0)  # the image's embedding about conv_in's size
    return randomized(net, SEED)


def save_union(unet) -> ControlNetUnionModel:
    """union/ in float16; returns it loaded back in float32 (what the references use)."""
    shutil.rmtree(FOLDER / "union", ignore_errors=True)
    make_union(unet).half().save_pretrained(FOLDER / "union", safe_serialization=True)
    return ControlNetUnionModel.from_pretrained(FOLDER / "union", torch_dtype=torch.float32).eval()


def module_case(net: ControlNetUnionModel) -> dict[str, np.ndarray]:
    """Two calls of ``net`` on fixed random 4-row inputs (16x16 latents, 64x64 images in [0, 1]): one image of type 3
    (scale 0.7: every residual scaled) and two of types 1 and 3 (scales 0.7 and 0.5: each image's condition)."""
    rng = np.random.RandomState(6)
    inputs = dict(sample=rng.randn(4, 4, 16, 16).astype(np.float32),
                  timestep=np.array([500.0, 500.0, 21.0, 21.0], np.float32),
                  hidden=rng.randn(4, 77, 80).astype(np.float32), text_embeds=rng.randn(4, 48).astype(np.float32),
                  time_ids=np.array([[64, 64, 0, 0, 64, 64]] * 4, np.float32),
                  cond=rng.rand(2, 4, 3, 64, 64).astype(np.float32))
    out = {f"module_{k}": v for k, v in inputs.items()}
    for name, types, scales in (("one", [3], [0.7]), ("two", [1, 3], [0.7, 0.5])):
        control_type = torch.zeros(8).scatter_(0, torch.tensor(types), 1).reshape(1, -1).repeat(4, 1)
        with torch.no_grad():
            down, mid = net(torch.from_numpy(inputs["sample"]), torch.from_numpy(inputs["timestep"]),
                            encoder_hidden_states=torch.from_numpy(inputs["hidden"]),
                            controlnet_cond=[torch.from_numpy(inputs["cond"][k]) for k in range(len(types))],
                            control_type=control_type, control_type_idx=types, conditioning_scale=scales,
                            added_cond_kwargs={"text_embeds": torch.from_numpy(inputs["text_embeds"]),
                                               "time_ids": torch.from_numpy(inputs["time_ids"])}, return_dict=False)
        out.update({f"module_{name}_down_{k}": d.numpy() for k, d in enumerate(down)})
        out[f"module_{name}_mid"] = mid.numpy()
    return out


def main() -> None:
    torch.set_num_threads(1)  # the same float32 sums whatever the machine's core count
    base = StableDiffusionXLPipeline.from_pretrained(FIXTURES / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    net = save_union(base.unet)
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    with np.load(CONTROLS) as data:
        controls = data["controls"]
    arrays = module_case(net)
    pipe = StableDiffusionXLControlNetUnionPipeline(
        vae=base.vae, text_encoder=base.text_encoder, text_encoder_2=base.text_encoder_2, tokenizer=base.tokenizer,
        tokenizer_2=base.tokenizer_2, scheduler=base.scheduler, unet=base.unet, controlnet=net, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    meta = {}
    for key, (images, types, scale) in CASES.items():
        out = pipe(control_image=[PIL.Image.fromarray(controls[i]) for i in images], control_mode=types,
                   controlnet_conditioning_scale=scale, latents=torch.from_numpy(noise.copy()), **SETTINGS,
                   num_images_per_prompt=2, height=64, width=64, output_type="np").images
        arrays[f"{key}_images"] = np.round(out * 255).astype(np.uint8)
        meta[key] = dict(controls=images, control_types=types, scale=scale)
    write_npz(FOLDER / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.make_fixtures controlnet-union (the torch venv)", versions=versions(),
                torch_threads=1, model="tests/fixtures/tiny-pt", settings=SETTINGS, size=[64, 64],
                seeds=[int(s) for s in seeds], cases=meta,
                notes=["Control images: tiny-pt-controlnet/reference.npz controls[i], one picture for both images.",
                       "Noise: noise.npz of tiny-pt-img2img (seeds 41, 42), txt2img's latents (x init_noise_sigma by "
                       "the pipeline).",
                       "module_*: union (float32) on fixed 4-row inputs; module_cond (2 images, 4 rows, 3, 64, 64); "
                       "module_one_*: cond[0], type 3, scale 0.7; module_two_*: cond[0] type 1 scale 0.7 and cond[1] "
                       "type 3 scale 0.5; down_0..8 and mid, channels-first."])
    (FOLDER / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {FOLDER}")


def cmd_controlnet_union() -> None:
    """``python -m tools.make_fixtures controlnet-union``: :func:`main`."""
    main()


if __name__ == "__main__":
    main()
