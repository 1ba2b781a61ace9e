"""engine/control.py and control_preprocess.py: ControlUnit validation, A1111's step rule and control modes, the
control arrays, the infotext, the preprocessors and resize modes (host code: no program runs here)."""

import json

import numpy as np
import pytest

from sdxl_engine.engine.control import (
    ControlUnit,
    a1111_keep,
    control_arrays,
    detect,
    diffusers_keep,
    infotext,
    keep_row,
    mode_factors,
    validate_units,
)
from sdxl_engine.engine.control_preprocess import (
    MODULES,
    UnknownModule,
    fit,
    pixel_perfect_resolution,
    preprocess,
)
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.models.controlnet import soft_scales

LOADED = ["canny-xl", "depth-xl"]


def picture(h=48, w=80) -> np.ndarray:
    """A non-square picture (width != height: a swapped axis shows): a dark disc off-centre on a light ramp."""
    y, x = np.mgrid[0:h, 0:w]
    image = np.stack([200 + x * 0.5, 180 + y * 0.5, np.full_like(x, 220.0)], -1)
    image[(x - w * 0.3) ** 2 + (y - h * 0.4) ** 2 < (h * 0.25) ** 2] = (20, 30, 40)
    return image.clip(0, 255).astype(np.uint8)


def unit(**kw) -> ControlUnit:
    return ControlUnit(**{"image": picture(), "model": "canny-xl", **kw})


def test_a_unit_is_validated_and_normalised():
    (u,) = validate_units([unit(model="canny-xl [a1b2c3d4]", control_mode=2, resize_mode="Envelope (Outer Fit)",
                                module="lineart_standard (from white bg & black line)", processor_res=768)],
                          LOADED, 3)
    assert (u.model, u.control_mode, u.resize_mode, u.module, u.processor_res) == (
        "canny-xl", "ControlNet is more important", "Resize and Fill", "lineart_standard", 768)
    assert u.image.shape == (48, 80, 3)
    (grey,) = validate_units([unit(image=picture()[..., 0])], LOADED, 3)  # (H, W) made RGB, as A1111's HWC3
    assert grey.image.shape == (48, 80, 3) and (grey.image[..., 0] == grey.image[..., 2]).all()


@pytest.mark.parametrize("change,field,words", [
    (dict(model="openpose-xl"), "control_units[0].model", "no ControlNet named 'openpose-xl' is loaded; loaded: "
                                                           "canny-xl, depth-xl"),
    (dict(module="depth_midas"), "control_units[0].module", "needs a model of its own"),
    (dict(module="openpose_full"), "control_units[0].module", "needs a model of its own"),
    (dict(module="sharpen"), "control_units[0].module", "unknown preprocessor 'sharpen'; this server runs none, canny"),
    (dict(weight=2.5), "control_units[0].weight", "between 0 and 2"),
    (dict(weight=float("nan")), "control_units[0].weight", "expected a number"),
    (dict(guidance_start=0.6, guidance_end=0.4), "control_units[0].guidance_start", "after guidance_end"),
    (dict(guidance_end=1.5), "control_units[0].guidance_end", "between 0 and 1"),
    (dict(control_mode="Prompt"), "control_units[0].control_mode", "'Balanced'"),
    (dict(resize_mode=7), "control_units[0].resize_mode", "'Crop and Resize'"),
    (dict(processor_res=32), "control_units[0].processor_res", "64..2048"),
    (dict(pixel_perfect="yes"), "control_units[0].pixel_perfect", "true or false"),
    (dict(image=np.zeros((8, 8, 3), np.float32)), "control_units[0].image", "uint8"),
    (dict(image=None), "control_units[0].image", "numpy array"),
])
def test_a_bad_unit_is_refused_naming_its_field(change, field, words):
    with pytest.raises(InvalidRequest) as err:
        validate_units([unit(**change)], LOADED, 3)
    assert err.value.field == field and words in err.value.message, err.value


def test_unit_counts_and_a_server_without_controlnets():
    with pytest.raises(InvalidRequest, match="at most 2 per request"):
        validate_units([unit(), unit(), unit()], LOADED, 2)
    with pytest.raises(InvalidRequest, match="no ControlNet is loaded on this server"):
        validate_units([unit()], [], 3)
    assert validate_units((), [], 3) == () and validate_units(None, LOADED, 3) == ()
    with pytest.raises(InvalidRequest) as err:
        validate_units(unit(), LOADED, 3)
    assert err.value.field == "control_units"
    assert isinstance(UnknownModule("f", "m"), InvalidRequest)


def test_a_controlnet_of_another_architecture_is_refused_as_not_fitting_the_model():
    """Several models: the server's ControlNets that do not fit the request's model (left out for it) are named as
    such, not "none loaded" nor "unknown"."""
    with pytest.raises(InvalidRequest) as err:
        validate_units([unit(model="cn-a")], [], 3, unfit=("cn-a", "cn-b"), model="tiny-shapes")
    assert err.value.field == "control_units" and err.value.message == (
        "no ControlNet of this server fits the model tiny-shapes: cn-a, cn-b are for another architecture; choose a "
        "model they fit, or drop the units")
    with pytest.raises(InvalidRequest) as err:  # one of them: "is"
        validate_units([unit(model="cn-a")], [], 3, unfit=("cn-a",), model="tiny-shapes")
    assert err.value.field == "control_units" and err.value.message == (
        "no ControlNet of this server fits the model tiny-shapes: cn-a is for another architecture; choose a "
        "model they fit, or drop the units")
    with pytest.raises(InvalidRequest) as err:
        validate_units([unit(model="cn-a [e3b0c442]")], LOADED, 3, unfit=("cn-a",), model="tiny-shapes")
    assert err.value.field == "control_units[0].model" and err.value.message == (
        "ControlNet 'cn-a' does not fit the model tiny-shapes (another architecture); it can run: canny-xl, depth-xl")
    (u,) = validate_units([unit()], LOADED, 3, unfit=("cn-a",), model="tiny-shapes")
    assert u.model == "canny-xl"


def test_a1111s_rule_keeps_one_step_more_at_the_end_than_diffusers():
    """hook.py: skipped when i/N < start or i/N > end; diffusers: or (i+1)/N > end. End 0.5 of 10 steps: A1111 runs
    0..5, diffusers 0..4; the start rule is the same."""
    assert [i for i in range(10) if a1111_keep(i, 10, 0.2, 0.5)] == [2, 3, 4, 5]
    assert [i for i in range(10) if diffusers_keep(i, 10, 0.2, 0.5)] == [2, 3, 4]
    assert all(a1111_keep(i, 10, 0.0, 1.0) for i in range(10))
    row = keep_row(0.0, 0.5, 3, 10, 12)  # img2img from step 3: 7 steps run, A1111 counts those
    assert row.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # j/7 <= 0.5: j = 0..3


def test_control_modes_as_hook_py():
    """Balanced: no soft scales, both halves; prompt: soft, both halves; ControlNet: soft, the prompt's half only;
    hires fix's second pass makes a canny unit soft."""
    assert mode_factors("Balanced") == (0.0, 1.0)
    assert mode_factors("My prompt is more important") == (1.0, 1.0)
    assert mode_factors("ControlNet is more important") == (1.0, 0.0)
    assert mode_factors("Balanced", "canny", hires_pass=True) == (1.0, 1.0)
    assert mode_factors("Balanced", "canny") == (0.0, 1.0)
    assert soft_scales(10) == pytest.approx([0.825 ** (12 - i) for i in range(10)])
    assert soft_scales(10)[-1] == pytest.approx(0.825**3)


def test_control_arrays_for_a_pass():
    units = validate_units([unit(weight=0.7), unit(model="depth-xl", guidance_end=0.5, control_mode=1)], LOADED, 3)
    arrays = control_arrays(units, 64, 32, 4, 0, 10, 12)
    assert arrays.images.shape == (4, 2, 32, 64, 3) and arrays.images.dtype == np.uint8
    assert arrays.weight.tolist() == pytest.approx([0.7, 1.0]) and arrays.soft.tolist() == [0, 1]
    assert arrays.uncond.tolist() == [1, 1] and arrays.keep.shape == (2, 12) and arrays.keep[1].sum() == 6
    assert arrays.models == ("canny-xl", "depth-xl")


def test_infotext_is_sd_webui_controlnets():
    """internal_controlnet/args.py serialize: its 11 fields in order, defaults written as the module's values; a
    value with commas, so the PNG writer quotes it."""
    units = validate_units([unit(module="canny", weight=0.6, guidance_end=0.8)], LOADED, 3)
    text = infotext(units, {"canny-xl": "canny-xl [a1b2c3d4]"})
    assert text == {"ControlNet 0": "Module: canny, Model: canny-xl [a1b2c3d4], Weight: 0.6, Resize Mode: Crop and "
                                    "Resize, Processor Res: 512, Threshold A: 100.0, Threshold B: 200.0, Guidance "
                                    "Start: 0.0, Guidance End: 0.8, Pixel Perfect: False, Control Mode: Balanced"}
    parsed = dict(item.split(": ") for item in text["ControlNet 0"].split(", "))  # args.py parse's split
    assert len(parsed) == 11 and json.loads(json.dumps(text["ControlNet 0"])) == text["ControlNet 0"]


def test_canny_is_opencvs_on_the_resized_image():
    """canny: the short side to processor_res (area down), edge-padded to 64, cv2.Canny(low, high), cut back; the
    map's size is the resized image's (a non-square image keeps its aspect)."""
    import cv2

    image = picture(96, 160)
    got = preprocess(image, "canny", 48, 50, 120)
    assert got.shape == (48, 80, 3) and set(np.unique(got)) <= {0, 255}
    small = cv2.resize(image, (80, 48), interpolation=cv2.INTER_AREA)
    padded = np.pad(small, [[0, 16], [0, 48], [0, 0]], mode="edge")
    assert np.array_equal(got[..., 0], cv2.Canny(padded, 50, 120)[:48, :80])
    assert np.array_equal(preprocess(image, "canny", 48), preprocess(image, "canny", 48, 100, 200))  # -1: defaults


def test_the_simple_preprocessors():
    image = picture()
    assert np.array_equal(preprocess(image, "none"), image)
    assert np.array_equal(preprocess(image, "invert"), 255 - image)
    assert np.array_equal(preprocess(image, "tile_resample", threshold_a=1.0), image)
    assert preprocess(image, "tile_resample", threshold_a=2.0).shape == (24, 40, 3)
    blurred = preprocess(image, "blur_gaussian", 48, 3.0)
    assert blurred.shape == (48, 80, 3) and blurred.std() < image.std()
    xdog = preprocess(image, "scribble_xdog", 48)
    assert xdog.shape == (48, 80, 3) and set(np.unique(xdog)) <= {0, 255} and xdog.max() == 255
    line = preprocess(image, "lineart_standard", 48)
    assert line.shape == (48, 80, 3) and line.max() > 100 and line.min() == 0
    assert set(MODULES) == {"none", "canny", "invert", "tile_resample", "blur_gaussian", "scribble_xdog",
                            "lineart_standard"}


def test_resize_modes_fit_the_requests_size():
    """Just Resize stretches; Crop and Resize covers and crops the middle; Resize and Fill fits inside and fills the
    rest with the border's median colour. A 48x80 map to 64x64 (width x height)."""
    image = picture()
    for mode in ("Just Resize", "Crop and Resize", "Resize and Fill"):
        assert fit(image, 64, 32, mode).shape == (32, 64, 3), mode
    crop = fit(image, 64, 64, "Crop and Resize")  # scaled by 64/48 to 107x64, the middle 64 columns
    assert crop.shape == (64, 64, 3)
    filled = fit(image, 64, 64, "Resize and Fill")  # scaled by 64/80 to 64x38, rows 13..51, the rest the border's
    assert (filled[:13] == np.median(np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]]), 0)
            .astype(np.uint8)).all()
    assert pixel_perfect_resolution(image, 64, 64, "Crop and Resize") == 64
    assert pixel_perfect_resolution(image, 64, 64, "Resize and Fill") == round(48 * 64 / 80)


def test_a_binary_map_stays_binary_when_resized():
    edges = preprocess(picture(), "canny", 48)
    grown = fit(edges, 120, 72, "Just Resize")
    assert set(np.unique(grown)) <= {0, 255}


def test_detect_is_a_units_preprocessing_alone():
    """/controlnet/detect's body: the module resolved, the map at processor_res; refusals as a unit's, without the
    unit's index (the route has no units)."""
    image = picture(96, 160)
    assert np.array_equal(detect(image, "canny", 64), preprocess(image, "canny", 64))
    assert np.array_equal(detect(image, "invert (from white bg & black line)"), 255 - image)
    with pytest.raises(UnknownModule, match="needs a model of its own"):
        detect(image, "depth_anything")
    with pytest.raises(InvalidRequest, match="uint8"):
        detect(image.astype(np.float32), "canny")
