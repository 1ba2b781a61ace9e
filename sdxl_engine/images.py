"""Images out of the engine: PIL images, PNGs that carry how they were made, optional saving.

Saved files are named after what made them (``seed42-a-red-circle.png``) and never replace
another file: each is written under a temporary name in its folder, then linked to its final
name, which fails rather than overwrite (a taken name gets ``-2``, ``-3``, ...).
"""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
import time
import unicodedata
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


def png_bytes(image: Image.Image) -> bytes:
    """``image`` encoded as PNG, with its ``parameters`` text chunk (if it has one)."""
    info = PngImagePlugin.PngInfo()
    if "parameters" in image.info:
        info.add_text("parameters", image.info["parameters"])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def slug(text: str, words: int = 6, max_chars: int = 40) -> str:
    """The first ``words`` words of ``text`` for a file name: ASCII letters and digits, lower
    case, joined by ``-``, at most ``max_chars`` characters; ``image`` when nothing is left."""
    ascii_text = unicodedata.normalize("NFKD", text or "").encode("ascii", "ignore").decode().lower()
    out = "-".join(re.findall(r"[a-z0-9]+", ascii_text)[:words])[:max_chars].strip("-")
    return out or "image"


def image_stem(seed: int, prompt: str) -> str:
    """File name (without ``.png``) of one image: ``seed42-a-red-circle-on-a-blue``."""
    return f"seed{seed}-{slug(prompt)}"


def request_stamp() -> str:
    """A name prefix unique to one request: local time to the microsecond and a random id,
    e.g. ``20250101-120000.123456-3fa9c2``."""
    now = time.time_ns()
    seconds = time.strftime("%Y%m%d-%H%M%S", time.localtime(now // 10**9))
    return f"{seconds}.{now // 1000 % 10**6:06d}-{secrets.token_hex(3)}"


def write_new(data: bytes, folder: Path, stem: str, suffix: str = ".png") -> Path:
    """Write ``data`` to ``folder/stem + suffix`` without ever replacing a file; return the path.

    The bytes go to a temporary file in the same folder first, which is then hard-linked to the
    final name: the link fails if the name exists (then ``stem-2``, ``stem-3``, ... are tried),
    and a reader never sees half a file. Where the file system has no hard links, the final name
    is created exclusively (O_EXCL) and written. Raises OSError if the folder is unusable.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{stem}.{secrets.token_hex(4)}.partial"
    with open(tmp, "xb") as f:
        f.write(data)
    try:
        for n in range(1, 10_000):
            path = folder / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
            try:
                os.link(tmp, path)
                return path
            except FileExistsError:
                continue
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                return _write_exclusive(data, folder, stem, suffix)
        raise FileExistsError(errno.EEXIST, f"no free name for {stem}{suffix} in {folder}")
    finally:
        tmp.unlink(missing_ok=True)


def _write_exclusive(data: bytes, folder: Path, stem: str, suffix: str) -> Path:
    """write_new without hard links: create the first free name with O_EXCL, then write it."""
    for n in range(1, 10_000):
        path = folder / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
        try:
            with open(path, "xb") as f:
                f.write(data)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free name for {stem}{suffix} in {folder}")


def save_png(image: Image.Image, folder: Path, stem: str) -> Path:
    """Save ``image`` as ``folder/stem.png`` (or ``stem-2.png``...; never over a file) with its
    ``parameters`` text chunk; return the path."""
    return write_new(png_bytes(image), folder, stem)
