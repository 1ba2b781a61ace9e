"""A LoRA for the tiny refiner and diffusers' ensemble of experts with it, for tests/program/test_generate_refiner.py.

    /tmp/torchvenv/bin/python -m tools.fixtures_refiner_lora      (the torch venv; never the runtime's)

Writes tests/fixtures/tiny-pt-refiner-reference/:

* ``refiner-lora.safetensors``: a PEFT LoRA (r 4, lora_alpha 8: scale 2) on tests/fixtures/tiny-pt-refiner's UNet
  attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``), its A and B seeded noise, saved by diffusers'
  ``save_lora_weights`` with its adapter metadata. Its cross-attention ``to_k``/``to_v`` take the refiner's 48
  text channels and it adapts the refiner's fourth block level, so it fits the refiner and not tiny-pt's base.
* ``lora.{npz,json}``: diffusers' ensemble (tiny-pt's ``StableDiffusionXLPipeline(denoising_end=0.3)``, then the
  refiner's img2img pipeline with ``denoising_start=0.8``) with the LoRA loaded into the refiner
  (``load_lora_weights``, every layer adapted, no warning) at weight 0.8 (``set_adapters``); Euler, the reference
  settings and the engine's noise of tools.refiner_fixtures.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

from tools.fixtures_common import plain_config, versions, write_npz
from tools.refiner_fixtures import BASE, NOISE, REFERENCE, REFINER, SETTINGS, SIZE

LORA = REFERENCE / "refiner-lora.safetensors"
WEIGHT = 0.8
SWITCH = 0.3


def write_lora(refiner: StableDiffusionXLImg2ImgPipeline) -> int:
    """The LoRA file (module docstring); the count of layers it adapts. ``refiner``'s UNet gets the adapter."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                        init_lora_weights=False)
    model = inject_adapter_in_model(config, refiner.unet, adapter_name="fixture")
    generator = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for key, param in sorted(model.named_parameters()):
            if "lora_A" in key:
                param.copy_(torch.randn(param.shape, generator=generator) / int(np.prod(param.shape[1:])) ** 0.5)
            elif "lora_B" in key:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    layers = get_peft_model_state_dict(model, adapter_name="fixture")
    StableDiffusionXLImg2ImgPipeline.save_lora_weights(REFERENCE, unet_lora_layers=layers, weight_name=LORA.name,
                                                       unet_lora_adapter_metadata=config.to_dict())
    return sum(1 for key in layers if "lora_A" in key)


def main() -> None:
    torch.set_num_threads(1)
    with np.load(NOISE) as data:
        seeds, noise = data["seeds"], data["noise"]
    count = write_lora(StableDiffusionXLImg2ImgPipeline.from_pretrained(REFINER, dtype=torch.float32,
                                                                        add_watermarker=False))
    base = StableDiffusionXLPipeline.from_pretrained(BASE, dtype=torch.float32, add_watermarker=False)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pretrained(REFINER, dtype=torch.float32, add_watermarker=False)
    refiner.load_lora_weights(str(LORA.parent), weight_name=LORA.name, adapter_name="refiner-lora")
    adapted = sum(1 for _, module in refiner.unet.named_modules()
                  if hasattr(module, "lora_A") and "refiner-lora" in module.lora_A)
    assert adapted == count, (adapted, count)  # every layer of the file adapted (the text encoders have none)
    refiner.set_adapters(["refiner-lora"], adapter_weights=[WEIGHT])
    config = plain_config(base.scheduler.config)
    arrays = {}
    for key, with_lora in (("lora", True), ("plain", False)):
        base.scheduler, refiner.scheduler = (EulerDiscreteScheduler.from_config(config),
                                             EulerDiscreteScheduler.from_config(config))
        for pipe in (base, refiner):
            pipe.set_progress_bar_config(disable=True)
        (refiner.enable_lora if with_lora else refiner.disable_lora)()
        common = dict(**SETTINGS, negative_prompt=None, num_images_per_prompt=2)
        latents = base(**common, width=SIZE, height=SIZE, latents=torch.from_numpy(noise.copy()),
                       denoising_end=SWITCH, output_type="latent").images
        images = refiner(**common, image=latents, denoising_start=SWITCH, output_type="np").images
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
    write_npz(REFERENCE / "lora.npz", arrays)
    meta = dict(made_by="python -m tools.fixtures_refiner_lora", versions=versions(), torch_threads=1,
                lora=f"tests/fixtures/tiny-pt-refiner-reference/{LORA.name}", lora_layers=count, weight=WEIGHT,
                switch_at=SWITCH, sampler="Euler", settings=SETTINGS, size=[SIZE, SIZE],
                seeds=[int(s) for s in seeds],
                notes=["lora_images: the ensemble with the LoRA in the refiner at weight 0.8; plain_images: the same "
                       "with the LoRA disabled (the ensemble's euler_08 case)."])
    (REFERENCE / "lora.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {LORA} ({count} layers) and {REFERENCE}/lora.*")


if __name__ == "__main__":
    main()
