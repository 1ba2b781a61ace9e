"""The Hugging Face blog's JAX SDXL pipeline at full SDXL 1.0 base size, random weights, timed on one TPU chip.

    python3.11 -m tools.tpu_blog --size 1024 --steps 20 --guidance 5 --images 1,4 --out blog_tpu.json
    python3.11 -m tools.tpu_blog --tiny --size 64 --images 1,4 --out /tmp/tiny.json    # CPU check, seconds

*Accelerating SDXL inference with JAX on Cloud TPU v5e* as its notebook runs it: diffusers'
``FlaxStableDiffusionXLPipeline`` (``split_head_dim=True``), every parameter but the scheduler state cast to
bfloat16, the scheduler SDXL base's folder names (``EulerDiscreteScheduler``, which the Flax loader maps to
``FlaxEulerDiscreteScheduler``: "leading" spacing, ``steps_offset`` 1, epsilon prediction), prompt and negative
prompt tokenized by ``prepare_inputs``, ids and params ``replicate``-d over the devices, one PRNG key per device,
the pipeline called with ``jit=True`` (its ``pmap``). The weights are random (no download, no network): each
component's Flax module is built from SDXL base's config files (sdxl_engine/checkpoint/configs/sdxl-base-1.0,
read as JSON), its parameter shapes come from ``jax.eval_shape`` of its init, and each leaf is filled on the device
by one small jitted kernel per shape, directly in bfloat16 (kernels normal / sqrt(fan in), embeddings normal * 0.02,
norm scales 1, biases 0; the normal values sliced at random offsets from one pool of normal draws). The two CLIP
tokenizers are built offline from a small byte-level BPE vocabulary (any text tokenizes; the timing only needs 77
ids per encoder).

``--images N`` is images per device per call: the prompt tokenized N times, ids (devices, N, 2, 77) after
``replicate``, so one chip makes N images per call. Per N, one JSON line (printed as it finishes, all of them
written to ``--out``): ``first_call_s`` (the first call: trace, compile, run, copy to host), then one warm call
and ``--runs`` timed ones (each blocked on ``np.asarray(images)``): ``per_call_s`` (median), ``per_image_s``,
``images_per_s``, and the device's ``peak_bytes_in_use`` when it reports one. An out-of-memory error
(RESOURCE_EXHAUSTED) is recorded for that N, not raised.

``--module-dtype``: the modules' computation dtype, ``dtype=`` of every module and of the pipeline. bfloat16 (the
default) as this project has always run the blog (tools/blog_pipeline.py ``--dtype bfloat16``, the 1024² counts of
docs/benchmarks.md): computation in bfloat16. The notebook itself passes no ``dtype`` to ``from_pretrained``, so its
modules compute at their float32 default on the bfloat16 parameters (Flax promotes them): ``--module-dtype float32``.
The parameters are bfloat16 either way, the scheduler state float32.

On the lent TPU machine (Python 3.11; ``jax[tpu]==0.10.2 flax==0.12.8 diffusers==0.39.0 transformers==4.57.6
huggingface-hub==0.36.2 tokenizers==0.22.2 "numpy<2.5" pillow``, no torch; 0.22.1 ran too), from the repository root:

    python3.11 -m tools.tpu_blog --size 1024 --steps 20 --guidance 5 --images 1,4 --out blog_tpu.json

It imports nothing from sdxl_engine (the blog's stack pins a transformers the engine does not run on); it only
reads the config JSON files shipped in the package's folder. ``--tiny`` scales those configs down (the same
architecture, small widths and depths), and changes nothing else, so the CPU check runs the same code path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from diffusers import (
    FlaxAutoencoderKL,
    FlaxEulerDiscreteScheduler,
    FlaxStableDiffusionXLPipeline,
    FlaxUNet2DConditionModel,
)
from diffusers.utils import logging as diffusers_logging
from flax.jax_utils import replicate
from transformers import CLIPTextConfig, CLIPTokenizer, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

diffusers_logging.set_verbosity_error()  # "Flax classes are deprecated", once per module set up, at every trace

CONFIG_DIR = Path(__file__).resolve().parents[1] / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0"
# The blog's example prompts.
PROMPT = "high-quality photo of a baby dolphin playing in a pool and wearing a party hat"
NEGATIVE = "illustration, low-quality"
PARAM_DTYPE = jnp.bfloat16

# --tiny: overrides on SDXL base's configs. Same block types, 3 UNet levels, 4 VAE levels (factor 8), two text
# encoders whose hidden sizes add up to the UNet's cross-attention width; widths multiples of 32 (the Flax UNet's
# GroupNorms have 32 groups).
TINY = {
    "unet": dict(sample_size=8, block_out_channels=[32, 64, 64], layers_per_block=1, attention_head_dim=[2, 4, 4],
                 transformer_layers_per_block=[1, 1, 2], cross_attention_dim=64, addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=6 * 8 + 32),
    "vae": dict(block_out_channels=[32, 32, 64, 64], layers_per_block=1, sample_size=64),
    "text_encoder": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         projection_dim=32),
    "text_encoder_2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           projection_dim=32),
}


def load_configs(config_dir: Path, tiny: bool) -> dict[str, dict]:
    """{component: config dict} from the diffusers folder's JSON files, with :data:`TINY` over them if ``tiny``."""
    configs = {name: json.loads((config_dir / name / "config.json").read_text())
               for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    configs["scheduler"] = json.loads((config_dir / "scheduler" / "scheduler_config.json").read_text())
    if tiny:
        for name, override in TINY.items():
            configs[name] = {**configs[name], **override}
    return configs


# ---- tokenizers: CLIP's byte-level BPE over a small vocabulary (no download) -------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """CLIP's reversible byte -> printable-unicode table (openai/CLIP simple_tokenizer.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: merge the lowest-ranked adjacent pair until none is known."""
    while len(symbols) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
        if rank == len(ranks):
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2:]
    return symbols


def build_vocab(words) -> tuple[dict[str, int], list[str]]:
    """Vocabulary and merges in CLIP's layout (base symbols, merged tokens, then the two specials, end of text last:
    the highest id, as the text encoders' pooling expects), each word of ``words`` one token."""
    base = list(bytes_to_unicode().values())
    vocab_list = base + [s + "</w>" for s in base]
    ranks: dict[tuple[str, str], int] = {}
    known = set(vocab_list)
    for word in dict.fromkeys(words):
        symbols = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        while len(symbols) > 1:
            ranks.setdefault((symbols[0], symbols[1]), len(ranks))
            merged = symbols[0] + symbols[1]
            if merged not in known:
                known.add(merged)
                vocab_list.append(merged)
            symbols = [merged] + symbols[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab_list)}, [" ".join(pair) for pair in ranks]


def make_tokenizers(workdir: Path) -> tuple[CLIPTokenizer, CLIPTokenizer]:
    """SDXL's two CLIP tokenizers (77 tokens; padded with end-of-text and with "!", as SDXL base's are)."""
    words = "".join(c if c.isalnum() else " " for c in f"{PROMPT} {NEGATIVE}".lower()).split()
    vocab, merges = build_vocab(words)
    (workdir / "vocab.json").write_text(json.dumps(vocab))
    (workdir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return tuple(CLIPTokenizer(str(workdir / "vocab.json"), str(workdir / "merges.txt"), pad_token=pad,
                               model_max_length=77) for pad in ("<|endoftext|>", "!"))


# ---- random parameters --------------------------------------------------------------------------------------------

@partial(jax.jit, static_argnames=("shape", "normal"))
def _fill(pool, offset, value, *, shape, normal):
    """One leaf, in bfloat16: ``value`` times the normal draws of ``pool`` from ``offset`` on if ``normal``, else
    ``value`` everywhere. Compiled once per (shape, kind), a slice and a multiply (quick to compile, where a random
    generator of each shape took most of a second per shape); the pool, offset and value are arguments."""
    if normal:
        size = int(np.prod(shape))
        return jax.lax.dynamic_slice(pool, (offset,), (size,)).reshape(shape) * value.astype(PARAM_DTYPE)
    return jnp.full(shape, value, PARAM_DTYPE)


def leaf_init(name: str, shape: tuple[int, ...]) -> tuple[bool, float]:
    """(normal, value) for a parameter leaf named ``name``: kernels normal / sqrt(fan in), embeddings normal * 0.02,
    LayerNorm / GroupNorm scales 1, biases 0."""
    if name == "kernel":
        return True, 1.0 / float(np.sqrt(np.prod(shape[:-1])))
    if name == "embedding":
        return True, 0.02
    if name == "scale":
        return False, 1.0
    if name == "bias":
        return False, 0.0
    raise ValueError(f"no fill for a parameter leaf named {name!r} {shape}")


def random_params(abstract, pool, rng: np.random.Generator):
    """A tree of bfloat16 arrays shaped as ``abstract`` (a tree of ShapeDtypeStructs), filled on the device (the
    normal leaves from ``pool``, standard normal draws, each at its own random offset) and each one replicated over
    the devices as soon as made (``flax.jax_utils.replicate``, leaf by leaf, the unreplicated leaf freed at once, so
    the chip never holds the parameters twice)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for path, leaf in leaves:
        shape = tuple(int(d) for d in leaf.shape)
        normal, value = leaf_init(getattr(path[-1], "key", str(path[-1])), shape)
        offset = int(rng.integers(0, pool.shape[0] - int(np.prod(shape)) + 1))
        x = _fill(pool, jnp.int32(offset), jnp.float32(value), shape=shape, normal=normal)
        r = replicate(x)
        x.delete()
        out.append(r)
    return jax.tree_util.tree_unflatten(treedef, out)


def build(configs: dict[str, dict], module_dtype, seed: int):
    """The blog's pipeline over random weights: (pipeline, replicated params, seconds to make them,
    parameters per component)."""
    unet = FlaxUNet2DConditionModel.from_config(configs["unet"], dtype=module_dtype, split_head_dim=True)
    vae = FlaxAutoencoderKL.from_config(configs["vae"], dtype=module_dtype)
    te1 = FlaxCLIPTextModel(CLIPTextConfig.from_dict(configs["text_encoder"]), dtype=module_dtype, _do_init=False)
    te2 = FlaxCLIPTextModelWithProjection(CLIPTextConfig.from_dict(configs["text_encoder_2"]), dtype=module_dtype,
                                          _do_init=False)
    scheduler = FlaxEulerDiscreteScheduler.from_config(configs["scheduler"])
    tok1, tok2 = make_tokenizers(Path(tempfile.mkdtemp(prefix="tpu-blog-tok-")))
    pipeline = FlaxStableDiffusionXLPipeline(text_encoder=te1, text_encoder_2=te2, vae=vae, tokenizer=tok1,
                                             tokenizer_2=tok2, unet=unet, scheduler=scheduler, dtype=module_dtype)
    rng = jax.random.PRNGKey(0)
    abstract = {"unet": jax.eval_shape(unet.init_weights, rng),
                "vae": jax.eval_shape(vae.init_weights, rng),
                "text_encoder": jax.eval_shape(lambda r: te1.init_weights(r, (1, 77)), rng),
                "text_encoder_2": jax.eval_shape(lambda r: te2.init_weights(r, (1, 77)), rng)}
    t0 = time.perf_counter()
    largest = max(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(abstract))
    pool = jax.random.normal(jax.random.PRNGKey(seed), (2 * largest,), PARAM_DTYPE)
    offsets = np.random.default_rng(seed)
    p_params = {name: random_params(tree, pool, offsets) for name, tree in abstract.items()}
    pool.delete()
    p_params["scheduler"] = replicate(scheduler.create_state())  # float32, as the blog keeps it
    jax.block_until_ready(p_params)
    counts = {name: int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
              for name, tree in abstract.items()}
    return pipeline, p_params, time.perf_counter() - t0, counts


# ---- the measurement -----------------------------------------------------------------------------------------------

def memory_stats() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats}


def is_oom(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def measure(pipeline, p_params, n: int, args) -> dict:
    """The blog's generate() for N images per device: tokenize N prompts, replicate, one key per device, the pipeline
    with jit=True, images copied to the host."""
    devices = jax.device_count()
    prompt_ids = replicate(pipeline.prepare_inputs([PROMPT] * n))  # (devices, n, 2, 77)
    neg_prompt_ids = replicate(pipeline.prepare_inputs([NEGATIVE] * n))
    rng = jax.random.split(jax.random.PRNGKey(args.seed), devices)  # one key per device

    def call():
        images = pipeline(prompt_ids, p_params, rng, num_inference_steps=args.steps, guidance_scale=args.guidance,
                          height=args.size, width=args.size, neg_prompt_ids=neg_prompt_ids, jit=True).images
        return np.asarray(images)

    row = {"images_per_device": n, "images_per_call": n * devices, "prompt_ids_shape": list(prompt_ids.shape)}
    t0 = time.perf_counter()
    images = call()
    row["first_call_s"] = time.perf_counter() - t0
    row["images_shape"] = list(images.shape)
    row["images_finite"] = bool(np.isfinite(images).all())
    call()  # warm
    seconds = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    per_call = statistics.median(seconds)
    row.update(per_call_s=per_call, per_call_all_s=seconds, per_image_s=per_call / (n * devices),
               images_per_s=n * devices / per_call)
    return row


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "libtpu", "flax", "diffusers", "transformers", "huggingface-hub", "tokenizers",
                 "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--images", default="1,4", help="images per device per call, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="timed calls per N, after one warm call")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--module-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="modules' computation dtype (float32: the notebook's from_pretrained default)")
    p.add_argument("--config-dir", type=Path, default=CONFIG_DIR, help="SDXL base's diffusers folder (configs)")
    p.add_argument("--tiny", action="store_true", help="scale the configs down (CPU check)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    counts = [int(n) for n in args.images.split(",")]

    device = jax.devices()[0]
    header = {"what": "diffusers FlaxStableDiffusionXLPipeline, the blog's generate(), random weights",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "versions": versions(), "platform": device.platform, "device_kind": device.device_kind,
              "device_count": jax.device_count(), "host": platform.node(),
              "jax_platforms": os.environ.get("JAX_PLATFORMS"), "config_dir": str(args.config_dir),
              "tiny": args.tiny, "size": args.size, "steps": args.steps, "guidance": args.guidance,
              "runs": args.runs, "seed": args.seed, "param_dtype": "bfloat16", "module_dtype": args.module_dtype,
              "split_head_dim": True, "scheduler": "FlaxEulerDiscreteScheduler", "jit": True}
    configs = load_configs(args.config_dir, args.tiny)
    header["scheduler_config"] = {k: v for k, v in configs["scheduler"].items() if not k.startswith("_")}
    t0 = time.perf_counter()
    pipeline, p_params, params_s, param_counts = build(configs, jnp.dtype(args.module_dtype), args.seed)
    header.update(build_s=time.perf_counter() - t0, params_s=params_s, param_counts=param_counts,
                  memory_after_params=memory_stats())
    print(json.dumps(header), flush=True)

    rows, failed = [], False
    for n in counts:
        try:
            row = measure(pipeline, p_params, n, args)
        except Exception as error:  # recorded per N; the next N still runs
            row = {"images_per_device": n, "oom": is_oom(error), "error": f"{type(error).__name__}: {error}"[:500]}
            if not row["oom"]:
                failed = True
                traceback.print_exc()
        else:
            row["oom"] = False
        row.update(memory_stats())
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps({**header, "results": rows}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
