"""Fit a model's latents-to-RGB preview factors by least squares from its own VAE's decodes.

    python -m tools.fit_preview                       # tiny-shapes -> assets/tiny-shapes/latent_rgb.json
    python -m tools.fit_preview --model DIR --out DIR/latent_rgb.json

Runs the engine's compiled program (with the per-step hook) on prompts of the model's vocabulary
and seeds 0..n-1, takes each image's x0 estimate at the last step (with Euler it is the final
latents, the VAE's input: the final step goes to sigma 0) and the decoded image, and solves
``image ≈ x0ᵀ F + bias`` over every latent pixel (engine.previews.fit_latent_rgb; the image
average-pooled to latent resolution, in [-1, 1]). Writes ``{"factors", "bias", "_note"}`` with
the fit's mean absolute error in /255 on the images it was fitted on and on held-out seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sdxl_engine.checkpoint import builtin
from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.previews import FACTORS_FILE, LatentRGB, fit_latent_rgb
from sdxl_engine.program.generate import ProgramInputs, tokenize
from sdxl_engine.program.schedulers import make_schedule

PROMPTS = ("a red circle on a blue background", "a large green square at the top", "a small yellow star on the left",
           "a purple triangle on a white background", "a large pink cross in the centre on a black background",
           "a blue square", "a white circle on a black background", "an orange triangle at the bottom")
STEPS = 20


def last_x0_and_images(engine: Engine, prompt: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(batch, C, h, w) float32 x0 at the last Euler step and the (batch, H, W, 3) uint8 images."""
    width, height = engine.limits.default_size
    program = engine.program(width, height, True)
    ids, _ = tokenize(engine.model, prompt)
    empty, _ = tokenize(engine.model, "")
    seeds = [seed * engine.batch + i for i in range(engine.batch)]
    schedule = make_schedule("Euler", engine.model.scheduler_config, STEPS)
    inputs = ProgramInputs.build(ids, empty, True, seeds, 5.0, schedule, STEPS, engine.config.max_inference_steps)
    parts: dict[int, np.ndarray] = {}

    def receive(shard, step, x0):
        if step == STEPS - 1 and x0 is not None:
            parts[shard] = np.array(x0, copy=True)
        return False, True, step + 1  # call at every step, with x0 (the last one's is kept)

    images, _ = program.executable.run(engine.params, inputs, receive)
    images = np.asarray(images)
    return np.concatenate([parts[k] for k in sorted(parts)]), images


def error_255(rgb: LatentRGB, x0: np.ndarray, images: np.ndarray) -> float:
    """Mean absolute difference, in /255, between the previews and the images pooled to latent resolution."""
    f = images.shape[1] // x0.shape[2]
    n, h, w = images.shape[0], x0.shape[2], x0.shape[3]
    pooled = images.astype(np.float64).reshape(n, h, f, w, f, 3).mean(axis=(2, 4))
    return float(np.abs(rgb(x0).astype(np.float64) - pooled).mean())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shapes")
    parser.add_argument("--out", default=str(builtin.TINY_SHAPES_DIR / FACTORS_FILE))
    parser.add_argument("--seeds", type=int, default=2, help="seed groups per prompt to fit on (one more is held out)")
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig.load({"model": args.model, "progress": True}), log=print).start()
    fit, held = [], []
    for prompt in PROMPTS:
        for group in range(args.seeds + 1):
            (held if group == args.seeds else fit).append(last_x0_and_images(engine, prompt, group))
    x0, images = (np.concatenate(a) for a in zip(*fit))
    factors, bias = fit_latent_rgb(x0, images)
    rgb = LatentRGB(factors, bias, args.out)
    hx0, himages = (np.concatenate(a) for a in zip(*held))
    on_fit, on_held = error_255(rgb, x0, images), error_255(rgb, hx0, himages)
    note = (f"latents -> RGB preview factors of {args.model}, fitted by least squares to its own VAE's decodes "
            f"(python -m tools.fit_preview): {len(x0)} images ({len(PROMPTS)} prompts, Euler {STEPS} steps, "
            "guidance 5); "
            f"mean abs error vs the images pooled to latent resolution {on_fit:.1f}/255 on them, "
            f"{on_held:.1f}/255 on {len(hx0)} held-out images")
    data = {"_note": note, "factors": [[round(float(v), 5) for v in row] for row in factors],
            "bias": [round(float(v), 5) for v in bias]}
    rows = ",\n  ".join(json.dumps(row) for row in data["factors"])  # one latent channel a line
    Path(args.out).write_text(f'{{\n "_note": {json.dumps(note)},\n "factors": [\n  {rows}\n ],\n'
                              f' "bias": {json.dumps(data["bias"])}\n}}\n')
    print(note)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
