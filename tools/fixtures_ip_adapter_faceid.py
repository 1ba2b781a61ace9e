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
  :data:`LAYER_GAIN`, and, as h94's real file, a LoRA for every attention (:func:`faceid_lora`): ``ip_adapter.{i}.
  to_q_lora/to_k_lora/to_v_lora/to_out_lora.down/up.weight`` for the i-th of ``unet.attn_processors`` (attn1 and
  attn2; 44 for tiny-pt), rank :data:`LORA_RANK`, seed 34, strong enough to move the images far past the tolerance.
  diffusers' ``load_ip_adapter`` applies it at weight 1 (``_load_ip_adapter_loras``, ``load_lora_weights(...,
  adapter_name="faceid_0")``; checked: ``faceid_0`` is in ``unet.peft_config``).
* ``reference.npz``: ``embeds`` (3, 32) float32, random unit vectors (insightface's ``normed_embedding`` is one, 512
  wide), ``module_tokens`` (3, 4, 80) and ``module_negative`` (1, 4, 80): the loaded projection of them and of a zero
  embedding, ``none_images`` (the pipeline without an adapter) and ``<case>_images`` (2, 64, 64, 3) uint8 for
  :data:`CASES`: 2 images (``num_images_per_prompt`` 2), 10 Euler steps, "a red circle", negative "a blue square",
  guidance 5, the engine's noise; ``ip_adapter_image_embeds=[(2, n, 32)]``: zeros (the negative, as diffusers' FaceID
  example) then the case's embeddings; all with the LoRA, as diffusers runs them. ``faceid_no_lora_images``: the
  "faceid" case with the LoRA set to weight 0 (``set_adapters(["faceid_0"], [0.0])``): what the adapter alone gives.
* ``reference.json``: each case's embeddings and scale, how far the LoRA moves the "faceid" case, diffusers'
  ``attn_processors`` names (key id i is the i-th), versions.
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
LORA_RANK = 2  # h94's is 128; 2 keeps the file small and still tells down (rank, in) from up (out, rank)
# up @ down has entries ~ LORA_GAIN / sqrt(in), of the order of the layers' own (PyTorch's init: ~0.58 / sqrt(in)):
# a LoRA dropped, on the wrong layers or at another weight moves the images far past the tolerance
LORA_GAIN = 0.5


def faceid_lora(unet) -> dict[str, torch.Tensor]:
    """``ip_adapter.{i}.to_{q,k,v,out}_lora.{down,up}.weight`` for the i-th of ``unet.attn_processors`` (the keys
    diffusers' ``_load_ip_adapter_loras`` reads): down (LORA_RANK, in) ~ N(0, 1 / in), up (out, LORA_RANK) ~
    N(0, LORA_GAIN^2 / LORA_RANK), seed 34; ``in`` the cross-attention width for attn2's to_k / to_v."""
    generator = torch.Generator().manual_seed(34)
    out = {}
    for i, name in enumerate(unet.attn_processors):
        attention = unet.get_submodule(name[: -len(".processor")])
        for which, linear in (("to_q", attention.to_q), ("to_k", attention.to_k), ("to_v", attention.to_v),
                              ("to_out", attention.to_out[0])):
            down = torch.randn((LORA_RANK, linear.in_features), generator=generator) / linear.in_features ** 0.5
            up = torch.randn((linear.out_features, LORA_RANK), generator=generator) * LORA_GAIN / LORA_RANK ** 0.5
            out[f"ip_adapter.{i}.{which}_lora.down.weight"] = down.contiguous()
            out[f"ip_adapter.{i}.{which}_lora.up.weight"] = up.contiguous()
    return out


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
    state.update(faceid_lora(pipe.unet))
    processors = list(pipe.unet.attn_processors)
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
    assert "faceid_0" in pipe.unet.peft_config, "diffusers did not load the FaceID LoRA"
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
    pipe.set_ip_adapter_scale(CASES["faceid"][1])
    pipe.set_adapters(["faceid_0"], adapter_weights=[0.0])  # the adapter without its LoRA
    chosen = embeds[CASES["faceid"][0]][None]
    arrays["faceid_no_lora_images"] = images_of(pipe, noise,
                                                ip_adapter_image_embeds=[torch.cat([torch.zeros_like(chosen), chosen])])
    lora = dict(rank=LORA_RANK, gain=LORA_GAIN, seed=34, keys=len([k for k in state if "_lora." in k]),
                mean_change_of_faceid=float(np.abs(arrays["faceid_images"].astype(int)
                                                   - arrays["faceid_no_lora_images"]).mean()),
                max_change_of_faceid=int(np.abs(arrays["faceid_images"].astype(int)
                                                - arrays["faceid_no_lora_images"]).max()))
    print("lora", lora)
    write_npz(folder / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.make_fixtures "
                        "ip-adapter-faceid",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt", settings=SETTINGS,
                size=[64, 64], seeds=[int(s) for s in seeds], faceid=FACEID, tokens=FACEID["num_tokens"], cases=meta,
                lora=lora, attn_processors=processors,
                notes=[f"load_ip_adapter(folder, subfolder='', weight_name='{FILE}', image_encoder_folder=None); "
                       "set_ip_adapter_scale(scale); ip_adapter_image_embeds=[cat(zeros, the case's embeddings)] "
                       "(one adapter, its embeddings' tokens concatenated). load_ip_adapter loads the file's LoRA "
                       "(adapter 'faceid_0', weight 1): every case's images are with it.",
                       "Noise: noise.npz of tiny-pt-img2img (seeds 41, 42) as the pipeline's latents."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"wrote {folder}")


if __name__ == "__main__":
    cmd_ip_adapter_faceid()
