"""PyTorch reference fixtures for the project's own Flax NNX modules (diffusers is the reference).

Commands, run from the repository root:

    python -m tools.make_fixtures tiny
    python -m tools.make_fixtures keys
    python -m tools.make_fixtures samplers
    python -m tools.make_fixtures single
    python -m tools.make_fixtures sgm-keys
    python -m tools.make_fixtures single-fullsize --out FILE [--dtype float16|float32]
    python -m tools.make_fixtures lora
    python -m tools.make_fixtures single-lora
    python -m tools.make_fixtures lcm-lora
    python -m tools.make_fixtures img2img
    python -m tools.make_fixtures fullsize --out DIR [--dtype float32|bfloat16]

* ``tiny`` writes, under tests/fixtures/: ``tiny-pt/`` (a small random SDXL made with diffusers'
  and transformers' PyTorch classes, saved by ``StableDiffusionXLPipeline.save_pretrained`` with
  safetensors), ``tiny-pt-conv/`` (``unet/`` and ``vae/`` of a second layout: conv 1x1
  projections, integer head counts, upcast attention) and ``tiny-pt-reference/`` (``arrays.npz``
  and ``reference.json``: token ids, text-encoder, UNet and VAE outputs, whole-pipeline images
  for 9 cases, scheduler timesteps and sigmas; float32, deterministic).
* ``keys`` writes tests/fixtures/sdxl-base-keys.json: the name and shape of every tensor that
  ``save_pretrained`` writes for the full-size SDXL 1.0 base UNet, VAE and both text encoders,
  built on the meta device from sdxl_engine/checkpoint/configs/sdxl-base-1.0/ (no memory).
* ``samplers`` writes tests/fixtures/sampler-steps.json and .npz: for every sampler's
  diffusers class and a matrix of scheduler configs (:data:`SAMPLER_CASES`), the timesteps,
  sigmas, init_noise_sigma and a whole ``scheduler.step`` trajectory on fixed small arrays (the
  sample after each step; Euler a's noise per step), plus each class's ``__init__`` defaults, and
  tiny-pt's pipeline images with DDIM from a config lacking ``clip_sample`` (:data:`DDIM_IMAGE_CASE`) and
  with LCM (:data:`LCM_IMAGE_CASES`), its step noise the engine's: run ``python -m tools.lcm_noise`` (the
  runtime's venv) first, it writes tests/fixtures/lcm-noise.npz, which this hands to LCMScheduler in order.
* ``single`` writes tests/fixtures/tiny-single/ from tiny-pt/: tiny-pt as an SDXL single file in the
  original sgm layout (float16), a swap UNet (diffusers layout, bfloat16) and an LDM-layout VAE, each
  loaded back by diffusers' ``from_single_file`` with no key warning and checked tensor by tensor, and
  reference images of the single file's pipeline and of tiny-pt with both parts swapped (trailing spacing).
* ``sgm-keys`` writes tests/fixtures/sdxl-base-sgm-keys.json: the same full-size SDXL base named as its
  original single file names it (``sgm_state`` on the meta device). ``single-fullsize`` writes such a file
  with random values (float16: about 6.9 GB; not committed), for load time and peak memory.
* ``lora`` writes tests/fixtures/tiny-pt-lora/: a kohya LoRA for tiny-pt written key by key (sgm names,
  LoCon convs, both text encoders, alphas), a PEFT LoRA (peft's LoraConfig, saved by diffusers'
  ``save_lora_weights``), each proven by ``load_lora_weights`` (no unused key, every layer adapted), and
  the pipeline's images with them at weight 1 and 0.5 and both at once (``set_adapters``).
* ``lcm-lora`` writes tests/fixtures/tiny-shapes-lcm/: the shipped tiny-shapes with its LCM-LoRA
  (sdxl_engine/assets/tiny-shapes/lcm-lora.safetensors, proven by ``load_lora_weights``) and LCMScheduler at
  guidance 1, its step noise the engine's (tests/fixtures/lcm-noise.npz: ``python -m tools.lcm_noise`` first),
  4 and 2 steps, and the 4-step case without the LoRA.
* ``img2img`` writes tests/fixtures/tiny-pt-img2img/reference.{npz,json}: tiny-pt's
  ``StableDiffusionXLImg2ImgPipeline`` images with Euler, DPM++ 2M Karras and DDIM at two strengths each
  (:data:`IMG2IMG_CASES`), from two fixed pictures, the image latents the VAE posterior's mean and the
  noise the engine's (``python -m tools.img2img_noise``, the runtime's venv, first: it writes
  tests/fixtures/tiny-pt-img2img/noise.npz).
* ``fullsize`` writes a random full-size SDXL base (diffusers format, safetensors, about 14 GB
  in float32) to DIR and reference outputs to DIR/reference/; it is not committed.

It needs PyTorch and the reference libraries, which the runtime and CI never install:
``pip install torch==2.13.0 diffusers==0.42.1 transformers==5.24.0 safetensors accelerate``.
It is never run in CI; the runtime and the tests never import it (the tests read its output).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import hashlib
import inspect
import io
import json
import logging
import re
import resource
import shutil
import time
import zipfile
from pathlib import Path

import diffusers
import numpy as np
import psutil
import torch
import transformers
import diffusers.schedulers.scheduling_lcm
import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as sdxl_img2img
import PIL.Image
from diffusers import (AutoencoderKL, DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, LCMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel)
from safetensors import safe_open
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer


ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
SDXL_BASE_DIR = ROOT / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"

# sha256 of stabilityai/stable-diffusion-xl-base-1.0's files at hub revision
# 462165984030d82259a11f4367a4eed129e94a7b; SDXL_BASE_DIR holds byte-identical copies.
SDXL_BASE_SHA256 = {
    "model_index.json": "6d7b93508390ab91ac5bfbe4aeb4dc2d83f7bb1b05fb069d714b5b0c75f70d44",
    "scheduler/scheduler_config.json": "af3e45a949aff8b8341ab8b811429ec03fee857a700a1d9477363e4fff9666e2",
    "text_encoder/config.json": "39b8b2e4b1949e36969caa425b6c81c68bace99198dd9078ce05d16ad401fe7f",
    "text_encoder_2/config.json": "a892d1c3a69a7e9247a24de2bc1d5891e3109a54696e53be20093af671072c34",
    "tokenizer/special_tokens_map.json": "c4864a9376a8401918425bed71fc14fc0e81f9b59ec45c1cf96cccb2df508eac",
    "tokenizer/tokenizer_config.json": "19d7b034cb0cc3ce9766c2231373ab8aa8991fc72e2c8f76558bfaae3de0d563",
    "tokenizer_2/special_tokens_map.json": "f118ab3a983206e4f32583448de6bd6aae4ee21869135cef1f5848a753cdaab6",
    "tokenizer_2/tokenizer_config.json": "c9d23941f76a41cbd50eda9290f57be7828f0a7a677939e9ef181f7e12bd1bdf",
    "unet/config.json": "30ebc70750223e59006f7f2b4e1e6c102570aa19a9c4ae3e1fbe7591332dbae6",
    "vae/config.json": "0b331c8ac22ded5f9997a144a575c1d113d6169aff262c353f39015bd24a6264",
}

COMPONENTS = ("text_encoder", "text_encoder_2", "vae", "unet")

# ``tiny``: SDXL's architecture, deliberately unlike the project's tiny-shapes (more layers and heads).
TINY_TEXT = dict(
    text_encoder=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      hidden_act="quick_gelu", projection_dim=32),
    text_encoder_2=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        hidden_act="gelu", projection_dim=48),
)
TINY_UNET = dict(
    sample_size=16,
    block_out_channels=(16, 32, 32),  # small enough to commit (~3.5 MB of float32)
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=2,
    attention_head_dim=(2, 2, 4),  # the number of heads per level, in diffusers' SDXL naming
    transformer_layers_per_block=(1, 2, 2),
    use_linear_projection=True,
    norm_num_groups=8,
    cross_attention_dim=32 + 48,  # text_encoder + text_encoder_2 hidden sizes
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=6 * 8 + 48,  # 6 time ids x 8 + text_embeds (projection_dim 48)
)
TINY_VAE = dict(
    block_out_channels=(16, 32, 32),
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    layers_per_block=1,
    norm_num_groups=8,
    latent_channels=4,
    sample_size=64,
    scaling_factor=0.13025,
)
# ``tiny-pt-conv``: the other layouts: conv 1x1 proj_in/proj_out, ints for heads and layers, upcast attention.
CONV_UNET = dict(
    sample_size=16,
    block_out_channels=(16, 32),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1,
    transformer_layers_per_block=1,
    attention_head_dim=8,  # 8 heads at every level (head size 2 at 16 channels, 4 in the 32-channel mid block)
    use_linear_projection=False,
    upcast_attention=True,
    norm_num_groups=16,
    norm_eps=1e-6,
    flip_sin_to_cos=True,
    freq_shift=0,
    cross_attention_dim=40,
    addition_embed_type="text_time",
    addition_time_embed_dim=4,
    projection_class_embeddings_input_dim=6 * 4 + 16,  # 6 time ids x 4 + text_embeds of 16
)
CONV_VAE = dict(
    block_out_channels=(16, 32),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=2,
    norm_num_groups=16,
    latent_channels=4,
    sample_size=32,
    scaling_factor=0.13025,
)
SEEDS = dict(text_encoder=0, text_encoder_2=1, unet=2, vae=3, conv_unet=4, conv_vae=5)

PROMPTS = ["a red circle", "a large green star on the left", "", "a blue square on a black background"]
FULLSIZE_PROMPTS = PROMPTS[:2]

# Scheduler variants: class and from_config overrides over SDXL base's scheduler config.
SCHEDULERS = {
    "euler-leading": (EulerDiscreteScheduler, {}),
    "euler-trailing": (EulerDiscreteScheduler, {"timestep_spacing": "trailing"}),
    "euler-linspace": (EulerDiscreteScheduler, {"timestep_spacing": "linspace"}),
    "dpm++2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpm++2m-karras": (DPMSolverMultistepScheduler,
                       {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "ddim": (DDIMScheduler, {}),
}
SCHEDULE_STEPS = (1, 2, 4, 7, 10, 20, 50)

# Pipeline cases: prompt, negative prompt, guidance, steps, width, height, scheduler variant.
# An empty negative prompt is passed to diffusers as None: SDXL base (force_zeros_for_empty_prompt)
# then uses zero embeddings, as the engine does; diffusers encodes a literal "" instead.
CASES = [
    ("a red circle", "", 5.0, 8, 64, 64, "euler-leading"),
    ("a red circle", "a blue square", 5.0, 8, 64, 64, "euler-leading"),
    ("a large green star on the left", "", 7.5, 5, 80, 48, "euler-leading"),
    ("a red circle", "", 1.0, 6, 64, 64, "euler-leading"),
    ("a red circle", "", 0.0, 4, 64, 64, "euler-trailing"),
    ("a blue square on a black background", "a red circle", 5.0, 10, 64, 64, "dpm++2m"),
    ("a blue square on a black background", "a red circle", 5.0, 10, 64, 64, "dpm++2m-karras"),
    ("a blue square on a black background", "a red circle", 5.0, 10, 64, 64, "ddim"),
    ("a blue square on a black background", "", 3.0, 7, 64, 64, "euler-linspace"),
]

# Suggested (atol, rtol) for a float32 reimplementation, per output key. Each is at least 10x what
# float32 rounding alone gives here (an array's ``f64_max_abs_diff`` in reference.json: the same
# computation in float64) and below what a real slip does: guidance 5.05 instead of 5.0 moves
# case 0's images by 2e-3, a zeroed instead of an encoded empty negative prompt by 0.18.
TOLERANCES = {
    r"ids_\d": (0, 0),
    r"te\d_\w+": (1e-5, 1e-4),
    r"(conv_)?unet_out": (2e-5, 1e-4),
    r"(conv_)?vae_(decode_out|encode_mean|encode_logvar)": (5e-5, 1e-4),
    r"case\d+_final_latents": (1e-3, 1e-4),
    r"case\d+_images": (1e-4, 0),
    r"(case\d+|sched_.+)_(timesteps|sigmas)": (1e-6, 1e-5),
}

MEANINGS = [  # (key pattern, meaning); %s is filled with the pattern's groups
    (r"ids_(1|2)", "tokenizer%s(P) input_ids, padding='max_length', max_length=77, truncation=True"),
    (r"te1_hidden", "text_encoder(ids_1, output_hidden_states=True).hidden_states[-2] (penultimate layer)"),
    (r"te1_last", "text_encoder(ids_1).last_hidden_state (after the final layer norm)"),
    (r"te1_pooled", "text_encoder(ids_1).pooler_output (final-layer-norm state at the first eos_token_id position)"),
    (r"te2_hidden", "text_encoder_2(ids_2, output_hidden_states=True).hidden_states[-2]"),
    (r"te2_text_embeds", "text_encoder_2(ids_2).text_embeds: text_projection(pooled output), no normalisation"),
    (r"(conv_)?unet_sample", "UNet input sample, standard normal"),
    (r"(conv_)?unet_timesteps", "UNet input timesteps"),
    (r"(conv_)?unet_encoder_hidden_states", "UNet input encoder_hidden_states, standard normal"),
    (r"(conv_)?unet_text_embeds", "UNet added_cond_kwargs['text_embeds'], standard normal"),
    (r"(conv_)?unet_time_ids", "UNet added_cond_kwargs['time_ids']: (orig h, orig w, crop top, crop left, h, w)"),
    (r"(conv_)?unet_out", "unet(sample, timesteps, encoder_hidden_states, added_cond_kwargs).sample"),
    (r"(conv_)?vae_decode_in", "VAE decoder input latents (unscaled), standard normal"),
    (r"(conv_)?vae_decode_out", "vae.decode(vae_decode_in).sample: the image, not clipped"),
    (r"(conv_)?vae_encode_in", "VAE encoder input image, uniform in [-1, 1]"),
    (r"(conv_)?vae_encode_mean", "vae.encode(vae_encode_in).latent_dist.mean"),
    (r"(conv_)?vae_encode_logvar", "vae.encode(vae_encode_in).latent_dist.logvar (clamped to [-30, 20] by diffusers)"),
    (r"case(\d+)_latents", "case %s: initial latents passed to the pipeline (numpy RandomState(case).standard_normal); "
                           "the pipeline multiplies them by init_noise_sigma"),
    (r"case(\d+)_final_latents", "case %s: latents after the last scheduler step (before / scaling_factor)"),
    (r"case(\d+)_images", "case %s: pipeline output_type='np' images, NHWC in [0, 1]"),
    (r"case(\d+)_timesteps", "case %s: scheduler.timesteps the pipeline used"),
    (r"case(\d+)_sigmas", "case %s: scheduler.sigmas the pipeline used (num_inference_steps + 1, last 0)"),
    (r"sched_(.+)_(\d+)_timesteps", "scheduler %s, set_timesteps(%s): timesteps"),
    (r"sched_(.+)_(\d+)_sigmas", "scheduler %s, set_timesteps(%s): sigmas"),
]


def build_vocab():
    """sdxl_engine.checkpoint.builtin's vocabulary, imported only for ``tiny`` (it brings JAX, which ``samplers`` does not need)."""
    from sdxl_engine.checkpoint.builtin import build_vocab as build

    return build()


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def sdxl_base_configs(root: Path = SDXL_BASE_DIR) -> dict:
    """SDXL 1.0 base's configs, after checking every file's sha256 against the hub's.

    Returns {"unet": dict, "vae": dict, "scheduler": dict, "text_encoder": CLIPTextConfig,
    "text_encoder_2": CLIPTextConfig}.
    """
    for rel, digest in SDXL_BASE_SHA256.items():
        if hashlib.sha256((root / rel).read_bytes()).hexdigest() != digest:
            raise ValueError(f"{root / rel}: differs from the hub's file (expected sha256 {digest})")
    return {
        "unet": _json(root / "unet" / "config.json"),
        "vae": _json(root / "vae" / "config.json"),
        "scheduler": _json(root / "scheduler" / "scheduler_config.json"),
        "text_encoder": CLIPTextConfig.from_json_file(root / "text_encoder" / "config.json"),
        "text_encoder_2": CLIPTextConfig.from_json_file(root / "text_encoder_2" / "config.json"),
    }


def plain_config(config) -> dict:
    """A scheduler's resolved config as a plain dict, less ``_use_default_values`` (a set, in no fixed order)."""
    return {k: v for k, v in config.items() if k != "_use_default_values"}


def tiny_configs() -> dict:
    """The ``tiny`` model's configs, in the layout of sdxl_base_configs()."""
    vocab = build_vocab()[0]
    common = dict(vocab_size=len(vocab), max_position_embeddings=77, pad_token_id=1,
                  bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"])
    return {
        "unet": TINY_UNET,
        "vae": TINY_VAE,
        "scheduler": sdxl_base_configs()["scheduler"],
        **{name: CLIPTextConfig(**common, **spec) for name, spec in TINY_TEXT.items()},
    }


def make_tokenizers() -> list[CLIPTokenizer]:
    """SDXL's two CLIP tokenizers over the project's vocabulary: pad "<|endoftext|>" and "!", 77 tokens."""
    vocab, merges = build_vocab()
    pairs = [tuple(m.split(" ")) for m in merges]
    return [CLIPTokenizer(vocab=vocab, merges=pairs, pad_token=pad, model_max_length=77)
            for pad in ("<|endoftext|>", "!")]


def write_tokenizers(tokenizers: list[CLIPTokenizer], model_dir: Path) -> None:
    """Save both tokenizers under model_dir, plus the vocab.json and merges.txt that transformers 5 omits."""
    vocab, merges = build_vocab()
    for tok, sub in zip(tokenizers, ("tokenizer", "tokenizer_2")):
        tok.save_pretrained(model_dir / sub)
        (model_dir / sub / "vocab.json").write_text(json.dumps(vocab))
        (model_dir / sub / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def build_component(name: str, configs: dict) -> torch.nn.Module:
    """An untrained ``name`` ("unet", "vae", "text_encoder", "text_encoder_2") on torch's default device."""
    if name == "unet":
        return UNet2DConditionModel.from_config(configs["unet"])
    if name == "vae":
        return AutoencoderKL.from_config(configs["vae"])
    cls = CLIPTextModel if name == "text_encoder" else CLIPTextModelWithProjection
    return cls(configs[name])


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every 1-D parameter (norm scales and shifts, biases) moved by N(0, 0.1^2); eval mode.

    Default initialisation leaves norm scales at 1 and many biases at 0, so a loader that dropped
    them would still match the reference; after this every parameter shows in the outputs.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model.eval()


def seeded_component(name: str, configs: dict, seed: int) -> torch.nn.Module:
    """build_component() under torch seed ``seed``, then randomized(): the same weights on every run."""
    torch.manual_seed(seed)
    return randomized(build_component(name, configs), seed)


def saved_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """{name: shape} of the tensors save_pretrained writes for ``model``: its state_dict.

    transformers' CLIP ``position_ids`` is a non-persistent buffer, so it is not in the state_dict
    and not in the files (``tiny`` checks this rule against the files it writes).
    """
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def file_shapes(folder: Path) -> dict[str, list[int]]:
    """{name: shape} of every tensor in the *.safetensors files of ``folder`` (one model, maybe sharded)."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def check_saved(model: torch.nn.Module, folder: Path) -> None:
    """Raise RuntimeError unless the safetensors in ``folder`` hold exactly saved_shapes(model)."""
    expected, found = saved_shapes(model), file_shapes(folder)
    if expected != found:
        diff = sorted(k for k in set(expected) | set(found) if expected.get(k) != found.get(k))
        raise RuntimeError(f"{folder}: saved tensors differ from the state_dict rule: {diff[:10]}")


def text_inputs(tokenizers: list[CLIPTokenizer], prompts: list[str]) -> dict[str, np.ndarray]:
    """ids_1, ids_2: (n, 77) int32 token ids of ``prompts`` from tokenizer and tokenizer_2."""
    return {f"ids_{i}": np.asarray(tok(prompts, padding="max_length", max_length=77, truncation=True).input_ids,
                                   np.int32)
            for i, tok in ((1, tokenizers[0]), (2, tokenizers[1]))}


def text_outputs(te1: CLIPTextModel, te2: CLIPTextModelWithProjection, inputs: dict) -> dict[str, torch.Tensor]:
    """Text-encoder outputs for ids_1/ids_2 (n, 77), in the models' dtype.

    te1_hidden (n, 77, h1), te1_last (n, 77, h1), te1_pooled (n, h1), te2_hidden (n, 77, h2),
    te2_text_embeds (n, projection_dim).
    """
    with torch.no_grad():
        o1 = te1(torch.from_numpy(inputs["ids_1"]).long(), output_hidden_states=True)
        o2 = te2(torch.from_numpy(inputs["ids_2"]).long(), output_hidden_states=True)
    return {"te1_hidden": o1.hidden_states[-2], "te1_last": o1.last_hidden_state, "te1_pooled": o1.pooler_output,
            "te2_hidden": o2.hidden_states[-2], "te2_text_embeds": o2.text_embeds}


def unet_inputs(config, batch: int, size: int, timesteps: list[int], time_ids: list[list[float]], seed: int,
                prefix: str = "") -> dict[str, np.ndarray]:
    """Random inputs of one UNet call: sample (b, 4, size, size), timesteps (b,) int64,
    encoder_hidden_states (b, 77, cross_attention_dim), text_embeds (b, d), time_ids (b, 6); float32."""
    rng = np.random.RandomState(seed)
    text_dim = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    return {
        prefix + "unet_sample": rng.standard_normal((batch, 4, size, size)).astype(np.float32),
        prefix + "unet_timesteps": np.array(timesteps, np.int64),
        prefix + "unet_encoder_hidden_states":
            rng.standard_normal((batch, 77, config["cross_attention_dim"])).astype(np.float32),
        prefix + "unet_text_embeds": rng.standard_normal((batch, text_dim)).astype(np.float32),
        prefix + "unet_time_ids": np.array(time_ids, np.float32),
    }


def unet_outputs(unet: UNet2DConditionModel, inputs: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """unet_out (b, 4, h, w): one call on unet_inputs(), in the UNet's dtype."""
    x = {k[len(prefix):]: torch.from_numpy(v) for k, v in inputs.items() if k.startswith(prefix + "unet_")}
    dtype = unet.dtype
    added = {"text_embeds": x["unet_text_embeds"].to(dtype), "time_ids": x["unet_time_ids"].to(dtype)}
    with torch.no_grad():
        out = unet(x["unet_sample"].to(dtype), x["unet_timesteps"], x["unet_encoder_hidden_states"].to(dtype),
                   added_cond_kwargs=added).sample
    return {prefix + "unet_out": out}


def vae_inputs(decode_shape: tuple, encode_shape: tuple | None, seed: int, prefix: str = "") -> dict[str, np.ndarray]:
    """vae_decode_in: standard normal latents (b, 4, h, w); vae_encode_in: uniform [-1, 1] images (b, 3, H, W)."""
    rng = np.random.RandomState(seed)
    inputs = {prefix + "vae_decode_in": rng.standard_normal(decode_shape).astype(np.float32)}
    if encode_shape:
        inputs[prefix + "vae_encode_in"] = rng.uniform(-1, 1, encode_shape).astype(np.float32)
    return inputs


def vae_outputs(vae: AutoencoderKL, inputs: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """vae_decode_out (b, 3, H, W) and, given vae_encode_in, vae_encode_mean/logvar (b, 4, h, w); VAE's dtype."""
    out = {}
    with torch.no_grad():
        z = torch.from_numpy(inputs[prefix + "vae_decode_in"]).to(vae.dtype)
        out[prefix + "vae_decode_out"] = vae.decode(z).sample
        if prefix + "vae_encode_in" in inputs:
            dist = vae.encode(torch.from_numpy(inputs[prefix + "vae_encode_in"]).to(vae.dtype)).latent_dist
            out[prefix + "vae_encode_mean"], out[prefix + "vae_encode_logvar"] = dist.mean, dist.logvar
    return out


def _keep_latents(store: dict, pipe, step: int, timestep, kwargs: dict) -> dict:
    """callback_on_step_end: remember the latents after each step, change nothing."""
    store["latents"] = kwargs["latents"]
    return {}


def pipeline_case(pipe: StableDiffusionXLPipeline, k: int, base_scheduler: dict) -> tuple[dict, dict]:
    """Run CASES[k] (2 images) with explicit latents; returns ({key: array}, case metadata).

    case{k}_latents (2, 4, h/f, w/f) float32; case{k}_final_latents the same shape, in the pipeline's
    dtype; case{k}_images (2, H, W, 3) in [0, 1]; case{k}_timesteps and case{k}_sigmas as used.
    """
    prompt, negative, guidance, steps, width, height, variant = CASES[k]
    cls, overrides = SCHEDULERS[variant]
    pipe.scheduler = cls.from_config(base_scheduler, **overrides)
    f = pipe.vae_scale_factor
    latents = np.random.RandomState(k).standard_normal((2, 4, height // f, width // f)).astype(np.float32)
    store = {}
    images = pipe(prompt, negative_prompt=negative or None, guidance_scale=guidance, num_inference_steps=steps,
                  width=width, height=height, num_images_per_prompt=2, output_type="np",
                  latents=torch.from_numpy(latents).to(pipe.unet.dtype),
                  callback_on_step_end=functools.partial(_keep_latents, store),
                  callback_on_step_end_tensor_inputs=["latents"]).images
    arrays = {f"case{k}_latents": latents, f"case{k}_final_latents": store["latents"], f"case{k}_images": images,
              f"case{k}_timesteps": pipe.scheduler.timesteps}
    if hasattr(pipe.scheduler, "sigmas"):
        arrays[f"case{k}_sigmas"] = pipe.scheduler.sigmas
    cfg = pipe.do_classifier_free_guidance
    meta = dict(prompt=prompt, negative_prompt=negative, diffusers_negative_prompt=negative or None,
                cfg_applied=cfg, negative_embeddings_zeroed=cfg and not negative, guidance_scale=guidance,
                num_inference_steps=steps, width=width, height=height, num_images_per_prompt=2,
                scheduler_variant=variant, scheduler_class=cls.__name__, from_config_overrides=overrides,
                scheduler_config=plain_config(pipe.scheduler.config),
                init_noise_sigma=float(pipe.scheduler.init_noise_sigma),
                time_ids=[height, width, 0, 0, height, width], latents=f"numpy RandomState({k}).standard_normal")
    return arrays, meta


def schedules(base_scheduler: dict) -> tuple[dict, dict]:
    """sched_<variant>_<steps>_timesteps / _sigmas for every SCHEDULERS variant and SCHEDULE_STEPS.

    Returns ({key: array in the scheduler's own dtype}, {variant: class, overrides, config,
    init_noise_sigma per step count}).
    """
    arrays, meta = {}, {}
    for variant, (cls, overrides) in SCHEDULERS.items():
        sched = cls.from_config(base_scheduler, **overrides)
        meta[variant] = dict(scheduler_class=cls.__name__, from_config_overrides=overrides,
                             config=plain_config(sched.config), init_noise_sigma={})
        for n in SCHEDULE_STEPS:
            sched.set_timesteps(n)
            arrays[f"sched_{variant}_{n}_timesteps"] = sched.timesteps
            if hasattr(sched, "sigmas"):
                arrays[f"sched_{variant}_{n}_sigmas"] = sched.sigmas
            meta[variant]["init_noise_sigma"][n] = float(sched.init_noise_sigma)
    return arrays, meta


# ``samplers``: A1111 name -> (diffusers class, the from_config overrides the name stands for), as the engine maps them.
SAMPLER_CLASSES = {
    "Euler": (EulerDiscreteScheduler, {}),
    "Euler a": (EulerAncestralDiscreteScheduler, {}),
    "DPM++ 2M": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "DPM++ 2M Karras": (DPMSolverMultistepScheduler,
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "DDIM": (DDIMScheduler, {}),
    "LCM": (LCMScheduler, {}),
}
STEP_NOISE = ("Euler a", "LCM")  # the samplers that draw fresh noise in step()
DROP = "<missing>"  # a SAMPLER_CASES value: the field is removed from the model's config (the class default applies)
# SDXL base's fields that a config saved by EulerDiscreteScheduler lacks and DDIMScheduler reads (or, for
# skip_prk_steps, PNDM): from_config gives DDIM its own defaults, clip_sample True and set_alpha_to_one True.
EULER_SAVED_DROPS = ("clip_sample", "set_alpha_to_one", "sample_max_value", "skip_prk_steps")
# (case name, sampler, changes to SDXL base's scheduler_config.json, steps). Empty changes {} with "minimal" below
# means a config holding only _class_name: every field is the class's default.
SAMPLER_CASES = [
    ("euler-leading", "Euler", {}, 6),
    ("euler-linspace", "Euler", {"timestep_spacing": "linspace"}, 5),
    ("euler-trailing", "Euler", {"timestep_spacing": "trailing"}, 5),
    ("euler-karras-in-config", "Euler", {"use_karras_sigmas": True}, 6),
    ("euler-karras-sigma-range", "Euler", {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}, 5),
    ("euler-exponential", "Euler", {"use_exponential_sigmas": True, "timestep_spacing": "trailing"}, 5),
    ("euler-final-sigma-min", "Euler", {"final_sigmas_type": "sigma_min"}, 5),
    ("euler-v-trailing", "Euler", {"prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 5),
    ("euler-sample", "Euler", {"prediction_type": "sample"}, 4),
    ("euler-zero-snr", "Euler", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                 "timestep_spacing": "trailing"}, 5),
    ("euler-log-linear", "Euler", {"interpolation_type": "log_linear"}, 5),
    ("euler-continuous-v", "Euler", {"timestep_type": "continuous", "prediction_type": "v_prediction"}, 4),
    ("euler-cosine", "Euler", {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}, 4),
    ("euler-minimal", "Euler", "minimal", 4),
    ("euler-a-leading", "Euler a", {}, 6),
    ("euler-a-linspace", "Euler a", {"timestep_spacing": "linspace"}, 5),
    ("euler-a-trailing", "Euler a", {"timestep_spacing": "trailing"}, 5),
    ("euler-a-karras-in-config", "Euler a", {"use_karras_sigmas": True}, 5),  # not a field of Euler a: no effect
    ("euler-a-v-zero-snr", "Euler a", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                       "timestep_spacing": "trailing"}, 5),
    ("dpm-leading", "DPM++ 2M", {}, 10),
    ("dpm-linspace", "DPM++ 2M", {"timestep_spacing": "linspace"}, 7),
    ("dpm-trailing", "DPM++ 2M", {"timestep_spacing": "trailing"}, 7),
    ("dpm-karras-in-config", "DPM++ 2M", {"use_karras_sigmas": True}, 6),
    ("dpm-v", "DPM++ 2M", {"prediction_type": "v_prediction"}, 6),
    ("dpm-sample", "DPM++ 2M", {"prediction_type": "sample"}, 5),
    ("dpm-heun", "DPM++ 2M", {"solver_type": "heun"}, 7),
    ("dpm-sigma-min-16", "DPM++ 2M", {"final_sigmas_type": "sigma_min"}, 16),  # 15+ steps: the last is 2nd order
    ("dpm-sigma-min-6", "DPM++ 2M", {"final_sigmas_type": "sigma_min"}, 6),  # lower_order_final: 1st order
    ("dpm-sigma-min-15", "DPM++ 2M", {"final_sigmas_type": "sigma_min"}, 15),  # lower_order_final's edge: 2nd order
    ("dpm-sigma-min-no-lower-order-final", "DPM++ 2M", {"final_sigmas_type": "sigma_min",
                                                         "lower_order_final": False}, 6),
    ("dpm-euler-at-final", "DPM++ 2M", {"final_sigmas_type": "sigma_min", "euler_at_final": True}, 16),
    ("dpm-lambda-min-clipped", "DPM++ 2M", {"lambda_min_clipped": -2.5, "timestep_spacing": "linspace"}, 6),
    ("dpm-zero-snr", "DPM++ 2M", {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction",
                                  "timestep_spacing": "trailing"}, 6),
    ("dpm-exponential", "DPM++ 2M", {"use_exponential_sigmas": True}, 6),
    ("dpm-order-3-sde-in-config", "DPM++ 2M", {"solver_order": 3, "algorithm_type": "sde-dpmsolver++"}, 6),
    ("dpm-karras", "DPM++ 2M Karras", {}, 8),
    ("dpm-karras-sigma-range", "DPM++ 2M Karras", {"sigma_min": 0.1, "sigma_max": 10.0}, 6),
    ("dpm-karras-trailing-v", "DPM++ 2M Karras", {"timestep_spacing": "trailing",
                                                  "prediction_type": "v_prediction"}, 6),
    ("ddim-sdxl", "DDIM", {}, 6),
    ("ddim-clip-sample-missing", "DDIM", {"clip_sample": DROP}, 6),  # from_config: DDIM's default True
    ("ddim-clip-range-2", "DDIM", {"clip_sample": True, "clip_sample_range": 2.0}, 5),
    ("ddim-linspace", "DDIM", {"timestep_spacing": "linspace"}, 7),  # carry != 1
    ("ddim-linspace-clip", "DDIM", {"timestep_spacing": "linspace", "clip_sample": True}, 6),
    ("ddim-trailing", "DDIM", {"timestep_spacing": "trailing"}, 5),
    ("ddim-alpha-to-one", "DDIM", {"set_alpha_to_one": True}, 5),
    ("ddim-v-clip", "DDIM", {"prediction_type": "v_prediction", "clip_sample": True}, 5),
    ("ddim-sample", "DDIM", {"prediction_type": "sample"}, 4),
    ("ddim-minimal", "DDIM", "minimal", 4),
    ("ddim-euler-saved-config", "DDIM", dict.fromkeys(EULER_SAVED_DROPS, DROP), 10),  # clip True, alpha 1
    ("lcm-sdxl", "LCM", {}, 4),
    ("lcm-1-step", "LCM", {}, 1),
    ("lcm-2-steps", "LCM", {}, 2),
    ("lcm-8-steps", "LCM", {}, 8),
    ("lcm-16-steps", "LCM", {}, 16),
    ("lcm-v", "LCM", {"prediction_type": "v_prediction"}, 4),
    ("lcm-sample", "LCM", {"prediction_type": "sample"}, 4),
    ("lcm-trailing-in-config", "LCM", {"timestep_spacing": "trailing"}, 4),  # LCM does not read it: no effect
    ("lcm-clip-sample", "LCM", {"clip_sample": True}, 4),
    ("lcm-clip-range-2-v", "LCM", {"clip_sample": True, "clip_sample_range": 2.0,
                                   "prediction_type": "v_prediction"}, 5),
    ("lcm-original-30", "LCM", {"original_inference_steps": 30}, 6),  # k = 33: timesteps from 989
    ("lcm-original-8-all", "LCM", {"original_inference_steps": 8}, 8),  # every one of the original steps
    ("lcm-timestep-scaling-0.1", "LCM", {"timestep_scaling": 0.1}, 4),  # c_skip large enough to matter
    ("lcm-alpha-to-one", "LCM", {"set_alpha_to_one": True}, 4),  # unused: no previous timestep is negative
    ("lcm-linear", "LCM", {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02}, 4),
    ("lcm-minimal", "LCM", "minimal", 4),
]
SAMPLER_SHAPE = (1, 4, 2, 2)  # latents of a 1-image batch; every update is elementwise
SAMPLER_MAX_STEPS = max(case[3] for case in SAMPLER_CASES)


def case_config(base: dict, changes) -> dict:
    """The model's raw scheduler config of one SAMPLER_CASES row."""
    if changes == "minimal":
        return {"_class_name": base["_class_name"]}
    config = {k: v for k, v in base.items() if changes.get(k) != DROP}
    config.update({k: v for k, v in changes.items() if v != DROP})
    return config


def init_defaults(cls) -> dict:
    """{argument: default} of ``cls.__init__`` (diffusers' from_config fills a missing field with these)."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}


def sampler_trajectory(sampler: str, config: dict, steps: int, model_outputs: np.ndarray, start: np.ndarray):
    """diffusers' scheduler for ``sampler`` from ``config``, run for ``steps`` steps on fixed arrays.

    The sample starts at ``start * init_noise_sigma``; step k's model output is ``model_outputs[k]``.
    Returns (scheduler, samples (steps + 1, *SAMPLER_SHAPE), noise (steps, *SAMPLER_SHAPE) or None).
    Euler a's and LCM's noise of step k is torch.randn from a generator seeded 1000 + k, passed to step() the
    same way (LCM draws none on its last step: that row is recorded all the same, so an engine adding noise
    there is caught).
    """
    cls, overrides = SAMPLER_CLASSES[sampler]
    sched = cls.from_config(config, **overrides)
    sched.set_timesteps(steps)
    sample = torch.from_numpy(start) * sched.init_noise_sigma
    samples, noises = [sample], []
    for k, t in enumerate(sched.timesteps):
        sched.scale_model_input(sample, t)  # Euler's step index; the scaling itself is the UNet's input only
        output = torch.from_numpy(model_outputs[k])
        kwargs = {}
        if sampler in STEP_NOISE:
            kwargs["generator"] = torch.Generator().manual_seed(1000 + k)
            noises.append(torch.randn(SAMPLER_SHAPE, generator=torch.Generator().manual_seed(1000 + k),
                                      dtype=torch.float32))
        sample = sched.step(output, t, sample, **kwargs).prev_sample
        samples.append(sample)
    return sched, torch.stack(samples).numpy(), torch.stack(noises).numpy() if noises else None


# ``samplers``' image-level cases: tiny-pt's pipeline with DDIM from a config that lacks clip_sample (the class
# default True clips x0 every step); name -> (prompt, negative prompt, guidance, steps, the config's fields
# dropped, latents seed); 64x64, 2 images. ``ddim_euler_image``: a config as EulerDiscreteScheduler saves it
# (EULER_SAVED_DROPS), the empty negative prompt as None (diffusers' force_zeros_for_empty_prompt).
DDIM_IMAGE_CASES = {"ddim_image": ("a red circle", "a blue square", 5.0, 6, ("clip_sample",), 23),
                    "ddim_euler_image": ("a red circle", None, 4.0, 10, EULER_SAVED_DROPS, 31)}


def ddim_image_case(out: Path, name: str = "ddim_image") -> tuple[dict, dict]:
    """diffusers' images for DDIM_IMAGE_CASES[name] on out/tiny-pt: ({key: array}, metadata)."""
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    prompt, negative, guidance, steps, drops, seed = DDIM_IMAGE_CASES[name]
    config = {k: v for k, v in plain_config(pipe.scheduler.config).items() if k not in drops}
    pipe.scheduler = DDIMScheduler.from_config(config)
    latents = np.random.RandomState(seed).standard_normal((2, 4, 16, 16)).astype(np.float32)
    images = pipe(prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps, width=64,
                  height=64, num_images_per_prompt=2, output_type="np", latents=torch.from_numpy(latents)).images
    arrays = {f"{name}_latents": latents, f"{name}_images": np.round(images * 255).astype(np.uint8)}
    meta = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                width=64, height=64, scheduler_config=config, clip_sample=pipe.scheduler.config.clip_sample,
                latents=f"numpy RandomState({seed}).standard_normal((2, 4, 16, 16))", images="uint8, round(np * 255)")
    if name != "ddim_image":  # the first case's metadata keeps the fields it was made with
        meta.update(set_alpha_to_one=pipe.scheduler.config.set_alpha_to_one,
                    timesteps=[int(t) for t in pipe.scheduler.timesteps])
    return arrays, meta


# ``samplers``' LCM image cases: tiny-pt's pipeline with LCMScheduler.from_config of its config, 64x64, 2 images
# on given latents, the step noise tools/lcm_noise.py's (the engine's rule). Prompt, negative prompt, guidance, steps.
LCM_IMAGE_CASES = {"lcm_image": ("a red circle", "", 1.0, 4),
                   "lcm_image_cfg": ("a red circle", "a blue square", 5.0, 4)}


class EngineNoise:
    """Replaces scheduling_lcm.randn_tensor with the given noises, in order; counts the calls."""

    def __init__(self, noise: np.ndarray):
        self.noise, self.calls = noise, 0

    def __call__(self, shape, generator=None, device=None, dtype=None, **kwargs):
        assert tuple(shape) == self.noise.shape[1:] and dtype == torch.float32, (shape, dtype)
        self.calls += 1
        return torch.from_numpy(self.noise[self.calls - 1].copy())

    def __enter__(self):
        self.saved = diffusers.schedulers.scheduling_lcm.randn_tensor
        diffusers.schedulers.scheduling_lcm.randn_tensor = self
        return self

    def __exit__(self, *exc):
        diffusers.schedulers.scheduling_lcm.randn_tensor = self.saved


def lcm_image_cases(out: Path) -> tuple[dict, dict]:
    """diffusers' images for LCM_IMAGE_CASES on out/tiny-pt with the engine's step noise: ({key: array}, metadata)."""
    with np.load(out / "lcm-noise.npz") as data:
        seeds, noise = data["seeds"], data["noise"]
    pipe = StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    config = plain_config(pipe.scheduler.config)
    pipe.scheduler = LCMScheduler.from_config(config)
    latents = np.random.RandomState(29).standard_normal((2, 4, 16, 16)).astype(np.float32)
    arrays, meta = {"lcm_image_latents": latents}, {}
    for key, (prompt, negative, guidance, steps) in LCM_IMAGE_CASES.items():
        assert len(noise) == steps - 1
        with EngineNoise(noise) as patched:
            images = pipe(prompt, negative_prompt=negative or None, guidance_scale=guidance,
                          num_inference_steps=steps, width=64, height=64, num_images_per_prompt=2, output_type="np",
                          latents=torch.from_numpy(latents)).images
        assert patched.calls == steps - 1, patched.calls
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(prompt=prompt, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                         cfg_applied=guidance > 1, timesteps=[int(t) for t in pipe.scheduler.timesteps])
    meta.update(width=64, height=64, scheduler_config=config, lcm_config=plain_config(pipe.scheduler.config),
                seeds=[int(s) for s in seeds], latents="numpy RandomState(29).standard_normal((2, 4, 16, 16))",
                noise="tests/fixtures/lcm-noise.npz (python -m tools.lcm_noise): randn_tensor of step k returns "
                      "its noise[k]; called steps - 1 times", images="uint8, round(np * 255)")
    return arrays, meta


# ``img2img``: tiny-pt's StableDiffusionXLImg2ImgPipeline, 64x64, 2 images (one picture each), 10 steps; case ->
# (A1111 sampler name, strength). The prompt, negative prompt and guidance are IMG2IMG_SETTINGS'.
IMG2IMG_CASES = {"euler_03": ("Euler", 0.3), "euler_075": ("Euler", 0.75),
                 "dpmk_03": ("DPM++ 2M Karras", 0.3), "dpmk_075": ("DPM++ 2M Karras", 0.75),
                 "ddim_03": ("DDIM", 0.3), "ddim_075": ("DDIM", 0.75)}
IMG2IMG_SETTINGS = dict(prompt="a red circle", negative_prompt="a blue square", guidance_scale=5.0,
                        num_inference_steps=10)
IMG2IMG_SCHEDULERS = {"Euler": (EulerDiscreteScheduler, {}),
                      "DPM++ 2M Karras": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++",
                                                                        "solver_order": 2, "use_karras_sigmas": True}),
                      "DDIM": (DDIMScheduler, {})}


def img2img_pictures() -> np.ndarray:
    """(2, 64, 64, 3) uint8: two fixed pictures (a colour ramp with a disc; a checker with a bar), no randomness."""
    y, x = np.mgrid[0:64, 0:64].astype(np.float64)
    ramp = np.stack([x * 4, y * 4, 255 - (x + y) * 2], -1)
    ramp[(x - 40) ** 2 + (y - 24) ** 2 < 12**2] = (250, 240, 30)
    checker = np.where(((x // 8 + y // 8) % 2)[..., None] == 1, (200, 60, 60), (30, 90, 200)).astype(np.float64)
    checker[28:36, 8:56] = (245, 245, 245)
    return np.clip(np.stack([ramp, checker]), 0, 255).astype(np.uint8)


class Img2ImgNoise:
    """Replaces the img2img pipeline's ``randn_tensor`` with the engine's noise (called once, checked) and its
    ``retrieve_latents`` with the posterior's mean (``sample_mode="argmax"``, the engine's convention)."""

    def __init__(self, noise: np.ndarray):
        self.noise, self.calls, self.encodes = noise, 0, 0

    def randn(self, shape, generator=None, device=None, dtype=None, **kwargs):
        assert tuple(shape) == self.noise.shape and dtype == torch.float32, (shape, dtype)
        self.calls += 1
        return torch.from_numpy(self.noise.copy())

    def latents(self, encoder_output, generator=None, sample_mode="sample"):
        self.encodes += 1
        return self.saved[1](encoder_output, generator, sample_mode="argmax")

    module = sdxl_img2img  # the pipeline module whose two functions are replaced (a subclass names another)

    def __enter__(self):
        self.saved = self.module.randn_tensor, self.module.retrieve_latents
        self.module.randn_tensor, self.module.retrieve_latents = self.randn, self.latents
        return self

    def __exit__(self, *exc):
        self.module.randn_tensor, self.module.retrieve_latents = self.saved


def cmd_img2img(out: Path) -> None:
    """``img2img``: out/tiny-pt-img2img/reference.{npz,json} (see the module docstring)."""
    torch.set_num_threads(1)
    folder = out / "tiny-pt-img2img"
    with np.load(folder / "noise.npz") as data:
        seeds, noise = data["seeds"], data["noise"]
    pipe = sdxl_img2img.StableDiffusionXLImg2ImgPipeline.from_pretrained(out / "tiny-pt", dtype=torch.float32,
                                                                         add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    assert not pipe.config.requires_aesthetics_score  # time ids as txt2img's: (h, w, 0, 0, h, w)
    config = plain_config(pipe.scheduler.config)
    pictures = img2img_pictures()
    arrays, meta = {"pictures": pictures}, {}
    steps = IMG2IMG_SETTINGS["num_inference_steps"]
    for key, (sampler, strength) in IMG2IMG_CASES.items():
        cls, overrides = IMG2IMG_SCHEDULERS[sampler]
        pipe.scheduler = cls.from_config(config, **overrides)
        with Img2ImgNoise(noise) as patched:
            images = pipe(**IMG2IMG_SETTINGS, image=[PIL.Image.fromarray(p) for p in pictures], strength=strength,
                          num_images_per_prompt=2, output_type="np").images
        assert patched.calls == 1 and patched.encodes == 1, (patched.calls, patched.encodes)
        start = steps - min(int(steps * strength), steps)
        arrays[f"{key}_images"] = np.round(images * 255).astype(np.uint8)
        meta[key] = dict(sampler=sampler, scheduler=cls.__name__, overrides=overrides, strength=strength,
                         start_step=start, timesteps=[float(t) for t in pipe.scheduler.timesteps[start:]],
                         begin_index=getattr(pipe.scheduler, "begin_index", None))
    write_npz(folder / "reference.npz", arrays)
    meta = dict(made_by="python -m tools.img2img_noise (runtime venv), then python -m tools.make_fixtures img2img",
                versions=versions(), torch_threads=1, model="tests/fixtures/tiny-pt", settings=IMG2IMG_SETTINGS,
                size=[64, 64], scheduler_config=config, seeds=[int(s) for s in seeds], cases=meta,
                notes=["pictures (2, 64, 64, 3) uint8: img2img_pictures(), image i the input of output image i, "
                       "given as PIL images (VaeImageProcessor: x / 255, 2x - 1; no resize at 64x64).",
                       "Image latents: retrieve_latents with sample_mode='argmax' (the posterior's mean) x "
                       "scaling_factor; the pipeline's default samples the posterior.",
                       "Noise: randn_tensor in prepare_latents returns noise.npz's noise (the engine's initial "
                       "noise of seeds 41, 42), added by scheduler.add_noise at timesteps[start_step].",
                       "start_step: steps - min(int(steps x strength), steps) (get_timesteps); <case>_images "
                       "(2, 64, 64, 3) uint8, round(np * 255)."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def sampler_case(row: tuple, base: dict, model_outputs: np.ndarray, start: np.ndarray) -> tuple[dict, dict]:
    """One SAMPLER_CASES row: ({key: array}, its entry of the JSON's cases)."""
    name, sampler, changes, steps = row
    config = case_config(base, changes)
    sched, samples, noise = sampler_trajectory(sampler, config, steps, model_outputs, start)
    arrays = {f"{name}_samples": samples}
    if noise is not None:
        arrays[f"{name}_noise"] = noise
    fields = init_defaults(SAMPLER_CLASSES[sampler][0])
    case = dict(name=name, sampler=sampler, steps=steps, changes=changes,
                resolved={k: v for k, v in sched.config.items() if k in fields},
                timesteps=[float(t) for t in sched.timesteps.numpy().astype(np.float32)],
                sigmas=[float(s) for s in sched.sigmas.numpy()] if hasattr(sched, "sigmas") else None,
                init_noise_sigma=float(sched.init_noise_sigma))
    if sampler == "LCM":  # c_skip, c_out per step, and the alphā the noise brings the sample to
        scalings = [sched.get_scalings_for_boundary_condition_discrete(t) for t in sched.timesteps]
        case["c_skip"] = [float(c) for c, _ in scalings]
        case["c_out"] = [float(c) for _, c in scalings]
    return arrays, case


def _write_samplers(out: Path, arrays: dict, meta: dict) -> None:
    write_npz(out / "sampler-steps.npz", arrays)
    text = json.dumps(meta, indent=1, default=str)
    text = re.sub(r"\[[-+.,\seE\d]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # numbers: one line
    (out / "sampler-steps.json").write_text(text + "\n")


def cmd_samplers_add(out: Path, names: list[str]) -> None:
    """``samplers --add NAME ...``: compute only the named SAMPLER_CASES rows and DDIM_IMAGE_CASES and merge
    them into out/sampler-steps.{json,npz}, every other entry kept as it is (to the byte: another CPU or
    torch build moves the last bits of the others, so a full run would rewrite them all)."""
    torch.set_num_threads(1)
    with np.load(out / "sampler-steps.npz") as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads((out / "sampler-steps.json").read_text())
    base = meta["base_config"]
    rows = {row[0]: row for row in SAMPLER_CASES}
    unknown = [n for n in names if n not in rows and n not in DDIM_IMAGE_CASES]
    if unknown:
        raise SystemExit(f"unknown case {unknown}; SAMPLER_CASES or DDIM_IMAGE_CASES names")
    order = [row[0] for row in SAMPLER_CASES]
    cases = {case["name"]: case for case in meta["cases"]}
    for name in names:
        if name in rows:
            new_arrays, cases[name] = sampler_case(rows[name], base, arrays["model_outputs"], arrays["start"])
        else:
            new_arrays, meta[f"{name}_case"] = ddim_image_case(out, name)
        arrays.update(new_arrays)
    meta["cases"] = sorted(cases.values(), key=lambda case: order.index(case["name"]))
    meta["notes"] = SAMPLER_NOTES
    _write_samplers(out, arrays, meta)


SAMPLER_NOTES = [
    "Each case's model config: base_config with its changes (a field set to `missing` removed; "
    "'minimal': only _class_name); resolved: the class's own fields of the scheduler's config.",
    "Each case: cls.from_config(config, **overrides of the sampler's name), set_timesteps(steps); the "
    "sample starts at start * init_noise_sigma, step k gets model_outputs[k]; <case>_samples[k + 1] is "
    "step k's prev_sample (float32, the scheduler's own space: sigma space for Euler, x-space for DPM++ "
    "and DDIM and LCM). <case>_noise[k]: Euler a's and LCM's step noise (torch.randn, generator seeded "
    "1000 + k; LCM's last row is not used by diffusers, which adds no noise after the last step). LCM cases "
    "also record c_skip and c_out (get_scalings_for_boundary_condition_discrete) per step.",
    "Suggested tolerance: float32, |engine - diffusers| <= 1e-5 * (1 + |diffusers|) per step.",
    "ddim_image_case: tiny-pt's StableDiffusionXLPipeline (float32) with DDIMScheduler.from_config of its "
    "config less clip_sample, on ddim_image_latents; ddim_image_images (2, 64, 64, 3) uint8.",
    "ddim_euler_image_case: the same with its config less the fields a config saved by EulerDiscreteScheduler "
    "lacks (clip_sample, set_alpha_to_one, sample_max_value, skip_prk_steps: DDIM's defaults True, True), 10 "
    "steps, guidance 4, no negative prompt (force_zeros_for_empty_prompt), on ddim_euler_image_latents.",
    "lcm_image_cases: tiny-pt's pipeline (float32) with LCMScheduler.from_config of its config on "
    "lcm_image_latents, the step noise lcm-noise.npz's (the engine's seed rule for its seeds); "
    "<case>_images (2, 64, 64, 3) uint8.",
]


def cmd_samplers(out: Path) -> None:
    """``samplers``: out/sampler-steps.json and out/sampler-steps.npz (see the module docstring)."""
    torch.set_num_threads(1)
    base = sdxl_base_configs()["scheduler"]
    rng = np.random.RandomState(19)
    model_outputs = rng.standard_normal((SAMPLER_MAX_STEPS, *SAMPLER_SHAPE)).astype(np.float32)
    start = rng.standard_normal(SAMPLER_SHAPE).astype(np.float32)
    arrays = {"model_outputs": model_outputs, "start": start}
    cases = []
    for row in SAMPLER_CASES:
        case_arrays, case = sampler_case(row, base, model_outputs, start)
        arrays.update(case_arrays)
        cases.append(case)
    image_arrays, image_meta = ddim_image_case(out)
    arrays.update(image_arrays)
    euler_arrays, euler_meta = ddim_image_case(out, "ddim_euler_image")
    arrays.update(euler_arrays)
    lcm_arrays, lcm_meta = lcm_image_cases(out)
    arrays.update(lcm_arrays)
    meta = dict(
        made_by="python -m tools.lcm_noise (runtime venv), then python -m tools.make_fixtures samplers",
        ddim_image_case=image_meta, ddim_euler_image_case=euler_meta, lcm_image_cases=lcm_meta,
        versions=versions(), torch_threads=1,
        base_config=base, missing=DROP, shape=list(SAMPLER_SHAPE), cases=cases,
        class_defaults={cls.__name__: init_defaults(cls) for cls, _ in SAMPLER_CLASSES.values()},
        notes=SAMPLER_NOTES,
    )
    _write_samplers(out, arrays, meta)


def as_numpy(arrays: dict) -> dict[str, np.ndarray]:
    """Tensors and arrays as numpy; floating point as float32, integers unchanged."""
    out = {}
    for key, value in arrays.items():
        value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        out[key] = value.astype(np.float32) if value.dtype.kind == "f" else value
    return out


def meaning(key: str) -> str:
    """The MEANINGS entry of an arrays.npz key."""
    for pattern, text in MEANINGS:
        m = re.fullmatch(pattern, key)
        if m:
            groups = [g for g in m.groups() if g is not None and g != "conv_"]
            text = text % tuple(groups) if "%s" in text else text
            return ("tiny-pt-conv: " if key.startswith("conv_") else "") + text
    raise KeyError(f"no meaning written for array {key!r}")


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed's format with fixed zip timestamps, so the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, buf.getvalue())


def write_reference(out: Path, arrays: dict, arrays64: dict, meta: dict) -> None:
    """out/arrays.npz and out/reference.json; ``arrays64`` (same keys, subset) gives f64_max_abs_diff."""
    out.mkdir(parents=True, exist_ok=True)
    arrays = as_numpy(arrays)
    described = {}
    for key, value in arrays.items():
        row = dict(shape=list(value.shape), dtype=str(value.dtype), meaning=meaning(key))
        if value.dtype.kind == "f":
            row["max_abs"] = float(np.abs(value).max()) if value.size else 0.0
        tolerance = [tol for pattern, tol in TOLERANCES.items() if re.fullmatch(pattern, key)]
        if tolerance:
            row["tolerance"] = dict(atol=tolerance[0][0], rtol=tolerance[0][1])
        if key in arrays64 and value.dtype.kind == "f":
            ref = arrays64[key].detach().numpy() if isinstance(arrays64[key], torch.Tensor) else arrays64[key]
            row["f64_max_abs_diff"] = float(np.abs(value.astype(np.float64) - ref.astype(np.float64)).max())
        described[key] = row
    write_npz(out / "arrays.npz", arrays)
    (out / "reference.json").write_text(json.dumps({**meta, "arrays": described}, indent=2, default=str) + "\n")


def versions() -> dict:
    """Versions of the libraries that made the reference."""
    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__}


def save_tiny(out: Path) -> None:
    """Stage 1 of ``tiny``: build, save and check tiny-pt/ and tiny-pt-conv/ under ``out``."""
    configs = tiny_configs()
    models = {name: seeded_component(name, configs, SEEDS[name]) for name in COMPONENTS}
    tokenizers = make_tokenizers()
    pipe = StableDiffusionXLPipeline(**models, tokenizer=tokenizers[0], tokenizer_2=tokenizers[1],
                                     scheduler=EulerDiscreteScheduler.from_config(configs["scheduler"]),
                                     force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(out / "tiny-pt", safe_serialization=True)
    write_tokenizers(tokenizers, out / "tiny-pt")  # again, to add vocab.json and merges.txt
    conv = {"unet": seeded_component("unet", {"unet": CONV_UNET}, SEEDS["conv_unet"]),
            "vae": seeded_component("vae", {"vae": CONV_VAE}, SEEDS["conv_vae"])}
    for name, model in conv.items():
        model.save_pretrained(out / "tiny-pt-conv" / name, safe_serialization=True)
    for folder, parts in ((out / "tiny-pt", models), (out / "tiny-pt-conv", conv)):
        for name, model in parts.items():
            check_saved(model, folder / name)


def component_arrays(pipe: StableDiffusionXLPipeline, conv: dict, inputs: dict) -> dict:
    """Text-encoder, UNet and VAE outputs of tiny-pt and tiny-pt-conv for ``inputs``, in the models' dtype."""
    return {**text_outputs(pipe.text_encoder, pipe.text_encoder_2, inputs),
            **unet_outputs(pipe.unet, inputs), **vae_outputs(pipe.vae, inputs),
            **unet_outputs(conv["unet"], inputs, "conv_"), **vae_outputs(conv["vae"], inputs, "conv_")}


def cmd_tiny(out: Path) -> None:
    """``tiny``: tiny-pt/, tiny-pt-conv/ and tiny-pt-reference/ under ``out`` (replaced if present)."""
    torch.set_num_threads(1)  # one thread: the same float32 sums whatever the machine's core count
    for name in ("tiny-pt", "tiny-pt-conv", "tiny-pt-reference"):
        shutil.rmtree(out / name, ignore_errors=True)
    # 1. Build and save the models, then reload them: the references come from the saved files.
    save_tiny(out)
    pipes = {dtype: StableDiffusionXLPipeline.from_pretrained(out / "tiny-pt", dtype=dtype, add_watermarker=False)
             for dtype in (torch.float32, torch.float64)}
    convs = {dtype: {"unet": UNet2DConditionModel.from_pretrained(out / "tiny-pt-conv" / "unet", dtype=dtype),
                     "vae": AutoencoderKL.from_pretrained(out / "tiny-pt-conv" / "vae", dtype=dtype)}
             for dtype in pipes}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    base_scheduler = plain_config(pipes[torch.float32].scheduler.config)
    # 2. Inputs: token ids of PROMPTS, random UNet and VAE inputs.
    inputs = {**text_inputs([pipes[torch.float32].tokenizer, pipes[torch.float32].tokenizer_2], PROMPTS),
              **unet_inputs(TINY_UNET, 2, 16, [999, 261], [[64, 64, 0, 0, 64, 64], [48, 80, 0, 0, 48, 80]], seed=100),
              **vae_inputs((2, 4, 16, 16), (2, 3, 64, 64), seed=101),
              **unet_inputs(CONV_UNET, 2, 16, [0, 500], [[64, 64, 0, 0, 64, 64], [48, 80, 0, 0, 48, 80]], 102, "conv_"),
              **vae_inputs((2, 4, 16, 16), (2, 3, 32, 32), 103, "conv_")}
    # 3. Component outputs and pipeline cases, in float32 and (for the rounding estimate) float64.
    arrays = {**inputs, **component_arrays(pipes[torch.float32], convs[torch.float32], inputs)}
    arrays64 = component_arrays(pipes[torch.float64], convs[torch.float64], inputs)
    cases = []
    for k in range(len(CASES)):
        case_arrays, case_meta = pipeline_case(pipes[torch.float32], k, base_scheduler)
        arrays.update(case_arrays)
        arrays64.update(pipeline_case(pipes[torch.float64], k, base_scheduler)[0])
        cases.append(case_meta)
    sched_arrays, sched_meta = schedules(base_scheduler)
    arrays.update(sched_arrays)
    # 4. Write arrays.npz and reference.json.
    meta = dict(
        made_by="python -m tools.make_fixtures tiny", versions=versions(), torch_threads=1,
        models={"tiny-pt": "tests/fixtures/tiny-pt (StableDiffusionXLPipeline, float32 safetensors)",
                "tiny-pt-conv": "tests/fixtures/tiny-pt-conv (unet/ and vae/ only)"},
        prompts=PROMPTS, cases=cases, schedules=sched_meta,
        notes=[
            "All floating-point arrays are float32, computed in float32 on CPU; f64_max_abs_diff is the largest "
            "difference from the same computation with the models in float64 (rounding noise, not error).",
            "tolerance (per output array): suggested |jax - torch| <= atol + rtol * |torch|; compare float32 "
            "matmuls at full precision (jax_default_matmul_precision='highest' off CPU).",
            "Empty negative prompts are passed to diffusers as negative_prompt=None: with "
            "force_zeros_for_empty_prompt the unconditional embeddings and pooled embeddings are zeros.",
            "guidance_scale <= 1: diffusers runs no CFG (batch 2, text-conditioned only); see cfg_applied.",
        ],
    )
    write_reference(out / "tiny-pt-reference", arrays, arrays64, meta)


def cmd_keys(out: Path) -> None:
    """``keys``: {component: {name: shape}} of full-size SDXL base, plus param_counts, to ``out``."""
    configs = sdxl_base_configs()
    result, counts = {}, {}
    with torch.device("meta"):
        for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
            model = build_component(name, configs)
            result[name] = saved_shapes(model)
            counts[name] = sum(p.numel() for p in model.parameters())
    result["param_counts"] = counts
    text = json.dumps(result, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # each shape on one line
    out.write_text(text + "\n")


class StageLog:
    """Seconds, resident memory and peak resident memory (ru_maxrss, whole process) after each stage."""

    def __init__(self):
        self.rows = []
        self.start = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        row = dict(stage=stage, seconds=round(now - self.start, 1),
                   rss_gb=round(psutil.Process().memory_info().rss / 2**30, 2),
                   peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.start = now


def free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise: GBs here)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


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
                notes=["Configs: sdxl_engine/checkpoint/configs/sdxl-base-1.0 (hub-identical). Tokenizers: the project's vocabulary.",
                       "Text encoders keep eos_token_id 2 from the hub config: pooling takes argmax(input_ids), "
                       "which finds <|endoftext|>, the vocabulary's highest id."])
    write_reference(out / "reference", {**inputs, **outputs}, {}, meta)
    log.mark("write reference")


# --- ``single``: an SDXL single file in the original (sgm) layout, and swapped parts -------------------------

SINGLE_DIR = FIXTURES / "tiny-single"
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
        "input_blocks_8_1_transformer_blocks_1_attn2_to_q": "down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_q",
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


class _LoggedWarnings(list):
    """Collects log records of WARNING and above from diffusers, transformers and peft."""

    def __enter__(self):
        import logging

        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = lambda record: self.append(record.getMessage())
        self._loggers = [logging.getLogger(n) for n in ("diffusers", "transformers", "peft", "")]
        for logger in self._loggers:
            logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        for logger in self._loggers:
            logger.removeHandler(self._handler)


def load_checked(pipe: StableDiffusionXLPipeline, path: Path, adapter: str, expected_layers: int) -> None:
    """load_lora_weights with no warning (unused or unexpected keys) and every layer of the file adapted."""
    import warnings as py_warnings

    diffusers.utils.logging.set_verbosity_warning()
    transformers.logging.set_verbosity_warning()
    with _LoggedWarnings() as logged, py_warnings.catch_warnings(record=True) as caught:
        py_warnings.simplefilter("always")
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=adapter)
    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    # transformers' load report lists the base weights an adapter does not hold as MISSING (they are kept:
    # cmd_lora checks the base images after loading); an UNEXPECTED or unused key is a LoRA layer dropped.
    # "No LoRA keys associated to CLIPTextModel..." is a UNet-only LoRA's (lcm-lora-sdxl's too): nothing dropped.
    messages = [m for m in logged + [str(w.message) for w in caught]
                if re.search(r"unexpected|unused|not used|not been|not found", m, re.IGNORECASE)
                and not m.startswith("No LoRA keys associated to CLIPTextModel")]
    if messages:
        raise SystemExit(f"{path.name}: diffusers warned while loading: {messages}")
    adapted = sum(1 for model in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
                  for name, module in model.named_modules() if hasattr(module, "lora_A") and adapter in module.lora_A)
    if adapted != expected_layers:
        raise SystemExit(f"{path.name}: diffusers adapted {adapted} layers, the file has {expected_layers}")


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
TINY_SHAPES = ROOT / "sdxl_engine" / "assets" / "tiny-shapes"
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
                versions=versions(), torch_threads=1, model="sdxl_engine/assets/tiny-shapes",
                lora=dict(file="sdxl_engine/assets/tiny-shapes/lcm-lora.safetensors", layers=layers,
                          sha256=hashlib.sha256(lora_path.read_bytes()).hexdigest()),
                scheduler="LCMScheduler.from_config(tiny-shapes' scheduler config)", size=[64, 64],
                seeds=[int(s) for s in seeds], latents="numpy RandomState(37).standard_normal((2, 4, 16, 16))",
                notes=["pipe.load_lora_weights(adapter_name='lcm') with no warning, every layer adapted; "
                       "<case>_images with the LoRA at weight 1, base4_images: the lcm4 case after disable_lora.",
                       "Step noise: randn_tensor of step k returns lcm-noise.npz's noise[k] (steps - 1 calls).",
                       "Images: (2, 64, 64, 3) uint8, round(np * 255)."])
    (folder / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.make_fixtures",
                                     description="PyTorch reference fixtures (needs torch; never run in CI).")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="tiny-pt, tiny-pt-conv and tiny-pt-reference under --out")
    tiny.add_argument("--out", type=Path, default=FIXTURES)
    keys = sub.add_parser("keys", help="parameter names and shapes of full-size SDXL base")
    keys.add_argument("--out", type=Path, default=FIXTURES / "sdxl-base-keys.json")
    samplers = sub.add_parser("samplers", help="scheduler step references: sampler-steps.json and .npz")
    samplers.add_argument("--out", type=Path, default=FIXTURES)
    samplers.add_argument("--add", nargs="+", metavar="CASE", help="only these cases, merged into --out's files")
    single = sub.add_parser("single", help="tiny-single: tiny-pt as an sgm single file, a swap UNet and LDM VAE")
    single.add_argument("--out", type=Path, default=FIXTURES)
    sgm_keys = sub.add_parser("sgm-keys", help="full-size SDXL base's single-file key names and shapes")
    sgm_keys.add_argument("--out", type=Path, default=FIXTURES / "sdxl-base-sgm-keys.json")
    single_full = sub.add_parser("single-fullsize", help="a random full-size SDXL single file (not committed)")
    single_full.add_argument("--out", type=Path, required=True)
    single_full.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    lora = sub.add_parser("lora", help="tiny-pt-lora: a kohya and a PEFT LoRA for tiny-pt, diffusers' images with them")
    lora.add_argument("--out", type=Path, default=FIXTURES)
    single_lora = sub.add_parser("single-lora", help="tiny-single/lora-reference: both LoRAs on the single file")
    single_lora.add_argument("--out", type=Path, default=FIXTURES)
    lcm_lora = sub.add_parser("lcm-lora", help="tiny-shapes-lcm: diffusers' images with the shipped LCM-LoRA")
    lcm_lora.add_argument("--out", type=Path, default=FIXTURES)
    img2img = sub.add_parser("img2img", help="tiny-pt-img2img: diffusers' img2img images (tools.img2img_noise first)")
    img2img.add_argument("--out", type=Path, default=FIXTURES)
    full = sub.add_parser("fullsize", help="random full-size SDXL base and its reference outputs")
    full.add_argument("--out", type=Path, required=True)
    full.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.command == "tiny":
        cmd_tiny(args.out)
    elif args.command == "keys":
        cmd_keys(args.out)
    elif args.command == "samplers":
        cmd_samplers_add(args.out, args.add) if args.add else cmd_samplers(args.out)
    elif args.command == "single":
        cmd_single(args.out)
    elif args.command == "sgm-keys":
        cmd_sgm_keys(args.out)
    elif args.command == "single-fullsize":
        cmd_single_fullsize(args.out, args.dtype)
    elif args.command == "lora":
        cmd_lora(args.out)
    elif args.command == "single-lora":
        cmd_single_lora(args.out)
    elif args.command == "lcm-lora":
        cmd_lcm_lora(args.out)
    elif args.command == "img2img":
        cmd_img2img(args.out)
    else:
        cmd_fullsize(args.out, args.dtype)


if __name__ == "__main__":
    main()
