"""The Hugging Face blog's JAX SDXL pipeline (*Accelerating SDXL inference with JAX on Cloud TPU v5e*), as a worker.

    /work/venv-blog/bin/python -m tools.blog_pipeline --model DIR --size 64   # JSON lines on stdin/stdout

The other side of ``python -m tools.vs_blog``: diffusers 0.39's ``FlaxStableDiffusionXLPipeline`` doing the
blog's ``generate()`` (tokenize, ``replicate`` the ids and params over every device, one PRNG key per device, the
pipeline with ``jit=True``, i.e. its ``pmap``, then ``numpy_to_pil``), ``split_head_dim=True`` as the blog loads
it. It needs the last releases with Flax in an interpreter of its own (Python 3.11: ``jax==0.10.2 flax==0.12.8
diffusers==0.39.0 transformers==4.57.6 huggingface-hub==0.36.2 "numpy<2.5" pillow torch==2.13.0``; torch, CPU,
reads the folder's PyTorch-layout safetensors) and imports nothing from the runtime. Parameters in ``--dtype``
(float32: the engine's CPU default; the blog's bfloat16 on a TPU).

Commands, one JSON object per line on stdin, one JSON reply per line on stdout (after ``{"ready": ...}``):

* ``{"op": "time", "seed": S}``: one timed ``generate()``: ``latency`` (the whole call, as the blog times it),
  ``pipeline`` (the pipeline call and the copy of its images to the host, no tokenizing or PIL) and ``cpu`` (this
  process's CPU time over the call, all threads), seconds.
* ``{"op": "images", "latents": NPZ, "out": NPZ}``: the pipeline on the given initial noise ``latents`` (n, C, h, w)
  float32 (one image per device), its images (n, H, W, 3) uint8 written to ``out``.
* ``{"op": "parts", "runs": N}``: medians of N calls of each part, seconds (see :func:`parts`).
* ``{"op": "cost"}``: XLA's cost analysis and op counts of the compiled pmap program (:func:`cost`).
* ``{"op": "profile", "dir": D, "runs": N}``: N requests under ``jax.profiler`` and the optimized HLO, in D
  (:func:`profile`; read by tools/xla_profile.py).
* ``--fullsize-config DIR`` (no stdin): the same count at ``--size`` for SDXL base's configs in DIR (abstract
  weights: lowered and compiled, not run), one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from diffusers import FlaxStableDiffusionXLPipeline
from diffusers.pipelines.stable_diffusion_xl import pipeline_flax_stable_diffusion_xl as blog_module
from flax.jax_utils import replicate

from tools.hlo_counts import program_counts

PROMPT = "a red circle on the left"
NEGATIVE = "a blue square"


def flax_readable_copy(model: Path) -> Path:
    """A copy of ``model`` that diffusers' and transformers' Flax ``from_pt`` read: each diffusers component's
    ``diffusion_pytorch_model.bin`` (the only PyTorch file diffusers' Flax loader reads) beside its safetensors, and
    the text encoders' keys with CLIPTextModel's ``text_model.`` prefix where the file leaves it out (PyTorch's
    loader adds it, the Flax conversion does not). Same tensors; ``model`` itself is not touched."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    copy = Path(tempfile.mkdtemp(prefix="blog-model-")) / model.name
    shutil.copytree(model, copy)
    for source in copy.glob("*/diffusion_pytorch_model.safetensors"):
        torch.save(load_file(source), source.parent / "diffusion_pytorch_model.bin")
    for source in copy.glob("text_encoder*/model.safetensors"):
        tensors = load_file(source)
        save_file({k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}": v
                   for k, v in tensors.items()}, source, metadata={"format": "pt"})
    return copy


class Blog:
    """The blog's notebook, as functions: the pipeline loaded once, params replicated, ``generate()``."""

    def __init__(self, model: str, size: int, steps: int, guidance: float, dtype: str):
        self.pipeline, params = FlaxStableDiffusionXLPipeline.from_pretrained(
            flax_readable_copy(Path(model)), from_pt=True, dtype=jnp.dtype(dtype), split_head_dim=True)
        scheduler_state = params.pop("scheduler")
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.dtype(dtype)), params)
        params["scheduler"] = scheduler_state
        self.p_params = replicate(params)
        self.size, self.steps, self.guidance = size, steps, guidance
        self.devices = jax.device_count()

    def tokenize_prompt(self, prompt: str, neg_prompt: str):
        return self.pipeline.prepare_inputs(prompt), self.pipeline.prepare_inputs(neg_prompt)

    def replicate_all(self, prompt_ids, neg_prompt_ids, seed: int):
        rng = jax.random.split(jax.random.PRNGKey(seed), self.devices)
        return replicate(prompt_ids), replicate(neg_prompt_ids), rng

    def call(self, prompt_ids, neg_prompt_ids, rng, latents=None, steps: int | None = None):
        """The pipeline with jit=True; (devices, 1, H, W, 3) float32 images in [0, 1], on the host."""
        images = self.pipeline(prompt_ids, self.p_params, rng, num_inference_steps=steps or self.steps,
                               guidance_scale=self.guidance, height=self.size, width=self.size, latents=latents,
                               neg_prompt_ids=neg_prompt_ids, jit=True).images
        return np.array(images)

    def generate(self, seed: int) -> tuple[list, float]:
        """The blog's generate(): PIL images, and the seconds of the pipeline call with the copy to the host."""
        prompt_ids, neg_prompt_ids = self.tokenize_prompt(PROMPT, NEGATIVE)
        prompt_ids, neg_prompt_ids, rng = self.replicate_all(prompt_ids, neg_prompt_ids, seed)
        t0 = time.perf_counter()
        images = self.call(prompt_ids, neg_prompt_ids, rng)
        pipeline_s = time.perf_counter() - t0
        images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
        return self.pipeline.numpy_to_pil(images), pipeline_s


def to_uint8(images: np.ndarray) -> np.ndarray:
    """numpy_to_pil's rounding: (n, H, W, 3) float [0, 1] -> uint8."""
    return (images.reshape((-1,) + images.shape[-3:]) * 255).round().astype("uint8")


def timed(fn, runs: int) -> float:
    fn()  # compiled and warm
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def parts(blog: Blog, runs: int) -> dict:
    """Medians (seconds) of the blog pipeline's parts, each pmapped over every device as the pipeline runs them:
    ``text_encoders`` (get_embeddings of prompt and negative, as _generate calls it), ``unet_step`` (one
    loop_body: the CFG UNet call and the scheduler step), ``vae_decode``, ``host`` (tokenize + replicate +
    numpy_to_pil, without the devices), and the whole pipeline with 1 and with ``steps`` steps (each its own
    compiled program: the step count is static in the blog's pmap)."""
    pipe, params = blog.pipeline, blog.p_params
    prompt_ids, neg_ids = blog.tokenize_prompt(PROMPT, NEGATIVE)
    p_ids, p_neg, rng = blog.replicate_all(prompt_ids, neg_ids, 0)
    latent = blog.size // pipe.vae_scale_factor

    embed = jax.pmap(lambda ids, neg, p: (pipe.get_embeddings(ids, p), pipe.get_embeddings(neg, p)))
    out = {"text_encoders": timed(lambda: jax.block_until_ready(embed(p_ids, p_neg, params)), runs)}

    (emb, pooled), (nemb, npooled) = embed(p_ids, p_neg, params)
    lat = jnp.ones((blog.devices, 1, pipe.unet.config.in_channels, latent, latent), jnp.float32)

    def one_step(latents, emb, pooled, nemb, npooled, p):
        state = pipe.scheduler.set_timesteps(p["scheduler"], num_inference_steps=blog.steps, shape=latents.shape)
        hidden = jnp.concatenate([nemb, emb])
        ids = pipe._get_add_time_ids((blog.size, blog.size), (0, 0), (blog.size, blog.size), 1, emb.dtype)
        cond = {"text_embeds": jnp.concatenate([npooled, pooled]), "time_ids": jnp.concatenate([ids, ids])}
        latents_input = jnp.concatenate([latents] * 2)
        t = jnp.array(state.timesteps, dtype=jnp.int32)[1]
        latents_input = pipe.scheduler.scale_model_input(state, latents_input, t)
        noise = pipe.unet.apply({"params": p["unet"]}, latents_input, jnp.broadcast_to(t, (2,)).astype(jnp.int32),
                                encoder_hidden_states=hidden, added_cond_kwargs=cond).sample
        uncond, text = jnp.split(noise, 2, axis=0)
        noise = uncond + blog.guidance * (text - uncond)
        return pipe.scheduler.step(state, noise, t, latents).to_tuple()[0]

    step = jax.pmap(one_step)
    out["unet_step"] = timed(lambda: jax.block_until_ready(step(lat, emb, pooled, nemb, npooled, params)), runs)
    decode = jax.pmap(lambda z, p: pipe.vae.apply({"params": p["vae"]}, z / pipe.vae.config.scaling_factor,
                                                  method=pipe.vae.decode).sample)
    out["vae_decode"] = timed(lambda: jax.block_until_ready(decode(lat, params)), runs)
    images = blog.call(p_ids, p_neg, rng)

    def host():
        ids, neg = blog.tokenize_prompt(PROMPT, NEGATIVE)
        blog.replicate_all(ids, neg, 0)
        pipe.numpy_to_pil(images.reshape((-1,) + images.shape[-3:]))

    out["host"] = timed(host, runs)
    for n in (1, blog.steps):
        out[f"pipeline_{n}_steps"] = timed(lambda n=n: blog.call(p_ids, p_neg, rng, steps=n), runs)
    out["per_step_from_pipeline"] = (out[f"pipeline_{blog.steps}_steps"] - out["pipeline_1_steps"]) / (blog.steps - 1)
    return out


def compiled_program(blog: Blog):
    """The blog's pmap program as ``generate()`` runs it, lowered and compiled (one device's program)."""
    prompt_ids, neg_ids = blog.tokenize_prompt(PROMPT, NEGATIVE)
    p_ids, p_neg, rng = blog.replicate_all(prompt_ids, neg_ids, 0)
    gs = jnp.array([blog.guidance] * p_ids.shape[0])[:, None]
    return blog_module._p_generate.lower(blog.pipeline, p_ids, blog.p_params, rng, blog.steps, blog.size,
                                         blog.size, gs, None, p_neg, False).compile()


def profile(blog: Blog, out: Path, runs: int) -> dict:
    """``runs`` generate() calls under ``jax.profiler`` (the trace under ``out``) and the program's optimized HLO
    text in ``out``/program.hlo, for tools/xla_profile.py."""
    jax.profiler.start_trace(str(out))
    for seed in range(runs):
        blog.generate(seed)
    jax.profiler.stop_trace()
    (out / "program.hlo").write_text(compiled_program(blog).as_text())
    return {"xplane": str(next(out.rglob("*.xplane.pb"))), "hlo": str(out / "program.hlo"), "requests": runs}


def cost(blog: Blog) -> dict:
    """XLA's cost analysis of the blog's compiled pmap program (per device: pmap compiles one device's program)
    and the op counts of its optimized HLO."""
    compiled = compiled_program(blog)
    return {**program_counts(compiled), "per": "device"}


def fullsize_cost(config_dir: Path, size: int, steps: int, guidance: float, dtype: str) -> dict:
    """The blog's pmap program for SDXL base's configs (``config_dir``: the diffusers folder's config files) at
    ``size``², abstract ``dtype`` params (eval_shape of each module's init), lowered and compiled, not run."""
    from diffusers import FlaxAutoencoderKL, FlaxEulerDiscreteScheduler, FlaxUNet2DConditionModel
    from transformers import CLIPTextConfig, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

    dt = jnp.dtype(dtype)
    rng = jax.random.PRNGKey(0)
    unet = FlaxUNet2DConditionModel.from_config(
        json.loads((config_dir / "unet" / "config.json").read_text()), dtype=dt, split_head_dim=True)
    vae = FlaxAutoencoderKL.from_config(json.loads((config_dir / "vae" / "config.json").read_text()), dtype=dt)
    te1 = FlaxCLIPTextModel(CLIPTextConfig.from_json_file(config_dir / "text_encoder" / "config.json"), dtype=dt,
                            _do_init=False)
    te2 = FlaxCLIPTextModelWithProjection(CLIPTextConfig.from_json_file(config_dir / "text_encoder_2" / "config.json"),
                                          dtype=dt, _do_init=False)
    scheduler = FlaxEulerDiscreteScheduler.from_config(
        json.loads((config_dir / "scheduler" / "scheduler_config.json").read_text()))
    cast = lambda tree: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, dt), tree)  # noqa: E731
    params = {"unet": cast(jax.eval_shape(unet.init_weights, rng)), "vae": cast(jax.eval_shape(vae.init_weights, rng)),
              "text_encoder": cast(jax.eval_shape(lambda r: te1.init_weights(r, (1, 77)), rng)),
              "text_encoder_2": cast(jax.eval_shape(lambda r: te2.init_weights(r, (1, 77)), rng)),
              "scheduler": scheduler.create_state()}
    pipe = FlaxStableDiffusionXLPipeline(text_encoder=te1, text_encoder_2=te2, vae=vae, tokenizer=None,
                                         tokenizer_2=None, unet=unet, scheduler=scheduler, dtype=dt)  # ids are given
    n = jax.device_count()
    rep = lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype)  # noqa: E731  (replicate: a leading device axis)
    p_params = jax.tree_util.tree_map(rep, params)
    ids = jax.ShapeDtypeStruct((n, 1, 2, 77), jnp.int32)
    keys = jax.ShapeDtypeStruct((n, 2), jnp.uint32)
    gs = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    t0 = time.perf_counter()
    lowered = blog_module._p_generate.lower(pipe, ids, p_params, keys, steps, size, size, gs, None, ids, False)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return {**program_counts(compiled), "per": "device", "size": size, "steps": steps,
            "dtype": dtype, "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1, "jax": jax.__version__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="diffusers-format SDXL folder (PyTorch-layout safetensors)")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fullsize-config", type=Path, help="count the program for these configs, then exit")
    args = p.parse_args(argv)
    if args.fullsize_config:
        print(json.dumps(fullsize_cost(args.fullsize_config, args.size, args.steps, args.guidance, args.dtype)))
        return
    blog = Blog(args.model, args.size, args.steps, args.guidance, args.dtype)
    for seed in range(2):  # compile and warm up
        blog.generate(seed)
    print(json.dumps({"ready": True, "jax": jax.__version__, "devices": blog.devices,
                      "device_kind": jax.devices()[0].platform}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "time":
            t0, cpu = time.perf_counter(), time.process_time()
            _, pipeline_s = blog.generate(int(cmd["seed"]))
            reply = {"latency": time.perf_counter() - t0, "pipeline": pipeline_s, "cpu": time.process_time() - cpu}
        elif cmd["op"] == "images":
            with np.load(cmd["latents"]) as data:
                latents = jnp.asarray(data["latents"])
            ids, neg = blog.tokenize_prompt(PROMPT, NEGATIVE)
            ids, neg, rng = blog.replicate_all(ids, neg, 0)
            latents = latents.reshape((blog.devices, -1) + latents.shape[1:])  # one image per device
            np.savez(cmd["out"], images=to_uint8(blog.call(ids, neg, rng, latents=latents)))
            reply = {"written": cmd["out"]}
        elif cmd["op"] == "parts":
            reply = parts(blog, int(cmd.get("runs", 5)))
        elif cmd["op"] == "cost":
            reply = cost(blog)
        elif cmd["op"] == "profile":
            reply = profile(blog, Path(cmd["dir"]), int(cmd.get("runs", 2)))
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
