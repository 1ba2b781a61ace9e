"""engine/control.py's ControlNet-Union units: the control type per image, several images in one unit, their
refusals by field, the arrays (each image's type) and the infotext (host code: no program runs here)."""

import numpy as np
import pytest

from sdxl_engine.engine.control import ControlUnit, control_arrays, infotext, unit_images, validate_units
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.validation import GenerateRequest, Limits, validate

LOADED = ["canny-xl", "union", "union6"]
UNIONS = {"union": 8, "union6": 6}


def picture(h=48, w=80, shade=200) -> np.ndarray:
    """A non-square picture with a dark disc off-centre."""
    y, x = np.mgrid[0:h, 0:w]
    image = np.full((h, w, 3), shade, np.uint8)
    image[(x - w * 0.3) ** 2 + (y - h * 0.4) ** 2 < (h * 0.25) ** 2] = (20, 30, 40)
    return image


def check(*units):
    return validate_units(list(units), LOADED, 3, unions=UNIONS)


def test_a_union_units_types_are_the_extensions_or_diffusers_names_or_indices():
    """Names (any case: sd-webui-controlnet's, diffusers' TASKNAME2ID and ProMax's tile/repaint) and indices become
    indices; several images carry one type each; a plain ControlNet's unit keeps none."""
    (one,) = check(ControlUnit(image=picture(), model="union", control_type=" Lineart"))
    assert one.control_type == (3,) and one.image.shape == (48, 80, 3)
    (two,) = check(ControlUnit(image=[picture(), picture(shade=90)], model="union", control_type=["depth", 6]))
    assert two.control_type == (1, 6) and len(two.images) == 2
    for name, index in (("openpose", 0), ("hed", 2), ("scribble", 2), ("mlsd", 3), ("normal", 4), ("segment", 5),
                        ("repaint", 7)):
        assert check(ControlUnit(image=picture(), model="union", control_type=name))[0].control_type == (index,)
    for name, index in (("OpenPose", 0), ("soft edge", 2), ("Hard Edge", 3), ("Normal Map", 4),
                        ("Segmentation", 5), ("Tile", 6), ("inpaint", 7)):  # sd-webui-controlnet's names
        assert check(ControlUnit(image=picture(), model="union", control_type=name))[0].control_type == (index,)
    # an index as text: the page's, gradio_client's and MCP's control_type is a string (the refusal offers 0..7)
    assert check(ControlUnit(image=picture(), model="union", control_type=" 3"))[0].control_type == (3,)
    (plain,) = check(ControlUnit(image=picture(), model="canny-xl"))
    assert plain.control_type is None and len(plain.images) == 1


@pytest.mark.parametrize("unit,field,words", [
    (dict(model="union"), "control_units[0].control_type", "needs a control type"),
    (dict(model="union", control_type=""), "control_units[0].control_type", "one of OpenPose, Depth, Soft Edge"),
    (dict(model="union", control_type="pose"), "control_units[0].control_type", "unknown control type 'pose'"),
    (dict(model="union6", control_type="tile"), "control_units[0].control_type", "ProMax"),
    (dict(model="union", control_type=8), "control_units[0].control_type", "has 8 types"),
    (dict(model="union", control_type="8"), "control_units[0].control_type", "has 8 types"),
    (dict(model="union", control_type="-1"), "control_units[0].control_type", "unknown control type '-1'"),
    (dict(model="union", control_type=True), "control_units[0].control_type", "unknown"),
    (dict(model="union", control_type=["depth", "canny"]), "control_units[0].control_type", "2 control types for 1"),
    (dict(model="union", image=[picture()] * 5, control_type=[1] * 5), "control_units[0].image", "1..4"),
    (dict(model="union", image=[picture(), "x"], control_type=[1, 3]), "control_units[0].image[1]", "numpy"),
    (dict(model="canny-xl", control_type="canny"), "control_units[0].control_type", "not a ControlNet-Union"),
    (dict(model="canny-xl", image=[picture(), picture()]), "control_units[0].image", "takes one"),
])
def test_a_bad_union_unit_is_refused_naming_its_field(unit, field, words):
    with pytest.raises(InvalidRequest) as err:
        check(ControlUnit(**{"image": picture(), **unit}))
    assert err.value.field == field and words in err.value.message, err.value


def test_the_arrays_hold_each_images_type_in_unit_order():
    """A plain unit, then a two-image union unit: images and types in that order (a plain unit's type 0), one
    weight per unit; the program's image counts (1, 2); () when each unit has one image."""
    units = check(ControlUnit(image=picture(), model="canny-xl", weight=0.5),
                  ControlUnit(image=(picture(), picture(shade=90)), model="union", control_type=("depth", "canny"),
                              weight=0.7))
    arrays = control_arrays(units, 64, 32, 2, 0, 10, 12)
    assert arrays.images.shape == (2, 3, 32, 64, 3)
    assert arrays.types.tolist() == [0, 1, 3] and arrays.weight.tolist() == pytest.approx([0.5, 0.7])
    assert not np.array_equal(arrays.images[0, 1], arrays.images[0, 2])
    assert unit_images(units) == (1, 2) and unit_images(units[:1]) == ()
    assert arrays.inputs()["types"].dtype == np.int32


def test_the_infotext_names_a_union_units_types():
    units = check(ControlUnit(image=(picture(), picture()), model="union", control_type=("lineart", 1)))
    assert infotext(units, {"union": "union [e3b0c442]"})["ControlNet 0"].endswith(
        "Control Mode: Balanced, Union Control Type: Hard Edge + Depth")


def test_a_request_reads_the_unions_from_its_limits():
    """validate: Limits.controlnet_unions says which loaded ControlNets are unions (their units need a type)."""
    limits = Limits(max_seed=100, max_steps=50, sizes=((64, 64),), default_size=(64, 64), default_steps=8,
                    default_guidance=5.0, controlnets=(("union", "e3b0c442"), ("canny-xl", "e3b0c442")),
                    controlnet_unions=(("union", 8),))
    unit = ControlUnit(image=picture(64, 64), model="union", control_type="depth")
    assert validate(GenerateRequest("a", control_units=[unit]), limits).control_units[0].control_type == (1,)
    with pytest.raises(InvalidRequest, match="control_units.0..control_type"):
        validate(GenerateRequest("a", control_units=[ControlUnit(image=picture(64, 64), model="union")]), limits)
