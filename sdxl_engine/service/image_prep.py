"""AUTOMATIC1111's image handling for ``/sdapi/v1/img2img``, as its modules/processing.py
(``StableDiffusionProcessingImg2Img.init``), modules/images.py (``resize_image``, ``flatten``) and
modules/masking.py (``get_crop_region``, ``expand_crop_region``, ``fill``) do it, with Pillow and numpy:
the init image and mask brought to the request's size, the mask made binary, inverted and blurred, the
masked area pre-filled, "only masked" inpainting's crop, and the overlay that puts the original's pixels back
outside the mask (``apply_overlay``, ``uncrop``). The denoising itself is the engine's (diffusers' rules).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image, ImageFilter, ImageOps

LANCZOS = Image.Resampling.LANCZOS
RESIZE_MODES = {0: "Just resize", 1: "Crop and resize", 2: "Resize and fill", 3: "Just resize (latent upscale)"}
FILL_MODES = {0: "fill", 1: "original", 2: "latent noise", 3: "latent nothing"}
BACKGROUND = (255, 255, 255)  # A1111's img2img_background_color default, under a transparent init image


def img2img_start_step(denoising_strength: float, steps: int) -> int:
    """The first of ``steps`` steps an A1111 img2img runs: A1111 runs ``t_enc + 1`` steps, ``t_enc =
    int(min(denoising_strength, 0.999) * steps)`` (sd_samplers_common.setup_img2img_steps with
    img2img_fix_steps off; the k-diffusion samplers take ``sigmas[steps - t_enc - 1:]``), so it starts at
    ``steps - t_enc - 1``: 20 steps at 0.75 start at step 4 and run 16. ``denoising_strength`` in [0, 1]."""
    t_enc = int(min(denoising_strength, 0.999) * steps)
    return steps - t_enc - 1


def flatten(image: Image.Image, background=BACKGROUND) -> Image.Image:
    """An RGB copy of ``image``, a transparent one composited over ``background`` (A1111's images.flatten)."""
    if image.mode == "RGBA":
        base = Image.new("RGBA", image.size, background)
        base.alpha_composite(image)
        image = base
    return image.convert("RGB")


def resize_image(resize_mode: int, image: Image.Image, width: int, height: int) -> Image.Image:
    """``image`` brought to ``width`` x ``height`` as A1111's images.resize_image with no upscaler model (Lanczos):
    0 just resize (stretched); 1 crop and resize (scaled to cover, centred, the rest cut); 2 resize and fill
    (scaled to fit, centred, the empty bands filled with the image's stretched edge rows or columns). An image
    of mode "L" (a mask) stays "L"; any other comes back RGB."""
    mode = "L" if image.mode == "L" else "RGB"
    if resize_mode == 0:
        return image.resize((width, height), resample=LANCZOS)
    ratio, src_ratio = width / height, image.width / image.height
    if resize_mode == 1:
        src_w = width if ratio > src_ratio else image.width * height // image.height
        src_h = height if ratio <= src_ratio else image.height * width // image.width
    else:
        src_w = width if ratio < src_ratio else image.width * height // image.height
        src_h = height if ratio >= src_ratio else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=LANCZOS)
    out = Image.new(mode, (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if resize_mode == 2:
        if ratio < src_ratio:
            fill_height = height // 2 - src_h // 2
            if fill_height > 0:
                out.paste(resized.resize((width, fill_height), box=(0, 0, width, 0)), box=(0, 0))
                out.paste(resized.resize((width, fill_height), box=(0, resized.height, width, resized.height)),
                          box=(0, fill_height + src_h))
        elif ratio > src_ratio:
            fill_width = width // 2 - src_w // 2
            if fill_width > 0:
                out.paste(resized.resize((fill_width, height), box=(0, 0, 0, height)), box=(0, 0))
                out.paste(resized.resize((fill_width, height), box=(resized.width, 0, resized.width, height)),
                          box=(fill_width + src_w, 0))
    return out


def binary_mask(mask: Image.Image) -> Image.Image:
    """A1111's create_binary_mask (round on): a mask with transparency is its alpha channel, > 128 white
    (opaque = repaint); any other is its grey ("L"). White = repaint, black = keep."""
    if mask.mode == "RGBA" and mask.getextrema()[-1] != (255, 255):
        return mask.split()[-1].convert("L").point(lambda x: 255 if x > 128 else 0)
    return mask.convert("L")


def gaussian_blur_1d(mask: np.ndarray, sigma: float, axis: int) -> np.ndarray:
    """OpenCV's ``GaussianBlur`` along one ``axis`` of a (H, W) uint8 mask with A1111's kernel size
    ``2 * int(2.5 * sigma + 0.5) + 1`` (its mask_blur_x / mask_blur_y), reflected borders (BORDER_REFLECT_101),
    rounded to uint8 (OpenCV's fixed-point sums can differ by 1 level)."""
    size = 2 * int(2.5 * sigma + 0.5) + 1
    half = size // 2
    x = np.arange(size, dtype=np.float64) - half
    kernel = np.exp(-(x * x) / (2 * sigma * sigma))
    kernel /= kernel.sum()
    pad = [(0, 0), (0, 0)]
    pad[axis] = (half, half)
    padded = np.pad(mask.astype(np.float64), pad, mode="reflect")
    out = np.zeros(mask.shape, np.float64)
    n = mask.shape[axis]
    for k, weight in enumerate(kernel):
        out += weight * (padded[k:k + n] if axis == 0 else padded[:, k:k + n])
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def crop_region(mask: np.ndarray, pad: int) -> tuple[int, int, int, int] | None:
    """(x1, y1, x2, y2): the box around a (H, W) mask's non-zero pixels grown by ``pad`` pixels, within the
    mask (A1111's masking.get_crop_region); None for a blank mask."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if rows.size == 0:
        return None
    h, w = mask.shape
    return (max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0), min(int(cols[-1]) + 1 + pad, w),
            min(int(rows[-1]) + 1 + pad, h))


def expand_crop_region(region, width: int, height: int, image_width: int, image_height: int):
    """``region`` grown to the processing size's aspect ratio ``width / height``, kept within the image
    (A1111's masking.expand_crop_region)."""
    x1, y1, x2, y2 = region
    if (x2 - x1) / (y2 - y1) > width / height:
        diff = int((x2 - x1) / (width / height) - (y2 - y1))
        y1, y2 = y1 - diff // 2, y2 + diff - diff // 2
        if y2 >= image_height:
            y1, y2 = y1 - (y2 - image_height), image_height
        if y1 < 0:
            y1, y2 = 0, y2 - y1
        y2 = min(y2, image_height)
    else:
        diff = int((y2 - y1) * (width / height) - (x2 - x1))
        x1, x2 = x1 - diff // 2, x2 + diff - diff // 2
        if x2 >= image_width:
            x1, x2 = x1 - (x2 - image_width), image_width
        if x1 < 0:
            x1, x2 = 0, x2 - x1
        x2 = min(x2, image_width)
    return x1, y1, x2, y2


def fill(image: Image.Image, mask: Image.Image) -> Image.Image:
    """The masked area of ``image`` (RGB) painted over with ever less blurred copies of the rest
    (A1111's masking.fill, ``inpainting_fill`` 0): the colours around the mask flow into it."""
    out = Image.new("RGBA", image.size)
    masked = Image.new("RGBa", image.size)
    masked.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    for radius, repeats in ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)):
        blurred = masked.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            out.alpha_composite(blurred)
    return out.convert("RGB")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An img2img request's inputs for the engine: ``image`` (H, W, 3) uint8 and ``mask`` None or (H, W) uint8
    (255 = repaint) at the request's size; ``finish``: None, or the function that turns the engine's
    (n, H, W, 3) uint8 images into the answer's (the overlay; "only masked" pastes back into the original's
    size); ``params``: A1111's infotext entries for what ran (``Mask blur``, ``Inpaint area``...)."""

    image: np.ndarray
    mask: np.ndarray | None
    finish: PasteBack | None
    params: dict


def prepare(init: Image.Image, mask: Image.Image | None, width: int, height: int, resize_mode: int = 0,
            mask_blur_x: float = 4, mask_blur_y: float = 4, invert: bool = False, fill_mode: int = 1,
            full_res: bool = False, padding: int = 32) -> Prepared:
    """An A1111 img2img's init image (any mode: a transparent one is flattened on white) and optional mask
    (:func:`binary_mask`) prepared as StableDiffusionProcessingImg2Img.init does, for ``width`` x ``height``:

    1. the mask made binary, inverted (``invert``: repaint the black part), blurred by ``mask_blur_x`` /
       ``mask_blur_y`` pixels (:func:`gaussian_blur_1d`);
    2. ``full_res`` ("Inpaint area: Only masked"): the box around the mask, grown by ``padding`` and to the
       request's aspect ratio, is cut from the image and mask and brought to ``width`` x ``height`` (resize mode
       2); the answer is the original's size, the result pasted back into the box (crop and resize) under the
       overlay. A blank mask falls back to the whole image, as A1111's. Otherwise both are resized by
       ``resize_mode`` (:func:`resize_image`; 3, A1111's latent upscale, resizes as 0 here);
    3. the overlay: the original's pixels outside the mask, over the result with the blurred mask doubled
       (``clip(2 x mask)``) as its opacity (apply_overlay); only masked uses the blurred mask as it is;
    4. ``fill_mode`` 0, 2 or 3 pre-fill the masked area with the surrounding colours (:func:`fill`; A1111's
       2 and 3 then also change the latents, which the engine does not: the caller says so).
    """
    image = flatten(init)
    params: dict = {}
    if mask is None:
        resized = resize_image(0 if resize_mode == 3 else resize_mode, image, width, height)
        return Prepared(np.asarray(resized), None, None, params)
    m = binary_mask(mask)
    if m.size != image.size:
        m = m.resize(image.size, resample=LANCZOS)  # the caller has checked the aspect ratio
    if invert:
        m = ImageOps.invert(m)
        params["Mask mode"] = "Inpaint not masked"
    grey = np.asarray(m)
    if mask_blur_x > 0:
        grey = gaussian_blur_1d(grey, mask_blur_x, axis=1)
    if mask_blur_y > 0:
        grey = gaussian_blur_1d(grey, mask_blur_y, axis=0)
    params["Mask blur"] = _number(mask_blur_x) if mask_blur_x == mask_blur_y else f"{mask_blur_x}x{mask_blur_y}"
    box = crop_region(grey, padding) if full_res else None
    original = np.asarray(image)
    if box is not None:
        box = expand_crop_region(box, width, height, image.width, image.height)
        x1, y1, x2, y2 = box
        alpha = grey.astype(np.float32) / 255.0
        work_mask = resize_image(2, Image.fromarray(grey).crop(box), width, height)
        work_image = resize_image(2, image.crop(box), width, height)
        params.update({"Inpaint area": "Only masked", "Masked area padding": padding})
        finish = PasteBack(original, alpha, box)
    else:
        mode = 0 if resize_mode == 3 else resize_mode
        work_mask = resize_image(mode, Image.fromarray(grey), width, height)
        work_image = resize_image(mode, image, width, height)
        original = np.asarray(work_image)
        alpha = np.clip(np.asarray(work_mask).astype(np.float32) * 2, 0, 255).astype(np.uint8) / np.float32(255)
        finish = overlay(original, alpha)
    if fill_mode != 1:
        work_image = fill(work_image, work_mask)
    params["Masked content"] = FILL_MODES.get(fill_mode, "fill")
    return Prepared(np.asarray(work_image), np.asarray(work_mask), finish, params)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


@dataclasses.dataclass(frozen=True)
class PasteBack:
    """How an answer's images are made from the engine's, recorded with the request (service/request.py) and
    applied by the service after each engine call: A1111's overlay (processing.apply_overlay) and, for "only
    masked" inpainting, its uncrop.

    ``original``: (H, W, 3) uint8, the picture put back; ``alpha``: (H, W) float32 in [0, 1], the share of the
    result at each pixel (1 = the engine's, 0 = the original's; a blurred mask's edge mixes them); ``box``: None,
    or (x1, y1, x2, y2) in the original where each result is resized into first (crop and resize, A1111's
    uncrop), the answer then being the original's size.
    """

    original: np.ndarray
    alpha: np.ndarray
    box: tuple[int, int, int, int] | None = None

    def apply(self, images: np.ndarray) -> np.ndarray:
        """The answer's images ((n, H, W, 3) uint8, the original's size) for the engine's ``images`` ((n, h, w, 3)
        uint8): ``result * alpha + original * (1 - alpha)``, rounded; pixels of alpha 0 or 1 are copied."""
        if self.box is not None:
            x1, y1, x2, y2 = self.box
            canvas = np.zeros((len(images), *self.original.shape), np.uint8)
            for i, image in enumerate(images):
                canvas[i, y1:y2, x1:x2] = np.asarray(resize_image(1, Image.fromarray(image), x2 - x1, y2 - y1))
            images = canvas
        out = np.where((self.alpha >= 1)[None, :, :, None], images, self.original[None])
        ys, xs = np.nonzero((self.alpha > 0) & (self.alpha < 1))
        if ys.size:
            a = self.alpha[ys, xs][None, :, None]
            mixed = images[:, ys, xs].astype(np.float32) * a + self.original[ys, xs][None].astype(np.float32) * (1 - a)
            out[:, ys, xs] = np.clip(np.rint(mixed), 0, 255).astype(np.uint8)
        return out.astype(np.uint8)


def overlay(original: np.ndarray, alpha: np.ndarray) -> PasteBack:
    """The overlay of ``original`` (H, W, 3) uint8 where ``alpha`` (H, W) float32 is 0, each result kept where
    it is 1 (:class:`PasteBack` without a box)."""
    return PasteBack(original, np.asarray(alpha, np.float32))


def same_aspect(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether sizes ``a`` and ``b`` (width, height) have one aspect ratio, to a pixel of either."""
    return math.isclose(a[0] / a[1], b[0] / b[1], abs_tol=1 / min(a[1], b[1]))
