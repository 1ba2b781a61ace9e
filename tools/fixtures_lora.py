"""``python -m tools.make_fixtures lora`` and ``lcm-lora``.

* ``lora`` writes tests/fixtures/tiny-pt-lora/: a kohya LoRA for tiny-pt written key by key (sgm names, LoCon
  convs, both text encoders, alphas), a PEFT LoRA (peft's LoraConfig, saved by diffusers' ``save_lora_weights``),
  each proven by ``load_lora_weights`` (no unused key, every layer adapted), and the pipeline's images with them at
  weight 1 and 0.5 and both at once (``set_adapters``).
* ``lcm-lora`` writes tests/fixtures/tiny-shapes-lcm/: the shipped tiny-shapes with its LCM-LoRA
  (assets/tiny-shapes/lcm-lora.safetensors, proven by ``load_lora_weights``) and LCMScheduler at guidance 1, its
  step noise the engine's (tests/fixtures/lcm-noise.npz: ``python -m tools.lcm_noise`` first), 4 and 2 steps, and
  the 4-step case without the LoRA.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers import LCMScheduler, StableDiffusionXLPipeline
from safetensors import safe_open

from tools.fixtures_common import ROOT, EngineNoise, load_checked, plain_config, versions, write_npz

# ``lora``: two LoRAs for tiny-pt and diffusers' images with them. The kohya file is written here by hand in
# kohya's SDXL naming (sd-scripts trains SDXL on the sgm/LDM UNet: input_blocks/middle_block/output_blocks), so
# the module names below are kohya's, not derived from any converter; diffusers' load_lora_weights maps them.
KOHYA_UNET_MODULES = (
    # (kohya module name after lora_unet_, rank, alpha)
    ("input_blocks_0_0", 4, 2.0),  # conv_in (LoCon 3x3)
    ("time_embed_0", 4, 4.0), ("time_embed_2", 4, 4.0), ("label_emb_0_0", 4, 4.0), ("label_emb_0_2", 4, 4.0),
    ("input_blocks_1_0_in_layers_2", 4, 2.0), ("input_blocks_1_0_emb_layers_1", 4, 2.0),
    ("input_blocks_1_0_out_layers_3", 4, 2.0), ("input_blocks_3_0_op", 4, 2.0),
    ("input_blocks_4_0_skip_connection", 4, 2.0),
    ("input_blocks_4_1_proj_in", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_attn1_to_q", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_attn1_to_k", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_attn1_to_v", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_attn1_to_out_0", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_attn2_to_k", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_attn2_to_v", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_ff_net_0_proj", 8, 4.0),
    ("input_blocks_4_1_transformer_blocks_0_ff_net_2", 8, 4.0),
    ("input_blocks_4_1_proj_out", 8, 4.0),
    ("input_blocks_8_1_transformer_blocks_1_attn2_to_q", 4, 4.0),
    ("middle_block_0_in_layers_2", 4, 1.0), ("middle_block_1_transformer_blocks_0_attn1_to_q", 4, 4.0),
    ("middle_block_2_out_layers_3", 4, 1.0),
    ("output_blocks_0_1_transformer_blocks_0_attn2_to_out_0", 4, 4.0), ("output_blocks_2_2_conv", 4, 2.0),
    ("output_blocks_5_1_proj_out", 4, 4.0), ("output_blocks_5_2_conv", 4, 2.0),
    ("output_blocks_6_0_skip_connection", 4, 2.0), ("output_blocks_8_0_in_layers_2", 4, 2.0),
    ("out_2", 4, 2.0),  # conv_out
)
# (prefix, transformers module names of both text encoders, rank, alpha)
KOHYA_TEXT_MODULES = (
    ("lora_te1_", ("text_model_encoder_layers_0_self_attn_q_proj", "text_model_encoder_layers_0_self_attn_v_proj",
                   "text_model_encoder_layers_1_self_attn_out_proj", "text_model_encoder_layers_1_mlp_fc1",
                   "text_model_encoder_layers_1_mlp_fc2"), 4, 2.0),
    # MLP only: diffusers 0.42.1 with transformers 5.24 drops kohya's lora_te2_*_self_attn_* layers (its load
    # report lists them UNEXPECTED: they stay `to_q_lora` names), so diffusers could not be the reference for them.
    ("lora_te2_", ("text_model_encoder_layers_0_mlp_fc1", "text_model_encoder_layers_2_mlp_fc1",
                   "text_model_encoder_layers_2_mlp_fc2"), 4, 2.0),
)
PEFT_UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                     "conv1", "conv2", "time_emb_proj"]
PEFT_TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
LORA_PROMPT, LORA_STEPS, LORA_GUIDANCE = "a red circle", 4, 5.0
# (case name, {adapter: weight}); "base" is tiny-pt without a LoRA, on the same latents.
LORA_CASES = (("base", {}), ("kohya_1", {"kohya": 1.0}), ("kohya_05", {"kohya": 0.5}), ("peft_1", {"peft": 1.0}),
              ("peft_05", {"peft": 0.5}), ("both", {"kohya": 0.7, "peft": -0.6}))


def _module_by_torch_shape(module: torch.nn.Module) -> tuple[int, ...]:
    return tuple(module.weight.shape)


def kohya_lora(pipe: StableDiffusionXLPipeline, seed: int) -> dict[str, torch.Tensor]:
    """A kohya LoRA for ``pipe``'s tiny-pt, written key by key: lora_down (rank, in[, kh, kw]), lora_up
    (out, rank[, 1, 1]) and alpha per module; shapes read from the diffusers module each kohya name means,
    the sgm -> diffusers names written out by hand below (diffusers' _maybe_map_sgm_blocks_to_diffusers and
    _convert_unet_lora_key derive them; load_checked proves they agree)."""
    unet_modules = dict(pipe.unet.named_modules())
    ldm = {  # kohya (sgm) name -> diffusers module, for tiny-pt's 3 levels x 2 layers (written out, not derived)
        "input_blocks_0_0": "conv_in", "time_embed_0": "time_embedding.linear_1",
        "time_embed_2": "time_embedding.linear_2", "label_emb_0_0": "add_embedding.linear_1",
        "label_emb_0_2": "add_embedding.linear_2", "input_blocks_1_0_in_layers_2": "down_blocks.0.resnets.0.conv1",
        "input_blocks_1_0_emb_layers_1": "down_blocks.0.resnets.0.time_emb_proj",
        "input_blocks_1_0_out_layers_3": "down_blocks.0.resnets.0.conv2",
        "input_blocks_3_0_op": "down_blocks.0.downsamplers.0.conv",
        "input_blocks_4_0_skip_connection": "down_blocks.1.resnets.0.conv_shortcut",
        "input_blocks_4_1_proj_in": "down_blocks.1.attentions.0.proj_in",
        "input_blocks_4_1_proj_out": "down_blocks.1.attentions.0.proj_out",
        "input_blocks_8_1_transformer_blocks_1_attn2_to_q":
            "down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_q",
        "middle_block_0_in_layers_2": "mid_block.resnets.0.conv1",
        "middle_block_1_transformer_blocks_0_attn1_to_q": "mid_block.attentions.0.transformer_blocks.0.attn1.to_q",
        "middle_block_2_out_layers_3": "mid_block.resnets.1.conv2",
        "output_blocks_0_1_transformer_blocks_0_attn2_to_out_0":
            "up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0",
        "output_blocks_2_2_conv": "up_blocks.0.upsamplers.0.conv", "output_blocks_5_1_proj_out":
            "up_blocks.1.attentions.2.proj_out", "output_blocks_5_2_conv": "up_blocks.1.upsamplers.0.conv",
        "output_blocks_6_0_skip_connection": "up_blocks.2.resnets.0.conv_shortcut",
        "output_blocks_8_0_in_layers_2": "up_blocks.2.resnets.2.conv1", "out_2": "conv_out",
    }
    for inner in ("attn1_to_q", "attn1_to_k", "attn1_to_v", "attn1_to_out_0", "attn2_to_k", "attn2_to_v",
                  "ff_net_0_proj", "ff_net_2"):
        ldm[f"input_blocks_4_1_transformer_blocks_0_{inner}"] = (
            "down_blocks.1.attentions.0.transformer_blocks.0." + inner.replace("attn1_", "attn1.").replace(
                "attn2_", "attn2.").replace("to_out_0", "to_out.0").replace("ff_net_0_proj", "ff.net.0.proj")
            .replace("ff_net_2", "ff.net.2"))
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def add(prefix: str, name: str, weight_shape: tuple, rank: int, alpha: float) -> None:
        fan_in = int(np.prod(weight_shape[1:]))
        down_shape = (rank, *weight_shape[1:])
        up_shape = (weight_shape[0], rank, 1, 1) if len(weight_shape) == 4 else (weight_shape[0], rank)
        out[f"{prefix}{name}.lora_down.weight"] = torch.randn(down_shape, generator=generator) / fan_in ** 0.5
        out[f"{prefix}{name}.lora_up.weight"] = torch.randn(up_shape, generator=generator) * (1.0 / rank ** 0.5)
        out[f"{prefix}{name}.alpha"] = torch.tensor(alpha)

    # Deltas near the base weights' size (default init: std 1/sqrt(3 fan_in)): large enough to change the images
    # far beyond the tolerance, small enough that attention logits stay moderate (larger ones make float32
    # rounding differences between two implementations grow step by step, and no reference is reproducible).
    for name, rank, alpha in KOHYA_UNET_MODULES:
        add("lora_unet_", name, _module_by_torch_shape(unet_modules[ldm[name]]), rank, alpha)
    for prefix, names, rank, alpha in KOHYA_TEXT_MODULES:
        encoder = pipe.text_encoder if prefix == "lora_te1_" else pipe.text_encoder_2
        modules = dict(encoder.named_modules())
        for name in names:
            hf = name.replace("text_model_encoder_layers_", "text_model.encoder.layers.").replace(
                "_self_attn_", ".self_attn.").replace("_mlp_", ".mlp.")
            # transformers 5's CLIPTextModel has no text_model level; kohya's names keep it (real files have it)
            module = modules.get(hf) or modules[hf[len("text_model."):]]
            add(prefix, name, _module_by_torch_shape(module), rank, alpha)
    return out


def peft_lora(pipe: StableDiffusionXLPipeline, folder: Path, seed: int) -> Path:
    """A PEFT LoRA on all three components (peft's LoraConfig, r 4, lora_alpha 8: scale 2), its A and B
    filled with seeded noise, saved by diffusers' save_lora_weights with its adapter metadata. ``pipe`` is
    changed (peft's inject_adapter_in_model: transformers' add_adapter wants a newer peft): pass a copy."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    configs = {"unet": LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_UNET_TARGETS, init_lora_weights=False),
               "text_encoder": LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TEXT_TARGETS, init_lora_weights=False),
               "text_encoder_2": LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TEXT_TARGETS,
                                            init_lora_weights=False)}
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name, config in configs.items():
        model = inject_adapter_in_model(config, getattr(pipe, name), adapter_name="fixture")
        with torch.no_grad():
            for key, param in sorted(model.named_parameters()):
                if "lora_A" in key:
                    param.copy_(torch.randn(param.shape, generator=generator) / int(np.prod(param.shape[1:])) ** 0.5)
                elif "lora_B" in key:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        layers[name] = get_peft_model_state_dict(model, adapter_name="fixture")
    StableDiffusionXLPipeline.save_lora_weights(
        folder, unet_lora_layers=layers["unet"], text_encoder_lora_layers=layers["text_encoder"],
        text_encoder_2_lora_layers=layers["text_encoder_2"], weight_name="peft.safetensors",
        unet_lora_adapter_metadata=configs["unet"].to_dict(),
        text_encoder_lora_adapter_metadata=configs["text_encoder"].to_dict(),
        text_encoder_2_lora_adapter_metadata=configs["text_encoder_2"].to_dict())
    return folder / "peft.safetensors"


def cmd_lora(out: Path) -> None:
    """``lora``: out/tiny-pt-lora/ with kohya.safetensors, peft.safetensors and reference.npz / .json."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    folder = out / "tiny-pt-lora"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    # 1. The two files.
    kohya = kohya_lora(pipe, seed=300)
    save_file({k: v.contiguous() for k, v in kohya.items()}, str(folder / "kohya.safetensors"),
              metadata={"ss_base_model_version": "sdxl_base_v1-0", "ss_network_module": "networks.lora"})
    latents = np.random.RandomState(7).standard_normal((2, 4, 16, 16)).astype(np.float32)
    before = pipe(LORA_PROMPT, guidance_scale=LORA_GUIDANCE, num_inference_steps=LORA_STEPS, width=64, height=64,
                  num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
    peft_path = peft_lora(StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32,
                                                                    add_watermarker=False), folder, seed=301)
    with safe_open(str(peft_path), framework="pt") as f:
        peft_layers = sum(1 for k in f.keys() if k.endswith("lora_A.weight"))
    # 2. Both load in diffusers, every layer adapted, no warning.
    load_checked(pipe, folder / "kohya.safetensors", "kohya", sum(1 for k in kohya if k.endswith("lora_down.weight")))
    load_checked(pipe, peft_path, "peft", peft_layers)
    # 3. Images, same latents for every case.
    arrays = {"latents": latents}
    for name, weights in LORA_CASES:
        if weights:
            pipe.enable_lora()
            pipe.set_adapters(list(weights), adapter_weights=list(weights.values()))
        else:
            pipe.disable_lora()
        arrays[f"{name}_images"] = pipe(LORA_PROMPT, guidance_scale=LORA_GUIDANCE, num_inference_steps=LORA_STEPS,
                                        width=64, height=64, num_images_per_prompt=2, output_type="np",
                                        latents=torch.from_numpy(latents)).images
    if not np.array_equal(arrays["base_images"], before):
        raise SystemExit("loading the LoRAs changed tiny-pt's own images (disable_lora)")
    write_npz(folder / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.make_fixtures lora", versions=versions(), torch_threads=1,
                model="tests/fixtures/tiny-pt", prompt=LORA_PROMPT, negative_prompt=None, steps=LORA_STEPS,
                guidance_scale=LORA_GUIDANCE, size=[64, 64], scheduler="EulerDiscreteScheduler (tiny-pt's config)",
                latents="numpy RandomState(7).standard_normal((2, 4, 16, 16))",
                cases={name: weights for name, weights in LORA_CASES},
                files={"kohya.safetensors": dict(layers=sum(1 for k in kohya if k.endswith("lora_down.weight")),
                                                 format="kohya sgm names, alpha stored"),
                       "peft.safetensors": dict(layers=peft_layers, format="diffusers save_lora_weights (PEFT), "
                                                "r 4, lora_alpha 8 in lora_adapter_metadata")},
                notes=["Each file loaded with pipe.load_lora_weights(adapter_name=...) with no warning, every "
                       "layer adapted; weights by pipe.set_adapters(names, adapter_weights); base: disable_lora.",
                       "<case>_images: (2, 64, 64, 3) float32 in [0, 1], output_type='np'."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")


# ``lcm-lora``: the shipped tiny-shapes with its LCM-LoRA in diffusers, LCMScheduler, guidance 1 (no
# CFG), the step noise tests/fixtures/lcm-noise.npz's (the engine's rule, tools/lcm_noise.py). (prompt, steps).
TINY_SHAPES = ROOT / "assets" / "tiny-shapes"
LCM_LORA_CASES = {"lcm4": ("a large red star on the left on a white background", 4),
                  "lcm2": ("a small blue triangle in the centre on a gray background", 2)}


def cmd_lcm_lora(out: Path) -> None:
    """``lcm-lora``: out/tiny-shapes-lcm/reference.npz and .json (diffusers' images with the shipped LCM-LoRA)."""
    torch.set_num_threads(1)
    folder = out / "tiny-shapes-lcm"
    folder.mkdir(parents=True, exist_ok=True)
    lora_path = TINY_SHAPES / "lcm-lora.safetensors"
    with np.load(out / "lcm-noise.npz") as data:
        seeds, noise = data["seeds"], data["noise"]
    pipe = StableDiffusionXLPipeline.from_pretrained(TINY_SHAPES, dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    config = plain_config(pipe.scheduler.config)
    pipe.scheduler = LCMScheduler.from_config(config)
    with safe_open(str(lora_path), framework="pt") as f:
        layers = sum(1 for k in f.keys() if k.endswith("lora_A.weight"))
    load_checked(pipe, lora_path, "lcm", layers)
    latents = np.random.RandomState(37).standard_normal((2, 4, 16, 16)).astype(np.float32)
    arrays, meta = {"latents": latents}, {}
    for key, (prompt, steps) in LCM_LORA_CASES.items():
        with EngineNoise(noise[: steps - 1]) as patched:
            images = pipe(prompt, guidance_scale=1.0, num_inference_steps=steps, width=64, height=64,
                          num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
        assert patched.calls == steps - 1, patched.calls
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(prompt=prompt, num_inference_steps=steps, guidance_scale=1.0,
                         timesteps=[int(t) for t in pipe.scheduler.timesteps])
    pipe.disable_lora()
    with EngineNoise(noise) as patched:
        arrays["base4_images"] = np.round(pipe(LCM_LORA_CASES["lcm4"][0], guidance_scale=1.0, num_inference_steps=4,
                                               width=64, height=64, num_images_per_prompt=2, output_type="np",
                                               latents=torch.from_numpy(latents)).images * 255).astype(np.uint8)
    write_npz(folder / "reference.npz", arrays)
    meta.update(made_by="python -m tools.lcm_noise (runtime venv), then python -m tools.make_fixtures lcm-lora",
                versions=versions(), torch_threads=1, model="assets/tiny-shapes",
                lora=dict(file="assets/tiny-shapes/lcm-lora.safetensors", layers=layers,
                          sha256=hashlib.sha256(lora_path.read_bytes()).hexdigest()),
                scheduler="LCMScheduler.from_config(tiny-shapes' scheduler config)", size=[64, 64],
                seeds=[int(s) for s in seeds], latents="numpy RandomState(37).standard_normal((2, 4, 16, 16))",
                notes=["pipe.load_lora_weights(adapter_name='lcm') with no warning, every layer adapted; "
                       "<case>_images with the LoRA at weight 1, base4_images: the lcm4 case after disable_lora.",
                       "Step noise: randn_tensor of step k returns lcm-noise.npz's noise[k] (steps - 1 calls).",
                       "Images: (2, 64, 64, 3) uint8, round(np * 255)."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
