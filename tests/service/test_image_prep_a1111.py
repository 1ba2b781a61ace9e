"""serving/apis/a1111_images.py: A1111's img2img image handling, each rule against an independent expectation
(A1111's own worked examples, scipy's Gaussian filter, hand-made images)."""

import numpy as np
import pytest
from PIL import Image, ImageDraw
from scipy.ndimage import gaussian_filter1d

from sdxl_engine.service import image_prep as ai
from tests.helpers import extra_fields


@pytest.mark.parametrize("strength, steps, start", [
    (0.75, 20, 4),   # t_enc 15: A1111 runs 16 steps, from step 4
    (0.75, 8, 1),    # t_enc 6: 7 steps
    (1.0, 20, 0),    # capped at 0.999: t_enc 19, every step
    (0.0, 20, 19),   # t_enc 0: one step, the last
    (0.5, 3, 1),     # t_enc 1: 2 steps
])
def test_a1111s_step_rule_runs_t_enc_plus_one_steps(strength, steps, start):
    assert ai.img2img_start_step(strength, steps) == start


def test_resize_modes_stretch_crop_and_fill_as_a1111():
    """A 100 x 50 picture to 50 x 50: just resize squeezes it; crop and resize keeps its middle 50 x 50 after
    scaling to cover (its left and right quarters gone); resize and fill scales it to fit and repeats the edge
    rows above and below."""
    image = Image.new("RGB", (100, 50), (200, 0, 0))
    ImageDraw.Draw(image).rectangle((0, 0, 24, 49), fill=(0, 0, 200))  # a blue left quarter
    just = np.asarray(ai.resize_image(0, image, 50, 50))
    crop = np.asarray(ai.resize_image(1, image, 50, 50))
    fill = np.asarray(ai.resize_image(2, image, 50, 50))
    assert just.shape == crop.shape == fill.shape == (50, 50, 3)
    assert just[25, 2, 2] > 150 and crop[25, 2, 0] > 150  # the blue quarter: squeezed in, or cut off
    assert fill[12:38, 2, 2].min() > 150 and fill[:12, 40, 0].min() > 150 and fill[38:, 40, 0].min() > 150
    assert ai.resize_image(1, Image.new("L", (100, 50), 255), 50, 50).mode == "L"


def test_binary_mask_reads_alpha_when_transparent_else_grey():
    rgba = Image.new("RGBA", (4, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 0, 129))
    rgba.putpixel((2, 0), (0, 0, 0, 128))
    assert np.asarray(ai.binary_mask(rgba)).tolist() == [[0, 255, 0, 0]]
    opaque = Image.new("RGBA", (2, 1), (255, 255, 255, 255))
    assert np.asarray(ai.binary_mask(opaque)).tolist() == [[255, 255]]


@pytest.mark.parametrize("sigma", [1, 4, 7.5])
def test_mask_blur_is_opencvs_gaussian_with_a1111s_kernel(sigma):
    """cv2.GaussianBlur with A1111's kernel size 2 * int(2.5 sigma + 0.5) + 1 and reflected borders (101) is
    scipy's gaussian_filter1d truncated at the same radius in "mirror" mode, up to one level of rounding."""
    mask = np.zeros((40, 64), np.uint8)
    mask[10:30, 20:50] = 255
    radius = int(2.5 * sigma + 0.5)
    for axis in (0, 1):
        expected = gaussian_filter1d(mask.astype(np.float64), sigma, axis=axis, mode="mirror", truncate=radius / sigma)
        got = ai.gaussian_blur_1d(mask, sigma, axis)
        assert np.abs(got.astype(float) - expected).max() <= 0.5 + 1e-9
        # the blur spreads along ``axis`` only: just outside the square on that axis > 0, across it still 0
        assert (got[20, 19] > 0 and (got[5, :] == 0).all()) if axis else (got[9, 30] > 0 and (got[:, 5] == 0).all())


def test_crop_region_and_its_expansion_as_a1111s_example():
    """A1111's docstring: a mask drawn in a 128 x 32 region, processed at 512 x 512, is expanded to 128 x 128."""
    mask = np.zeros((512, 512), np.uint8)
    mask[200:232, 100:228] = 255
    box = ai.crop_region(mask, 0)
    assert box == (100, 200, 228, 232)
    x1, y1, x2, y2 = ai.expand_crop_region(box, 512, 512, 512, 512)
    assert (x2 - x1, y2 - y1) == (128, 128) and (x1, x2) == (100, 228)
    assert ai.crop_region(mask, 16) == (84, 184, 244, 248)
    assert ai.crop_region(np.zeros((8, 8), np.uint8), 4) is None
    # at the image's edge the box slides inward and keeps its size
    edge = np.zeros((100, 100), np.uint8)
    edge[0:10, 90:100] = 255
    assert ai.expand_crop_region(ai.crop_region(edge, 0), 40, 20, 100, 100) == (80, 0, 100, 10)


def test_fill_paints_the_masked_hole_with_the_colours_around_it():
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    ImageDraw.Draw(image).rectangle((20, 20, 43, 43), fill=(0, 0, 0))
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((20, 20, 43, 43), fill=255)
    filled = np.asarray(ai.fill(image, mask)).astype(int)
    assert np.abs(filled[32, 32] - [200, 30, 30]).max() <= 2  # the hole now red, as around it
    assert np.array_equal(filled[:16], np.asarray(image)[:16])  # outside the mask: unchanged


def test_the_overlay_keeps_the_original_outside_the_mask_with_the_blurred_edge_doubled():
    """prepare's finish: where the blurred mask is 0 the original, where it is >= 128 the result, between them
    a mix with opacity 2 x mask (A1111's mask_for_overlay)."""
    init = Image.new("RGB", (64, 64), (0, 0, 0))
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((32, 0, 63, 63), fill=255)
    prepared = ai.prepare(init, mask, 64, 64, mask_blur_x=4, mask_blur_y=0, fill_mode=1)
    out = prepared.finish.apply(np.full((1, 64, 64, 3), 200, np.uint8))[0, 10, :, 0].astype(int)
    blurred = ai.gaussian_blur_1d(np.asarray(mask), 4, axis=1)[10].astype(int)
    expected = np.rint(200 * np.minimum(2 * blurred, 255) / 255)
    assert np.abs(out - expected).max() <= 1
    assert out[0] == 0 and out[63] == 200 and 0 < out[29] < 200
    assert prepared.params == {"Mask blur": "4x0", "Masked content": "original"}
    assert np.array_equal(prepared.mask[10], blurred)  # the engine gets the blurred mask (it binarizes at 128)


def test_only_masked_crops_around_the_mask_and_pastes_back_at_the_originals_size():
    init = Image.new("RGB", (128, 96), (10, 20, 30))
    mask = Image.new("L", (128, 96), 0)
    ImageDraw.Draw(mask).rectangle((70, 20, 99, 49), fill=255)  # 30 x 30
    prepared = ai.prepare(init, mask, 64, 64, mask_blur_x=0, mask_blur_y=0, full_res=True, padding=2)
    assert prepared.image.shape == (64, 64, 3) and prepared.mask.shape == (64, 64)
    # the box is the mask (30 x 30) and 2 pixels of padding around it (34 x 34), scaled to 64 x 64
    assert prepared.mask[32, 32] == 255 and prepared.mask[1, 1] == 0 and prepared.mask[62, 62] == 0
    out = prepared.finish.apply(np.full((2, 64, 64, 3), 250, np.uint8))
    assert out.shape == (2, 96, 128, 3)
    assert (out[:, 20:50, 70:100] == 250).all() and (out[:, :18] == [10, 20, 30]).all()
    assert prepared.params["Inpaint area"] == "Only masked" and prepared.params["Masked area padding"] == 2


def test_no_mask_is_a_resize_and_a_transparent_init_is_flattened_on_white():
    rgba = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    prepared = ai.prepare(rgba, None, 16, 16)
    assert prepared.mask is None and prepared.finish is None and (prepared.image == 255).all()


def test_an_inverted_mask_repaints_the_black_part():
    init = Image.new("RGB", (16, 16), (0, 0, 0))
    mask = Image.new("L", (16, 16), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 7, 15), fill=255)
    prepared = ai.prepare(init, mask, 16, 16, mask_blur_x=0, mask_blur_y=0, invert=True)
    assert prepared.mask[:, :8].max() == 0 and prepared.mask[:, 8:].min() == 255
    assert prepared.params["Mask mode"] == "Inpaint not masked"


def test_mask_round_off_sends_the_blurred_mask_soft():
    """img2img's mask_round (A1111's StableDiffusionProcessingImg2Img field, default true: the latent mask rounded)
    maps to the engine's soft_mask: false keeps the blurred mask's grey levels. The mask sent is the blurred one
    either way (grey levels along its edge)."""
    import base64
    import io
    import types

    from PIL import Image

    from sdxl_engine.serving.apis.a1111 import Img2Img, img2img_call

    def b64(image):
        out = io.BytesIO()
        image.save(out, "PNG")
        return base64.b64encode(out.getvalue()).decode()

    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    engine = types.SimpleNamespace(limits=types.SimpleNamespace(default_size=(64, 64), default_steps=4),
                                   config=types.SimpleNamespace(refiner=""))
    body = dict(prompt="x", init_images=[b64(Image.new("RGB", (64, 64), (200, 30, 30)))],
                mask=b64(Image.fromarray(mask)), mask_blur=4, inpaint_full_res=False, width=64, height=64)
    for mask_round, soft in ((True, False), (False, True)):
        call, _ = img2img_call(Img2Img(**body, mask_round=mask_round), engine)
        fields = extra_fields(call)
        assert fields["soft_mask"] is soft
        grey = fields["mask"]
        assert ((grey > 0) & (grey < 255)).any() and grey[32, 32] == 255 and grey[0, 0] == 0
    call, _ = img2img_call(Img2Img(**{**body, "mask": None}), engine)
    assert "soft_mask" not in extra_fields(call)


def test_denoising_strength_0_runs_one_step_and_says_0_as_a1111():
    """img2img at denoising_strength 0: A1111's rule runs one step (t_enc 0: the last step), so the engine gets
    start_step = steps - 1 and no strength; the PNG parameters and the info say Denoising strength 0, not null."""
    import base64
    import io
    import types

    from PIL import Image

    from sdxl_engine.serving.apis.a1111 import Img2Img, Txt2Img, img2img_call, info_record

    out = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(out, "PNG")
    engine = types.SimpleNamespace(limits=types.SimpleNamespace(default_size=(64, 64), default_steps=4),
                                   config=types.SimpleNamespace(refiner=""))
    body = Img2Img(prompt="x", init_images=[base64.b64encode(out.getvalue()).decode()], denoising_strength=0,
                   steps=4, width=64, height=64)
    call, _ = img2img_call(body, engine)
    assert call.engine.strength is None and extra_fields(call)["start_step"] == 3
    assert call.parameters["Denoising strength"] == 0
    info = {"sampler": "Euler", "prompt": "x", "negative_prompt": "", "width": 64, "height": 64, "guidance_scale": 5,
            "num_inference_steps": 4, "model": "m", "latency_s": 1.0, "warnings": [], "strength": None}
    assert info_record(body, info, [1], [""])["denoising_strength"] == 0
    assert info_record(Img2Img(**{**body.model_dump(), "denoising_strength": 0.4}), {**info, "strength": 0.4}, [1],
                       [""])["denoising_strength"] == 0.4
    assert info_record(Txt2Img(prompt="x"), {k: v for k, v in info.items() if k != "strength"}, [1],
                       [""])["denoising_strength"] is None


def _b64_png(image: Image.Image) -> str:
    import base64
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def _img2img_call(**fields):
    """img2img_call of an A1111 body (``fields`` over a prompt) on a stand-in engine of default size 64 x 64."""
    import types

    from sdxl_engine.serving.apis.a1111 import Img2Img, img2img_call

    engine = types.SimpleNamespace(limits=types.SimpleNamespace(default_size=(64, 64), default_steps=20),
                                   config=types.SimpleNamespace(refiner=""))
    return img2img_call(Img2Img(prompt="x", **fields), engine)


def _holed(width: int = 48, height: int = 32):
    """A red ``width`` x ``height`` picture with a black hole and the mask of that hole (255 = repaint)."""
    image = Image.new("RGB", (width, height), (200, 30, 30))
    ImageDraw.Draw(image).rectangle((16, 8, 31, 23), fill=(0, 0, 0))
    mask = Image.new("L", (width, height), 0)
    ImageDraw.Draw(mask).rectangle((16, 8, 31, 23), fill=255)
    return image, mask


@pytest.mark.parametrize("mode, name", [(0, "fill"), (2, "latent noise"), (3, "latent nothing")])
def test_inpainting_fill_2_and_3_pre_fill_the_hole_as_0_does(mode, name):
    """A1111's inpainting_fill 2 (latent noise) and 3 (latent nothing) run as 0 (fill) here, as their warning says:
    the masked area is painted with the colours around it (masking.fill), the image the engine gets is exactly fill
    0's; 1 (original) keeps the hole black. Non-square: 48 x 32."""
    image, mask = _holed()
    prepared = ai.prepare(image, mask, 48, 32, mask_blur_x=0, mask_blur_y=0, fill_mode=mode)
    expected = np.asarray(ai.fill(image, mask))
    assert prepared.image.shape == (32, 48, 3) and np.array_equal(prepared.image, expected)
    assert np.abs(prepared.image[16, 24].astype(int) - [200, 30, 30]).max() <= 2  # the hole red, as around it
    assert prepared.params["Masked content"] == name
    original = ai.prepare(image, mask, 48, 32, mask_blur_x=0, mask_blur_y=0, fill_mode=1)
    assert (original.image[8:24, 16:32] == 0).all() and original.params["Masked content"] == "original"
    # through A1111's route: the image field is the filled one, and 2 and 3 say they ran as 0
    call, warnings = _img2img_call(init_images=[_b64_png(image)], mask=_b64_png(mask), inpainting_fill=mode,
                                   mask_blur=0, inpaint_full_res=False, width=48, height=32)
    assert np.array_equal(extra_fields(call)["image"], expected)
    said = [w for w in warnings if w.startswith("inpainting_fill=")]
    assert said == ([] if mode == 0 else [f"inpainting_fill={mode} ({name}) runs as 0 (fill) here: the masked area "
                                         "is pre-filled with the colours around it, and its latents are not replaced"])


def test_mask_blur_x_blurs_along_x_and_mask_blur_y_along_y():
    """An asymmetric blur (x 6, y 1) on a non-square mask (64 x 40): A1111's mask_blur_x spreads the mask's edge
    along a row (cv2.GaussianBlur's kernel width), mask_blur_y along a column. Kernel radii int(2.5 sigma + 0.5):
    15 pixels for 6, 3 for 1. prepare and the A1111 route (mask_blur_x / mask_blur_y; mask_blur sets both)."""
    image = Image.new("RGB", (64, 40), (10, 20, 30))
    mask = Image.new("L", (64, 40), 0)
    ImageDraw.Draw(mask).rectangle((24, 12, 39, 27), fill=255)  # columns 24-39, rows 12-27
    m = np.asarray(mask)
    expected = ai.gaussian_blur_1d(ai.gaussian_blur_1d(m, 6, axis=1), 1, axis=0)
    prepared = ai.prepare(image, mask, 64, 40, mask_blur_x=6, mask_blur_y=1, fill_mode=1)
    assert prepared.mask.shape == (40, 64) and np.array_equal(prepared.mask, expected)
    assert prepared.params["Mask blur"] == "6x1"
    row, column = prepared.mask[20], prepared.mask[:, 32]
    assert row[14] > 0 and row[10] > 0 and row[8] == 0  # x: 10 pixels left of the edge still reached (radius 15)
    assert column[9] > 0 and column[6] == 0 and column[4] == 0  # y: 3 pixels above the edge at most
    for fields in (dict(mask_blur_x=6, mask_blur_y=1), dict(mask_blur_x=6, mask_blur_y=1, mask_blur=None)):
        call, _ = _img2img_call(init_images=[_b64_png(image)], mask=_b64_png(mask), inpainting_fill=1,
                                inpaint_full_res=False, width=64, height=40, **fields)
        assert np.array_equal(extra_fields(call)["mask"], expected)
        assert call.parameters["Mask blur"] == "6x1"
    call, _ = _img2img_call(init_images=[_b64_png(image)], mask=_b64_png(mask), inpainting_fill=1, mask_blur=2,
                            mask_blur_x=6, mask_blur_y=1, inpaint_full_res=False, width=64, height=40)
    both = ai.gaussian_blur_1d(ai.gaussian_blur_1d(m, 2, axis=1), 2, axis=0)
    assert np.array_equal(extra_fields(call)["mask"], both) and call.parameters["Mask blur"] == "2"


def test_the_default_denoising_strength_is_a1111s_0_75():
    """img2img without denoising_strength: A1111's default 0.75, run by its step rule (20 steps: t_enc 15, from
    step 4); the engine gets strength 0.75."""
    call, _ = _img2img_call(init_images=[_b64_png(Image.new("RGB", (64, 64), (1, 2, 3)))], steps=20, width=64,
                            height=64)
    assert extra_fields(call)["strength"] == 0.75 and extra_fields(call)["start_step"] == 4


def test_an_init_image_or_mask_over_the_per_image_limit_is_refused_naming_it():
    """A valid PNG padded to MAX_IMAGE_BYTES + 1 bytes (22.4 MB of base64: under img2img's 48 MB body cap, and within
    the base64 text's own bound) is refused by the per-image bound, naming ``init_images[0]`` or ``mask``; one byte
    shorter it is the engine's image."""
    import base64
    import io

    from sdxl_engine.serving.apis.core import ApiError
    from sdxl_engine.serving.guard import MAX_IMAGE_BODY_BYTES, MAX_IMAGE_BYTES

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 90, 90)).save(out, "PNG")
    over = out.getvalue() + b"\0" * (MAX_IMAGE_BYTES + 1 - len(out.getvalue()))
    text = base64.b64encode(over).decode()
    assert 2 * len(text) < MAX_IMAGE_BODY_BYTES
    small = _b64_png(Image.new("RGB", (64, 48), (90, 90, 90)))
    for fields, field in (({"init_images": [text]}, "init_images[0]"),
                          ({"init_images": [small], "mask": text}, "mask")):
        with pytest.raises(ApiError) as err:
            _img2img_call(**fields, width=64, height=48)
        assert (err.value.status, err.value.param, err.value.message) == (
            400, field, f"{field}: the image is over 16 MiB")
    call, _ = _img2img_call(init_images=[base64.b64encode(over[:MAX_IMAGE_BYTES]).decode()], width=64, height=48)
    assert extra_fields(call)["image"].shape == (48, 64, 3) and (extra_fields(call)["image"] == 90).all()


def test_img2img_for_another_model_takes_its_own_steps_and_size_for_the_fields_not_sent():
    """override_settings.sd_model_checkpoint names a model whose own defaults differ from the server's default model
    (8 steps, 96 x 64 against 20 steps, 64 x 64): A1111's step rule runs on its 8 steps (0.75: from step 1; on the
    default's 20 it would start at 4), before it is loaded too (its engine_defaults.json), and the picture is
    prepared at its size once it is loaded."""
    import types

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.validation import Limits
    from sdxl_engine.serving.apis.a1111 import Img2Img, img2img_call

    default = Limits(max_seed=2**31 - 1, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=20,
                     default_guidance=5.0)
    other = types.SimpleNamespace(default_size=(96, 64), default_steps=8)

    class Engine:
        limits, config, default_model, loaded = default, types.SimpleNamespace(refiner=""), "a", {"a": default}

        def model_names(self):
            return ["a", "b"]

        def find_model(self, text):
            return text if text in ("a", "b") else None

        def limits_for(self, name):
            return self.loaded.get(name)

        def defaults_for(self, name):
            return EngineConfig(num_inference_steps={"a": 20, "b": 8}[name])

    engine = Engine()
    body = dict(prompt="x", init_images=[_b64_png(Image.new("RGB", (48, 32), (1, 2, 3)))])
    for loaded in (False, True):
        if loaded:
            engine.loaded["b"] = other
        call, _ = img2img_call(Img2Img(**body, override_settings={"sd_model_checkpoint": "b"}), engine)
        fields = extra_fields(call)
        assert call.engine.model == "b" and fields["start_step"] == ai.img2img_start_step(0.75, 8) == 1
        assert call.engine.num_inference_steps is None  # the engine runs the model's own 8
        assert (call.engine.width, call.engine.height) == ((96, 64) if loaded else (64, 64))
    call, _ = img2img_call(Img2Img(**body), engine)  # the default model: its own 20
    assert call.engine.model is None and extra_fields(call)["start_step"] == 4


def test_a_size_the_model_cannot_make_names_width_or_height_not_the_init_image():
    """img2img resizes the init image to width x height (prepare), so a size the model does not make is the
    request's width or height (A1111's 422), not init_images (the engine's word for the image it was sent)."""
    import types

    from sdxl_engine.engine.validation import Limits
    from sdxl_engine.serving.apis.a1111 import Img2Img, img2img_call
    from sdxl_engine.serving.apis.core import ApiError

    limits = Limits(max_seed=100, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=4,
                    default_guidance=5.0, multiple=16, max_pixels=128 * 128)
    engine = types.SimpleNamespace(limits=limits, config=types.SimpleNamespace(refiner=""))
    import base64
    import io

    out = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 90, 90)).save(out, "PNG")
    init = base64.b64encode(out.getvalue()).decode()
    for width, height, field in ((72, 64, "width"), (64, 40, "height"), (144, 128, "width/height")):
        with pytest.raises(ApiError) as refused:
            img2img_call(Img2Img(prompt="x", init_images=[init], width=width, height=height), engine)
        assert (refused.value.status, refused.value.param) == (422, field)
        assert refused.value.message.startswith(f"{field}: "), refused.value.message
    call, _ = img2img_call(Img2Img(prompt="x", init_images=[init], width=80, height=48), engine)
    assert call.engine.image.shape == (48, 80, 3)
