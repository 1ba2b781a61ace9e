"""Images out of the engine: PNGs that carry how they were made, written without replacing a file.

Saved files are named after what made them (``seed42-a-red-circle.png``) and never replace
another file: each is written under a temporary name in its folder, then linked to its final
name, which fails rather than overwrite (a taken name gets ``-2``, ``-3``, ...).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import struct
import time
import unicodedata
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

USER_COMMENT = 0x9286  # EXIF UserComment, in the Exif IFD (0x8769): where A1111 keeps the parameters of a JPEG/WebP
EXIF_IFD = 0x8769


def a1111_parameters(prompt: str, negative_prompt: str, steps: int, guidance_scale: float, seed: int,
                     width: int, height: int, model: str, extra: dict | None = None, sampler: str = "Euler",
                     model_hash: str | None = None) -> str:
    """Generation parameters in the AUTOMATIC1111 ``parameters`` text format.

    Line 1: the prompt; line 2: ``Negative prompt: ...`` (omitted when empty); last line:
    ``Steps: 20, Sampler: Euler, CFG scale: 7.0, Seed: 42, Size: 1024x1024, Model hash: ..., Model: ...``
    (``model``: the model that made the image; ``Model hash``, its A1111 short hash, only when known).
    """
    fields = {"Steps": steps, "Sampler": sampler, "CFG scale": f"{guidance_scale:g}", "Seed": seed,
              "Size": f"{width}x{height}", **({"Model hash": model_hash} if model_hash else {}), "Model": model,
              **(extra or {})}
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
    # A1111's re_param (modules/infotext_utils.py): a value is plain up to the next comma, or JSON-quoted
    # (Lora hashes: "ink: 0123456789ab, ...").
    for key, value in re.findall(r'([A-Za-z ]+): ("(?:\\.|[^\\"])+"|[^,]+)(?:, |$)', lines[-1]):
        value = value.strip()
        out[key.strip()] = json.loads(value) if value.startswith('"') else value
    return out


def png_bytes(image: np.ndarray | Image.Image, parameters: str | None = None, level: int = 1) -> bytes:
    """An RGB image as a lossless PNG, with the A1111 ``parameters`` text chunk.

    Written directly (PNG spec, ISO/IEC 15948): every row with the "Sub" filter, deflated by
    zlib at ``level`` with its run-length strategy, which is much faster than Pillow's default
    encoder (level 6, adaptive filters; docs/benchmarks.md, leg 9 of the tiny-model table). zlib
    releases the GIL, so images encode in parallel.

    Args:
        image: (H, W, 3) uint8 array, or a PIL RGB image (its ``parameters`` info is used when
            ``parameters`` is None).
    """
    if isinstance(image, Image.Image):
        parameters = image.info.get("parameters") if parameters is None else parameters
        image = np.asarray(image.convert("RGB"))
    height, width, _ = image.shape
    flat = image.reshape(height, width * 3)
    rows = np.empty((height, 1 + width * 3), np.uint8)
    rows[:, 0] = 1  # filter type 1, "Sub": each byte minus the same channel of the pixel to its left
    rows[:, 1:4] = flat[:, :3]
    np.subtract(flat[:, 3:], flat[:, :-3], out=rows[:, 4:])  # uint8 arithmetic wraps, as PNG's filter does
    deflate = zlib.compressobj(level, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    data = deflate.compress(rows.data) + deflate.flush()
    chunks = [_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))]  # 8-bit RGB
    if parameters:
        chunks.append(_text_chunk("parameters", parameters))
    chunks += [_chunk(b"IDAT", data), _chunk(b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _text_chunk(key: str, text: str) -> bytes:
    """tEXt (Latin-1) when the text fits, else iTXt (UTF-8), as Pillow writes ``parameters``."""
    try:
        return _chunk(b"tEXt", key.encode("latin-1") + b"\0" + text.encode("latin-1"))
    except UnicodeEncodeError:
        return _chunk(b"iTXt", key.encode("latin-1") + b"\0\0\0\0\0" + text.encode("utf-8"))


def encode_pngs(images: np.ndarray, parameters: list[str]) -> list[bytes]:
    """(n, H, W, 3) uint8 -> n PNGs (:func:`png_bytes`), encoded in parallel threads."""
    with ThreadPoolExecutor(max_workers=min(len(images), os.cpu_count() or 1)) as pool:
        return list(pool.map(png_bytes, images, parameters))


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
    is created exclusively (O_EXCL) and written. Raises OSError if the folder is unusable or a write
    fails (a full disk); nothing is left behind then, neither the temporary file nor a part of the file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{stem}.{secrets.token_hex(4)}.partial"
    f = open(tmp, "xb")
    try:  # from here on the temporary file goes, whatever fails (a write on a full disk included)
        with f:
            f.write(data)
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
            f = open(path, "xb")
        except FileExistsError:
            continue
        try:
            with f:
                f.write(data)
        except BaseException:  # created, not written: remove the name, or it would hold part of the image
            path.unlink(missing_ok=True)
            raise
        return path
    raise FileExistsError(errno.EEXIST, f"no free name for {stem}{suffix} in {folder}")
