"""Does the shipped canny ControlNet steer tiny-shapes? Held-out outlines in, where and how large the shape is out.

    python -m tools.evaluate_controlnet                       # assets/tiny-shapes-canny, writes its evaluation.json
    python -m tools.evaluate_controlnet --controlnet /tmp/cn --json /tmp/cn.json

For each held-out (colour, shape, position) combination of :data:`tools.shapes.HELD_OUT` (never drawn in the
ControlNet's or the model's training), in turn small and large, on a white background: the shape is rendered
(:func:`tools.shapes.render`) and sent as a ControlNet unit's image with the ``canny`` preprocessor at its default
resolution (the engine draws the edges, as for any client), the prompt names colour, shape and background but
**not** position or size ("a red star on a white background"), and the engine makes 4 images (seeds ``--seed`` ..
+3) with the unit and the same 4 without it. Each image is read by the model-independent checker of
:mod:`tools.shapes`: the foreground centroid (pixels) and area. Reported, with and without the unit:

* ``position``: fraction of images whose nearest anchor is the outline's;
* ``centroid_error_px``: mean distance from the foreground centroid to the outline's shape's centroid;
* ``size``: fraction of images whose foreground area is nearer the outline's size class (small or large, rendered
  areas) than the other; and ``area_ratio``: median foreground area over the outline's shape's.

A ControlNet that works moves ``position`` and ``size`` up and ``centroid_error_px`` down; without it the prompt
gives no position, so ``position`` is about chance (0.2).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.control import ControlUnit
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.validation import GenerateRequest
from tools import shapes

ROOT = Path(__file__).resolve().parents[1]
CONTROLNET = ROOT / "assets" / "tiny-shapes-canny"


def centroid_and_area(image: np.ndarray) -> tuple[tuple[float, float] | None, float]:
    """(x, y) of the foreground's centroid in pixels (None without foreground) and its area as a fraction."""
    mask = shapes.foreground_mask(image)
    if mask.sum() < 4:
        return None, float(mask.mean())
    ys, xs = np.nonzero(mask)
    return (float(xs.mean()), float(ys.mean())), float(mask.mean())


def evaluate(engine: Engine, name: str, seed: int = 0, steps: int = 8, guidance: float = 5.0) -> dict:
    """The figures of the module docstring for the loaded ControlNet ``name``."""
    start = time.perf_counter()
    rows = []
    for i, (colour, shape, position) in enumerate(shapes.HELD_OUT):
        size = ("small", "large")[i % 2]
        attrs = shapes.Attributes(shape, colour, "white", position, size)
        outline = shapes.render(attrs)
        target, target_area = centroid_and_area(outline)
        other_area = centroid_and_area(shapes.render(shapes.Attributes(
            shape, colour, "white", position, "large" if size == "small" else "small")))[1]
        prompt = f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape} on a white background"
        for control in (True, False):
            units = (ControlUnit(image=outline, model=name, module="canny"),) if control else ()
            images = engine.generate(GenerateRequest(prompt, seed=seed, num_inference_steps=steps,
                                                     guidance_scale=guidance, control_units=units)).images
            for image in images:
                centre, area = centroid_and_area(image)
                rows.append({"control": control, "prompt": prompt, "position": position, "size": size,
                             "read_position": shapes.analyse(image)["position"],
                             "centroid_error_px": None if centre is None else
                             float(np.hypot(centre[0] - target[0], centre[1] - target[1])),
                             "size_right": abs(area - target_area) < abs(area - other_area),
                             "area_ratio": area / target_area})

    def summary(control: bool) -> dict:
        part = [r for r in rows if r["control"] == control]
        errors = [r["centroid_error_px"] for r in part if r["centroid_error_px"] is not None]
        return {"images": len(part),
                "position": float(np.mean([r["read_position"] == r["position"] for r in part])),
                "centroid_error_px": float(np.mean(errors)) if errors else None,
                "size": float(np.mean([r["size_right"] for r in part])),
                "area_ratio": float(np.median([r["area_ratio"] for r in part]))}

    return {"controlnet": name, "model": engine.model.name, "seeds": [seed, seed + 3],
            "steps": steps, "guidance_scale": guidance, "sampler": "Euler",
            "with_controlnet": summary(True), "without": summary(False),
            "eval_s": round(time.perf_counter() - start, 1), "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--controlnet", default=str(CONTROLNET), help="the ControlNet folder (diffusers layout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8, help="tiny-shapes' default (its engine_defaults.json)")
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--json", help="write the report here (default: evaluation.json in the ControlNet's folder)")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig.load({"model": "tiny-shapes", "controlnet": args.controlnet}),
                    log=lambda *_: None).start()
    report = evaluate(engine, next(iter(engine.controlnets)), args.seed, args.steps, args.guidance)
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    out = Path(args.json) if args.json else Path(args.controlnet) / "evaluation.json"
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
