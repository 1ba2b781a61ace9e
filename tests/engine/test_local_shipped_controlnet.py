"""tiny-shapes' shipped canny ControlNet (assets/tiny-shapes/controlnet-canny, tools/train_controlnet.py): loaded
beside the model by default, and it does what a ControlNet is for: the shape lands where the outline is drawn."""

import numpy as np
import pytest

from sdxl_engine.engine.control import ControlUnit
from sdxl_engine.engine.validation import GenerateRequest
from tools import shapes
from tools.evaluate_controlnet import centroid_and_area

NAME = "tiny-shapes-canny"
# Held-out (colour, shape, position) combinations, one per side (never drawn in the model's or the ControlNet's
# training); the prompt names neither position nor size.
CASES = (("red", "star", "left"), ("orange", "cross", "top"), ("yellow", "circle", "right"),
         ("green", "triangle", "bottom"))


@pytest.mark.engine
def test_the_shipped_controlnet_is_loaded_beside_tiny_shapes(tiny_shapes_engine):
    assert NAME in tiny_shapes_engine.controlnets
    assert NAME in dict(tiny_shapes_engine.limits.controlnets)


@pytest.mark.engine
def test_the_shape_lands_where_the_outline_is(tiny_shapes_engine):
    """Per held-out outline (canny by the engine, as a client's picture is), 4 seeds with the unit and the same 4
    without: with it the shape's centroid is within a few pixels of the outline's and at its anchor; without it
    the prompt says nothing of where, and the centroid is far off on average."""
    errors = {True: [], False: []}
    at_anchor = []
    for colour, shape, position in CASES:
        outline = shapes.render(shapes.Attributes(shape, colour, "white", position, "large"))
        target, _ = centroid_and_area(outline)
        for control in (True, False):
            units = (ControlUnit(image=outline, model=NAME, module="canny"),) if control else ()
            request = GenerateRequest(f"a {colour} {shape} on a white background", seed=0, control_units=units)
            for image in tiny_shapes_engine.generate(request).images:
                centre, _ = centroid_and_area(image)
                errors[control].append(np.hypot(centre[0] - target[0], centre[1] - target[1]))
                if control:
                    at_anchor.append(shapes.analyse(image)["position"] == position)
    with_unit, without = float(np.mean(errors[True])), float(np.mean(errors[False]))
    assert with_unit < 0.5 * without, (with_unit, without)
    assert np.mean(at_anchor) >= 0.75, at_anchor
