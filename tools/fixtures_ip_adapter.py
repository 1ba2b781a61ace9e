"""IP-Adapter references: a tiny random IP-Adapter for tiny-pt in h94/IP-Adapter's file layout, a tiny random
``CLIPVisionModelWithProjection`` as its image encoder, and diffusers' ``StableDiffusionXLPipeline`` images with
``load_ip_adapter``, for tests/models/test_ip_adapter_module.py and tests/program/test_generate_ip_adapter.py.

    .venv-torch/bin/python -m tools.make_fixtures ip-adapter      (the torch venv; never the runtime's)

Needs tests/fixtures/tiny-pt/, tiny-pt-controlnet/cn-a and tiny-pt-img2img/noise.npz (the engine's initial noise of
seeds 41 and 42). Writes
tests/fixtures/tiny-pt-ip-adapter/ laid out as h94/IP-Adapter is (what people download):

* ``sdxl_models/image_encoder/``: ``CLIPVisionModelWithProjection`` (hidden 32, 2 layers, 4 heads, 32 px images in
  8 px patches, projection 24), seed 21, 1-D parameters moved (``randomized``), ``save_pretrained`` (float32).
* ``sdxl_models/ip-adapter_sdxl.safetensors``: the plain adapter's state dict in h94's keys: ``image_proj.proj.*``
  (24 -> 4 tokens x tiny-pt's cross-attention width 80), ``image_proj.norm.*``, and ``ip_adapter.{2j+1}.to_k_ip.weight``
  / ``to_v_ip.weight`` for the j-th cross-attention layer in the order of diffusers' ``unet.attn_processors``
  (PyTorch's default Linear init x 2, seed 22: strong enough that the adapter moves 64 x 64 images).
* ``models/image_encoder/``: a second encoder (hidden 40, projection 16; seed 23), where h94 keeps ViT-H, for
  ``sdxl_models/ip-adapter-plus_sdxl_vit-h.safetensors``: a Plus adapter in h94's keys: diffusers'
  ``IPAdapterPlusImageProjection`` (40 -> 4 blocks of width 48 (diffusers reads no depth from a file: 4), 1 head of
  64, 6 queries -> 80; seed 24, 1-D parameters moved) written back in the original Resampler's names
  (``layers.{i}.0.to_kv`` = to_k and to_v stacked, ``0.norm1/norm2``, ``1.0/1.1/1.3``: the inverse of diffusers'
  ``_convert_ip_adapter_image_proj_to_diffusers``, checked by loading it back), its ``ip_adapter.*`` layers as the
  plain one's (seed 25).
* ``reference.npz``: ``pictures`` (2, 64, 64, 3) uint8 (tools/fixtures_img2img.py's), ``tall`` (64, 40, 3) uint8 (a
  non-square reference: the first picture's left 40 columns), ``pixels_<name>`` (3, 32, 32) float32: diffusers'
  feature extractor (``CLIPImageProcessor(size=32, crop_size=32)``, as ``load_ip_adapter`` makes it) on each,
  the module case (``module_image_embeds`` (3, 24), ``module_tokens`` (3, 4, 80): the encoder's ``image_embeds`` and
  the adapter's image projection of them; ``module_plus_tokens`` (3, 6, 80) and ``module_plus_negative`` (1, 6, 80):
  Plus's tokens of the second encoder's penultimate hidden states of them and of a zero image), and
  ``<case>_images`` (2, 64, 64, 3) uint8 for :data:`CASES`, ``with_controlnet`` (:data:`CONTROLNET_CASE`:
  StableDiffusionXLControlNetPipeline with tiny-pt-controlnet's cn-a) and :data:`PLUS_CASES`: 2 images
  (one prompt, ``num_images_per_prompt`` 2), 10 Euler steps, "a red circle", negative "a blue square", guidance 5,
  the engine's noise; ``none_images``: the same without the adapter.
* ``reference.json``: each case's images and scale, the layer of each ``ip_adapter`` key id, versions.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import PIL.Image
import torch
from safetensors.torch import save_file
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from tools.fixtures_common import FIXTURES, randomized, versions, write_npz
from tools.fixtures_img2img import img2img_pictures

FOLDER = FIXTURES / "tiny-pt-ip-adapter"
NOISE = FIXTURES / "tiny-pt-img2img" / "noise.npz"
ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
               patch_size=8, projection_dim=24, hidden_act="gelu")
TOKENS = 4  # the plain adapter's image tokens (diffusers: num_image_text_embeds = 4 for "proj.weight")
SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0, num_inference_steps=10)
# case -> (reference images by name, scale)
CASES = {
    "plain": (["picture0"], 0.8),
    "tall": (["tall"], 1.0),
    "two_images": (["picture0", "picture1"], 0.6),
}
VIT_H = dict(ENCODER, hidden_size=40, intermediate_size=80, projection_dim=16)  # where h94 keeps ViT-H
PLUS = dict(embed_dims=40, output_dims=80, hidden_dims=48, depth=4, dim_head=64, heads=1, num_queries=6)
PLUS_CASES = {"plus": (["tall"], 0.7)}
# the plain adapter with a ControlNet: (references, scale, control image, ControlNet weight), cn-a over every step
CONTROLNET_CASE = (["picture1"], 0.8, "picture0", 0.8)


def references() -> dict[str, np.ndarray]:
    """The reference pictures by name: two 64 x 64 and one 64 x 40 (height x width: a non-square one)."""
    pictures = img2img_pictures()
    return {"picture0": pictures[0], "picture1": pictures[1], "tall": pictures[0][:, :40].copy()}


def make_encoder(config: dict = ENCODER, seed: int = 21) -> CLIPVisionModelWithProjection:
    torch.manual_seed(seed)
    return randomized(CLIPVisionModelWithProjection(CLIPVisionConfig(**config)), seed)


def cross_attention_layers(unet) -> list[str]:
    """The cross-attention processors' names in ``unet.attn_processors`` order: key id 2j + 1 is layer j's
    (diffusers' ``_convert_ip_adapter_attn_to_diffusers``)."""
    return [name for name in unet.attn_processors if not name.endswith("attn1.processor")]


def hidden_size(unet, name: str) -> int:
    """The width of a processor's block, as diffusers reads it from the name."""
    channels = unet.config.block_out_channels
    if name.startswith("mid_block"):
        return channels[-1]
    block = int(name.split(".")[1])
    return channels[block] if name.startswith("down_blocks") else list(reversed(channels))[block]


def ip_layers(unet, seed: int) -> dict[str, torch.Tensor]:
    """``ip_adapter.{2j+1}.to_k_ip/to_v_ip.weight`` for every cross-attention (PyTorch's default Linear init x 2)."""
    torch.manual_seed(seed)
    cross, out = unet.config.cross_attention_dim, {}
    for j, name in enumerate(cross_attention_layers(unet)):
        width = hidden_size(unet, name)
        for which in ("to_k_ip", "to_v_ip"):
            out[f"ip_adapter.{2 * j + 1}.{which}.weight"] = torch.nn.Linear(cross, width, bias=False).weight * 2.0
    return out


def plus_projection():
    """diffusers' IPAdapterPlusImageProjection of :data:`PLUS`, seed 24, 1-D parameters moved."""
    from diffusers.models.embeddings import IPAdapterPlusImageProjection

    torch.manual_seed(24)
    return randomized(IPAdapterPlusImageProjection(**PLUS), 24)


def to_h94(projection) -> dict[str, torch.Tensor]:
    """A diffusers IPAdapterPlusImageProjection's state dict in the original Resampler's names (``image_proj.``)."""
    out = {}
    for key, value in projection.state_dict().items():
        parts = key.split(".")
        if parts[0] != "layers":
            out[key] = value
            continue
        i, rest = parts[1], ".".join(parts[2:])
        names = {"ln0.weight": "0.norm1.weight", "ln0.bias": "0.norm1.bias", "ln1.weight": "0.norm2.weight",
                 "ln1.bias": "0.norm2.bias", "attn.to_q.weight": "0.to_q.weight",
                 "attn.to_out.0.weight": "0.to_out.weight",
                 "ff.0.weight": "1.0.weight", "ff.0.bias": "1.0.bias", "ff.1.net.0.proj.weight": "1.1.weight",
                 "ff.1.net.2.weight": "1.3.weight"}
        if rest in names:
            out[f"layers.{i}.{names[rest]}"] = value
        elif rest == "attn.to_k.weight":
            to_v = projection.state_dict()[f"layers.{i}.attn.to_v.weight"]
            out[f"layers.{i}.0.to_kv.weight"] = torch.cat([value, to_v])  # keys first, as the Resampler's chunk
        elif rest != "attn.to_v.weight":
            raise KeyError(key)
    return {f"image_proj.{k}": v for k, v in out.items()}


def make_adapter(unet, embed_dim: int) -> dict[str, torch.Tensor]:
    """The plain adapter's state dict in h94's keys (see the module docstring)."""
    torch.manual_seed(22)
    cross = unet.config.cross_attention_dim
    proj = torch.nn.Linear(embed_dim, TOKENS * cross)
    norm = torch.nn.LayerNorm(cross)
    out = {"image_proj.proj.weight": proj.weight, "image_proj.proj.bias": proj.bias,
           "image_proj.norm.weight": norm.weight, "image_proj.norm.bias": norm.bias}
    out.update(ip_layers(unet, 22))
    generator = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for key in ("image_proj.proj.bias", "image_proj.norm.weight", "image_proj.norm.bias"):
            out[key] = out[key] + 0.1 * torch.randn(out[key].shape, generator=generator)
    return {k: v.detach().contiguous().float() for k, v in out.items()}


def pipeline():
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(FIXTURES / "tiny-pt", dtype=torch.float32,
                                                     add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images_of(pipe, noise: np.ndarray, **kw) -> np.ndarray:
    images = pipe(**SETTINGS, num_images_per_prompt=2, height=64, width=64, output_type="np",
                  latents=torch.from_numpy(noise.copy()), **kw).images
    return np.round(images * 255).astype(np.uint8)


def cmd_ip_adapter(out=FIXTURES) -> None:
    folder = out / FOLDER.name
    torch.set_num_threads(1)  # the same float32 sums whatever the machine's core count
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "sdxl_models").mkdir(parents=True)
    pipe = pipeline()
    encoder = make_encoder()
    encoder.save_pretrained(folder / "sdxl_models" / "image_encoder", safe_serialization=True)
    adapter = make_adapter(pipe.unet, ENCODER["projection_dim"])
    save_file(adapter, str(folder / "sdxl_models" / "ip-adapter_sdxl.safetensors"))
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    pictures = references()
    arrays = {"pictures": img2img_pictures(), "tall": pictures["tall"]}
    extractor = CLIPImageProcessor(size=ENCODER["image_size"], crop_size=ENCODER["image_size"])
    names = ["picture0", "picture1", "tall"]
    pixels = torch.cat([extractor(PIL.Image.fromarray(pictures[n]), return_tensors="pt").pixel_values
                        for n in names])
    for n, p in zip(names, pixels):
        arrays[f"pixels_{n}"] = p.numpy()
    arrays["none_images"] = images_of(pipe, noise)
    pipe.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name="ip-adapter_sdxl.safetensors",
                         image_encoder_folder="image_encoder")
    assert pipe.feature_extractor.size == {"shortest_edge": 32}, pipe.feature_extractor.size
    with torch.no_grad():  # the module case: the loaded encoder and projection, on the three pictures
        embeds = pipe.image_encoder(pixels).image_embeds  # (3, 24)
        tokens = pipe.unet.encoder_hid_proj.image_projection_layers[0](embeds)  # (3, 4, 80)
    arrays.update(module_image_embeds=embeds.numpy(), module_tokens=tokens.numpy())
    meta = {}
    for key, (refs, scale) in CASES.items():
        pipe.set_ip_adapter_scale(scale)
        images = [PIL.Image.fromarray(pictures[n]) for n in refs]
        arrays[f"{key}_images"] = images_of(pipe, noise, ip_adapter_image=[images])
        meta[key] = dict(references=refs, scale=scale,
                         mean_change_from_none=float(np.abs(arrays[f"{key}_images"].astype(int)
                                                            - arrays["none_images"]).mean()))
        print(key, meta[key])
    with_controlnet = controlnet_case(pipe, noise, pictures, arrays)
    # before Plus: its Resampler's attentions join unet.attn_processors once it is loaded (encoder_hid_proj.*)
    layers = {2 * j + 1: name.removesuffix(".processor") for j, name in enumerate(cross_attention_layers(pipe.unet))}
    plus_case(pipe, folder, noise, pixels, pictures, arrays, meta)
    write_npz(folder / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.make_fixtures ip-adapter",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt", settings=SETTINGS,
                size=[64, 64], seeds=[int(s) for s in seeds], encoder=ENCODER, tokens=TOKENS, cases=meta,
                vit_h_encoder=VIT_H, plus=PLUS, with_controlnet=with_controlnet,
                layers=layers,
                notes=["load_ip_adapter(folder, subfolder='sdxl_models', weight_name='ip-adapter_sdxl.safetensors', "
                       "image_encoder_folder='image_encoder'); set_ip_adapter_scale(scale); ip_adapter_image=[the "
                       "case's references] (one adapter, its images' tokens concatenated).",
                       "Noise: noise.npz of tiny-pt-img2img (seeds 41, 42) as the pipeline's latents."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {folder}")


def controlnet_case(pipe, noise, pictures, arrays) -> dict:
    """:data:`CONTROLNET_CASE`: the plain adapter with tiny-pt-controlnet's cn-a (one unit over every step, so
    diffusers' step rule and A1111's keep the same steps) in diffusers' StableDiffusionXLControlNetPipeline, which
    shares the pipeline's UNet (its IP-Adapter processors loaded) and image encoder."""
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    refs, scale, control, weight = CONTROLNET_CASE
    net = ControlNetModel.from_pretrained(FIXTURES / "tiny-pt-controlnet" / "cn-a", torch_dtype=torch.float32).eval()
    cn_pipe = StableDiffusionXLControlNetPipeline(
        vae=pipe.vae, text_encoder=pipe.text_encoder, text_encoder_2=pipe.text_encoder_2, tokenizer=pipe.tokenizer,
        tokenizer_2=pipe.tokenizer_2, unet=pipe.unet, scheduler=pipe.scheduler, controlnet=net,
        image_encoder=pipe.image_encoder, feature_extractor=pipe.feature_extractor, add_watermarker=False)
    cn_pipe.set_progress_bar_config(disable=True)
    pipe.set_ip_adapter_scale(scale)
    images = [PIL.Image.fromarray(pictures[n]) for n in refs]
    arrays["with_controlnet_images"] = images_of(cn_pipe, noise, ip_adapter_image=[images],
                                                 image=PIL.Image.fromarray(pictures[control]),
                                                 controlnet_conditioning_scale=weight)
    case = dict(references=refs, scale=scale, controlnet="cn-a", control=control, control_weight=weight,
                pipeline=type(cn_pipe).__name__)
    print("with_controlnet", case)
    return case


def plus_case(pipe, folder, noise, pixels, pictures, arrays, meta) -> None:
    """The Plus adapter and its encoder (models/image_encoder) written, loaded by diffusers in place of the plain
    one, its module outputs and :data:`PLUS_CASES`' images added to ``arrays`` and ``meta``."""
    make_encoder(VIT_H, 23).save_pretrained(folder / "models" / "image_encoder", safe_serialization=True)
    projection = plus_projection()
    state = {k: v.detach().contiguous().float() for k, v in to_h94(projection).items()}
    state.update({k: v.detach().contiguous().float() for k, v in ip_layers(pipe.unet, 25).items()})
    save_file(state, str(folder / "sdxl_models" / "ip-adapter-plus_sdxl_vit-h.safetensors"))
    pipe.unload_ip_adapter()
    pipe.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name="ip-adapter-plus_sdxl_vit-h.safetensors",
                         image_encoder_folder="models/image_encoder", low_cpu_mem_usage=False)
    loaded = pipe.unet.encoder_hid_proj.image_projection_layers[0]
    want = projection.state_dict()
    assert set(loaded.state_dict()) == set(want), "the Resampler's keys did not convert back"
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want), "the Resampler's weights differ"
    with torch.no_grad():
        hidden = pipe.image_encoder(torch.cat([torch.zeros_like(pixels[:1]), pixels]),
                                    output_hidden_states=True).hidden_states[-2]
        tokens = loaded(hidden)  # (4, 6, 80): the zero image's, then the pictures'
    arrays.update(module_plus_negative=tokens[:1].numpy(), module_plus_tokens=tokens[1:].numpy())
    for key, (refs, scale) in PLUS_CASES.items():
        pipe.set_ip_adapter_scale(scale)
        images = [PIL.Image.fromarray(pictures[n]) for n in refs]
        arrays[f"{key}_images"] = images_of(pipe, noise, ip_adapter_image=[images])
        meta[key] = dict(references=refs, scale=scale, adapter="ip-adapter-plus_sdxl_vit-h",
                         mean_change_from_none=float(np.abs(arrays[f"{key}_images"].astype(int)
                                                            - arrays["none_images"]).mean()))
        print(key, meta[key])


if __name__ == "__main__":
    cmd_ip_adapter()
