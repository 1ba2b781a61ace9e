"""engine/ip_adapter.py: IPAdapterUnit's validation (each refusal names its field), the step rule and the arrays a
program takes (tokens per unit, once per request; split back for hires fix's second pass). Compiles no program."""

import json

import numpy as np
import pytest

from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.engine.ip_adapter import IPAdapterUnit, ip_arrays, validate_ip_units
from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-ip-adapter"
PICTURE = np.zeros((48, 64, 3), np.uint8)


@pytest.mark.parametrize("units,field,text", [
    ([IPAdapterUnit(image=PICTURE, model="other")], "ip_adapter_units[0].model", "loaded: ip-a, ip-b"),
    ([IPAdapterUnit(image=PICTURE, model="ip-a"), IPAdapterUnit(image="x", model="ip-b")],
     "ip_adapter_units[1].image", "numpy array"),
    ([IPAdapterUnit(image=(PICTURE, np.zeros((4, 4), np.float32)), model="ip-a")], "ip_adapter_units[0].image[1]",
     "uint8"),
    ([IPAdapterUnit(image=(PICTURE,) * 5, model="ip-a")], "ip_adapter_units[0].image", "1 .. 4"),
    ([IPAdapterUnit(image=PICTURE, model="ip-a", weight=2.5)], "ip_adapter_units[0].weight", "between 0 and 2"),
    ([IPAdapterUnit(image=PICTURE, model="ip-a", guidance_start=0.6, guidance_end=0.5)],
     "ip_adapter_units[0].guidance_start", "after guidance_end"),
    ([IPAdapterUnit(image=PICTURE, model="ip-a")] * 3, "ip_adapter_units", "at most 2"),
    (IPAdapterUnit(image=PICTURE, model="ip-a"), "ip_adapter_units", "a list"),
    (["ip-a"], "ip_adapter_units[0]", "IPAdapterUnit"),
])
def test_refusals_name_the_field(units, field, text):
    with pytest.raises(InvalidRequest) as err:
        validate_ip_units(units, ["ip-a", "ip-b"], 2)
    assert err.value.field == field and text in err.value.message, err.value


def test_none_loaded_is_refused_and_valid_units_are_normalised():
    with pytest.raises(InvalidRequest, match="--ip-adapter PATH") as err:
        validate_ip_units([IPAdapterUnit(image=PICTURE, model="x")], [], 2)
    assert err.value.field == "ip_adapter_units"
    grey = np.full((10, 20), 7, np.uint8)
    (unit,) = validate_ip_units([IPAdapterUnit(image=[PICTURE, grey], model="ip-b [1a2b3c4d]", weight=1)],
                                ["ip-a", "ip-b"], 2)
    assert unit.model == "ip-b" and unit.weight == 1.0 and isinstance(unit.weight, float)
    assert [i.shape for i in unit.images] == [(48, 64, 3), (10, 20, 3)]
    assert validate_ip_units(None, [], 2) == ()


def test_arrays_concatenate_units_keep_the_a1111_rule_and_split_back():
    """Two units (one image, two images): tokens (2, 4 + 8, 80) in order, the scales, keep rows by A1111's rule
    over the steps that run (img2img from step 2), and split() gives each unit's tokens back (hires fix)."""
    from sdxl_engine.checkpoint.ip_adapter import load_ip_adapter
    from sdxl_engine.models import UNetConfig

    unet = UNetConfig.from_dict(json.loads((FIXTURES / "tiny-pt" / "unet" / "config.json").read_text()))
    adapter = load_ip_adapter("ip", FOLDER / "sdxl_models" / "ip-adapter_sdxl.safetensors", "float32", unet,
                              log=lambda _: None)
    with np.load(FOLDER / "reference.npz") as data:
        pictures = data["pictures"]
    units = validate_ip_units([IPAdapterUnit(image=pictures[0], model="ip", weight=0.5, guidance_end=0.5),
                               IPAdapterUnit(image=[pictures[1], pictures[0]], model="ip", guidance_start=0.25)],
                              ["ip"], 2)
    arrays = ip_arrays(units, {"ip": adapter}, 2, 10, 12)
    assert arrays.tokens.shape == (2, 12, 80) and arrays.counts == (4, 8) and arrays.models == ("ip", "ip")
    assert arrays.scale.tolist() == [0.5, 1.0]
    assert arrays.keep.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]
    first, second = arrays.split()
    np.testing.assert_array_equal(first, arrays.tokens[:, :4])
    np.testing.assert_array_equal(second, arrays.tokens[:, 4:])
    np.testing.assert_allclose(arrays.tokens[1, :4], arrays.tokens[1, 8:], atol=1e-6)  # picture 0 in both units
    assert np.abs(arrays.tokens[1, :4] - arrays.tokens[1, 4:8]).max() > 0.1  # picture 1: other tokens
    np.testing.assert_allclose(arrays.tokens[0, :4], arrays.tokens[0, 4:8], atol=1e-6)  # negatives: zeros projected
    again = ip_arrays(units, {"ip": adapter}, 0, 10, 12, tokens=arrays.split())
    np.testing.assert_array_equal(again.tokens, arrays.tokens)



def test_the_infotext_writes_each_unit_as_sd_webui_controlnet_does_numbered_after_the_controlnet_units():
    """Issue #60: an IP-Adapter unit's infotext entry is an A1111 ControlNet unit's ("ControlNet N", after the
    request's ControlNet units): the module ip-adapter-auto picks by the model's name (ViT-H's or bigG's), the
    model "name [hash]", the weight and the guidance share. A1111's parse of it: tests/serving/test_page.py."""
    from sdxl_engine.engine.ip_adapter import infotext

    units = [IPAdapterUnit(image=PICTURE, model="ip-adapter_sdxl", weight=0.6, guidance_end=0.8),
             IPAdapterUnit(image=PICTURE, model="ip-adapter-plus_sdxl_vit-h", guidance_start=0.25)]
    titles = {"ip-adapter_sdxl": "ip-adapter_sdxl [0a1b2c3d]"}
    entries = infotext(units, titles, first=1)
    assert list(entries) == ["ControlNet 1", "ControlNet 2"]
    assert entries["ControlNet 1"] == (
        "Module: ip-adapter_clip_sdxl, Model: ip-adapter_sdxl [0a1b2c3d], Weight: 0.6, Resize Mode: Crop and Resize, "
        "Processor Res: 512, Threshold A: -1.0, Threshold B: -1.0, Guidance Start: 0.0, Guidance End: 0.8, "
        "Pixel Perfect: False, Control Mode: Balanced")
    assert entries["ControlNet 2"].startswith("Module: ip-adapter_clip_sdxl_plus_vith, Model: "
                                              "ip-adapter-plus_sdxl_vit-h, Weight: 1.0,")
    assert "Guidance Start: 0.25, Guidance End: 1.0" in entries["ControlNet 2"]
    assert infotext([], titles) == {}


EMBED = [0.125] * 8  # a FaceID adapter "face" of width 8 in these validation tests (h94's: 512)


@pytest.mark.parametrize("unit,field,text", [
    (IPAdapterUnit(model="face"), "ip_adapter_units[0].embeds", "send the face's embedding (8 floats"),
    (IPAdapterUnit(image=PICTURE, model="face"), "ip_adapter_units[0].image", "takes no image"),
    (IPAdapterUnit(image=PICTURE, embeds=EMBED, model="face"), "ip_adapter_units[0].image", "takes no image"),
    (IPAdapterUnit(embeds=EMBED, model="ip-a"), "ip_adapter_units[0].embeds", "not face embeddings"),
    (IPAdapterUnit(model="ip-a"), "ip_adapter_units[0].image", "send one"),
    (IPAdapterUnit(embeds=EMBED[:7], model="face"), "ip_adapter_units[0].embeds", "has 7 values; this IP-Adapter "
                                                                                   "takes 8-d"),
    (IPAdapterUnit(embeds=[EMBED, EMBED[:3]], model="face"), "ip_adapter_units[0].embeds[1]", "has 3 values"),
    (IPAdapterUnit(embeds=[*EMBED[:7], float("nan")], model="face"), "ip_adapter_units[0].embeds", "value 7 is not "
                                                                                                  "finite"),
    (IPAdapterUnit(embeds=np.full((2, 8), np.inf), model="face"), "ip_adapter_units[0].embeds[0]", "not finite"),
    (IPAdapterUnit(embeds=[*EMBED[:7], "0.1"], model="face"), "ip_adapter_units[0].embeds", "str '0.1'"),
    (IPAdapterUnit(embeds=[*EMBED[:7], True], model="face"), "ip_adapter_units[0].embeds", "bool"),
    (IPAdapterUnit(embeds=[EMBED] * 5, model="face"), "ip_adapter_units[0].embeds", "5 face embeddings; a unit takes "
                                                                                    "1 .. 4"),
    (IPAdapterUnit(embeds=np.zeros((1, 2, 8)), model="face"), "ip_adapter_units[0].embeds", "shape (1, 2, 8)"),
    (IPAdapterUnit(embeds="0.1, 0.2", model="face"), "ip_adapter_units[0].embeds", "got str"),
    (IPAdapterUnit(embeds=[*EMBED[:7], 1e39], model="face"), "ip_adapter_units[0].embeds", "float32's range"),
])
def test_faceid_refusals_name_the_field(unit, field, text):
    """A FaceID adapter's unit (``embeds``: face embeddings of its width): each refusal names the field (and the
    embedding among several), an image for it or embeddings for an image adapter too."""
    with pytest.raises(InvalidRequest) as err:
        validate_ip_units([unit], ["ip-a", "face"], 2, {"face": 8})
    assert err.value.field == field and text in err.value.message, err.value


def test_faceid_embeds_are_normalised_to_float32_rows():
    """One embedding (a list of floats or ints, or a (d,) array) or several ((n, d), a list of lists) become a tuple
    of (d,) float32 arrays; the infotext names sd-webui-controlnet's FaceID module."""
    from sdxl_engine.engine.ip_adapter import FACEID_MODULE, infotext

    for embeds, count in ((EMBED, 1), ([1] * 8, 1), (np.ones(8), 1), (np.ones((3, 8), np.float64), 3),
                          ([EMBED, np.ones(8, np.float32)], 2)):
        (unit,) = validate_ip_units([IPAdapterUnit(embeds=embeds, model="face")], ["face"], 1, {"face": 8})
        assert unit.image is None and len(unit.embeds) == count
        assert all(e.shape == (8,) and e.dtype == np.float32 for e in unit.embeds)
    assert infotext([unit], {}).popitem()[1].startswith(f"Module: {FACEID_MODULE}, Model: face,")
