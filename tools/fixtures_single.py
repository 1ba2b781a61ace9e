"""``python -m tools.make_fixtures single``, ``single-lora``, ``sgm-keys`` and ``single-fullsize``: an SDXL single
file in the original (sgm) layout, and swapped parts.

* ``single`` writes tests/fixtures/tiny-single/ from tiny-pt/: tiny-pt as an SDXL single file in the original sgm
  layout (float16), a swap UNet (diffusers layout, bfloat16) and an LDM-layout VAE, each loaded back by diffusers'
  ``from_single_file`` with no key warning and checked tensor by tensor, and reference images of the single file's
  pipeline and of tiny-pt with both parts swapped (trailing spacing).
* ``single-lora`` writes tiny-single/lora-reference.*: both of ``lora``'s LoRAs at once on the single file
  (``from_single_file`` + ``load_lora_weights`` + ``set_adapters``).
* ``sgm-keys`` writes tests/fixtures/sdxl-base-sgm-keys.json: the full-size SDXL base named as its original single
  file names it (``sgm_state`` on the meta device). ``single-fullsize --out FILE [--dtype float16|float32]`` writes
  such a file with random values (float16: about 6.9 GB; not committed), for load time and peak memory.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline
from safetensors import safe_open
from transformers import CLIPTextModelWithProjection

from tools.fixtures_common import (
    COMPONENTS,
    FIXTURES,
    as_numpy,
    build_component,
    load_checked,
    plain_config,
    sdxl_base_configs,
    seeded_component,
    versions,
    write_npz,
)
from tools.fixtures_lora import LORA_GUIDANCE, LORA_PROMPT, LORA_STEPS

# (prompt, negative prompt, guidance, steps, scheduler overrides, latents seed): the single file's case, then the
# swap case (tiny-pt with unet-swap.safetensors and vae-ldm.safetensors, trailing spacing, as for Lightning UNets).
SINGLE_CASES = {"single": ("a red circle", "", 5.0, 8, {}, 20),
                "swap": ("a blue square on a black background", "a red circle", 4.0, 4,
                         {"timestep_spacing": "trailing"}, 21)}
SWAP_SEEDS = dict(unet=7, vae=8)


def _sgm_unet_key(key: str, layers: int, attention_blocks: set[int]) -> str:
    """A diffusers UNet key -> the LDM name: the inverse of diffusers' ``convert_ldm_unet_checkpoint``
    (``layers`` = layers_per_block; ``attention_blocks`` = up blocks with attentions, whose upsampler is at
    index 2 of its output block, else 1)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING
    table = {**DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"], **DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"]}
    if key in table:
        return table[key]
    resnet = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
              ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection")]

    def res(rest: str) -> str:
        for new, old in resnet:
            if rest.startswith(new + "."):
                return old + rest[len(new):]
        return rest
    m = re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.(.+)", key)
    if m:
        b, kind, i, rest = int(m[1]), m[2], int(m[3]), m[4]
        if kind == "downsamplers":
            return f"input_blocks.{1 + b * (layers + 1) + layers}.0.op.{rest[len('conv.'):]}"
        index = 1 + b * (layers + 1) + i
        return f"input_blocks.{index}.0.{res(rest)}" if kind == "resnets" else f"input_blocks.{index}.1.{rest}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key)
    if m:
        return (f"middle_block.{2 * int(m[2])}.{res(m[3])}" if m[1] == "resnets" else f"middle_block.1.{m[3]}")
    m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)\.(.+)", key)
    b, kind, i, rest = int(m[1]), m[2], int(m[3]), m[4]
    if kind == "upsamplers":
        return f"output_blocks.{b * (layers + 1) + layers}.{2 if b in attention_blocks else 1}.{rest}"
    index = b * (layers + 1) + i
    return f"output_blocks.{index}.0.{res(rest)}" if kind == "resnets" else f"output_blocks.{index}.1.{rest}"


def _sgm_vae_key(key: str, up_blocks: int) -> str:
    """A diffusers VAE key -> the LDM name: the inverse of diffusers' ``convert_ldm_vae_checkpoint``."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING
    table = DIFFUSERS_TO_LDM_MAPPING["vae"]
    if key in table:
        return table[key]
    key = key.replace("conv_shortcut", "nin_shortcut")
    m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(resnets\.(\d+)|downsamplers\.0)\.(.+)", key)
    if m:
        return f"encoder.down.{m[1]}.{'block.' + m[3] if m[3] else 'downsample'}.{m[4]}"
    m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.+)", key)
    if m:
        return f"decoder.up.{up_blocks - 1 - int(m[1])}.{'block.' + m[3] if m[3] else 'upsample'}.{m[4]}"
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.(resnets\.(\d)|attentions\.0)\.(.+)", key)
    if m[3] is not None:
        return f"{m[1]}.mid.block_{int(m[3]) + 1}.{m[4]}"
    names = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    name, leaf = m[4].rsplit(".", 1)
    return f"{m[1]}.mid.attn_1.{names[name]}.{leaf}"


def sgm_vae_state(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    """The VAE's state_dict in LDM names, the attention's linear weights as 1x1 conv kernels (out, in, 1, 1)."""
    out = {}
    for key, value in vae.state_dict().items():
        new = _sgm_vae_key(key, len(vae.config.up_block_types))
        if ".mid.attn_1." in new and new.endswith(".weight") and ".norm." not in new:
            value = value[:, :, None, None]
        out[new] = value
    return out


def _sgm_open_clip(te2: CLIPTextModelWithProjection) -> dict[str, torch.Tensor]:
    """text_encoder_2's state_dict in OpenCLIP names: q/k/v fused into in_proj, text_projection transposed;
    the inverse of diffusers' ``convert_open_clip_checkpoint``."""
    state = {k.removeprefix("text_model."): v for k, v in te2.state_dict().items()}
    out = {"positional_embedding": state.pop("embeddings.position_embedding.weight"),
           "token_embedding.weight": state.pop("embeddings.token_embedding.weight"),
           "ln_final.weight": state.pop("final_layer_norm.weight"), "ln_final.bias": state.pop("final_layer_norm.bias"),
           "text_projection": state.pop("text_projection.weight").T.contiguous(),
           "logit_scale": torch.tensor(np.log(1 / 0.07), dtype=torch.float32)}  # OpenCLIP's, as real files hold
    layer_names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
                   "self_attn.out_proj": "attn.out_proj"}
    for n in range(te2.config.num_hidden_layers):
        pre = f"encoder.layers.{n}."
        for leaf in ("weight", "bias"):
            out[f"transformer.resblocks.{n}.attn.in_proj_{leaf}"] = torch.cat(
                [state.pop(f"{pre}self_attn.{p}_proj.{leaf}") for p in "qkv"])
            for new, old in layer_names.items():
                out[f"transformer.resblocks.{n}.{old}.{leaf}"] = state.pop(f"{pre}{new}.{leaf}")
    if state:
        raise RuntimeError(f"text_encoder_2 tensors without an OpenCLIP name: {sorted(state)[:5]}")
    return out


def sgm_state(pipe: StableDiffusionXLPipeline) -> dict[str, torch.Tensor]:
    """A whole SDXL pipeline as the original single file's state dict (sd_xl_base_1.0.safetensors' prefixes)."""
    unet = pipe.unet
    layers = unet.config.layers_per_block
    attention = {b for b, t in enumerate(unet.config.up_block_types) if "CrossAttn" in t}
    state = {"model.diffusion_model." + _sgm_unet_key(k, layers, attention): v for k, v in unet.state_dict().items()}
    state.update({"first_stage_model." + k: v for k, v in sgm_vae_state(pipe.vae).items()})
    state.update({"conditioner.embedders.0.transformer.text_model." + k.removeprefix("text_model."): v
                  for k, v in pipe.text_encoder.state_dict().items()})
    state.update({"conditioner.embedders.1.model." + k: v for k, v in _sgm_open_clip(pipe.text_encoder_2).items()})
    return state


class _Warnings(logging.Handler):
    """Collects the warnings diffusers and transformers log while a fixture is loaded."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _loaded_without_warnings(load):
    """``load()`` with diffusers' and transformers' warnings captured; RuntimeError if one is about weights or keys
    (unused, missing, unexpected, newly initialised). Others (a dtype note) are allowed."""
    handler = _Warnings()
    loggers = [logging.getLogger(n) for n in ("diffusers", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING)
    try:
        result = load()
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    about_keys = [line for line in handler.lines
                  if re.search(r"weight|key|not used|initiali[sz]ed|missing|unexpected", line, re.I)]
    if about_keys:
        raise RuntimeError(f"diffusers warned about the keys of a fixture: {about_keys[:3]}")
    return result


def _same_weights(name: str, expected: torch.nn.Module, loaded: torch.nn.Module) -> None:
    """RuntimeError unless ``loaded`` holds exactly ``expected``'s tensors (names, shapes, values)."""
    a, b = expected.state_dict(), loaded.state_dict()
    if a.keys() != b.keys():
        raise RuntimeError(f"{name}: the loaded keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
    bad = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k].float(), b[k].float())]
    if bad:
        raise RuntimeError(f"{name}: the loaded tensors differ from the written ones: {bad[:5]}")


def _single_case(pipe: StableDiffusionXLPipeline, case: str, base_scheduler: dict) -> tuple[dict, dict]:
    """SINGLE_CASES[case] on ``pipe`` (2 images, explicit latents): arrays and metadata."""
    prompt, negative, guidance, steps, overrides, seed = SINGLE_CASES[case]
    pipe.scheduler = EulerDiscreteScheduler.from_config(base_scheduler, **overrides)
    latents = np.random.RandomState(seed).standard_normal((2, 4, 16, 16)).astype(np.float32)
    images = pipe(prompt, negative_prompt=negative or None, guidance_scale=guidance, num_inference_steps=steps,
                  width=64, height=64, num_images_per_prompt=2, output_type="np",
                  latents=torch.from_numpy(latents)).images
    arrays = {f"{case}_latents": latents, f"{case}_images": images, f"{case}_timesteps": pipe.scheduler.timesteps}
    meta = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                width=64, height=64, sampler="Euler", from_config_overrides=overrides,
                scheduler_config=plain_config(pipe.scheduler.config),
                latents=f"numpy RandomState({seed}).standard_normal")
    return arrays, meta


def cmd_single(out: Path) -> None:
    """``single``: tiny-single/ under ``out`` from tiny-pt/ (made by ``tiny``), each file proven in diffusers.

    1. tiny-sdxl-sgm.fp16.safetensors: tiny-pt's four components in the original layout, float16;
       ``StableDiffusionXLPipeline.from_single_file(path, config=tiny-pt)`` must load it with no warning
       and hold exactly tiny-pt's weights (as float16).
    2. unet-swap.bf16.safetensors: another random UNet of tiny-pt's config, diffusers layout, no prefix, bfloat16;
       vae-ldm.safetensors: another random VAE, LDM layout without prefix, float32
       (``AutoencoderKL.from_single_file`` must load it with no warning and hold its weights).
    3. Reference images: the single file's pipeline, and tiny-pt with both parts swapped and trailing spacing.
    """
    from safetensors.torch import save_file
    torch.set_num_threads(1)
    tiny = FIXTURES / "tiny-pt"
    folder = out / "tiny-single"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # 1. The single file, float16, and its proof.
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny, dtype=torch.float32, add_watermarker=False)
    single = folder / "tiny-sdxl-sgm.fp16.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in sgm_state(pipe).items()}, str(single))
    loaded = _loaded_without_warnings(lambda: StableDiffusionXLPipeline.from_single_file(
        str(single), config=str(tiny), torch_dtype=torch.float32, add_watermarker=False))
    for name in COMPONENTS:
        half = getattr(pipe, name).to(torch.float16)
        _same_weights(name, half, getattr(loaded, name))
        getattr(pipe, name).to(torch.float32)
    # 2. The swapped parts and their proof.
    configs = {"unet": pipe.unet.config, "vae": pipe.vae.config}  # tiny-pt's
    unet = seeded_component("unet", configs, SWAP_SEEDS["unet"]).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(folder / "unet-swap.bf16.safetensors"))
    vae = seeded_component("vae", configs, SWAP_SEEDS["vae"])
    save_file({k: v.contiguous() for k, v in sgm_vae_state(vae).items()}, str(folder / "vae-ldm.safetensors"))
    loaded_vae = _loaded_without_warnings(lambda: AutoencoderKL.from_single_file(
        str(folder / "vae-ldm.safetensors"), config=str(tiny), subfolder="vae", torch_dtype=torch.float32))
    _same_weights("vae", vae, loaded_vae)
    # 3. Reference images.
    for p in (loaded, pipe):
        p.set_progress_bar_config(disable=True)
    base_scheduler = plain_config(pipe.scheduler.config)
    arrays, cases = {}, {}
    case_arrays, cases["single"] = _single_case(loaded, "single", base_scheduler)
    arrays.update(case_arrays)
    pipe.unet = unet.to(torch.float32).eval()
    pipe.vae = loaded_vae.eval()
    case_arrays, cases["swap"] = _single_case(pipe, "swap", base_scheduler)
    arrays.update(case_arrays)
    write_npz(folder / "arrays.npz", as_numpy(arrays))
    meta = dict(made_by="python -m tools.make_fixtures single", versions=versions(), torch_threads=1,
                files={"tiny-sdxl-sgm.fp16.safetensors": "tiny-pt in the original sgm layout, float16",
                       "unet-swap.bf16.safetensors": f"a UNet of tiny-pt's config (seed {SWAP_SEEDS['unet']}), "
                                                     "diffusers layout, no prefix, bfloat16",
                       "vae-ldm.safetensors": f"a VAE of tiny-pt's config (seed {SWAP_SEEDS['vae']}), LDM layout, "
                                              "no prefix, float32"},
                cases=cases, tolerance="images: max 4/255, mean 0.5/255",
                references={"single": "StableDiffusionXLPipeline.from_single_file(file, config=tiny-pt)",
                            "swap": "tiny-pt with unet = unet-swap (upcast to float32), vae = "
                                    "AutoencoderKL.from_single_file(vae-ldm, config=tiny-pt, subfolder='vae'), "
                                    "EulerDiscreteScheduler trailing"})
    (folder / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


SINGLE_LORA_CASE = {"kohya": 0.8, "peft": 0.5}  # two LoRAs at once on the single-file model


def cmd_single_lora(out: Path) -> None:
    """``single-lora``: tiny-single/lora-reference.npz and .json: both tiny-pt-lora LoRAs (kohya 0.8, PEFT 0.5)
    on the single file, as diffusers runs them: ``from_single_file(tiny-sdxl-sgm.fp16, config=tiny-pt)``, then
    ``load_lora_weights`` (checked: no unused key, every layer adapted) and ``set_adapters``; the latents,
    prompt, steps and guidance of ``lora``'s cases. Needs ``single`` and ``lora`` first."""
    torch.set_num_threads(1)
    folder, lora_dir = out / "tiny-single", out / "tiny-pt-lora"
    pipe = StableDiffusionXLPipeline.from_single_file(str(folder / "tiny-sdxl-sgm.fp16.safetensors"),
                                                      config=str(out / "tiny-pt"), torch_dtype=torch.float32,
                                                      add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    for name in SINGLE_LORA_CASE:
        path = lora_dir / f"{name}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            layers = sum(1 for k in f.keys() if k.endswith(("lora_down.weight", "lora_A.weight")))
        load_checked(pipe, path, name, layers)
    pipe.set_adapters(list(SINGLE_LORA_CASE), adapter_weights=list(SINGLE_LORA_CASE.values()))
    latents = np.random.RandomState(7).standard_normal((2, 4, 16, 16)).astype(np.float32)
    images = pipe(LORA_PROMPT, guidance_scale=LORA_GUIDANCE, num_inference_steps=LORA_STEPS, width=64, height=64,
                  num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
    write_npz(folder / "lora-reference.npz", {"latents": latents, "images": images})
    meta = dict(made_by="python -m tools.make_fixtures single-lora", versions=versions(), torch_threads=1,
                model="StableDiffusionXLPipeline.from_single_file(tiny-sdxl-sgm.fp16.safetensors, config=tiny-pt)",
                loras={f"tiny-pt-lora/{n}.safetensors": w for n, w in SINGLE_LORA_CASE.items()},
                prompt=LORA_PROMPT, negative_prompt=None, steps=LORA_STEPS, guidance_scale=LORA_GUIDANCE,
                size=[64, 64], scheduler="EulerDiscreteScheduler (tiny-pt's config)",
                latents="numpy RandomState(7).standard_normal((2, 4, 16, 16))",
                notes=["load_lora_weights(adapter_name=...) for each, then set_adapters(names, adapter_weights).",
                       "images: (2, 64, 64, 3) float32 in [0, 1], output_type='np'."])
    (folder / "lora-reference.json").write_text(json.dumps(meta, indent=2) + "\n")


def fullsize_sgm_shapes() -> dict[str, list[int]]:
    """{key: shape} of full-size SDXL base as its original single file (sd_xl_base_1.0.safetensors) names it:
    the modules built on the meta device from the shipped configs, renamed by :func:`sgm_state`."""
    import types
    configs = sdxl_base_configs()
    with torch.device("meta"):
        parts = types.SimpleNamespace(**{name: build_component(name, configs) for name in COMPONENTS})
        return {k: list(v.shape) for k, v in sgm_state(parts).items()}


def cmd_sgm_keys(out: Path) -> None:
    """``sgm-keys``: full-size SDXL base's single-file key names and shapes (fullsize_sgm_shapes) to ``out``."""
    text = json.dumps(fullsize_sgm_shapes(), indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # each shape on one line
    out.write_text(text + "\n")


def cmd_single_fullsize(out: Path, dtype_name: str) -> None:
    """``single-fullsize``: a random full-size SDXL base single file (sgm layout) at ``out``, written tensor by
    tensor (header first, then each tensor's bytes), so the host never holds the whole model. Values are
    N(0, 0.02^2): for load time and memory, not for images. Not committed."""
    shapes = fullsize_sgm_shapes()
    code, dtype = {"float16": ("F16", np.float16), "float32": ("F32", np.float32)}[dtype_name]
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    rng = np.random.default_rng(0)
    with open(out, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for shape in shapes.values():
            f.write((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype).tobytes())
    print(json.dumps({"file": str(out), "tensors": len(shapes), "bytes": out.stat().st_size}))
