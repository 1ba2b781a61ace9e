"""``python -m tools.make_fixtures fullsize --out DIR [--dtype float32|bfloat16]``: a random full-size SDXL base
(diffusers format, safetensors, about 14 GB in float32) written to DIR and reference outputs to DIR/reference/
(as ``tiny``'s, tools/fixtures_tiny.py); not committed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from tools.fixtures_common import (
    COMPONENTS,
    StageLog,
    _json,
    build_component,
    check_saved,
    free_memory,
    sdxl_base_configs,
    seeded_component,
    versions,
)
from tools.fixtures_tiny import (
    PROMPTS,
    make_tokenizers,
    text_inputs,
    text_outputs,
    unet_inputs,
    unet_outputs,
    vae_inputs,
    vae_outputs,
    write_reference,
    write_tokenizers,
)

FULLSIZE_PROMPTS = PROMPTS[:2]


def load_component(name: str, model_dir: Path) -> torch.nn.Module:
    """Component ``name`` of a diffusers folder, in float32, eval mode."""
    if name in ("unet", "vae"):
        cls = UNet2DConditionModel if name == "unet" else AutoencoderKL
        return cls.from_pretrained(model_dir / name, dtype=torch.float32).eval()
    cls = CLIPTextModel if name == "text_encoder" else CLIPTextModelWithProjection
    return cls.from_pretrained(model_dir / name, dtype=torch.float32).eval()


def save_fullsize(out: Path, dtype: torch.dtype, log: StageLog) -> None:
    """Stages 1-2 of ``fullsize``: model_index, scheduler and tokenizers, then each component alone."""
    configs = sdxl_base_configs()
    with torch.device("meta"):  # the pipeline only to write model_index.json as save_pretrained does
        parts = {name: build_component(name, configs) for name in COMPONENTS}
    tokenizers = make_tokenizers()
    pipe = StableDiffusionXLPipeline(**parts, tokenizer=tokenizers[0], tokenizer_2=tokenizers[1],
                                     scheduler=EulerDiscreteScheduler.from_config(configs["scheduler"]),
                                     force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_config(out)
    pipe.scheduler.save_pretrained(out / "scheduler")
    write_tokenizers(tokenizers, out)
    del pipe, parts
    free_memory()
    log.mark("model_index, scheduler, tokenizers")
    for i, name in enumerate(COMPONENTS):
        model = seeded_component(name, configs, seed=i).to(dtype)
        log.mark(f"build {name}")
        model.save_pretrained(out / name, safe_serialization=True)
        check_saved(model, out / name)
        del model
        free_memory()
        log.mark(f"save {name}")


def fullsize_reference(out: Path, log: StageLog) -> tuple[dict, dict]:
    """Stage 3 of ``fullsize``: each component reloaded in float32 and run once; returns (inputs, outputs)."""
    unet_cfg = _json(out / "unet" / "config.json")
    inputs = {**text_inputs(make_tokenizers(), FULLSIZE_PROMPTS),
              **unet_inputs(unet_cfg, 2, 64, [500, 500], [[512, 512, 0, 0, 512, 512]] * 2, seed=200),
              **vae_inputs((1, 4, 64, 64), None, seed=201)}
    te = [load_component(name, out) for name in ("text_encoder", "text_encoder_2")]
    log.mark("load text encoders")
    outputs = text_outputs(te[0], te[1], inputs)
    del te
    free_memory()
    log.mark("run text encoders")
    for name, run in (("unet", unet_outputs), ("vae", vae_outputs)):
        model = load_component(name, out)
        log.mark(f"load {name}")
        outputs.update(run(model, inputs))
        del model
        free_memory()
        log.mark(f"run {name}")
    return inputs, outputs


def cmd_fullsize(out: Path, dtype_name: str) -> None:
    """``fullsize``: a random SDXL base in diffusers format at ``out``, references in out/reference/."""
    log = StageLog()
    out.mkdir(parents=True, exist_ok=True)
    save_fullsize(out, getattr(torch, dtype_name), log)
    inputs, outputs = fullsize_reference(out, log)
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*"))
             if p.is_file() and "reference" not in p.parts}
    meta = dict(made_by=f"python -m tools.make_fixtures fullsize --out {out} --dtype {dtype_name}",
                versions=versions(), saved_dtype=dtype_name, compute_dtype="float32",
                torch_threads=torch.get_num_threads(),
                prompts=FULLSIZE_PROMPTS, stages=log.rows, files=files,
                notes=["Configs: sdxl_engine/checkpoint/configs/sdxl-base-1.0 (hub-identical). "
                       "Tokenizers: the project's vocabulary.",
                       "Text encoders keep eos_token_id 2 from the hub config: pooling takes argmax(input_ids), "
                       "which finds <|endoftext|>, the vocabulary's highest id."])
    write_reference(out / "reference", {**inputs, **outputs}, {}, meta)
    log.mark("write reference")
