"""A random full-size SDXL refiner folder (diffusers format, safetensors), for load time and memory at full size.

    /tmp/torchvenv/bin/python -m tools.fullsize_refiner_fixture --out /tmp/fullsize-refiner   (torch venv; 6.1 GB)
    /tmp/torchvenv/bin/python -m tools.fullsize_refiner_fixture --base --out /tmp/fullsize-base-bf16      (6.9 GB)

stabilityai/stable-diffusion-xl-refiner-1.0's architecture with random weights, saved by
``StableDiffusionXLImg2ImgPipeline``'s config and each component's ``save_pretrained``, as
``tools.make_fixtures fullsize`` does for the base:

* ``unet``: the refiner 1.0 UNet (:data:`REFINER_UNET_OVERRIDES` on the base's hub config: 384/768/1536/1536 channels,
  DownBlock2D + 2 x CrossAttn + DownBlock2D, 4 transformer layers, cross-attention over text_encoder_2's 1280
  channels, 5 time ids: 5 x 256 + 1280 = 2560), about 2.26 B parameters;
* ``text_encoder_2``: OpenCLIP bigG, the base's text_encoder_2 config (its own random weights);
* ``vae``: the base's config; ``scheduler`` the base's; ``tokenizer_2`` tiny-pt's (the project's vocabulary);
* model_index.json: ``text_encoder`` and ``tokenizer`` null, ``requires_aesthetics_score`` true,
  ``force_zeros_for_empty_prompt`` false (the refiner's).

Weights are made in ``--dtype`` directly (torch's default dtype while building: half the memory of float32, and
random values need no float32 master). ``--base``: SDXL 1.0 base the same way (all four components,
``StableDiffusionXLPipeline``'s model_index.json), the light kin of ``make_fixtures fullsize`` (which builds in
float32 and runs references). No reference outputs: the refiner's numerics are checked on tiny-pt-refiner
(tools.refiner_fixtures); this folder is for load time and memory only. Never in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline
from transformers import CLIPTokenizer

from tools.fixtures_common import (
    FIXTURES,
    StageLog,
    build_component,
    check_saved,
    free_memory,
    sdxl_base_configs,
    seeded_component,
    versions,
)

# stabilityai/stable-diffusion-xl-refiner-1.0 unet/config.json, where it differs from the base's.
REFINER_UNET_OVERRIDES = dict(
    block_out_channels=[384, 768, 1536, 1536],
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    attention_head_dim=[6, 12, 24, 24],
    transformer_layers_per_block=4,
    cross_attention_dim=1280,
    projection_class_embeddings_input_dim=2560,
)
REFINER_COMPONENTS = ("text_encoder_2", "vae", "unet")
SEEDS = dict(text_encoder=30, text_encoder_2=31, vae=32, unet=33)  # + 10 for --base


def refiner_configs() -> dict:
    """The base's hub configs with the refiner's UNet."""
    configs = sdxl_base_configs()
    configs["unet"] = {k: v for k, v in configs["unet"].items() if not k.startswith("_")} | REFINER_UNET_OVERRIDES
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/fullsize-refiner"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--base", action="store_true", help="SDXL 1.0 base instead of the refiner")
    args = parser.parse_args()
    out, dtype, log = args.out, getattr(torch, args.dtype), StageLog()
    out.mkdir(parents=True, exist_ok=True)
    configs = sdxl_base_configs() if args.base else refiner_configs()
    names = ("text_encoder",) + REFINER_COMPONENTS if args.base else REFINER_COMPONENTS
    with torch.device("meta"):  # the pipeline only to write model_index.json as save_pretrained does
        parts = {name: build_component(name, configs) for name in names}
    tokenizers = {sub: CLIPTokenizer.from_pretrained(FIXTURES / "tiny-pt" / sub)  # the project's vocabulary (no JAX)
                  for sub in (("tokenizer", "tokenizer_2") if args.base else ("tokenizer_2",))}
    scheduler = EulerDiscreteScheduler.from_config(configs["scheduler"])
    if args.base:
        pipe = StableDiffusionXLPipeline(**parts, **tokenizers, scheduler=scheduler, force_zeros_for_empty_prompt=True,
                                         add_watermarker=False)
    else:
        pipe = StableDiffusionXLImg2ImgPipeline(**parts, text_encoder=None, tokenizer=None, **tokenizers,
                                                scheduler=scheduler, requires_aesthetics_score=True,
                                                force_zeros_for_empty_prompt=False, add_watermarker=False)
    pipe.save_config(out)
    pipe.scheduler.save_pretrained(out / "scheduler")
    for sub, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(out / sub)
        for name in ("vocab.json", "merges.txt"):  # transformers 5 omits them; the engine's tokenizer reads them
            shutil.copyfile(FIXTURES / "tiny-pt" / sub / name, out / sub / name)
    del pipe, parts
    free_memory()
    log.mark("model_index, scheduler, tokenizers")
    counts = {}
    previous = torch.get_default_dtype()
    for name in names:
        torch.set_default_dtype(dtype)
        try:
            model = seeded_component(name, configs, seed=SEEDS[name] + (10 if args.base else 0)).to(dtype)
        finally:
            torch.set_default_dtype(previous)
        counts[name] = sum(p.numel() for p in model.parameters())
        log.mark(f"build {name}")
        model.save_pretrained(out / name, safe_serialization=True)
        check_saved(model, out / name)
        del model
        free_memory()
        log.mark(f"save {name}")
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    meta = dict(made_by=f"/tmp/torchvenv/bin/python -m tools.fullsize_refiner_fixture {'--base ' if args.base else ''}"
                        f"--out {out} --dtype {args.dtype}",
                versions=versions(), saved_dtype=args.dtype, param_counts=counts, stages=log.rows, files=files)
    (out / "made_by.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(json.dumps({"param_counts": counts, "bytes": sum(files.values())}))


if __name__ == "__main__":
    main()
