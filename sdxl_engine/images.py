"""Images out of the engine: PIL images, PNGs that carry how they were made, optional saving."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin


def a1111_parameters(prompt: str, negative_prompt: str, steps: int, guidance_scale: float, seed: int,
                     width: int, height: int, model: str, extra: dict | None = None) -> str:
    """Generation parameters in the AUTOMATIC1111 ``parameters`` text format.

    Line 1: the prompt; line 2: ``Negative prompt: ...`` (omitted when empty); last line:
    ``Steps: 20, Sampler: Euler, CFG scale: 7.0, Seed: 42, Size: 1024x1024, Model: ...``.
    """
    fields = {"Steps": steps, "Sampler": "Euler", "CFG scale": f"{guidance_scale:g}", "Seed": seed,
              "Size": f"{width}x{height}", "Model": model, **(extra or {})}
    lines = [prompt]
    if negative_prompt:
        lines.append(f"Negative prompt: {negative_prompt}")
    lines.append(", ".join(f"{k}: {v}" for k, v in fields.items()))
    return "\n".join(lines)


def parse_a1111_parameters(text: str) -> dict:
    """Inverse of :func:`a1111_parameters` for the fields it writes (used by tests and 'reuse')."""
    lines = text.split("\n")
    out = {"prompt": lines[0], "negative_prompt": ""}
    for line in lines[1:-1]:
        if line.startswith("Negative prompt: "):
            out["negative_prompt"] = line[len("Negative prompt: "):]
    for key, value in re.findall(r"([A-Za-z ]+): ([^,]+)(?:, |$)", lines[-1]):
        out[key.strip()] = value.strip()
    return out


def to_pil(images: np.ndarray, parameters: list[str] | None = None) -> list[Image.Image]:
    """(batch, H, W, 3) uint8 -> list of RGB PIL images, each carrying its parameters text.

    Raises ValueError for another shape or dtype.
    """
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be (batch, H, W, 3) uint8, got {images.shape} {images.dtype}")
    out = []
    for i, array in enumerate(images):
        image = Image.fromarray(array, "RGB")
        if parameters:
            image.info["parameters"] = parameters[i]
        out.append(image)
    return out


def save_png(image: Image.Image, path: Path) -> Path:
    """Write ``image`` as PNG with its ``parameters`` text chunk (if it has one)."""
    info = PngImagePlugin.PngInfo()
    if "parameters" in image.info:
        info.add_text("parameters", image.info["parameters"])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG", pnginfo=info)
    return path
