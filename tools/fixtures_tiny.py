"""``python -m tools.make_fixtures tiny`` and ``keys``.

* ``tiny`` writes, under tests/fixtures/: ``tiny-pt/`` (a small random SDXL made with diffusers'
  and transformers' PyTorch classes, saved by ``StableDiffusionXLPipeline.save_pretrained`` with
  safetensors), ``tiny-pt-conv/`` (``unet/`` and ``vae/`` of a second layout: conv 1x1
  projections, integer head counts, upcast attention) and ``tiny-pt-reference/`` (``arrays.npz``
  and ``reference.json``: token ids, text-encoder, UNet and VAE outputs, whole-pipeline images
  for 9 cases, scheduler timesteps and sigmas; float32, deterministic).
* ``keys`` writes tests/fixtures/sdxl-base-keys.json: the name and shape of every tensor that
  ``save_pretrained`` writes for the full-size SDXL 1.0 base UNet, VAE and both text encoders,
  built on the meta device from sdxl_engine/checkpoint/configs/sdxl-base-1.0/ (no memory).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from tools.fixtures_common import (
    COMPONENTS,
    as_numpy,
    build_component,
    check_saved,
    plain_config,
    saved_shapes,
    sdxl_base_configs,
    seeded_component,
    versions,
    write_npz,
)

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
    """sdxl_engine.checkpoint.builtin's vocabulary, imported only for ``tiny`` (it brings JAX, which ``samplers``
    does not need)."""
    from sdxl_engine.checkpoint.builtin import build_vocab as build

    return build()


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


def meaning(key: str) -> str:
    """The MEANINGS entry of an arrays.npz key."""
    for pattern, text in MEANINGS:
        m = re.fullmatch(pattern, key)
        if m:
            groups = [g for g in m.groups() if g is not None and g != "conv_"]
            text = text % tuple(groups) if "%s" in text else text
            return ("tiny-pt-conv: " if key.startswith("conv_") else "") + text
    raise KeyError(f"no meaning written for array {key!r}")


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
