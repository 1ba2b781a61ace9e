"""IP-Adapter FaceID references: a tiny random FaceID adapter for tiny-pt in h94/IP-Adapter-FaceID's file layout and
diffusers' ``StableDiffusionXLPipeline`` images with it (``load_ip_adapter(..., image_encoder_folder=None)`` and
``ip_adapter_image_embeds``), for tests/models/test_ip_adapter_faceid.py,
tests/program/test_generate_ip_adapter_faceid.py and tests/engine/test_local_ip_adapter_faceid.py.

    .venv-torch/bin/python -m tools.make_fixtures ip-adapter-faceid      (the torch venv; never the runtime's)

Needs tests/fixtures/tiny-pt/ and tiny-pt-img2img/noise.npz (the engine's initial noise of seeds 41 and 42). Writes
tests/fixtures/tiny-pt-ip-adapter-faceid/:

* ``ip-adapter-faceid_sdxl.safetensors``: FaceID's state dict in h94's keys (no image encoder: FaceID takes a face
  embedding): ``image_proj.proj.0.*`` (Linear 32 -> 64), ``image_proj.proj.2.*`` (Linear 64 -> 4 tokens x tiny-pt's
  cross-attention width 80), ``image_proj.norm.*``: diffusers' ``IPAdapterFaceIDImageProjection(image_embed_dim=32,
  cross_attention_dim=80, mult=2, num_tokens=4)`` (seed 31, 1-D parameters moved) written back in the original
  ``MLPProjModel``'s names (the inverse of diffusers' ``_convert_ip_adapter_image_proj_to_diffusers``, checked by
  loading it back), and ``ip_adapter.{2j+1}.to_k_ip/to_v_ip.weight`` as tools/fixtures_ip_adapter.py's (seed 32) x
  :data:`LAYER_GAIN`.
  h94's real file also has LoRA weights (``ip_adapter.*.to_*_lora.*``); this one has none, so diffusers loads no
  LoRA (the engine does not apply a FaceID file's LoRA: docs/ip-adapter.md).
* ``reference.npz``: ``embeds`` (3, 32) float32, random unit vectors (insightface's ``normed_embedding`` is one, 512
  wide), ``module_tokens`` (3, 4, 80) and ``module_negative`` (1, 4, 80): the loaded projection of them and of a zero
  embedding, ``none_images`` (the pipeline without an adapter) and ``<case>_images`` (2, 64, 64, 3) uint8 for
  :data:`CASES`: 2 images (``num_images_per_prompt`` 2), 10 Euler steps, "a red circle", negative "a blue square",
  guidance 5, the engine's noise; ``ip_adapter_image_embeds=[(2, n, 32)]``: zeros (the negative, as diffusers' FaceID
  example) then the case's embeddings.
* ``reference.json``: each case's embeddings and scale, versions.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

from tools.fixtures_common import FIXTURES, randomized, versions, write_npz
from tools.fixtures_ip_adapter import SETTINGS, images_of, ip_layers, pipeline

FOLDER = FIXTURES / "tiny-pt-ip-adapter-faceid"
NOISE = FIXTURES / "tiny-pt-img2img" / "noise.npz"
FILE = "ip-adapter-faceid_sdxl.safetensors"
FACEID = dict(image_embed_dim=32, mult=2, num_tokens=4)  # cross_attention_dim: tiny-pt's
# case -> (embedding rows of reference.npz's ``embeds``, scale)
CASES = {"faceid": ([0], 1.0), "faceid_two": ([1, 2], 0.8)}
LAYER_GAIN = 2.0  # the layers x 2 again (x 4 PyTorch's init): 4 tokens of one embedding move 64 x 64 images enough


def faceid_projection(cross: int):
    """diffusers' IPAdapterFaceIDImageProjection of :data:`FACEID`, seed 31, 1-D parameters moved."""
    from diffusers.models.embeddings import IPAdapterFaceIDImageProjection

    torch.manual_seed(31)
    return randomized(IPAdapterFaceIDImageProjection(cross_attention_dim=cross, **FACEID), 31)


def to_h94(projection) -> dict[str, torch.Tensor]:
    """The projection's state dict in the original MLPProjModel's names (``proj.0``, ``proj.2``, ``norm``)."""
    names = {"ff.net.0.proj": "proj.0", "ff.net.2": "proj.2", "norm": "norm"}
    out = {}
    for key, value in projection.state_dict().items():
        module, leaf = key.rsplit(".", 1)
        out[f"image_proj.{names[module]}.{leaf}"] = value.detach().contiguous().float()
    return out


def cmd_ip_adapter_faceid(out=FIXTURES) -> None:
    folder = out / FOLDER.name
    torch.set_num_threads(1)  # the same float32 sums whatever the machine's core count
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    pipe = pipeline()
    projection = faceid_projection(pipe.unet.config.cross_attention_dim)
    state = to_h94(projection)
    state.update({k: (v * LAYER_GAIN).detach().contiguous().float() for k, v in ip_layers(pipe.unet, 32).items()})
    save_file(state, str(folder / FILE))
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    generator = torch.Generator().manual_seed(33)
    embeds = torch.randn((3, FACEID["image_embed_dim"]), generator=generator)
    embeds = embeds / embeds.norm(dim=1, keepdim=True)
    arrays = {"embeds": embeds.numpy(), "none_images": images_of(pipe, noise)}
    pipe.load_ip_adapter(str(folder), subfolder="", weight_name=FILE, image_encoder_folder=None,
                         low_cpu_mem_usage=False)
    assert pipe.image_encoder is None
    loaded = pipe.unet.encoder_hid_proj.image_projection_layers[0]
    assert type(loaded).__name__ == "IPAdapterFaceIDImageProjection", type(loaded)
    want = projection.state_dict()
    assert set(loaded.state_dict()) == set(want), "the projection's keys did not convert back"
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want), "the projection's weights differ"
    with torch.no_grad():
        tokens = loaded(torch.cat([torch.zeros_like(embeds[:1]), embeds]))  # (4, 4, 80)
    arrays.update(module_negative=tokens[:1].numpy(), module_tokens=tokens[1:].numpy())
    meta = {}
    for key, (rows, scale) in CASES.items():
        pipe.set_ip_adapter_scale(scale)
        chosen = embeds[rows][None]  # (1, n, 32)
        arrays[f"{key}_images"] = images_of(pipe, noise,
                                            ip_adapter_image_embeds=[torch.cat([torch.zeros_like(chosen), chosen])])
        meta[key] = dict(embeds=rows, scale=scale,
                         mean_change_from_none=float(np.abs(arrays[f"{key}_images"].astype(int)
                                                            - arrays["none_images"]).mean()))
        print(key, meta[key])
    write_npz(folder / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.make_fixtures "
                        "ip-adapter-faceid",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt", settings=SETTINGS,
                size=[64, 64], seeds=[int(s) for s in seeds], faceid=FACEID, tokens=FACEID["num_tokens"], cases=meta,
                notes=[f"load_ip_adapter(folder, subfolder='', weight_name='{FILE}', image_encoder_folder=None); "
                       "set_ip_adapter_scale(scale); ip_adapter_image_embeds=[cat(zeros, the case's embeddings)] "
                       "(one adapter, its embeddings' tokens concatenated).",
                       "Noise: noise.npz of tiny-pt-img2img (seeds 41, 42) as the pipeline's latents."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {folder}")


if __name__ == "__main__":
    cmd_ip_adapter_faceid()
