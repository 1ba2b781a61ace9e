"""engine/validation.py's image-to-image fields, without an engine: the image's size, strength's rule, start_step."""

import numpy as np
import pytest

from sdxl_engine.engine.validation import DEFAULT_STRENGTH, GenerateRequest, InvalidRequest, Limits, validate

LIMITS = Limits(max_seed=2**32 - 5, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=20,
                default_guidance=5.0, multiple=8, max_pixels=128 * 128, batch=4)


def picture(height=64, width=64, k=0) -> np.ndarray:
    return np.full((height, width, 3), k, np.uint8)


def check(**kw) -> GenerateRequest:
    return validate(GenerateRequest("a red circle", seed=1, **kw), LIMITS)


def test_without_an_image_nothing_changes():
    request = check()
    assert request.image is None and request.strength is None and request.start_step is None
    assert (request.width, request.height) == (64, 64)


def test_one_image_serves_every_image_and_sets_the_size():
    request = check(image=picture(48, 80, 7), num_inference_steps=20)
    assert request.image.shape == (4, 48, 80, 3) and request.image.dtype == np.uint8
    assert (request.width, request.height) == (80, 48)  # the image's own size: width/height were not given
    assert request.strength == DEFAULT_STRENGTH and request.start_step == 20 - int(20 * DEFAULT_STRENGTH)


def test_a_list_gives_each_image_its_own():
    request = check(image=[picture(k=k) for k in range(4)], width=64, height=0, strength=0.5, num_inference_steps=10)
    assert [int(i[0, 0, 0]) for i in request.image] == [0, 1, 2, 3]
    assert request.start_step == 5


def test_start_step_wins_over_strength():
    request = check(image=picture(), strength=0.3, start_step=2, num_inference_steps=10)
    assert request.start_step == 2 and request.strength == 0.3


@pytest.mark.parametrize("kw, field, words", [
    (dict(image=picture(), strength=0), "strength", "above 0"),
    (dict(image=picture(), strength=1.01), "strength", "between 0 and 1"),
    (dict(image=picture(), strength=float("nan")), "strength", "finite"),
    (dict(image=picture(), strength="half"), "strength", "expected a number"),
    (dict(image=picture(), strength=True), "strength", "expected a number"),
    (dict(image=picture(), strength=0.04, num_inference_steps=20), "strength", "= 0 steps"),
    (dict(strength=0.5), "strength", "image to image only"),
    (dict(start_step=1), "start_step", "image to image only"),
    (dict(image=picture(), start_step=20, num_inference_steps=20), "start_step", "between 0 and 19"),
    (dict(image=picture().astype(np.float32)), "image", "uint8"),
    (dict(image=picture()[..., :1]), "image", "(height, width, 3)"),
    (dict(image=picture()[0]), "image", "(height, width, 3)"),
    (dict(image="a.png"), "image", "numpy array"),
    (dict(image=[picture()] * 3), "image", "3 images"),
    (dict(image=[picture(), picture(56, 64), picture(), picture()]), "image", "differ in size"),
    (dict(image=picture(), width=72), "image", "request's width is 72"),
    (dict(image=picture(60, 64)), "image", "not a multiple of 8"),
    (dict(image=picture(136, 136)), "image", "max_pixels"),
])
def test_refusals_name_the_field(kw, field, words):
    with pytest.raises(InvalidRequest) as err:
        check(**kw)
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_a_mask_value_of_exactly_one_half_repaints():
    """diffusers' VaeImageProcessor.binarize: ``mask[mask < 0.5] = 0; mask[mask >= 0.5] = 1``, so a float 0.5 is
    repaint (1); just below it is keep. In uint8, 128 (0.502) repaints and 127 (0.498) keeps. A non-square mask, so
    the columns are not the rows."""
    from sdxl_engine.engine.validation import as_masks

    images = np.zeros((2, 8, 16, 3), np.uint8)  # 16 wide, 8 high
    soft = np.zeros((8, 16), np.float32)
    soft[:, 4] = 0.5
    soft[:, 5] = np.nextafter(np.float32(0.5), np.float32(0))  # the largest float32 below 0.5
    soft[2, 10] = 0.5
    got = as_masks(soft, images, 2)
    expected = np.zeros((8, 16), np.float32)
    expected[:, 4] = 1
    expected[2, 10] = 1
    assert got.shape == (2, 8, 16) and np.array_equal(got[0], expected) and np.array_equal(got[1], expected)
    levels = np.zeros((8, 16), np.uint8)
    levels[:, 0], levels[:, 1], levels[:, 2] = 127, 128, 255
    assert as_masks(levels, images, 2)[0, 0, :4].tolist() == [0.0, 1.0, 1.0, 0.0]
    # through validate: the request's mask is the binarized one, one per image
    request = check(image=picture(8, 16), mask=soft, num_inference_steps=20)
    assert request.mask.shape == (4, 8, 16) and np.array_equal(request.mask[3], expected)


def test_the_default_img2img_strength_is_a1111s_0_75():
    """The default strength is A1111's img2img default denoising_strength, 0.75 (validation.DEFAULT_STRENGTH's
    comment says so), not diffusers' StableDiffusionXLImg2ImgPipeline default (0.3): 20 steps start at step
    20 - int(20 x 0.75) = 5 and run 15."""
    assert DEFAULT_STRENGTH == 0.75
    request = check(image=picture(48, 80), num_inference_steps=20)
    assert request.strength == 0.75 and request.start_step == 5
    request = check(image=picture(48, 80), num_inference_steps=10)
    assert request.strength == 0.75 and request.start_step == 3  # int(7.5) = 7 steps run


def test_hires_size_is_width_by_height_each_cut_as_a1111_then_to_the_multiple():
    """validation.hires_size: (int(width x scale), int(height x scale)), each down to the multiple; non-square so
    the order shows."""
    from sdxl_engine.engine.validation import hires_size

    assert hires_size(64, 48, 2, 8) == (128, 96)
    assert hires_size(48, 64, 2, 8) == (96, 128)
    assert hires_size(64, 48, 1.5, 16) == (96, 64)  # 72 -> 64
    assert hires_size(100, 60, 1.25, 8) == (120, 72)  # int(125.0) = 125 -> 120, int(75.0) = 75 -> 72
    assert hires_size(64, 40, 1.99, 8) == (120, 72)  # int(127.36) = 127 -> 120, int(79.6) = 79 -> 72


def test_a_hires_size_the_server_does_not_make_is_named_width_by_height():
    limits = Limits(max_seed=10, max_steps=50, sizes=((64, 48),), default_size=(64, 48), default_steps=10,
                    default_guidance=5.0, multiple=8, max_pixels=128 * 80)
    assert validate(GenerateRequest("a", width=64, height=40, hires_scale=2), limits).hires_scale == 2
    with pytest.raises(InvalidRequest) as err:
        validate(GenerateRequest("a", width=64, height=48, hires_scale=2), limits)
    assert err.value.field == "hires_scale" and str(err.value).startswith(
        "hires_scale: 2 x 64x48 = 128x96, which this server does not make: 128x96 is 12288 pixels")


@pytest.mark.parametrize("field, value, message", [
    ("sampler", 5, "sampler: expected a sampler's name (text), got int 5"),
    ("sampler", ["Euler"], "sampler: expected a sampler's name (text), got list ['Euler']"),
    ("hires_sampler", 2.5, "hires_sampler: expected a sampler's name (text), got float 2.5"),
    ("model", 5, "model: expected a model's name (text), got int 5"),
])
def test_a_sampler_or_model_of_the_wrong_type_is_named_as_such_not_as_an_unknown_name(field, value, message):
    extra = {"hires_scale": 1.5} if field == "hires_sampler" else {}
    with pytest.raises(InvalidRequest) as err:
        validate(GenerateRequest(prompt="x", **{field: value}, **extra), LIMITS)
    assert str(err.value) == message


@pytest.mark.parametrize("sampler, schedule_type, expected", [
    ("DPM++ SDE Karras", None, ("DPM++ SDE", "karras")),  # A1111's older combined names, on every front
    ("euler a  exponential", "automatic", ("Euler a", "exponential")),
    ("LMS Karras", "Karras", ("LMS", "karras")),  # the same type twice is fine
    ("DPM++ 2M SDE SGMUniform", None, ("DPM++ 2M SDE", "sgm_uniform")),  # A1111's alias
    ("DPM++ 2M Karras", None, ("DPM++ 2M Karras", "automatic")),  # a sampler of its own here: not split
    ("Euler", "trailing", ("Euler", "trailing")),
])
def test_a_sampler_name_carrying_a_schedule_type_is_split_as_a1111_splits_it(sampler, schedule_type, expected):
    checked = validate(GenerateRequest("p", sampler=sampler, schedule_type=schedule_type), LIMITS)
    assert (checked.sampler, checked.schedule_type) == expected


def test_a_combined_sampler_name_and_another_schedule_type_are_refused_naming_both():
    with pytest.raises(InvalidRequest) as err:
        validate(GenerateRequest("p", sampler="DPM++ SDE Karras", schedule_type="exponential"), LIMITS)
    assert err.value.field == "schedule_type"
    assert "'DPM++ SDE Karras' names the schedule type 'karras'" in err.value.message
    assert "asks for 'exponential'" in err.value.message
    with pytest.raises(InvalidRequest) as err:  # no sampler before the label: the name as given is unknown
        validate(GenerateRequest("p", sampler="DPM adaptive Karras"), LIMITS)
    assert err.value.field == "sampler"
    assert err.value.message.startswith("unknown sampler 'DPM adaptive Karras'; choose")


@pytest.mark.parametrize("eta, expected", [(None, None), (0, 0.0), (1, 1.0), (0.35, 0.35), ("0.5", 0.5)])
def test_eta_is_a_number_from_0_to_1_or_none(eta, expected):
    """A1111's ``eta`` (its sliders: 0 to 1); None = each sampler's default. Kept for any sampler (those without an
    eta ignore it, as A1111's do)."""
    checked = validate(GenerateRequest("p", sampler="Euler", eta=eta), LIMITS)
    assert checked.eta == expected and (expected is None or type(checked.eta) is float)


@pytest.mark.parametrize("eta, message", [(1.5, "must be between 0 and 1, got 1.5"), (-0.01, "must be between 0"),
                                          (1.0000001, "must be between 0 and 1, got 1.0000001"),  # not "got 1"
                                          (float("nan"), "must be a finite number"), (True, "expected a number"),
                                          ("x", "expected a number")])
def test_eta_outside_0_to_1_is_refused_naming_eta(eta, message):
    with pytest.raises(InvalidRequest) as err:
        validate(GenerateRequest("p", sampler="DDIM", eta=eta), LIMITS)
    assert err.value.field == "eta" and message in err.value.message
