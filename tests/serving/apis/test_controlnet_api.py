"""sd-webui-controlnet's API on this server (serving/apis/controlnet.py): A1111 units to the engine's
ControlUnits (legacy names, disabled units, ``{"image", "mask"}``, refusals by name), and the ``/controlnet/*``
routes and txt2img / img2img units over HTTP (FastAPI's TestClient, a stand-in for the engine call).
tests/serving/apis/test_controlnet_api_app.py drives them with webuiapi on a running app."""

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from sdxl_engine.engine.validation import Limits
from sdxl_engine.serving.apis.controlnet import units_of
from sdxl_engine.serving.apis.core import ApiError

LIMITS = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64), (80, 48)), default_size=(64, 64),
                default_steps=8, default_guidance=5.0, multiple=16, default_sampler="Euler",
                controlnets=(("cn-a", "1a2b3c4d"), ("cn-b", "")))
LOADED = {"cn-a": "cn-a [1a2b3c4d]", "cn-b": "cn-b"}


def b64_png(width: int = 24, height: int = 16, value: int = 200) -> str:
    """A base64 PNG, non-square: its left half ``value``, its right half black."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2] = value
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def scripts(*units, key: str = "controlnet") -> dict:
    return {"alwayson_scripts": {key: {"args": list(units)}}}


def test_units_map_every_field_and_skip_disabled_ones():
    image = b64_png()
    units, warnings = units_of(scripts(
        {"enabled": False, "model": "nowhere", "module": "depth"},  # skipped: never checked
        {"enabled": True, "module": "canny", "model": "cn-a [1a2b3c4d]", "weight": 0.6, "image": image,
         "resize_mode": "Just Resize", "control_mode": "My prompt is more important", "guidance_start": 0.1,
         "guidance_end": 0.7, "pixel_perfect": True, "processor_res": 256, "threshold_a": 50, "threshold_b": 120,
         "low_vram": True},
        {"enabled": "false"},
        {"model": "cn-b", "image": "data:image/png;base64," + image}, key="ControlNet"), LOADED)
    assert warnings == [] and len(units) == 2
    first, second = units
    assert (first.model, first.module, first.weight, first.resize_mode, first.control_mode, first.guidance_start,
            first.guidance_end, first.pixel_perfect, first.processor_res, first.threshold_a, first.threshold_b) == (
        "cn-a", "canny", 0.6, "Just Resize", "My prompt is more important", 0.1, 0.7, True, 256, 50, 120)
    assert first.image.shape == (16, 24, 3) and first.image[0, 0, 0] == 200 and first.image[0, -1, 0] == 0
    assert (second.model, second.module, second.weight, second.guidance_end) == ("cn-b", "none", 1.0, 1.0)
    np.testing.assert_array_equal(second.image, first.image)


def test_legacy_names_and_an_image_with_a_mask():
    (unit,), warnings = units_of(scripts({"input_image": {"image": b64_png(), "mask": b64_png(value=255)},
                                          "model": "cn-a", "guidance": 0.4, "lowvram": True}), LOADED)
    assert unit.guidance_end == 0.4 and unit.image.shape == (16, 24, 3)
    assert warnings == ["alwayson_scripts.controlnet.args[0].image: the mask is not used (it is for inpaint "
                        "modules, which this server does not run)"]
    with pytest.raises(ApiError) as err:
        units_of(scripts({"input_image": b64_png(), "image": b64_png(), "model": "cn-a"}), LOADED)
    assert err.value.param == "alwayson_scripts.controlnet.args[0].input_image"


IMAGE = b64_png()


@pytest.mark.parametrize("unit, field, words", [
    ({"model": "control_v11p_sd15_canny", "module": "canny", "image": IMAGE}, "model",
     ("'control_v11p_sd15_canny'", "cn-a [1a2b3c4d], cn-b")),
    ({"model": "cn-a", "module": "depth_midas", "image": IMAGE}, "module", ("depth_midas",)),
    ({"model": "cn-a", "module": "no-such-module", "image": IMAGE}, "module", ("no-such-module",)),
    ({"model": "cn-a"}, "image", ("control image",)),
    ({"model": "cn-a", "image": "bm90IGFuIGltYWdl"}, "image", ()),
])
def test_an_unknown_model_or_module_or_no_image_is_refused_by_name(unit, field, words):
    with pytest.raises(ApiError) as err:
        units_of(scripts({"enabled": False}, {**unit}), LOADED)  # the disabled one is never read
    assert err.value.status == 422 and err.value.param == f"alwayson_scripts.controlnet.args[1].{field}"
    assert err.value.message.startswith(err.value.param) and all(w in err.value.message for w in words)


def test_no_controlnet_loaded_says_so():
    with pytest.raises(ApiError) as err:
        units_of(scripts({"model": "cn-a", "image": b64_png()}), {})
    assert "none (the server was started without --controlnet)" in err.value.message


@pytest.fixture
def served(monkeypatch, tmp_path, runtime_log):
    from tests.helpers import mounted_apis
    from tests.serving.apis.test_apis import _png

    def info_for(call, seeds):
        return {"prompt": call.prompt, "negative_prompt": call.negative_prompt, "width": 8, "height": 8,
                "sampler": "Euler", "guidance_scale": 5.0, "num_inference_steps": 2, "model": "tiny-shapes",
                "style": "(No style)", "latency_s": 0.1, "warnings": [], "seeds": seeds}

    return mounted_apis(monkeypatch, tmp_path, LIMITS, lambda call, seeds: [_png("x") for _ in seeds], info_for,
                        runtime_log)


def test_txt2img_and_img2img_carry_the_units_to_the_engine_request(served):
    client, calls, _ = served
    body = {"prompt": "x", **scripts({"enabled": False}, {"model": "cn-a", "image": b64_png(), "weight": 0.5})}
    answer = client.post("/sdapi/v1/txt2img", json=body)
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.json()["info"])["warnings"] == []  # ControlNet alone: no "not honoured" warning
    (unit,) = calls[-1].engine.control_units
    assert (unit.model, unit.weight) == ("cn-a", 0.5)
    answer = client.post("/sdapi/v1/img2img", json={**body, "init_images": [b64_png(64, 64)]})
    assert answer.status_code == 200, answer.text
    assert calls[-1].engine.control_units[0].model == "cn-a" and calls[-1].engine.image is not None
    refused = client.post("/sdapi/v1/txt2img", json={"prompt": "x", **scripts({"model": "canny-sd15"})})
    assert refused.status_code == 422 and "canny-sd15" in refused.json()["detail"] and len(calls) == 2
    other = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "alwayson_scripts": {
        "controlnet": {"args": []}, "ADetailer": {"args": [{"ad_model": "x"}]}}}).json()
    assert json.loads(other["info"])["warnings"][0].endswith("no scripts or extensions here but ControlNet "
                                                             "(ADetailer...): the others did not run")


def test_the_controlnet_routes(served):
    client, _, _ = served
    assert client.get("/controlnet/version").json() == {"version": 3}
    assert client.get("/controlnet/model_list").json() == {"model_list": ["cn-a [1a2b3c4d]", "cn-b"]}
    assert client.get("/controlnet/settings").json() == {"control_net_unit_count": 3}
    modules = client.get("/controlnet/module_list").json()
    assert modules["module_list"][:2] == ["none", "canny"] and set(modules["module_detail"]) == set(
        modules["module_list"])
    assert modules["module_detail"]["canny"]["sliders"][1] == {"name": "Low Threshold", "value": 100, "min": 1,
                                                               "max": 255, "step": 1}
    answer = client.post("/controlnet/detect", json={"controlnet_module": "canny",
                                                     "controlnet_input_images": [b64_png(144, 96)],
                                                     "controlnet_processor_res": 64}).json()
    assert answer.get("info") == "Success" and len(answer["images"]) == 1, answer
    edges = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))))
    assert edges.shape[:2] == (64, 96)  # the short side at processor_res, the aspect kept (not square)
    assert edges[:, 44:52].max() == 255 and edges[:, :40].max() == 0 and edges[:, 56:].max() == 0  # one edge
    refused = client.post("/controlnet/detect", json={"controlnet_module": "canny", "controlnet_processor_res": 32,
                                                      "controlnet_images": [b64_png()]})  # webuiapi's name
    assert refused.status_code == 422 and refused.json()["detail"].startswith("controlnet_processor_res: ")
    refused = client.post("/controlnet/detect", json={"controlnet_module": "openpose",
                                                      "controlnet_input_images": [b64_png()]})
    assert refused.status_code == 422 and "openpose" in refused.json()["detail"]
    assert client.post("/controlnet/detect", json={"controlnet_module": "canny"}).status_code == 422


def test_the_controlnet_routes_take_the_api_key_and_refuse_another_sites_page():
    """With --api-key the /controlnet/* routes need it, as /sdapi/v1 does (apis.KeyGuard), in A1111's error shape;
    a POST from another site's page is refused before the route runs (apis.CrossSiteGuard)."""
    import threading
    import types

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sdxl_engine.serving.apis import access_for, mount

    ready = threading.Event()
    ready.set()
    engine = types.SimpleNamespace(model=types.SimpleNamespace(name="tiny-pt"), limits=LIMITS, ready=ready,
                                   error=None, config=types.SimpleNamespace(refiner=""))
    app = FastAPI()
    mount(app, types.SimpleNamespace(engine=engine), access_for("k-123", share=False, public_api=False, mcp=False),
          {}, log=lambda line: None)
    client = TestClient(app)
    refused = client.get("/controlnet/model_list")
    assert refused.status_code == 401 and refused.json()["error"] == "HTTPException"
    assert client.get("/controlnet/model_list", headers={"Authorization": "Bearer k-123"}).json() == {
        "model_list": ["cn-a [1a2b3c4d]", "cn-b"]}
    foreign = client.post("/controlnet/detect", json={"controlnet_module": "canny"},
                          headers={"Authorization": "Bearer k-123", "Origin": "https://elsewhere.example",
                                   "Sec-Fetch-Site": "cross-site"})
    assert foreign.status_code == 403 and foreign.json()["error"] == "HTTPException"


def test_a_unit_naming_an_ip_adapter_is_an_ip_adapter_unit():
    """sd-webui-controlnet sends IP-Adapter as a unit (an ip-adapter_clip_* module, the adapter as its model): it
    becomes the engine's IPAdapterUnit (image, weight, start, end), beside the ControlNet units in order; a module
    that is no IP-Adapter one, or a face ID one, is refused naming the field."""
    from sdxl_engine.engine.ip_adapter import IPAdapterUnit

    ip_loaded = {"ip-adapter_sdxl": "ip-adapter_sdxl [0a1b2c3d]"}
    units, warnings = units_of(scripts(
        {"module": "ip-adapter_clip_sdxl", "model": "ip-adapter_sdxl [0a1b2c3d]", "weight": 0.7, "image": b64_png(),
         "guidance_start": 0.1, "guidance_end": 0.9, "control_mode": "Balanced"},
        {"model": "cn-a", "image": b64_png()}), LOADED, ip_loaded)
    assert warnings == [] and [type(u).__name__ for u in units] == ["IPAdapterUnit", "ControlUnit"]
    ip = units[0]
    assert isinstance(ip, IPAdapterUnit) and (ip.model, ip.weight, ip.guidance_start, ip.guidance_end) == (
        "ip-adapter_sdxl", 0.7, 0.1, 0.9)
    assert ip.image.shape == (16, 24, 3)
    for module, text in (("canny", "is an IP-Adapter"), ("ip-adapter_face_id_plus", "insightface")):
        with pytest.raises(ApiError) as err:
            units_of(scripts({"module": module, "model": "ip-adapter_sdxl", "image": b64_png()}), LOADED, ip_loaded)
        assert err.value.status == 422 and err.value.param == "alwayson_scripts.controlnet.args[0].module"
        assert text in err.value.message
    with pytest.raises(ApiError) as err:
        units_of(scripts({"module": "ip-adapter_clip_sdxl", "model": "ip-adapter_plus", "image": b64_png()}), LOADED,
                 ip_loaded)
    assert err.value.param == "alwayson_scripts.controlnet.args[0].model" and "ip-adapter_sdxl [0a1b2c3d]" in \
        err.value.message


def test_a_faceid_unit_sends_ip_adapter_embeds_and_the_insightface_module_is_refused():
    """An IP-Adapter FaceID unit sends the face's embedding in ``ip_adapter_embeds`` (this server's field) with module
    ip-adapter_face_id (or none): it becomes an IPAdapterUnit with those embeds, no image read. Without it, the
    extension's ip-adapter_face_id modules (insightface on its server) are refused saying to send the embedding."""
    from sdxl_engine.engine.ip_adapter import IPAdapterUnit

    ip_loaded = {"ip-adapter-faceid_sdxl": "ip-adapter-faceid_sdxl [0a1b2c3d]"}
    face = [0.25] * 512
    for module in ("ip-adapter_face_id", None):
        (unit,), warnings = units_of(scripts(
            {"module": module, "model": "ip-adapter-faceid_sdxl [0a1b2c3d]", "ip_adapter_embeds": face,
             "weight": 0.6, "guidance_end": 0.8}), LOADED, ip_loaded)
        assert warnings == [] and isinstance(unit, IPAdapterUnit)
        assert (unit.model, unit.embeds, unit.image, unit.weight, unit.guidance_end) == (
            "ip-adapter-faceid_sdxl", face, None, 0.6, 0.8)
    for module in ("ip-adapter_face_id", "ip-adapter_face_id_plus"):
        with pytest.raises(ApiError) as err:
            units_of(scripts({"module": module, "model": "ip-adapter-faceid_sdxl", "image": b64_png()}), LOADED,
                     ip_loaded)
        assert err.value.status == 422 and err.value.param == "alwayson_scripts.controlnet.args[0].module"
        assert "insightface" in err.value.message and "ip_adapter_embeds" in err.value.message
    with pytest.raises(ApiError) as err:
        units_of(scripts({"module": "ip-adapter_clip_sdxl", "model": "ip-adapter-faceid_sdxl",
                          "ip_adapter_embeds": face}), LOADED, ip_loaded)
    assert err.value.param == "alwayson_scripts.controlnet.args[0].module" and "ip-adapter_face_id" in \
        err.value.message


@pytest.fixture
def served_ip(monkeypatch, tmp_path, runtime_log):
    import dataclasses

    from tests.helpers import mounted_apis
    from tests.serving.apis.test_apis import _png

    def info_for(call, seeds):
        return {"prompt": call.prompt, "negative_prompt": call.negative_prompt, "width": 8, "height": 8,
                "sampler": "Euler", "guidance_scale": 5.0, "num_inference_steps": 2, "model": "tiny-shapes",
                "style": "(No style)", "latency_s": 0.1, "warnings": [], "seeds": seeds}

    limits = dataclasses.replace(LIMITS, ip_adapters=(("ip-adapter_sdxl", "0a1b2c3d"),))
    return mounted_apis(monkeypatch, tmp_path, limits, lambda call, seeds: [_png("x") for _ in seeds], info_for,
                        runtime_log)


def test_an_ip_adapter_unit_reaches_the_engine_and_the_lists_name_it(served_ip):
    """An A1111 IP-Adapter unit in txt2img is the engine request's ip_adapter_units (its ControlNet unit beside it
    its control_units); /controlnet/model_list lists the IP-Adapter after the ControlNets, module_list its modules."""
    client, calls, _ = served_ip
    body = {"prompt": "x", **scripts({"module": "ip-adapter_clip_sdxl", "model": "ip-adapter_sdxl [0a1b2c3d]",
                                      "image": b64_png(), "weight": 0.6}, {"model": "cn-b", "image": b64_png()})}
    answer = client.post("/sdapi/v1/txt2img", json=body)
    assert answer.status_code == 200, answer.text
    (ip,), (control,) = calls[-1].engine.ip_adapter_units, calls[-1].engine.control_units
    assert (ip.model, ip.weight, control.model) == ("ip-adapter_sdxl", 0.6, "cn-b")
    assert client.get("/controlnet/model_list").json() == {
        "model_list": ["cn-a [1a2b3c4d]", "cn-b", "ip-adapter_sdxl [0a1b2c3d]"]}
    modules = client.get("/controlnet/module_list").json()
    assert modules["module_list"][-4:] == ["ip-adapter-auto", "ip-adapter_clip_sdxl", "ip-adapter_clip_sdxl_plus_vith",
                                           "ip-adapter_clip_h"]
    assert set(modules["module_detail"]) == set(modules["module_list"])


UNIONS = {"cn-b": 8}  # cn-b stands for a loaded ControlNet-Union here


@pytest.mark.parametrize("sent,want", [
    (dict(union_control_type="Hard Edge", module="none"), 3),  # the extension's enum value
    (dict(union_control_type="OpenPose", module="canny"), 0),  # the field wins the module
    (dict(union_control_type="Soft Edge"), 2), (dict(union_control_type="normal map"), 4),
    (dict(union_control_type="Tile"), 6), (dict(union_control_type="inpaint"), 7),
    (dict(union_control_type="scribble"), 2),  # its type filter's tags, as its from_str reads them
    (dict(union_control_type="Unknown", module="canny"), 3),  # Unknown: the module's type
    (dict(module="lineart_standard"), 3), (dict(module="scribble_xdog"), 2), (dict(module="tile_resample"), 6),
    (dict(module="blur_gaussian"), 6), (dict(module="invert"), 3),
    (dict(control_type="depth", module="none"), "depth"),  # the engine's field, checked by the engine
])
def test_a_union_units_control_type_is_read_as_sd_webui_controlnet_sends_it(sent, want):
    (unit,), _ = units_of(scripts({"model": "cn-b", "image": b64_png(), **sent}), LOADED, unions=UNIONS)
    assert unit.control_type == want
    (plain,), _ = units_of(scripts({"model": "cn-a", "image": b64_png(), **sent}), LOADED, unions=UNIONS)
    assert plain.control_type is None  # a plain ControlNet's unit carries none, whatever was sent


@pytest.mark.parametrize("model", ["cn-b", "cn-a"])  # a union, and a plain ControlNet (a bad value is bad for both)
@pytest.mark.parametrize("sent,words", [
    (dict(module="none"), "names no control type"),
    (dict(union_control_type="Sketch", module="canny"), "unknown control type 'Sketch'"),
    (dict(union_control_type=["Depth", "Hard Edge"], module="none"), "expected one control type (a name such as"),
    (dict(union_control_type=True, module="canny"), "expected one control type"),
])
def test_a_union_unit_without_a_control_type_is_refused_by_name(sent, words, model):
    if model == "cn-a" and "union_control_type" not in sent:
        return  # a plain ControlNet needs no type
    with pytest.raises(ApiError) as err:
        units_of(scripts({"model": model, "image": b64_png(), **sent}), LOADED, unions=UNIONS)
    assert err.value.param == "alwayson_scripts.controlnet.args[0].union_control_type" and words in err.value.message


def test_a_plain_controlnets_union_control_type_is_not_used_and_says_so():
    """The new user's find: a type sent with a plain ControlNet was dropped without a word (gradio_client and MCP
    refuse it; the extension sends the field with every unit, "Unknown" by default, so here it is a warning)."""
    (unit,), warnings = units_of(scripts({"model": "cn-a", "image": b64_png(), "union_control_type": "Depth"}),
                                 LOADED, unions=UNIONS)
    assert unit.control_type is None
    assert warnings == ["alwayson_scripts.controlnet.args[0].union_control_type='Depth' is not used: 'cn-a' is not "
                        "a ControlNet-Union"]
    (unit,), warnings = units_of(scripts({"model": "cn-a", "image": b64_png(), "union_control_type": "Unknown"}),
                                 LOADED, unions=UNIONS)
    assert unit.control_type is None and warnings == []


def test_control_types_lists_modules_and_models_by_type_and_a_union_under_each_type_it_has():
    """Issue #60: sd-webui-controlnet's GET /controlnet/control_types (scripts/api.py: {tag: {module_list,
    model_list, default_option, default_model}}): "All" has every module and model; each tag its modules ("none"
    first) and models ("None" first), the defaults the second entry; a plain ControlNet under the tags its name has
    (the extension's filter: "canny-xl" under Canny only), a ControlNet-Union under every tag of a type it has (a
    6-type union not under Tile or Inpaint, ProMax's 8-type one under both); "IP-Adapter" while one is loaded."""
    from sdxl_engine.engine.control_preprocess import MODULES
    from sdxl_engine.serving.apis.controlnet import CONTROL_TAGS, IP_MODULES, control_types

    loaded = {"canny-xl": "canny-xl [11111111]", "promax": "promax [22222222]", "union": "union [33333333]",
              "cn-a": "cn-a"}
    types = control_types(loaded, {"promax": 8, "union": 6}, {})["control_types"]
    assert list(types) == ["All", *CONTROL_TAGS] and "IP-Adapter" not in types
    assert types["All"] == {"module_list": list(MODULES), "model_list": ["None", *loaded.values()],
                            "default_option": "none", "default_model": "None"}
    assert types["Canny"] == {"module_list": ["none", "canny", "invert"],
                              "model_list": ["None", "canny-xl [11111111]", "promax [22222222]", "union [33333333]"],
                              "default_option": "canny", "default_model": "canny-xl [11111111]"}
    assert types["Tile"]["model_list"] == ["None", "promax [22222222]"]
    assert types["Tile"]["module_list"] == ["none", "tile_resample", "blur_gaussian"]
    assert types["Inpaint"] == {"module_list": ["none"], "model_list": ["None", "promax [22222222]"],
                                "default_option": "none", "default_model": "promax [22222222]"}
    for tag in ("OpenPose", "Depth", "SoftEdge", "Scribble", "Lineart", "MLSD", "NormalMap", "Segmentation"):
        assert types[tag]["model_list"] == ["None", "promax [22222222]", "union [33333333]"], tag
    assert not any("cn-a" in title for tag in CONTROL_TAGS for title in types[tag]["model_list"])
    assert types["Scribble"]["default_option"] == "scribble_xdog" and types["Lineart"]["default_option"] == \
        "lineart_standard"
    with_ip = control_types({}, {}, {"ip-adapter_sdxl": "ip-adapter_sdxl [44444444]"})["control_types"]
    assert with_ip["IP-Adapter"] == {"module_list": ["none", *IP_MODULES],
                                     "model_list": ["None", "ip-adapter_sdxl [44444444]"],
                                     "default_option": IP_MODULES[0], "default_model": "ip-adapter_sdxl [44444444]"}
    assert with_ip["All"]["module_list"][-len(IP_MODULES):] == list(IP_MODULES)
    assert with_ip["Canny"]["model_list"] == ["None"] and with_ip["Canny"]["default_model"] == "None"


def test_the_control_types_route_reads_the_engines_unions(served):
    client, _, _ = served
    types = client.get("/controlnet/control_types").json()["control_types"]
    assert types["All"]["model_list"] == ["None", "cn-a [1a2b3c4d]", "cn-b"]
    assert types["Canny"]["model_list"] == ["None"]  # neither is a union here, nor named for a type
