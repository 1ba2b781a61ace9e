"""The protocol APIs' mapping and checks without a server (serving/apis): A1111's and OpenAI's fields to the
/generate call, refusals with the engine's messages under each protocol's field names, the error shapes, the
access rules (key, share link) and the flags. tests/e2e/test_apis.py drives them with the real clients."""

import dataclasses
import json
import threading

import pytest

from sdxl_engine.engine.validation import Limits
from sdxl_engine.serving import cli
from sdxl_engine.serving.apis import Access, access_for, key_refusal
from sdxl_engine.serving.apis.a1111 import (Txt2Img, a1111_error, info_record, progress_record, sampler_of,
                                            to_call as a1111_call)
from sdxl_engine.serving.apis.core import ApiError, Call, FileTokens, check
from sdxl_engine.serving.apis.openai_images import openai_error, parse_size, to_call as openai_call
from sdxl_engine.serving.progress import JOBS

LIMITS = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64), (80, 48)), default_size=(64, 64),
                default_steps=8, default_guidance=5.0, multiple=16, default_sampler="Euler")


@dataclasses.dataclass
class StartedEngine:
    """What core.check reads of an engine that has started (engine.contract.EngineContract's fields)."""

    limits: Limits = LIMITS
    batch: int = 4
    error: BaseException | None = None
    ready: threading.Event = dataclasses.field(default_factory=lambda: (e := threading.Event(), e.set())[0])


@pytest.mark.parametrize("name, scheduler, expected", [
    ("Euler", None, "Euler"), ("euler a", "Automatic", "Euler a"), ("DPM++ 2M", "automatic", "DPM++ 2M"),
    ("DPM++ 2M", "Karras", "DPM++ 2M Karras"), ("DPM++ 2M Karras", "karras", "DPM++ 2M Karras"),
    ("DPM++ 2M Karras", None, "DPM++ 2M Karras"), (None, None, None), ("", "", None),
])
def test_sampler_and_scheduler_map_to_the_engines_sampler(name, scheduler, expected):
    assert sampler_of(name, scheduler) == expected


def test_unknown_sampler_or_scheduler_is_a_422_listing_what_there_is():
    with pytest.raises(ApiError) as err:
        sampler_of("LMS", None)
    assert (err.value.status, err.value.param, err.value.message) == (
        422, "sampler_name", "sampler_name: unknown sampler 'LMS'; choose one of Euler, Euler a, DPM++ 2M, "
                             "DPM++ 2M Karras, DDIM, LCM")
    with pytest.raises(ApiError) as err:
        sampler_of("Euler a", "Karras")
    assert err.value.param == "scheduler" and err.value.message.startswith(
        "scheduler: 'Karras' is not available for sampler 'Euler a'; this server has Euler with Automatic, ")


def test_txt2img_fields_map_to_the_generate_call_and_unknown_fields_are_ignored():
    body = Txt2Img.model_validate({"prompt": "a red circle", "negative_prompt": "blue", "seed": 9, "steps": 3,
                                   "cfg_scale": 4.5, "width": 80, "height": 48, "sampler_index": "DDIM",
                                   "styles": ["Anime"], "batch_size": 2, "n_iter": 3, "enable_hr": True,
                                   "alwayson_scripts": {"ControlNet": {"args": []}}})
    call = a1111_call(body)
    assert call.values(9) == ["a red circle", "blue", 9, 4.5, 3, 80, 48, "Anime", "DDIM"]
    assert call.images == 6 and call.field("num_inference_steps") == "steps"
    assert call.field("width/height") == "width/height"
    assert a1111_call(Txt2Img(prompt="x", sampler_name="Euler a", sampler_index="DDIM")).sampler == "Euler a"


def test_txt2img_refuses_two_styles_and_batches_below_one():
    with pytest.raises(ApiError, match=r"^styles: this server applies one style per request, got 2: Anime, Manga$"):
        a1111_call(Txt2Img(prompt="x", styles=["Anime", "Manga"]))
    assert a1111_call(Txt2Img(prompt="x", styles=["(No style)"])).style == "(No style)"
    with pytest.raises(ApiError, match=r"^n_iter: must be at least 1, got 0$"):
        a1111_call(Txt2Img(prompt="x", n_iter=0))


def test_check_gives_the_engines_message_under_the_protocols_field_name():
    engine = StartedEngine()
    cases = [
        (Txt2Img(prompt="x", steps=51), "steps: must be between 1 and 50, got 51", "steps"),
        (Txt2Img(prompt="x", cfg_scale=60), "cfg_scale: must be between 0 and 50, got 60", "cfg_scale"),
        (Txt2Img(prompt="  "), "prompt: is empty (nothing visible in it): describe the image you want, "
                               "e.g. 'a red circle'", "prompt"),
        (Txt2Img(prompt="x", width=96, height=96), "width/height: 96x96 is not a supported size; choose one of "
                                                   "64x64, 80x48 (0 = the model's default)", "width/height"),
        (Txt2Img(prompt="x", styles=["Vaporwave"]), "styles: unknown style 'Vaporwave'; choose one of (No style), "
                                                    "Cinematic, Photographic", "styles"),
        (Txt2Img(prompt="x", batch_size=17), "batch_size*n_iter: this server makes 1 to 16 images per request "
                                             "(4 engine calls of 4), got 17", "batch_size*n_iter"),
    ]
    for body, message, param in cases:
        with pytest.raises(ApiError) as err:
            check(engine, a1111_call(body))
        assert (err.value.status, err.value.param) == (400, param)
        assert err.value.message.startswith(message)
    check(engine, a1111_call(Txt2Img(prompt="a red circle", steps=50, batch_size=16)))  # the largest accepted


def test_prompt_syntax_and_lora_tags_are_refused_before_queueing_with_the_engines_messages():
    """validate's prompt checks (prompts.check_prompt) run in core.check: a 400 naming the field, not a 500
    from inside the engine."""
    engine = StartedEngine(limits=dataclasses.replace(LIMITS, loras=("ink", "peft")))
    cases = [
        (Txt2Img(prompt="a cat <lora:oil:0.5>"), "prompt: unknown LoRA 'oil' in <lora:oil:...>; available: ink, peft"),
        (Txt2Img(prompt="a cat <lora:ink:9>"), "prompt: '<lora:ink:9>': the weight must be between -4 and 4"),
        (Txt2Img(prompt="(( )) BREAK [ ]"), "prompt: is empty: it holds only brackets, weights or BREAK, no words"),
    ]
    for body, message in cases:
        with pytest.raises(ApiError) as err:
            check(engine, a1111_call(body))
        assert (err.value.status, err.value.param, err.value.message) == (400, "prompt", message)
    check(engine, a1111_call(Txt2Img(prompt="a cat <lora:ink:0.5> <lora:peft>")))
    check(StartedEngine(), openai_call({"prompt": "a (red:1.2) circle BREAK blue"}, "tiny-shapes")[0])


def test_check_refuses_with_503_when_the_engine_failed_to_start():
    with pytest.raises(ApiError) as err:
        check(StartedEngine(error=RuntimeError("no weights")), Call(prompt="x"))
    assert (err.value.status, err.value.message) == (503, "the engine failed to start: no weights")


def test_openai_body_maps_to_the_generate_call():
    call, fmt = openai_call({"prompt": "a red circle", "n": 4, "size": "80x48", "model": "tiny-shapes",
                             "quality": "hd", "style": "vivid", "user": "u1"}, "tiny-shapes")
    assert (call.values(-1), call.images, fmt) == (["a red circle", "", -1, None, None, 80, 48, "(No style)", None],
                                                   4, "b64_json")
    assert openai_call({"prompt": "x", "size": "auto", "response_format": "url"}, "m")[0].width is None
    assert parse_size("1024 x 768") == (1024, 768) and parse_size(None) is None


@pytest.mark.parametrize("body, status, param, message", [
    ({"n": 1}, 400, "prompt", "prompt: is required"),
    ({"prompt": "x", "n": 0}, 400, "n", "n: must be at least 1, got 0"),
    ({"prompt": "x", "n": "2"}, 400, "n", "n: expected a whole number, got str"),
    ({"prompt": "x", "size": "big"}, 400, "size", "size: expected \"WIDTHxHEIGHT\" in pixels such as \"1024x1024\", "
                                                  "or \"auto\"; got 'big'"),
    ({"prompt": "x", "response_format": "png"}, 400, "response_format",
     "response_format: must be one of b64_json, url, got 'png'"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model",
     "model: 'dall-e-3' is not served here; this server has 'tiny-shapes' (GET /v1/models)"),
    ([1, 2], 400, None, "the request body must be a JSON object"),
])
def test_openai_refusals(body, status, param, message):
    with pytest.raises(ApiError) as err:
        openai_call(body, "tiny-shapes")
    assert (err.value.status, err.value.param, err.value.message) == (status, param, message)


def test_openai_size_refusal_names_size_with_the_engines_sizes():
    call, _ = openai_call({"prompt": "x", "size": "96x96"}, "tiny-shapes")
    with pytest.raises(ApiError) as err:
        check(StartedEngine(), call)
    assert (err.value.param, err.value.message) == (
        "size", "size: 96x96 is not a supported size; choose one of 64x64, 80x48 (0 = the model's default)")


def test_error_shapes():
    err = ApiError(429, "over the limit", headers={"Retry-After": "5"})
    openai = openai_error(err)
    assert openai.status_code == 429 and openai.headers["retry-after"] == "5"
    assert json.loads(openai.body) == {"error": {"message": "over the limit", "type": "requests", "param": None,
                                                 "code": "rate_limit_exceeded"}}
    assert json.loads(openai_error(ApiError(404, "m", "model")).body)["error"]["code"] == "model_not_found"
    a1111 = a1111_error(ApiError(400, "steps: bad", "steps"), bad_value=422)
    assert a1111.status_code == 422 and json.loads(a1111.body) == {
        "error": "InvalidRequest", "detail": "steps: bad", "body": "", "errors": "steps: bad"}
    assert a1111_error(ApiError(400, "sd_model_checkpoint: no")).status_code == 400


def test_info_record_is_a1111s_shape():
    body = Txt2Img(prompt="a red circle", batch_size=2, styles=["Anime"])
    info = {"prompt": "anime artwork a red circle", "negative_prompt": "photo", "width": 64, "height": 64,
            "sampler": "DPM++ 2M Karras", "guidance_scale": 5.0, "num_inference_steps": 8, "model": "tiny-shapes",
            "style": "Anime", "latency_s": 0.5, "warnings": [], "seeds": [3, 4]}
    record = info_record(body, info, [3, 4], ["t3", "t4"])
    assert {k: record[k] for k in ("prompt", "all_prompts", "seed", "all_seeds", "sampler_name", "scheduler",
                                   "cfg_scale", "steps", "sd_model_name", "infotexts", "styles",
                                   "extra_generation_params")} == {
        "prompt": "a red circle", "all_prompts": ["anime artwork a red circle"] * 2, "seed": 3, "all_seeds": [3, 4],
        "sampler_name": "DPM++ 2M Karras", "scheduler": "Karras", "cfg_scale": 5.0, "steps": 8,
        "sd_model_name": "tiny-shapes", "infotexts": ["t3", "t4"], "styles": ["Anime"],
        "extra_generation_params": {"Style": "Anime"}}
    json.dumps(record)  # info travels as a JSON string


def test_progress_reads_the_callers_own_job():
    me, other = ("a1111", "10.0.0.1"), ("a1111", "10.0.0.2")
    assert progress_record(me)["state"]["job_count"] == 0 and progress_record(me)["progress"] == 0.0
    job = JOBS.open(me, calls=2)
    try:
        JOBS.begin_call(job, 10)
        JOBS.step(job, 4, 10, preview=b"\x89PNG")
        running = progress_record(me)
        assert (running["progress"], running["state"]["sampling_step"], running["state"]["sampling_steps"],
                running["state"]["job_count"], running["state"]["job_no"], running["current_image"]) == (
            0.2, 4, 10, 2, 0, "iVBORw==")
        assert progress_record(me, skip_current_image=True)["current_image"] is None
        assert progress_record(other)["state"]["job_count"] == 0 and progress_record(other)["current_image"] is None
        assert JOBS.interrupt(other) is False and progress_record(me)["state"]["interrupted"] is False
        assert JOBS.interrupt(me) and progress_record(me)["state"]["interrupted"] is True
    finally:
        JOBS.close(job)
    assert progress_record(me)["state"]["interrupted"] is False


def test_access_rules_and_log_lines():
    assert access_for(None, share=False, public_api=False) == Access(True, True, "")
    off = access_for("", share=True, public_api=False)
    assert (off.apis, off.mcp) == (False, False)
    assert off.line == ("[app] protocol APIs off: a share link is open and no API key is set: start with --api-key "
                        "KEY (or SDXL_API_KEY), or --public-api to serve them without one")
    assert access_for("", share=True, public_api=True).apis and access_for("k", share=True, public_api=False).apis
    keyed = access_for(" k1 ", share=True, public_api=False, mcp=False)
    assert keyed.line == ("[app] protocol APIs on: AUTOMATIC1111 at /sdapi/v1, OpenAI Images at /v1, MCP off; "
                          "API key required (Authorization: Bearer)") and "k1" not in keyed.line + repr(keyed)
    assert key_refusal(keyed, {"authorization": "Bearer k1"}) is None
    assert key_refusal(keyed, {"authorization": "bearer k1"}) is None
    assert key_refusal(keyed, {}) == "this server needs an API key: send the header Authorization: Bearer <key>"
    assert key_refusal(keyed, {"authorization": "Basic dXNlcjprMQ=="}) is None  # user:k1, as A1111's --api-auth
    assert key_refusal(keyed, {"authorization": "Basic dXNlcjprMg=="}) == "the API key is wrong"  # user:k2
    assert key_refusal(keyed, {"authorization": "Basic !!"}).startswith("this server needs an API key")
    assert key_refusal(keyed, {"authorization": "Token k1"}).startswith("this server needs an API key")
    assert key_refusal(keyed, {"authorization": "Bearer k2"}) == "the API key is wrong"
    assert key_refusal(Access(True, True, ""), {}) is None


def test_flags_and_their_environment(monkeypatch):
    args = cli.parse_args(["--api-key", "k", "--public-api", "--no-mcp"])
    assert (args.api_key, args.public_api, args.mcp) == ("k", True, False)
    assert "api_key" not in cli.engine_overrides(args) and "mcp" not in cli.engine_overrides(args)
    monkeypatch.setenv("SDXL_API_KEY", "from-env")
    monkeypatch.setenv("SDXL_MCP", "0")
    monkeypatch.setenv("SDXL_PUBLIC_API", "yes")
    args = cli.parse_args([])
    assert (args.api_key, args.public_api, args.mcp) == ("from-env", True, False)
    monkeypatch.delenv("SDXL_API_KEY")
    monkeypatch.delenv("SDXL_MCP")
    monkeypatch.delenv("SDXL_PUBLIC_API")
    args = cli.parse_args([])
    assert (args.api_key, args.public_api, args.mcp) == (None, False, True)


def test_file_tokens_are_unguessable_and_bounded(tmp_path):
    tokens = FileTokens(keep=2)
    files = [tmp_path / f"{i}.png" for i in range(3)]
    for f in files:
        f.write_bytes(b"png")
    names = [tokens.add(str(f)) for f in files]
    assert len(set(names)) == 3 and all(len(n) >= 32 for n in names)
    assert tokens.path(names[0]) is None and tokens.path(names[2]) == str(files[2])
    files[2].unlink()
    assert tokens.path(names[2]) is None and tokens.path("guess") is None


def test_mounted_routes_off_on_a_share_link_and_keyed_otherwise():
    """mount() on a FastAPI app: with a share link and no key both prefixes answer 403 in their protocol's shape,
    saying how to turn them on; with a key, a request without it gets a 401 before any route runs, and the
    capability URLs of url answers need none (404 for an unknown token)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sdxl_engine.serving.apis import mount

    lines = []
    off_app = FastAPI()
    mount(off_app, None, None, access_for("", share=True, public_api=False), {}, log=lines.append)
    off = TestClient(off_app)
    a1111 = off.get("/sdapi/v1/options")
    assert a1111.status_code == 403 and a1111.json()["detail"].startswith(
        "the AUTOMATIC1111 API is off: a share link is open and no API key is set: start with --api-key KEY")
    openai = off.post("/v1/images/generations", json={"prompt": "x"})
    assert openai.status_code == 403 and openai.json()["error"]["message"].startswith("the OpenAI Images API is off")
    assert lines == [access_for("", share=True, public_api=False).line]

    keyed_app = FastAPI()
    mount(keyed_app, None, None, access_for("k", share=True, public_api=False), {}, log=lines.append)
    keyed = TestClient(keyed_app)
    assert keyed.get("/sdapi/v1/sd-models").status_code == 401
    refused = keyed.post("/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert keyed.get("/gradio_api/mcp/").status_code == 401
    assert keyed.get("/v1/images/files/unknown.png").status_code == 404
