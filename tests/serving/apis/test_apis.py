"""The protocol APIs' mapping and checks without a server (serving/apis): A1111's and OpenAI's fields to the
/generate call, refusals with the engine's messages under each protocol's field names, the error shapes, the
access rules (key, share link) and the flags; then the mounted routes over HTTP (FastAPI's TestClient) with a
stand-in for the engine call. tests/serving/apis/test_apis_app.py drives them with the real clients on a running app."""

import base64
import dataclasses
import json
import threading
import types
from types import SimpleNamespace

import numpy as np
import pytest

from sdxl_engine.engine.validation import Limits
from sdxl_engine.serving import cli
from sdxl_engine.serving.apis import Access, access_for, key_refusal
from sdxl_engine.serving.apis.a1111 import (
    Txt2Img,
    a1111_error,
    info_record,
    latest,
    progress_record,
    running,
    sampler_of,
)
from sdxl_engine.serving.apis.a1111 import to_call as a1111_call
from sdxl_engine.serving.apis.core import ApiError, FileTokens, check, request_of
from sdxl_engine.serving.apis.openai_images import Answer, openai_error, parse_size, with_quality
from sdxl_engine.serving.apis.openai_images import to_call as openai_call
from tests.helpers import extra_fields, png_header_only

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
    ("Euler", None, ("Euler", None)), ("euler a", "Automatic", ("Euler a", None)),
    ("DPM++ 2M", "automatic", ("DPM++ 2M", None)), ("DPM++ 2M", "Karras", ("DPM++ 2M", "karras")),
    ("DPM++ 2M Karras", "karras", ("DPM++ 2M Karras", "karras")), ("DPM++ 2M Karras", None, ("DPM++ 2M Karras", None)),
    (None, None, (None, None)), ("", "", (None, None)), ("Euler", "Karras", ("Euler", "karras")),
    ("Euler a", "SGM Uniform", ("Euler a", "sgm_uniform")), ("Euler a", "sgmuniform", ("Euler a", "sgm_uniform")),
    ("Euler a Exponential", None, ("Euler a", "exponential")),  # A1111's get_sampler_and_scheduler split
    ("Euler a Karras", "Exponential", ("Euler a", "karras")),  # the name's type wins there, as in A1111
    ("DPM++ SDE Karras", None, ("DPM++ SDE", "karras")), ("LMS Karras", "", ("LMS", "karras")),
    # this server's own schedule types, which its /schedulers lists (A1111 has none of the spacings)
    ("Euler", "Trailing", ("Euler", "trailing")), ("DDIM", "leading", ("DDIM", "leading")),
    ("Euler a", "Linspace", ("Euler a", "linspace")),
])
def test_sampler_and_scheduler_map_to_the_engines_sampler_and_schedule_type(name, scheduler, expected):
    assert sampler_of(name, scheduler) == expected


def test_unknown_sampler_or_scheduler_is_a_422_listing_what_there_is():
    with pytest.raises(ApiError) as err:
        sampler_of("DPM adaptive", None)
    assert (err.value.status, err.value.param, err.value.message) == (
        422, "sampler_name", "sampler_name: unknown sampler 'DPM adaptive'; choose one of Euler, Euler a, DPM++ 2M, "
                             "DPM++ 2M Karras, DPM++ 2M SDE, DPM++ 3M SDE, UniPC, DDIM, LCM, Heun, DPM2, DPM++ SDE, "
                             "TCD, DPM2 a, LMS, Restart")
    with pytest.raises(ApiError) as err:
        sampler_of("Euler a", "Polyexponential")
    assert (err.value.status, err.value.param, err.value.message) == (
        422, "scheduler", "scheduler: unknown schedule type 'Polyexponential'; choose one of automatic, uniform, "
                          "karras, exponential, sgm_uniform, simple, beta, leading, linspace, trailing (A1111's "
                          "labels: Automatic, Uniform, Karras, Exponential, SGM Uniform, Simple, Beta, Leading, "
                          "Linspace, Trailing)")


def test_a1111_scheduler_reaches_the_engine_and_its_refusal_names_scheduler():
    """scheduler "Karras" with Euler is the engine's schedule_type karras; DDIM with it is refused by the engine
    naming A1111's field (the request's field names)."""
    from sdxl_engine.engine.validation import validate

    call = a1111_call(Txt2Img(prompt="x", sampler_name="Euler", scheduler="Karras"))
    assert (call.engine.sampler, call.engine.schedule_type) == ("Euler", "karras")
    assert call.field("schedule_type") == "scheduler"
    assert a1111_call(Txt2Img(prompt="x", sampler_name="Euler", scheduler="N/A")).engine.schedule_type is None
    checked = validate(call.engine, LIMITS)
    assert checked.schedule_type == "karras"


def values(call, seed) -> list:
    """A call's ``/generate`` values, with ``seed``."""
    engine = call.engine
    return [call.prompt, call.negative_prompt, seed, engine.guidance_scale, engine.num_inference_steps, engine.width,
            engine.height, call.style, engine.sampler]


def test_txt2img_fields_map_to_the_generate_call_and_unknown_fields_are_ignored():
    body = Txt2Img.model_validate({"prompt": "a red circle", "negative_prompt": "blue", "seed": 9, "steps": 3,
                                   "cfg_scale": 4.5, "width": 80, "height": 48, "sampler_index": "DDIM",
                                   "styles": ["Anime"], "batch_size": 2, "n_iter": 3, "enable_hr": True,
                                   "alwayson_scripts": {"ControlNet": {"args": []}}})
    call = a1111_call(body)
    assert values(call, 9) == ["a red circle", "blue", 9, 4.5, 3, 80, 48, "Anime", "DDIM"]
    assert call.images == 6 and call.field("num_inference_steps") == "steps"
    assert call.field("width/height") == "width/height"
    assert a1111_call(Txt2Img(prompt="x", sampler_name="Euler a", sampler_index="DDIM")).engine.sampler == "Euler a"


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
        # a style names no preset as the route builds the request (A1111's 422); the rest at check (400, which the
        # routes answer 422 as A1111's bad values)
        assert (err.value.status, err.value.param) == (422 if param == "styles" else 400, param)
        assert err.value.message.startswith(message)
    check(engine, a1111_call(Txt2Img(prompt="a red circle", steps=50, batch_size=16)))  # the largest accepted


def test_prompt_syntax_and_lora_tags_are_refused_before_queueing_with_the_engines_messages():
    """validate's prompt checks (prompts.check_prompt) run in core.check: a 400 naming the field, not a 500
    from inside the engine."""
    engine = StartedEngine(limits=dataclasses.replace(LIMITS, loras=("ink", "peft")))
    cases = [
        (Txt2Img(prompt="a cat <lora:oil:0.5>"), "prompt: unknown LoRA 'oil' in <lora:oil:0.5>; available: ink, peft"),
        (Txt2Img(prompt="a cat <lora:ink:9>"), "prompt: '<lora:ink:9>': the weight must be between -4 and 4"),
        (Txt2Img(prompt="(( )) BREAK [ ]"), "prompt: is empty: it holds only brackets, weights or BREAK, no words"),
    ]
    for body, message in cases:
        with pytest.raises(ApiError) as err:
            check(engine, a1111_call(body))
        assert (err.value.status, err.value.param, err.value.message) == (400, "prompt", message)
    check(engine, a1111_call(Txt2Img(prompt="a cat <lora:ink:0.5> <lora:peft>")))
    check(StartedEngine(), openai_call({"prompt": "a (red:1.2) circle BREAK blue"}, ["tiny-shapes"])[0])


def test_check_refuses_with_503_when_the_engine_failed_to_start():
    with pytest.raises(ApiError) as err:
        check(StartedEngine(error=RuntimeError("no weights")), request_of(prompt="x"))
    assert (err.value.status, err.value.message) == (503, "the engine failed to start: no weights")


def test_openai_body_maps_to_the_generate_call():
    call, answer = openai_call({"prompt": "a red circle", "n": 4, "size": "80x48", "model": "tiny-shapes",
                                "quality": "hd", "style": "vivid", "user": "u1"}, ["tiny-shapes"])
    assert (values(call, -1), call.images) == (["a red circle", "", -1, None, None, 80, 48, "(No style)", None],
                                              4)
    assert answer == Answer("b64_json", "png", 100, False, (
        'style="vivid" ignored: no vivid/natural styles here: describe the style in the prompt',), top_quality="hd")
    # quality hd/high: base + refiner where one is loaded, else a warning; other values warned as before
    refined, said = with_quality(call, answer, refiner=True)
    assert extra_fields(refined) == {"refiner_switch_at": 0.8} and said == answer
    plain, said = with_quality(call, answer, refiner=False)
    assert plain == call and said.warnings[-1] == ('quality="hd" ignored: no refiner is loaded here to refine with '
                                                   '(the server runs one with --refiner)')
    low, said = openai_call({"prompt": "x", "quality": "low"}, "m")
    assert with_quality(low, said, refiner=True) == (low, said) and said.warnings == (
        'quality="low" ignored: the steps and size decide the quality here',)
    assert openai_call({"prompt": "x", "size": "auto", "response_format": "url"}, "m")[0].engine.width is None
    defaults = {"prompt": "x", "quality": "auto", "background": "opaque", "partial_images": 0, "moderation": "low",
                "output_compression": 100, "stream": False}
    assert openai_call(defaults, "m")[1] == Answer()


@pytest.mark.parametrize("model, response_format", [
    (None, "b64_json"), ("tiny-shapes", "b64_json"), ("gpt-image-1", "b64_json"), ("gpt-image-1-mini", "b64_json"),
    ("dall-e-3", "url"), ("dall-e-2", "url"),
])
def test_openai_model_names_are_aliases_answering_as_that_model_does(model, response_format):
    """OpenAI's GPT image models answer base64 without being asked; DALL-E answered URLs by default."""
    assert openai_call({"prompt": "x", "model": model}, ["tiny-shapes"])[1].response_format == response_format
    assert openai_call({"prompt": "x", "model": model, "response_format": "b64_json"},
                       ["tiny-shapes"])[1].response_format == "b64_json"


def test_openai_model_names_one_of_the_servers_models_and_openais_names_the_default():
    models = ["base", "turbo"]
    for model, chosen in ((None, None), ("base", None), ("turbo", "turbo"), ("gpt-image-1", None), ("dall-e-3", None)):
        assert openai_call({"prompt": "x", "model": model}, models)[0].engine.model == chosen, model
    with pytest.raises(ApiError, match="^model: unknown model 'sdxl'; this server offers: base, turbo ") as err:
        openai_call({"prompt": "x", "model": "sdxl"}, models)
    assert (err.value.status, err.value.param) == (404, "model")


def test_openai_output_format_compression_and_stream_are_read():
    answer = openai_call({"prompt": "x", "output_format": "jpeg", "output_compression": 40, "stream": True}, "m")[1]
    assert answer == Answer("b64_json", "jpeg", 40, True, ())
    png_compressed = openai_call({"prompt": "x", "output_compression": 40, "partial_images": 2, "stream": True},
                                 "m")[1]
    assert png_compressed.warnings == (
        "partial_images=2 ignored: only the final image is sent here (no partial images)",
        "output_compression=40 ignored: PNG is lossless (it applies to jpeg and webp)")
    assert parse_size("1024 x 768") == (1024, 768) and parse_size(None) is None


@pytest.mark.parametrize("body, status, param, message", [
    ({"n": 1}, 400, "prompt", "prompt: is required"),
    ({"prompt": "x", "n": 0}, 400, "n", "n: must be at least 1, got 0"),
    ({"prompt": "x", "n": "2"}, 400, "n", "n: expected a whole number, got str"),
    ({"prompt": "x", "size": "big"}, 400, "size", "size: expected \"WIDTHxHEIGHT\" in pixels such as \"1024x1024\", "
                                                  "or \"auto\"; got 'big'"),
    ({"prompt": "x", "response_format": "png"}, 400, "response_format",
     "response_format: must be one of b64_json, url, got 'png'"),
    ({"prompt": "x", "model": "sdxl-turbo"}, 404, "model",
     "model: unknown model 'sdxl-turbo'; this server offers: tiny-shapes (GET /v1/models), the first also under "
     "OpenAI's names gpt-image-*, dall-e-2, dall-e-3"),
    ({"prompt": "x", "model": "gpt-image-1", "response_format": "url"}, 400, "response_format",
     "response_format: 'url' is not supported with 'gpt-image-1': GPT image models answer b64_json (leave "
     "response_format out)"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format",
     "output_format: must be one of png, jpeg, webp, got 'gif'"),
    ({"prompt": "x", "output_format": "jpeg", "output_compression": 101}, 400, "output_compression",
     "output_compression: must be between 0 and 100, got 101"),
    ({"prompt": "x", "output_compression": True}, 400, "output_compression",
     "output_compression: expected a whole number, got bool"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", "stream: expected true or false, got 'yes'"),
    ({"prompt": "x", "partial_images": 4}, 400, "partial_images", "partial_images: must be between 0 and 3, got 4"),
    ({"prompt": "x", "model": "dall-e-3", "output_format": "webp"}, 400, "output_format",
     "output_format: url answers are PNG files, sent whole; ask for response_format b64_json for webp images"),
    ({"prompt": "x", "response_format": "url", "stream": True}, 400, "stream",
     "stream: url answers are PNG files, sent whole; ask for response_format b64_json for a stream"),
    ([1, 2], 400, None, "the request body must be a JSON object"),
])
def test_openai_refusals(body, status, param, message):
    with pytest.raises(ApiError) as err:
        openai_call(body, ["tiny-shapes"])
    assert (err.value.status, err.value.param, err.value.message) == (status, param, message)


def test_openai_n_over_the_limit_is_refused_naming_n():
    call, _ = openai_call({"prompt": "x", "n": 17}, ["tiny-shapes"])
    with pytest.raises(ApiError) as err:
        check(StartedEngine(), call)
    assert (err.value.status, err.value.param, err.value.message) == (
        400, "n", "n: this server makes 1 to 16 images per request (4 engine calls of 4), got 17")
    check(StartedEngine(), openai_call({"prompt": "x", "n": 16}, ["tiny-shapes"])[0])


def test_openai_size_refusal_names_size_with_the_engines_sizes():
    call, _ = openai_call({"prompt": "x", "size": "96x96"}, ["tiny-shapes"])
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
    assert a1111_error(ApiError(400, "sd_model_checkpoint: no")).status_code == 422  # a refused value: A1111's 422
    for status in (401, 404, 413, 429, 503):  # the new user saw a 429 labelled "ServerError"
        assert json.loads(a1111_error(ApiError(status, "m")).body)["error"] == "HTTPException", status
    assert json.loads(a1111_error(ApiError(500, "m")).body)["error"] == "ServerError"


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
    """A1111's /progress answers the caller's running A1111 job (a1111.latest), not one it queued after it: its
    calls, steps and preview; another owner's job is not seen; an interrupt shows; with none running, the first
    queued one; interrupt and skip reach the running job only (a1111.running)."""
    from sdxl_engine.service.jobs import Job
    from sdxl_engine.service.request import to_request

    me, other = "10.0.0.1", "10.0.0.2"
    requests = SimpleNamespace(jobs=lambda owner, front=None: [j for j in made if j.owner == owner])
    made = []
    assert progress_record(latest(requests, me))["state"]["job_count"] == 0
    job = Job(me, "a1111", to_request(prompt="x"), calls=2)
    queued = [Job(me, "a1111", to_request(prompt="y"), calls=1) for _ in range(2)]
    made[:] = [*queued[::-1], job]  # Service.jobs: newest first
    job.status, job.step, job.steps = "running", 4, 10
    assert running(requests, me) == [job] and running(requests, other) == []
    job.preview = np.zeros((4, 2, 2, 3), np.uint8)
    shown = progress_record(latest(requests, me))
    assert (shown["progress"], shown["state"]["sampling_step"], shown["state"]["sampling_steps"],
            shown["state"]["job_count"], shown["state"]["job_no"]) == (0.2, 4, 10, 2, 0)
    assert base64.b64decode(shown["current_image"]).startswith(b"\x89PNG")
    assert progress_record(latest(requests, me), skip_current_image=True)["current_image"] is None
    assert progress_record(latest(requests, other))["state"]["job_count"] == 0
    assert progress_record(latest(requests, me))["state"]["interrupted"] is False
    job.cancelled.set()
    assert progress_record(latest(requests, me))["state"]["interrupted"] is True
    job.status = "cancelled"
    assert latest(requests, me) is queued[0] and running(requests, me) == []  # next in line
    for waiting in queued:
        waiting.status = "succeeded"
    assert progress_record(latest(requests, me))["state"]["job_count"] == 0  # finished: idle


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
    mount(off_app, None, access_for("", share=True, public_api=False), {}, log=lines.append)
    off = TestClient(off_app)
    a1111 = off.get("/sdapi/v1/options")
    assert a1111.status_code == 403 and a1111.json()["detail"].startswith(
        "the AUTOMATIC1111 API is off: a share link is open and no API key is set: start with --api-key KEY")
    openai = off.post("/v1/images/generations", json={"prompt": "x"})
    assert openai.status_code == 403 and openai.json()["error"]["message"].startswith("the OpenAI Images API is off")
    assert lines == [access_for("", share=True, public_api=False).line]

    keyed_app = FastAPI()
    # MCP off here (no engine config for its tools' defaults): the key check covers its path all the same
    mount(keyed_app, types.SimpleNamespace(engine=None), access_for("k", share=True, public_api=False, mcp=False), {},
          log=lines.append)
    keyed = TestClient(keyed_app)
    assert keyed.get("/sdapi/v1/sd-models").status_code == 401
    refused = keyed.post("/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert keyed.get("/gradio_api/mcp/").status_code == 401
    assert keyed.get("/v1/images/files/unknown.png").status_code == 404


# --- The mounted routes, driven over HTTP with FastAPI's TestClient; the engine call (core.generate) is a
# stand-in that makes PNGs with a parameters chunk and records the calls it got.

def _png(text: str, color: str = "red") -> bytes:
    import io

    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", text)
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, "PNG", pnginfo=info)
    return out.getvalue()


@pytest.fixture
def served(monkeypatch, tmp_path, runtime_log):
    """(TestClient of the mounted APIs, the calls core.generate got, the lines logged): 8x8 PNGs."""
    from tests.helpers import mounted_apis

    def info_for(call, seeds):
        return {"prompt": f"styled {call.prompt}", "negative_prompt": f"styled {call.negative_prompt}", "width": 8,
                "height": 8, "sampler": "Euler", "guidance_scale": 5.0, "num_inference_steps": 2,
                "model": "tiny-shapes", "style": "(No style)", "latency_s": 0.1, "warnings": ["engine note"],
                "seeds": seeds}

    return mounted_apis(monkeypatch, tmp_path, LIMITS, lambda call, seeds: [
        _png(f"{call.prompt}\nNegative prompt: {call.negative_prompt}\nSteps: 2, Seed: {s}") for s in seeds], info_for,
        runtime_log)


@pytest.mark.parametrize("body, field", [
    ('{"prompt": "a red \\ud800 circle"}', "prompt"),
    ('{"prompt": "x", "negative_prompt": "blue \\udfff"}', "negative_prompt"),
    ('{"prompt": "x", "styles": ["Anime", "\\ud800"]}', "styles[1]"),
    ('{"prompt": "x", "alwayson_scripts": {"cn": {"args": [{"m": "\\udc00"}]}}}', "alwayson_scripts.cn.args[0].m"),
    ('{"prompt": "x", "override_settings": {"sd_vae\\ud800": 1}}', "override_settings"),
])
def test_a1111_refuses_a_lone_surrogate_in_any_string_before_generating(served, body, field):
    """A lone surrogate cannot be sent back as UTF-8 (the answer echoes the request): a 422 in A1111's shape
    naming the field, before anything is generated, instead of a 500 after."""
    client, calls, lines = served
    answer = client.post("/sdapi/v1/txt2img", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422 and calls == []
    detail = answer.json()["detail"]
    assert answer.json()["error"] == "InvalidRequest" and detail.startswith(f"{field}: ")
    assert "holds a lone surrogate (\\u" in detail and detail == answer.json()["errors"]
    assert lines == [f"[app] request refused: /sdapi/v1/txt2img: {detail}"]


def test_a1111_options_and_openai_refuse_a_lone_surrogate_naming_the_field(served):
    client, calls, _ = served
    options = client.post("/sdapi/v1/options", content='{"sd_model_checkpoint\\ud800": "x"}',
                          headers={"Content-Type": "application/json"})
    assert options.status_code == 422 and options.json()["detail"] == (
        "the request body: the key 'sd_model_checkpoint\\ud800' holds a lone surrogate (\\ud800 at character 19), "
        "which is not a character: send text as UTF-8, or pair each \\ud800-\\udbff escape with a \\udc00-\\udfff one")
    value = client.post("/sdapi/v1/options", content='{"sd_vae": "\\ud800"}',
                        headers={"Content-Type": "application/json"})
    assert value.status_code == 422 and value.json()["detail"].startswith("sd_vae: holds a lone surrogate (\\ud800 at")
    openai = client.post("/v1/images/generations", content='{"prompt": "a \\ud800"}')
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "prompt"
    assert openai.json()["error"]["message"].startswith("prompt: holds a lone surrogate (\\ud800 at character 2)")
    paired = client.post("/sdapi/v1/txt2img", content='{"prompt": "a \\ud83d\\ude00 circle"}',
                         headers={"Content-Type": "application/json"})  # a valid pair: an emoji
    assert paired.status_code == 200 and calls[0].prompt == "a \U0001F600 circle"


def test_openai_refusals_before_generating_are_one_log_line_each(served):
    """A body the /v1 routes refuse before the request service sees it (n below 1, an edit without its image) is
    logged once, as the service logs its own refusals, with the route and the message the client gets."""
    client, calls, lines = served
    bad_n = client.post("/v1/images/generations", json={"prompt": "a red circle", "n": -1})
    no_image = client.post("/v1/images/edits", data={"prompt": "a red circle"}, files={"n": (None, "1")})
    assert (bad_n.status_code, no_image.status_code) == (400, 400) and calls == []
    assert lines == [f"[app] request refused: /v1/images/generations: {bad_n.json()['error']['message']}",
                     f"[app] request refused: /v1/images/edits: {no_image.json()['error']['message']}"]
    assert bad_n.json()["error"]["message"] == "n: must be at least 1, got -1"


def test_a_deeply_nested_body_is_named_as_such(served):
    client, calls, _ = served
    message = ("the request body is too deeply nested (more than 64 levels of [ or {): no field here nests so deep")
    for depth in (65, 5000):
        body = '{"prompt": "x", "alwayson_scripts": ' + "[" * depth + "]" * depth + "}"
        a1111 = client.post("/sdapi/v1/txt2img", content=body, headers={"Content-Type": "application/json"})
        assert (a1111.status_code, a1111.json()["detail"]) == (422, message)
        options = client.post("/sdapi/v1/options", content="[" * depth + "]" * depth)
        assert (options.status_code, options.json()["detail"]) == (422, message)
        openai = client.post("/v1/images/generations",
                             content='{"prompt": "x", "user": ' + "[" * depth + "]" * depth + "}")
        assert (openai.status_code, openai.json()["error"]["message"]) == (400, message)
    assert calls == []
    nested = client.post("/sdapi/v1/txt2img", headers={"Content-Type": "application/json"},
                         content='{"prompt": "x", "alwayson_scripts": ' + "[" * 60 + "]" * 60 + "}")
    assert nested.status_code == 200


def test_unknown_a1111_paths_answer_in_a1111s_error_shape(served):
    client, _, _ = served
    for method in ("GET", "POST"):
        answer = client.request(method, "/sdapi/v1/no-such-route")
        assert answer.status_code == 404 and answer.json() == {
            "error": "HTTPException",
            "detail": f"{method} /sdapi/v1/no-such-route is not served here (docs/protocols.md, "
                      "AUTOMATIC1111 API, lists the routes served)",
            "body": "", "errors": f"{method} /sdapi/v1/no-such-route is not served here (docs/protocols.md, "
                                  "AUTOMATIC1111 API, lists the routes served)"}
    assert client.get("/sdapi/v1/sd-models").json()[0]["title"] == "tiny-shapes"  # routes still answer first


@pytest.mark.parametrize("field", ["seed", "steps", "cfg_scale", "width", "height", "batch_size", "n_iter"])
def test_a1111_number_fields_refuse_booleans(served, field):
    client, calls, _ = served
    answer = client.post("/sdapi/v1/txt2img", json={"prompt": "x", field: True})
    assert answer.status_code == 422 and calls == []
    error = answer.json()["detail"][0]
    assert (error["loc"], error["msg"]) == (["body", field], "Value error, expected a number, got true")
    assert client.post("/sdapi/v1/txt2img", json={"prompt": "x", field: 2}).status_code == 200


def test_a1111_info_send_images_and_negative_prompts(served):
    """info's all_prompts / all_negative_prompts are each the prompt the images were made from (after the style);
    send_images false answers no images but the whole info."""
    client, _, _ = served
    body = {"prompt": "a red circle", "negative_prompt": "blue", "batch_size": 2}
    shown = client.post("/sdapi/v1/txt2img", json=body).json()
    info = json.loads(shown["info"])
    assert (info["all_prompts"], info["all_negative_prompts"], info["negative_prompt"]) == (
        ["styled a red circle"] * 2, ["styled blue"] * 2, "blue")
    assert len(shown["images"]) == 2
    assert info["infotexts"][1] == "a red circle\nNegative prompt: blue\nSteps: 2, Seed: 8"
    hidden = client.post("/sdapi/v1/txt2img", json={**body, "send_images": False}).json()
    assert hidden["images"] == [] and json.loads(hidden["info"])["all_seeds"] == [7, 8]
    assert json.loads(hidden["info"])["infotexts"] == info["infotexts"]


def test_a1111_fields_not_honoured_are_named_in_info_warnings_and_one_log_line(served):
    client, calls, lines = served
    body = {"prompt": "x", "firstphase_width": 512, "alwayson_scripts": {"ControlNet": {"args": []}},
            "restore_faces": True, "tiling": True, "subseed_strength": 0.5,
            "sampler_name": "Euler a", "s_noise": 0.9, "init_images": ["aGk="],
            "override_settings": {"sd_model_checkpoint": "tiny-shapes", "CLIP_stop_at_last_layers": 2,
                                  "sd_vae": "Automatic"}}
    info = json.loads(client.post("/sdapi/v1/txt2img", json=body).json()["info"])
    expected = [
        "firstphase_width=512 ignored: the hires fix's first pass is width x height here",
        'init_images=["aGk="] ignored: txt2img takes no image: send it to /sdapi/v1/img2img',
        "restore_faces=true ignored: no face restoration here",
        "tiling=true ignored: no tiling here: the images do not wrap around",
        "subseed_strength=0.5 ignored: no variation seeds here: each image is its seed alone",
        "s_noise=0.9 ignored: the sampler noise settings are fixed here (A1111's defaults)",
        "override_settings.CLIP_stop_at_last_layers=2 ignored: clip skip is fixed at 1 here",
    ]
    assert info["warnings"] == expected + ["engine note"]  # sd_vae "Automatic" is this server's value: no warning
    assert lines == [f"[app] A1111 txt2img: {len(expected)} field(s) not honoured: {'; '.join(expected)}"]
    lines.clear()
    defaults = {"prompt": "x", "enable_hr": False, "hr_scale": 2, "restore_faces": False, "tiling": None,
                "subseed": 5, "subseed_strength": 0, "seed_resize_from_w": -1, "s_noise": 1.0, "eta": None,
                "alwayson_scripts": {}, "script_args": [], "refiner_checkpoint": "", "denoising_strength": 0.7,
                "override_settings": {"sd_model_checkpoint": "tiny-shapes", "CLIP_stop_at_last_layers": 1},
                "do_not_save_grid": True}
    assert json.loads(client.post("/sdapi/v1/txt2img", json=defaults).json()["info"])["warnings"] == ["engine note"]
    assert lines == []
    for sampler, eta in (("Euler a", 1.0), ("DDIM", 0), ("DDIM", 1.0), ("Euler", 0.5), ("DPM++ 2M", 1.0),
                         ("TCD", 0.3), ("TCD", 1.0), ("DPM++ 2M SDE", 1.0), ("DPM++ SDE Karras", 0.5), ("DPM2 a", 0.0),
                         ("DDIM", None)):  # honoured (or, samplers without one, ignored by the engine as in A1111)
        sent = {"prompt": "x", "sampler_name": sampler, "eta": eta}
        warnings = json.loads(client.post("/sdapi/v1/txt2img", json=sent).json()["info"])["warnings"]
        assert warnings == ["engine note"] and calls[-1].engine.eta == eta


def test_a1111_disabled_controlnet_units_run_without_a_warning_and_other_scripts_are_named(served):
    """sd-webui-controlnet's units run here (tests/serving/apis/test_controlnet.py); disabled ones and an empty
    args change nothing and are no field "not honoured"; another script (ADetailer) is."""
    client, calls, lines = served
    for scripts, warned in (({"controlnet": {"args": [{"enabled": False, "module": "canny"}, {"enabled": "false"}]}},
                             False), ({"ControlNet": {"args": []}}, False), ({"controlnet": {}}, False),
                            ({"ADetailer": {"args": [{"ad_model": "x"}]}}, True)):
        response = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "alwayson_scripts": scripts})
        warnings = json.loads(response.json()["info"])["warnings"]
        assert response.status_code == 200 and warnings[0].startswith("alwayson_scripts=") is warned
        assert calls[-1].engine.control_units == ()
    assert warnings[0].endswith("ignored: no scripts or extensions here but ControlNet (ADetailer...): the others "
                                "did not run")
    assert len(calls) == 4


@pytest.mark.parametrize("scheduler", ["N/A", "", "automatic", "Use same scheduler", None, "whatever", "Karrass"])
def test_a1111_no_scheduler_names_are_automatic_as_in_a1111(scheduler):
    """A1111's get_sampler_and_scheduler reads a name that is none of its schedulers as Automatic."""
    assert sampler_of("Euler a", scheduler) == ("Euler a", None)
    assert sampler_of("DPM++ 2M", "N/A") == ("DPM++ 2M", None)


def test_a1111_schedulers_it_knows_but_this_server_lacks_are_refused():
    for scheduler in ("Polyexponential", "KL Optimal", "align_your_steps", "Normal"):
        with pytest.raises(ApiError) as err:
            sampler_of("Euler", scheduler)
        assert err.value.message.startswith(f"scheduler: unknown schedule type {scheduler!r}; choose one of ")


def test_openai_routes_encode_stream_and_warn(served):
    import base64
    import io

    from PIL import Image

    client, calls, lines = served
    answer = client.post("/v1/images/generations", json={"prompt": "a red circle", "model": "gpt-image-1", "n": 2,
                                                         "output_format": "jpeg", "output_compression": 50,
                                                         "quality": "high"})
    assert answer.status_code == 200 and answer.json()["output_format"] == "jpeg"
    assert answer.headers["x-sdxl-warnings"] == ('quality="high" ignored: no refiner is loaded here to refine with '
                                                 '(the server runs one with --refiner)')
    assert lines == ['[app] OpenAI images: 1 field(s) not honoured: quality="high" ignored: no refiner is loaded '
                     "here to refine with (the server runs one with --refiner)"]
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][1]["b64_json"])))
    comment = image.getexif().get_ifd(0x8769)[0x9286]
    assert image.format == "JPEG"
    assert comment == b"UNICODE\0" + "a red circle\nNegative prompt: \nSteps: 2, Seed: 8".encode("utf-16-be")
    assert tuple(round(c / 16) for c in image.convert("RGB").getpixel((4, 4))) == (16, 0, 0)  # red, as made
    webp = client.post("/v1/images/generations", json={"prompt": "x", "output_format": "webp"}).json()
    assert Image.open(io.BytesIO(base64.b64decode(webp["data"][0]["b64_json"]))).format == "WEBP"
    url = client.post("/v1/images/generations", json={"prompt": "x", "model": "dall-e-3"}).json()
    assert url["data"][0]["url"].startswith("http://testserver/v1/images/files/")
    served_png = url["data"][0]["url"].removeprefix("http://testserver")
    assert client.get(served_png).headers["content-type"] == "image/png"
    for wrong in (served_png.removesuffix(".png"), served_png + "/x", "/v1/images/files/"):  # not a name it gives
        missing = client.get(wrong)
        assert missing.status_code == 404 and missing.json()["error"]["message"].startswith(
            "no such image: /v1/images/files/"), (wrong, missing.text)
        assert "<token>.png" in missing.json()["error"]["message"]
    streamed = client.post("/v1/images/generations", json={"prompt": "x", "n": 2, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n") for block in streamed.text.strip().split("\n\n")]
    assert [e[0] for e in events] == ["event: image_generation.completed"] * 2
    data = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert [(d["type"], d["output_format"], d["size"]) for d in data] == [
        ("image_generation.completed", "png", "8x8")] * 2
    assert base64.b64decode(data[1]["b64_json"]) == _png("x\nNegative prompt: \nSteps: 2, Seed: 8")


def test_the_openai_sdk_reads_the_stream_and_the_jpeg(served):
    """openai's own client (over the TestClient's transport): stream=True yields the completed events as its
    types (ImageGenCompletedEvent), and output_format="jpeg" gives a JPEG."""
    import base64

    from openai import OpenAI

    client, _, _ = served
    sdk = OpenAI(base_url="http://testserver/v1", api_key="any", http_client=client)
    events = list(sdk.images.generate(model="gpt-image-1", prompt="a red circle", n=2, stream=True))
    assert [(type(e).__name__, e.type, e.size) for e in events] == [
        ("ImageGenCompletedEvent", "image_generation.completed", "8x8")] * 2
    assert base64.b64decode(events[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
    result = sdk.images.generate(model="dall-e-3", prompt="x", response_format="b64_json", output_format="jpeg")
    assert result.output_format == "jpeg" and base64.b64decode(result.data[0].b64_json)[:3] == b"\xff\xd8\xff"


def test_mcp_call_with_a_number_beyond_a_float_names_the_argument():
    """seed 1e400 reaches the mcp SDK as inf, which it turns into null ("None is not of type 'integer'"): the
    middleware answers the tools/call itself with a tool error naming seed and the number as sent; every other
    body reaches the app byte for byte, read in chunks."""
    from fastapi import FastAPI, Request
    from fastapi.testclient import TestClient

    from sdxl_engine.serving.apis import McpArguments

    app = FastAPI()

    @app.post("/gradio_api/mcp/")
    async def echo(request: Request):
        return {"echo": (await request.body()).decode()}

    app.add_middleware(McpArguments)
    client = TestClient(app)
    call = '{"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "generate", ' \
           '"arguments": {"prompt": "x", "seed": 1e400, "guidance_scale": 5.5}}}'
    answer = client.post("/gradio_api/mcp/", content=call)
    text = ("seed: 1e400 is not a finite number (beyond what JSON numbers can carry here); send a number within the "
            "argument's range")
    assert answer.status_code == 200
    assert answer.json() == {"jsonrpc": "2.0", "id": 3, "result": {"isError": True, "content": [{"type": "text",
                                                                                                  "text": text}]}}
    nan = client.post("/gradio_api/mcp/", content=call.replace("1e400", "7").replace("5.5", "NaN")).json()
    assert nan["result"]["content"][0]["text"].startswith("guidance_scale: NaN is not a finite number")
    # what the Python mcp SDK sends for float("inf"): null, named where the tool takes a number
    null = client.post("/gradio_api/mcp/", content=call.replace("1e400", "null")).json()
    assert null["result"]["isError"] is True and null["result"]["content"][0]["text"] == (
        "seed: got null where a number belongs (a client sends a number JSON cannot carry, such as 1e400 or "
        "infinity, as null); send a number within the argument's range")
    image_call = call.replace('"generate"', '"image_to_image"').replace('"seed": 1e400', '"seed": 1, "upscale": null')
    assert client.post("/gradio_api/mcp/", content=image_call).json()["result"]["content"][0]["text"].startswith(
        "upscale: got null where a number belongs")  # the image tool's numbers too
    text_null = call.replace("1e400", "7").replace('"prompt": "x"', '"prompt": "x", "negative_prompt": null')
    assert client.post("/gradio_api/mcp/", content=text_null).json() == {"echo": text_null}  # text may be null
    for body in (call.replace("1e400", "7"), "not json", "[" * 3000 + "]" * 3000,
                 '{"jsonrpc": "2.0", "method": "notifications/x", "params": {"v": 1e400}}'):
        assert client.post("/gradio_api/mcp/", content=body).json() == {"echo": body}

    def chunks():
        yield call[:20].encode()
        yield call[20:].encode()

    assert client.post("/gradio_api/mcp/", content=chunks()).json()["result"]["isError"] is True


def test_png_info_reads_this_servers_pngs_and_jpegs_and_a1111s_text(served):
    """POST /sdapi/v1/png-info (webuiapi's png_info): the parameters text of a PNG the handler wrote
    (images.png_bytes) or a JPEG the OpenAI route encoded, parsed as A1111's parse_generation_parameters."""
    import base64

    from sdxl_engine.service.images import a1111_parameters, png_bytes
    from sdxl_engine.serving.apis.openai_images import encode

    client, _, _ = served
    text = a1111_parameters("a red circle", "blue", 8, 5.0, 7, 64, 48, "tiny-shapes", sampler="DPM++ 2M Karras",
                            extra={"Lora hashes": '"ink: 24ffad87cf5b, peft: 8347dfde1941"'})
    png = png_bytes(np.zeros((48, 64, 3), np.uint8), text)
    expected = {"Prompt": "a red circle", "Negative prompt": "blue", "Steps": "8", "Sampler": "DPM++ 2M Karras",
                "CFG scale": "5", "Seed": "7", "Size-1": "64", "Size-2": "48", "Model": "tiny-shapes",
                "Lora hashes": "ink: 24ffad87cf5b, peft: 8347dfde1941"}
    answer = client.post("/sdapi/v1/png-info", json={"image": base64.b64encode(png).decode()})
    assert answer.status_code == 200 and answer.json() == {"info": text, "items": {}, "parameters": expected}
    jpeg = "data:image/jpeg;base64," + base64.b64encode(encode(png, "jpeg", 80)).decode()
    assert client.post("/sdapi/v1/png-info", json={"image": jpeg}).json()["parameters"] == expected
    plain = client.post("/sdapi/v1/png-info", json={"image": base64.b64encode(_png("a cat\nby me")).decode()}).json()
    assert plain["parameters"] == {"Prompt": "a cat\nby me", "Negative prompt": ""}  # no line of 3+ fields
    bad = client.post("/sdapi/v1/png-info", json={"image": "bm90IGFuIGltYWdl"})  # "not an image"
    assert bad.status_code == 422 and bad.json()["detail"] == ("image: not a base64 PNG, JPEG or WebP image "
                                                               "(cannot identify image file)")  # no object's repr
    bomb = client.post("/sdapi/v1/png-info", json={"image": base64.b64encode(png_header_only(60_000, 60_000)).decode()})
    assert bomb.status_code == 422 and bomb.json()["detail"].startswith("image: the image claims too many pixels")
    big = client.post("/sdapi/v1/png-info", json={"image": base64.b64encode(png_header_only(8000, 8000)).decode()})
    assert big.status_code == 200 and big.json()["info"] == ""  # under Pillow's limit: only its header is read


def test_the_readme_names_every_field_the_a1111_table_does_not_honour():
    """docs/protocols.md's AUTOMATIC1111 section lists IGNORED's fields by hand; this keeps the two from drifting."""
    from sdxl_engine.serving.apis.a1111 import IGNORED
    from tests.helpers import ROOT

    readme = (ROOT / "docs" / "protocols.md").read_text()
    section = readme[readme.index("### AUTOMATIC1111 API"):readme.index("### OpenAI Images API")]
    missing = [row.name for row in IGNORED if f"`{row.name}`" not in section
               and f"`{row.name.rsplit('_', 1)[0]}_w/h`" not in section
               and f"`{row.name.rsplit('_', 1)[0]}_width/height`" not in section]
    assert missing == []


def test_a1111_hires_fields_map_to_the_engines_and_keep_one_factor():
    from sdxl_engine.serving.apis.a1111 import Txt2ImgHires, hires_fields
    from sdxl_engine.serving.apis.core import ApiError

    assert hires_fields(Txt2ImgHires(prompt="x", hr_scale=3), 64, 64, 20) == ({}, [])  # enable_hr off
    fields, warnings = hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, hr_scale=1.5, denoising_strength=0.4,
                                                 hr_second_pass_steps=7, hr_upscaler="Latent (bicubic)"), 64, 48, 20)
    same = {"hires_prompt": None, "hires_negative_prompt": None}  # "": the first pass's
    assert fields == {"hires_scale": 1.5, "hires_strength": 0.4, "hires_steps": 7, "hires_upscaler": "Latent (bicubic)",
                      **same}
    assert warnings == []
    # no hr_second_pass_steps: A1111 passes the first pass's steps, and exactly that many run
    assert hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, hr_resize_y=96), 64, 48, 20)[0] == {
        "hires_scale": 2, "hires_strength": None, "hires_steps": 20, "hires_upscaler": None, **same}
    assert hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, hr_resize_x=128, hr_resize_y=96), 64, 48, 20)[0][
        "hires_scale"] == 2
    with pytest.raises(ApiError, match=r"^hr_resize_x/hr_resize_y: 128x128 has another aspect ratio than the first "
                                       r"pass's 64x48"):
        hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, hr_resize_x=128, hr_resize_y=128), 64, 48, 20)
    # the second pass's sampler (A1111 1.9's split names: hr_scheduler, else the first pass's scheduler) and prompts
    fields, warnings = hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, sampler_name="Euler",
                                                 hr_sampler_name="DPM++ 2M", hr_prompt="y", hr_negative_prompt=""),
                                    64, 64, 20)
    assert (fields["hires_sampler"], fields["hires_prompt"], fields["hires_negative_prompt"], warnings) == (
        "DPM++ 2M", "y", None, [])
    karras = Txt2ImgHires(prompt="x", enable_hr=True, sampler_name="Euler", scheduler="Karras",
                          hr_sampler_name="DPM++ 2M")
    assert hires_fields(karras, 64, 64, 20)[0]["hires_sampler"] == "DPM++ 2M"  # with the first pass's karras
    assert hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, sampler_name="DPM++ 2M", hr_scheduler="Karras"),
                        64, 64, 20)[0]["hires_sampler"] == "DPM++ 2M Karras"
    assert "hires_sampler" not in hires_fields(Txt2ImgHires(prompt="x", enable_hr=True,
                                                            hr_sampler_name="Use same sampler"), 64, 64, 20)[0]
    for bad, field in (({"hr_sampler_name": "Euler q"}, "hr_sampler_name"),
                       ({"hr_scheduler": "Karras"}, "hr_scheduler"), ({"hr_scheduler": "KL Optimal"}, "hr_scheduler")):
        with pytest.raises(ApiError) as err:
            hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, sampler_name="Euler", **bad), 64, 64, 20)
        assert err.value.param == field and err.value.message.startswith(f"{field}: "), err.value.message
    # an older combined name for the second pass carries its own type: the refusal names that field, not hr_scheduler
    with pytest.raises(ApiError) as err:
        hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, sampler_name="Euler", hr_sampler_name="DPM++ SDE Karras"),
                     64, 64, 20)
    assert err.value.param == "hr_sampler_name" and err.value.message.startswith(
        "hr_sampler_name: 'DPM++ SDE Karras' names the schedule type 'karras'; this server's second pass runs the "
        "first pass's (scheduler 'Automatic')")
    assert hires_fields(Txt2ImgHires(prompt="x", enable_hr=True, sampler_name="Euler", scheduler="Karras",
                                     hr_sampler_name="DPM++ SDE Karras"), 64, 64, 20)[0]["hires_sampler"] == "DPM++ SDE"


def test_a1111_refiner_checkpoint_must_name_the_loaded_refiner(tmp_path):
    import types

    from sdxl_engine.serving.apis.a1111 import Txt2Img, refiner_fields

    folder = tmp_path / "sdxl-refiner"
    folder.mkdir()
    engine = types.SimpleNamespace(config=types.SimpleNamespace(refiner=str(folder)))
    assert refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="None", refiner_switch_at=0.5), engine) == {}
    assert refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="sdxl-refiner [0123abcd]"), engine) == {
        "refiner_switch_at": 0.8}
    assert refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="sdxl-refiner.safetensors",
                                  refiner_switch_at=0.6), engine) == {"refiner_switch_at": 0.6}
    assert refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="sdxl-refiner", refiner_switch_at=1),
                          engine) == {}  # A1111 switches after the last step: no refiner
    with pytest.raises(ApiError, match=r"^refiner_checkpoint: unknown refiner 'other'; this server offers: "
                                             r"sdxl-refiner$") as err:
        refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="other"), engine)
    assert err.value.status == 422
    none = types.SimpleNamespace(config=types.SimpleNamespace(refiner=""))
    with pytest.raises(ApiError, match="no refiner is loaded here"):
        refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="sdxl-refiner"), none)


def test_a1111_refiner_checkpoint_chooses_among_several_refiners():
    """With several refiners (the engine's refiner_names: --refiner repeated, --refiners-dir) refiner_checkpoint picks
    one by name or A1111 title: the first is the default (no ``refiner`` field), another is the request's."""
    from sdxl_engine.serving.apis.a1111 import Txt2Img, refiner_fields

    class Engine:
        config = None

        def model_names(self):
            return ["base"]

        def refiner_names(self):
            return ["first", "second"]

    engine = Engine()
    assert refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="first [0123abcd]"), engine) == {
        "refiner_switch_at": 0.8}
    assert refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="second.safetensors", refiner_switch_at=0.6),
                          engine) == {"refiner_switch_at": 0.6, "refiner": "second"}
    with pytest.raises(ApiError, match="^refiner_checkpoint: unknown refiner 'third'; this server offers: "
                                             "first, second$"):
        refiner_fields(Txt2Img(prompt="x", refiner_checkpoint="third"), engine)


def test_override_settings_that_is_no_object_is_refused_naming_it():
    """A1111's override_settings is a dict (its pydantic model answers 422 for another type); a string, number or
    list was ignored without a word."""
    from sdxl_engine.serving.apis.a1111 import model_field

    engine = SimpleNamespace(model_names=lambda: ["a", "b"], find_model=lambda t: t if t in ("a", "b") else None)
    for sent, shown in (("str", 'str "str"'), (5, "int 5"), ([1, 2], "list [1, 2]")):
        with pytest.raises(ApiError) as err:
            model_field(Txt2Img(prompt="x", override_settings=sent), engine, None)
        assert (err.value.status, err.value.param) == (422, "override_settings")
        assert err.value.message == ('override_settings: expected an object of options ({"sd_model_checkpoint": '
                                     f"...}}), got {shown}")
    assert model_field(Txt2Img(prompt="x", override_settings={"sd_model_checkpoint": "b"}), engine, None) == \
        {"model": "b"}
    assert model_field(Txt2Img(prompt="x", override_settings=None), engine, None) == {}


def test_a_run_over_the_limit_is_refused_under_the_field_each_protocols_client_can_change():
    """The engine's run-time refusal names num_inference_steps (engine/durations.py): A1111's clients send it as
    ``steps``; OpenAI's send no steps (the model's run), so the refusal names the ``size`` they can change."""
    from sdxl_engine.engine.validation import InvalidRequest
    from sdxl_engine.serving.apis.core import refused_field

    err = InvalidRequest("num_inference_steps", "640x640 x 4 images, 8 steps to run, would hold this server's devices "
                                                "about 23 s, over its limit of 10 s (max_run_seconds)")
    openai, _ = openai_call({"prompt": "a red circle", "size": "640x640"}, ["tiny-shapes"])
    refusal = refused_field(err, openai)
    assert (refusal.status, refusal.param) == (400, "size") and refusal.message.startswith("size: 640x640 x 4 images")
    refusal = refused_field(err, a1111_call(Txt2Img(prompt="a red circle", steps=8)))
    assert refusal.param == "steps" and refusal.message.startswith("steps: 640x640 x 4 images")


def test_a1111_answers_one_mistake_with_one_status_on_every_route(served):
    """A value /sdapi/v1 cannot take is A1111's 422 (FastAPI's status for a body that does not validate) on every
    route: an unknown model in POST /options as in txt2img's override_settings, an unknown refiner, an option this
    server fixes; each naming the field, nothing generated."""
    client, calls, _ = served
    options = client.post("/sdapi/v1/options", json={"sd_model_checkpoint": "sdxl-turbo"})
    txt2img = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "override_settings": {
        "sd_model_checkpoint": "sdxl-turbo"}})
    refiner = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "refiner_checkpoint": "sd_xl_refiner_1.0"})
    fixed = client.post("/sdapi/v1/options", json={"CLIP_stop_at_last_layers": 2})
    assert [a.status_code for a in (options, txt2img, refiner, fixed)] == [422] * 4 and calls == []
    assert options.json()["detail"] == ("sd_model_checkpoint: unknown model 'sdxl-turbo'; this server offers: "
                                        "tiny-shapes")
    assert txt2img.json()["detail"] == ("override_settings.sd_model_checkpoint: unknown model 'sdxl-turbo'; this "
                                        "server offers: tiny-shapes")
    assert refiner.json()["detail"].startswith("refiner_checkpoint: no refiner is loaded here")
    assert fixed.json()["detail"] == ("options are fixed at start-up (flags or SDXL_* settings); cannot change "
                                      "CLIP_stop_at_last_layers")


def test_openai_says_in_its_warnings_when_a_stop_left_fewer_images_than_asked():
    """A request stopped after some of its engine calls (the jobs API's DELETE, or its owner's interrupt) answers
    the images made, 200, and names the stop in X-SDXL-Warnings (a stop before any image is the 409)."""
    import asyncio

    from sdxl_engine.serving.apis.core import Generated
    from sdxl_engine.serving.apis.openai_images import respond

    info = {"width": 8, "height": 8}
    made = Generated([_png("a"), _png("b")], [1, 2], info, ["a", "b"], stopped="cancelled by its owner")
    answer = Answer(warnings=("style=vivid ignored: no such style",))
    response = asyncio.run(respond(None, made, answer, None, lambda: ""))
    assert response.status_code == 200 and len(json.loads(response.body)["data"]) == 2
    assert response.headers["x-sdxl-warnings"] == ("style=vivid ignored: no such style; "
                                                   "stopped after 2 image(s): cancelled by its owner")
    whole = asyncio.run(respond(None, dataclasses.replace(made, stopped=None), Answer(), None, lambda: ""))
    assert "x-sdxl-warnings" not in whole.headers


def test_openai_names_the_fields_it_does_not_know_in_its_warnings(served):
    """A generations body with fields OpenAI's Images API does not have (an SD client's steps, a typo) is served,
    and its X-SDXL-Warnings says they were ignored; OpenAI's own fields and the extensions are not named."""
    client, calls, lines = served
    answer = client.post("/v1/images/generations", json={"prompt": "x", "bogus": 1, "num_inference_steps": 0,
                                                         "user": "me", "hires_scale": None})
    assert answer.status_code == 200
    assert answer.headers["x-sdxl-warnings"] == (
        "bogus, num_inference_steps ignored: not fields of the OpenAI Images API (nor of this server's extensions: "
        "refiner_switch_at, hires_scale, hires_upscaler, hires_strength, hires_steps)")
    assert "bogus, num_inference_steps ignored" in lines[-1]
    known = client.post("/v1/images/generations", json={"prompt": "x", "user": "me", "moderation": "low", "n": 1})
    assert "x-sdxl-warnings" not in known.headers
