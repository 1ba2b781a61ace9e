"""img2img's and inpainting's device time against txt2img's at the same step count, alternating rounds \
(docs/benchmarks.md).

    python -m tools.bench_img2img [--model tiny-shapes] [--steps 20] [--runs 7]

One engine; per round one request of each leg in turn: txt2img, img2img at strength 0.5 (half the steps
run) and at strength 1 (every step: the difference to txt2img is the VAE encode), inpainting (the left half
masked) at 0.5 and 1 (the extra: the per-step blend of a plain UNet). Reports each leg's median
``timings["device"]`` (the compiled program, until ready), the per-round ratios' median, and the compiles
the measured rounds made (0: strength and image are traced inputs).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.validation import GenerateRequest


def picture(width: int, height: int) -> np.ndarray:
    """(height, width, 3) uint8: a blue square on white, the kind of picture tiny-shapes draws."""
    image = np.full((height, width, 3), 255, np.uint8)
    image[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = (20, 40, 230)
    return image


def measure(engine: Engine, steps: int, runs: int) -> dict:
    """{leg: median device seconds}, the median per-round ratios to txt2img, and the compiles while measuring."""
    image = picture(*engine.limits.default_size)
    mask = np.zeros(image.shape[:2], np.uint8)
    mask[:, : image.shape[1] // 2] = 255
    legs = {"txt2img": {}, "img2img 0.5": {"image": image, "strength": 0.5},
            "img2img 1.0": {"image": image, "strength": 1.0},
            "inpaint 0.5": {"image": image, "mask": mask, "strength": 0.5},
            "inpaint 1.0": {"image": image, "mask": mask, "strength": 1.0}}
    run = lambda kw, seed: engine.generate(GenerateRequest(  # noqa: E731
        "a red circle", seed=seed, num_inference_steps=steps, **kw)).timings["device"]
    for kw in legs.values():  # compile (or load) and warm up each program
        run(kw, 0)
    before = engine.compile_count
    rounds = [{name: run(kw, seed) for name, kw in legs.items()} for seed in range(1, runs + 1)]
    return {"model": engine.model.name, "devices": engine.device_summary, "batch": engine.batch,
            "size": list(engine.limits.default_size), "steps": steps, "runs": runs,
            "device_s": {name: statistics.median(r[name] for r in rounds) for name in legs},
            "ratio_to_txt2img": {name: statistics.median(r[name] / r["txt2img"] for r in rounds) for name in legs},
            "compiles_while_measuring": engine.compile_count - before, "rounds": rounds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_img2img", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-shapes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig.load({"model": args.model}), log=lambda *a: None).start()
    print(json.dumps(measure(engine, args.steps, args.runs), indent=1))


if __name__ == "__main__":
    main()
