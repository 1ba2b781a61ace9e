"""The SDXL refiner as one single file in Stability's original (sgm) layout, made from tests/fixtures/tiny-pt-refiner.

    /tmp/torchvenv/bin/python -m tools.fixtures_refiner_single      (torch venv; never run in CI; about 5 s)

Writes ``tests/fixtures/tiny-single-refiner/``:

* ``tiny-refiner-sgm.fp16.safetensors``: tiny-pt-refiner's three components with ``sd_xl_refiner_1.0.safetensors``'
  prefixes, float16 (as that file stores them): ``model.diffusion_model.`` (LDM UNet), ``first_stage_model.`` (LDM
  VAE, 1x1-conv attention) and ``conditioner.embedders.0.model.`` (text_encoder_2 in OpenCLIP names: fused
  ``in_proj``, transposed ``text_projection``, ``logit_scale``); no ``conditioner.embedders.1.*`` and no CLIP-L.
  The names come from the same inverse of diffusers' conversion as tiny-single's base file
  (``tools.make_fixtures``: ``_sgm_unet_key``, ``sgm_vae_state``, ``_sgm_open_clip``).
* ``reference.json``: what was checked and the versions.

Proof before use: ``StableDiffusionXLImg2ImgPipeline.from_single_file(file, config=tiny-pt-refiner)`` loads it with
no warning about weights or keys and holds exactly tiny-pt-refiner's tensors cast to float16. Deterministic: the
tensors are tiny-pt-refiner's (no randomness); two runs give byte-identical files.
"""

from __future__ import annotations

import json
import shutil

import torch
from diffusers import StableDiffusionXLImg2ImgPipeline
from safetensors.torch import save_file

from tools.fixtures_common import FIXTURES, versions
from tools.fixtures_single import _loaded_without_warnings, _same_weights, _sgm_open_clip, _sgm_unet_key, sgm_vae_state

REFINER = FIXTURES / "tiny-pt-refiner"
OUT = FIXTURES / "tiny-single-refiner"
FILE = "tiny-refiner-sgm.fp16.safetensors"
# sd_xl_refiner_1.0.safetensors' prefixes: OpenCLIP ViT-bigG is embedder 0 (the base's is embedder 1).
TEXT_PREFIX = "conditioner.embedders.0.model."


def sgm_refiner_state(pipe: StableDiffusionXLImg2ImgPipeline) -> dict[str, torch.Tensor]:
    """A refiner pipeline as the original refiner single file's state dict (UNet, VAE, OpenCLIP as embedder 0)."""
    unet = pipe.unet
    layers = unet.config.layers_per_block
    attention = {b for b, t in enumerate(unet.config.up_block_types) if "CrossAttn" in t}
    state = {"model.diffusion_model." + _sgm_unet_key(k, layers, attention): v for k, v in unet.state_dict().items()}
    state.update({"first_stage_model." + k: v for k, v in sgm_vae_state(pipe.vae).items()})
    state.update({TEXT_PREFIX + k: v for k, v in _sgm_open_clip(pipe.text_encoder_2).items()})
    return state


def main() -> None:
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    pipe = StableDiffusionXLImg2ImgPipeline.from_pretrained(REFINER, dtype=torch.float32, add_watermarker=False)
    path = OUT / FILE
    state = sgm_refiner_state(pipe)
    if any(k.startswith("conditioner.embedders.1.") for k in state):
        raise RuntimeError("a refiner file has no embedder 1")
    save_file({k: v.to(torch.float16).contiguous() for k, v in sorted(state.items())}, str(path))
    loaded = _loaded_without_warnings(lambda: StableDiffusionXLImg2ImgPipeline.from_single_file(
        str(path), config=str(REFINER), torch_dtype=torch.float32, add_watermarker=False))
    if loaded.text_encoder is not None:
        raise RuntimeError("from_single_file made a text_encoder for the refiner file")
    for name in ("text_encoder_2", "unet", "vae"):
        _same_weights(name, getattr(pipe, name).to(torch.float16), getattr(loaded, name))
    meta = dict(made_by="python -m tools.fixtures_refiner_single", versions=versions(), source="tiny-pt-refiner",
                files={FILE: "tiny-pt-refiner in the original sgm refiner layout, float16"},
                tensors=len(state), prefixes={p: sum(k.startswith(p) for k in state)
                          for p in ("model.diffusion_model.", "first_stage_model.", TEXT_PREFIX)},
                proof="StableDiffusionXLImg2ImgPipeline.from_single_file(file, config=tiny-pt-refiner): no warning "
                      "about weights or keys; text_encoder_2, unet and vae equal tiny-pt-refiner's in float16")
    (OUT / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(state)} tensors)")


if __name__ == "__main__":
    main()
