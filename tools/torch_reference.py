"""diffusers' PyTorch ``StableDiffusionXLPipeline`` on the engine's weights, latents, steps and size.

    python -m tools.torch_reference --model DIR --latents latents.npz --steps 20 --out images.npz

What a user would run instead of this engine. It needs torch and diffusers (``pip install
torch==2.13.0 diffusers==0.42.1 transformers==5.24.0``, a CPU wheel, Python 3.11 here) and so
runs in an interpreter of its own: ``python -m tools.bench --torch-python PATH`` starts
it as a subprocess. It imports nothing from the runtime: the folder must be a diffusers-format
SDXL (safetensors, PyTorch class names: the shipped tiny-shapes is). Prints one JSON line:
seconds per call (median, min, max over ``--runs`` after one warm-up), torch's version and
threads; writes the images (n, H, W, 3) uint8 to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from diffusers import StableDiffusionXLPipeline


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="diffusers-format SDXL folder (safetensors)")
    p.add_argument("--latents", required=True, help="npz with 'latents' (n, 4, h, w) float32, unit normal")
    p.add_argument("--prompt", default="a red circle on the left")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", required=True, help="npz to write the images to")
    args = p.parse_args(argv)

    pipe = StableDiffusionXLPipeline.from_pretrained(args.model, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    with np.load(args.latents) as data:
        latents = torch.from_numpy(data["latents"])
    n, _, h, w = latents.shape
    scale = pipe.vae_scale_factor

    def call() -> np.ndarray:
        with torch.inference_mode():
            out = pipe(args.prompt, num_inference_steps=args.steps, guidance_scale=args.guidance,
                       height=h * scale, width=w * scale, num_images_per_prompt=n, latents=latents.clone(),
                       output_type="np").images
        return np.round(np.clip(out, 0, 1) * 255).astype(np.uint8)

    images = call()  # warm-up
    seconds = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    np.savez(args.out, images=images)
    print(json.dumps({"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
                      "runs": args.runs, "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
