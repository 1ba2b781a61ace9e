"""ControlNet preprocessors (A1111's ``module``) and the control image's resize modes: host code, OpenCV, no Gradio.

Each preprocessor is sd-webui-controlnet's (``scripts/preprocessor/legacy/processor.py``, ``annotator/util.py``), the
same OpenCV calls in the same order, on (H, W, 3) uint8 RGB pixels:

=================  ===================================================================================  ==========
module             what it does                                                                        a / b
=================  ===================================================================================  ==========
none               the image as it is (a ready map: depth, pose, edges made elsewhere)                  -
canny              resized so its short side is ``processor_res`` (cubic up, area down, edge-padded to   low, high
                   a multiple of 64), ``cv2.Canny(low, high)``, the padding removed                     (100, 200)
invert             255 - image (a white-background line drawing to the black-background maps models    -
                   take)
tile_resample      downsampled by ``threshold_a`` (area) when it is at least 1.1, else as it is          rate (1)
blur_gaussian      resized as canny, the padding removed, ``cv2.GaussianBlur`` with sigma ``threshold_a``  sigma (9)
scribble_xdog      resized as canny; difference of Gaussians (0.5, 5.0) thresholded at ``threshold_a``  thr (32)
lineart_standard   resized as canny; (Gaussian 6.0 - image) per pixel's min channel, / its median       -
                   above 8 (at least 16), x 127
=================  ===================================================================================  ==========

Preprocessors that need a network of their own (depth, pose, segmentation, normals, HED, lineart models, ...) are
refused by name (:class:`UnknownModule` names the ones available): send a ready map with module ``none``.

Then the map is fitted to the generation's size (sd-webui-controlnet's ``detectmap_proc``): "Just Resize" stretches
it, "Crop and Resize" scales it to cover the size and crops the middle, "Resize and Fill" scales it to fit inside
and fills the rest with the median colour of its border. The interpolation is theirs (``high_quality_resize``):
nearest for maps of 3 to 199 colours, area when shrinking, cubic when growing; a black-and-white map is thresholded
back to two values (Otsu). Not done here: its thinning of one-pixel edges after an upscale (``nake_nms`` and
``lvmin_thin``), which moves an edge by a pixel at most.
"""

from __future__ import annotations

import numpy as np

from sdxl_engine.engine.errors import InvalidRequest

# module -> (default processor_res or None, default threshold_a or None, default threshold_b or None)
MODULES: dict[str, tuple[int | None, float | None, float | None]] = {
    "none": (None, None, None),
    "canny": (512, 100.0, 200.0),
    "invert": (None, None, None),
    "tile_resample": (None, 1.0, None),
    "blur_gaussian": (512, 9.0, None),
    "scribble_xdog": (512, 32.0, None),
    "lineart_standard": (512, None, None),
}
# A1111's names for the same modules (sd-webui-controlnet's aliases), accepted and read as the module.
ALIASES = {"None": "none", "invert (from white bg & black line)": "invert",
           "lineart_standard (from white bg & black line)": "lineart_standard"}
# Names of preprocessors that need a model of their own: refused with that reason, not as unknown.
NEEDS_A_MODEL = ("depth", "openpose", "dw_openpose", "densepose", "seg", "normal", "hed", "pidinet", "mlsd",
                 "lineart_anime", "lineart_realistic", "lineart_coarse", "softedge", "scribble_hed", "scribble_pidinet",
                 "mediapipe_face", "shuffle", "reference", "ip-adapter", "instant_id", "inpaint", "recolor", "revision",
                 "t2ia", "clip_vision", "anime_face_segment", "oneformer", "uniformer", "zoe", "leres", "midas",
                 "marigold", "teed", "anyline", "animal_openpose", "dsine")
RESIZE_MODES = ("Just Resize", "Crop and Resize", "Resize and Fill")


class UnknownModule(InvalidRequest):
    """A preprocessor this engine does not run; the message names it and the available ones."""


def module_name(field: str, value) -> str:
    """A request's module as one of :data:`MODULES`. Raises UnknownModule naming ``field``: a preprocessor that
    needs a network (depth, pose, segmentation...) with that reason, any other name as unknown."""
    name = ALIASES.get(value, value) if isinstance(value, str) else value
    if isinstance(name, str) and name in MODULES:
        return name
    available = ", ".join(MODULES)
    if isinstance(name, str) and any(name.lower().startswith(p) for p in NEEDS_A_MODEL):
        raise UnknownModule(field, f"the preprocessor {name!r} needs a model of its own, which this server does not "
                                   f"run; send the ready map (a depth, pose or segmentation image) with module "
                                   f"'none', or use one of {available}")
    raise UnknownModule(field, f"unknown preprocessor {value!r}; this server runs {available}")


def hwc3(x: np.ndarray) -> np.ndarray:
    """annotator/util.py ``HWC3``: grey to 3 channels; RGBA blended onto white by its alpha."""
    if x.ndim == 2:
        x = x[:, :, None]
    if x.shape[2] == 3:
        return x
    if x.shape[2] == 1:
        return np.concatenate([x, x, x], axis=2)
    color, alpha = x[:, :, 0:3].astype(np.float32), x[:, :, 3:4].astype(np.float32) / 255.0
    return (color * alpha + 255.0 * (1.0 - alpha)).clip(0, 255).astype(np.uint8)


def _resize_with_pad(image: np.ndarray, resolution: int) -> tuple[np.ndarray, tuple[int, int]]:
    """processor.py ``resize_image_with_pad``: short side to ``resolution`` (cubic up, area down), edge-padded to
    multiples of 64; returns the padded image and the (height, width) to cut back to."""
    import cv2

    h, w = image.shape[:2]
    k = float(resolution) / float(min(h, w))
    th, tw = int(np.round(h * k)), int(np.round(w * k))
    resized = cv2.resize(image, (tw, th), interpolation=cv2.INTER_CUBIC if k > 1 else cv2.INTER_AREA)
    pad = lambda x: int(np.ceil(float(x) / 64.0) * 64 - x)  # noqa: E731
    return np.pad(resized, [[0, pad(th)], [0, pad(tw)], [0, 0]], mode="edge"), (th, tw)


def preprocess(image: np.ndarray, module: str, resolution: int = -1, threshold_a: float = -1,
               threshold_b: float = -1) -> np.ndarray:
    """The detected map of ``image`` (H, W, 3) uint8 by ``module`` (a :data:`MODULES` name), (H', W', 3) uint8.

    ``resolution``, ``threshold_a``, ``threshold_b``: A1111's processor_res and sliders; -1 (or below 0) = the
    module's default (as sd-webui-controlnet's ``bound_check_params``).
    """
    import cv2

    default_res, default_a, default_b = MODULES[module]
    res = int(resolution) if resolution is not None and resolution > 0 else (default_res or 512)
    a = float(threshold_a) if threshold_a is not None and threshold_a >= 0 else default_a
    b = float(threshold_b) if threshold_b is not None and threshold_b >= 0 else default_b
    image = hwc3(np.ascontiguousarray(image))
    if module == "none":
        return image
    if module == "invert":
        return 255 - image
    if module == "tile_resample":
        if a < 1.1:
            return image
        h, w = int(image.shape[0] / a), int(image.shape[1] / a)
        return cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)
    padded, (h, w) = _resize_with_pad(image, res)
    if module == "canny":
        out = cv2.Canny(padded, int(a), int(b))
    elif module == "blur_gaussian":
        out = cv2.GaussianBlur(padded[:h, :w].copy(), (0, 0), a)
    elif module == "scribble_xdog":
        g1 = cv2.GaussianBlur(padded.astype(np.float32), (0, 0), 0.5)
        g2 = cv2.GaussianBlur(padded.astype(np.float32), (0, 0), 5.0)
        dog = (255 - np.min(g2 - g1, axis=2)).clip(0, 255).astype(np.uint8)
        out = np.zeros_like(padded, dtype=np.uint8)
        out[2 * (255 - dog) > a] = 255
    else:  # lineart_standard
        x = padded.astype(np.float32)
        g = cv2.GaussianBlur(x, (0, 0), 6.0)
        intensity = np.min(g - x, axis=2).clip(0, 255)
        above = intensity[intensity > 8]
        intensity /= max(16, float(np.median(above)) if above.size else 16)
        intensity *= 127
        out = intensity.clip(0, 255).astype(np.uint8)
    return hwc3(np.ascontiguousarray(out[:h, :w]))


def pixel_perfect_resolution(image: np.ndarray, height: int, width: int, resize_mode: str) -> int:
    """sd-webui-controlnet's ``pixel_perfect_resolution``: the processor resolution at which the map lands on the
    generation's pixels one to one (the image's short side times the larger scale, the smaller one for "Resize and
    Fill")."""
    raw_h, raw_w = image.shape[:2]
    k0, k1 = float(height) / raw_h, float(width) / raw_w
    k = min(k0, k1) if resize_mode == "Resize and Fill" else max(k0, k1)
    return int(np.round(k * float(min(raw_h, raw_w))))


def _high_quality_resize(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``detectmap_proc``'s ``high_quality_resize`` to ``size`` (width, height), less its one-pixel-edge thinning."""
    import cv2

    if x.shape[0] == size[1] and x.shape[1] == size[0]:
        return x
    smaller = size[0] * size[1] < x.shape[0] * x.shape[1]
    if x.dtype == np.uint8 and x.shape[2] == 3:  # one uint32 per pixel: np.unique over rows took ~0.1 s at 512²
        colors = len(np.unique((x[..., 0].astype(np.uint32) << 16) | (x[..., 1].astype(np.uint32) << 8) | x[..., 2]))
    else:
        colors = len(np.unique(x.reshape(-1, x.shape[2]), axis=0))
    binary = colors == 2 and x.min() < 16 and x.max() > 240
    if 2 < colors < 200:
        interpolation = cv2.INTER_NEAREST
    elif smaller:
        interpolation = cv2.INTER_AREA
    else:
        interpolation = cv2.INTER_CUBIC
    y = cv2.resize(x, size, interpolation=interpolation)
    if binary:
        grey = np.mean(y.astype(np.float32), axis=2).clip(0, 255).astype(np.uint8)
        _, grey = cv2.threshold(grey, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
        y = np.stack([grey] * 3, axis=2)
    return y


def fit(detected: np.ndarray, width: int, height: int, resize_mode: str) -> np.ndarray:
    """The map (h, w, 3) uint8 fitted to (height, width, 3) by ``resize_mode`` (module docstring)."""
    if resize_mode == "Just Resize":
        return np.ascontiguousarray(_high_quality_resize(detected, (width, height)))
    old_h, old_w = detected.shape[:2]
    k0, k1 = float(height) / old_h, float(width) / old_w
    if resize_mode == "Resize and Fill":
        k = min(k0, k1)
        borders = np.concatenate([detected[0], detected[-1], detected[:, 0], detected[:, -1]], axis=0)
        background = np.tile(np.median(borders, axis=0).astype(detected.dtype)[None, None], [height, width, 1])
        inner = _high_quality_resize(detected, (int(np.round(old_w * k)), int(np.round(old_h * k))))
        new_h, new_w = inner.shape[:2]
        top, left = max(0, (height - new_h) // 2), max(0, (width - new_w) // 2)
        background[top:top + new_h, left:left + new_w] = inner
        return np.ascontiguousarray(background)
    k = max(k0, k1)  # Crop and Resize
    outer = _high_quality_resize(detected, (int(np.round(old_w * k)), int(np.round(old_h * k))))
    new_h, new_w = outer.shape[:2]
    top, left = max(0, (new_h - height) // 2), max(0, (new_w - width) // 2)
    return np.ascontiguousarray(outer[top:top + height, left:left + width])
