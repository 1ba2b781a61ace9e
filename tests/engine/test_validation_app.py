"""The bad-input matrix: every row through gradio_client against the running app, and through
the engine directly. Each bad row must come back as an error whose message names the argument
(the engine's own message, not Gradio's), and a valid request after them must still succeed
(checked once per path, after every row: a refusal runs nothing, so one generation shows the
server is still whole).

Rows with ``ok`` are accepted inputs (cleaned or defaulted); ``check`` then looks at the
result's info (API) / validated request (engine).
"""

import json
import math

import httpx
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from tests.helpers import QUICK, assert_serves

pytestmark = pytest.mark.e2e

MAX_SEED = 2**32 - 1
BAD = [
    # prompts: empty and whitespace-only prompts are refused (an empty SDXL prompt is noise, not a picture)
    ("empty prompt", dict(prompt=""), r"prompt: is empty"),
    ("whitespace prompt", dict(prompt="  \t\n "), r"prompt: is empty"),
    ("control-only prompt", dict(prompt="\x00\x01\x1b"), r"prompt: is empty"),
    ("invisible-only prompt", dict(prompt="\u200d \u200c\u3164\u2800"), r"prompt: is empty"),
    ("None prompt", dict(prompt=None), r"prompt: is empty"),
    ("prompt over 20000 chars", dict(prompt="a" * 20_001), r"prompt: is 20001 characters long; the limit is 20000"),
    ("int prompt", dict(prompt=5), r"prompt: expected text, got int"),
    ("list prompt", dict(prompt=["a red circle"]), r"prompt: expected text, got list"),
    ("dict negative prompt", dict(negative_prompt={"a": 1}), r"negative_prompt: expected text, got dict"),
    # seed
    ("seed -2", dict(seed=-2), rf"seed: must be between -1 and {MAX_SEED}, got -2"),
    ("seed 2**32", dict(seed=2**32), rf"seed: must be between -1 and {MAX_SEED}, got {2**32}"),
    ("seed 2**64", dict(seed=2**64), r"seed: must be between -1 and"),
    ("seed 1.5", dict(seed=1.5), r"seed: expected a whole number, got 1.5"),
    ("seed text", dict(seed="abc"), r"seed: expected a whole number, got 'abc'"),
    ("seed bool", dict(seed=True), r"seed: expected a whole number, got bool"),
    ("seed nan text", dict(seed="nan"), r"seed: expected a whole number, got 'nan'"),
    # guidance_scale
    ("guidance -1", dict(guidance_scale=-1), r"guidance_scale: must be between 0 and 50, got -1"),
    ("guidance huge", dict(guidance_scale=1e300), r"guidance_scale: must be between 0 and 50, got 1e\+300"),
    ("guidance nan", dict(guidance_scale="nan"), r"guidance_scale: must be a finite number, got 'nan'"),
    ("guidance inf", dict(guidance_scale="inf"), r"guidance_scale: must be a finite number, got 'inf'"),
    ("guidance -inf", dict(guidance_scale="-inf"), r"guidance_scale: must be a finite number, got '-inf'"),
    ("guidance 1e400 text", dict(guidance_scale="1e400"), r"guidance_scale: must be a finite number"),
    ("guidance text", dict(guidance_scale="high"), r"guidance_scale: expected a number, got 'high'"),
    ("guidance list", dict(guidance_scale=[7]), r"guidance_scale: expected a number, got list"),
    # num_inference_steps
    ("steps 0", dict(num_inference_steps=0), r"num_inference_steps: must be between 1 and 50, got 0"),
    ("steps -3", dict(num_inference_steps=-3), r"num_inference_steps: must be between 1 and 50, got -3"),
    ("steps max+1", dict(num_inference_steps=51), r"num_inference_steps: must be between 1 and 50, got 51"),
    ("steps 1e9", dict(num_inference_steps=10**9), r"num_inference_steps: must be between 1 and 50, got 1000000000"),
    ("steps 2.5", dict(num_inference_steps=2.5), r"num_inference_steps: expected a whole number, got 2.5"),
    # width / height (0 = the model's default)
    ("width negative", dict(width=-64), r"width: must be between 0 and 65536, got -64"),
    ("height negative", dict(height=-1), r"height: must be between 0 and 65536, got -1"),
    ("width not multiple", dict(width=70), r"width: 70 is not a multiple of 16 pixels"),
    ("height not multiple", dict(height=63), r"height: 63 is not a multiple of 16 pixels"),
    ("width huge", dict(width=10**6), r"width: must be between 0 and 65536"),
    ("size over the pixel budget", dict(width=2048, height=1024),
     r"width/height: 2048x1024 is 2097152 pixels; this server makes up to 1048576 \(max_pixels\), any multiple of 16 "
     r"pixels per side \(the model's sizes: 64x64"),
    ("size far over it", dict(width=8192, height=8192), r"width/height: 8192x8192 is 67108864 pixels"),
    ("width text", dict(width="wide"), r"width: expected a whole number, got 'wide'"),
    # sampler (A1111 names)
    ("unknown sampler", dict(sampler="DPM adaptive"), r"sampler: unknown sampler 'DPM adaptive'; choose one of Euler, "
                                                 r"Euler a, DPM\+\+ 2M, DPM\+\+ 2M Karras, DPM\+\+ 2M SDE, "
                                                 r"DPM\+\+ 3M SDE, UniPC, DDIM, LCM"),
    ("sampler number", dict(sampler=3), r"sampler: expected a sampler's name \(text\), got int 3"),
]

OK = [
    ("10000-char prompt is cut to 3 chunks of 75 tokens", dict(prompt="a red circle " * 770),
     lambda info: info["warnings"] == ["prompt needs more than 3 chunks of 75 tokens (each BREAK starts one) and "
                                       "was cut to 3 (225 tokens, the max_prompt_chunks setting)"]
     and info["prompt_chunks"] == 3),
    ("control chars and NUL become spaces", dict(prompt="a\x00red\x07circle\u202e"),
     lambda info: info["prompt"] == "a red circle"),
    ("emoji kept", dict(prompt="a red 🔴 circle 👩‍👩‍👧"), lambda info: info["prompt"] == "a red 🔴 circle 👩‍👩‍👧"),
    ("right-to-left text kept", dict(prompt="دائرة حمراء red circle"),
     lambda info: info["prompt"] == "دائرة حمراء red circle"),
    ("seed -1 is random", dict(seed=-1), lambda info: 0 <= info["seeds"][0] <= MAX_SEED),
    ("seed max", dict(seed=MAX_SEED), lambda info: info["seeds"] == [MAX_SEED, 0, 1, 2]),
    ("seed as numeric text", dict(seed="12"), lambda info: info["seeds"] == [12, 13, 14, 15]),
    ("seed whole float", dict(seed=3.0), lambda info: info["seeds"] == [3, 4, 5, 6]),
    ("guidance 0", dict(guidance_scale=0), lambda info: info["guidance_scale"] == 0.0),
    ("guidance max", dict(guidance_scale=50), lambda info: info["guidance_scale"] == 50.0),
    ("steps max", dict(num_inference_steps=50), lambda info: info["num_inference_steps"] == 50),
    ("size 0 = default", dict(width=0, height=0), lambda info: (info["width"], info["height"]) == (64, 64)),
    ("another bucket", dict(width=80, height=48), lambda info: (info["width"], info["height"]) == (80, 48)),
    ("None values = defaults", dict(negative_prompt=None, seed=None, guidance_scale=None, sampler=None),
     lambda info: info["guidance_scale"] == 5.0 and info["negative_prompt"] == "" and info["sampler"] == "Euler"),
    ("sampler name in any case", dict(sampler="dpm++ 2m karras"), lambda info: info["sampler"] == "DPM++ 2M Karras"),
]
VALID = QUICK


@pytest.fixture(scope="module")
def client(app_server):
    return app_server.client()


def refused_through_api(client, kwargs, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=message) as caught:
        client.predict(api_name="/generate", **{**VALID, **kwargs})
    assert "upstream Gradio app has raised an exception" not in str(caught.value)


@pytest.mark.parametrize("kwargs, message", [pytest.param(k, m, id=i) for i, k, m in BAD])
def test_bad_input_through_api_is_a_clear_error(client, kwargs, message):
    refused_through_api(client, kwargs, message)


def test_the_app_serves_after_every_bad_input(client):
    for _, kwargs, message in BAD:
        refused_through_api(client, kwargs, message)
    assert_serves(client)


@pytest.mark.parametrize("kwargs, check", [pytest.param(k, c, id=i) for i, k, c in OK])
def test_accepted_input_through_api(client, kwargs, check):
    gallery, info = client.predict(api_name="/generate", **{**VALID, **kwargs})
    assert len(gallery) == 4
    assert check(info), info


def refused_by_engine(engine, kwargs, message):
    # BAD is for the app's tiny-shapes; this is tiny-random.
    message = message.replace("multiple of 16", "multiple of 8")
    with pytest.raises(InvalidRequest, match=message) as caught:
        engine.generate(GenerateRequest(**{**VALID, **kwargs}))
    assert caught.value.field in str(caught.value) and message.startswith(caught.value.field)


@pytest.mark.parametrize("kwargs, message", [pytest.param(k, m, id=i) for i, k, m in BAD])
def test_bad_input_in_engine_is_typed_error(engine, kwargs, message):
    refused_by_engine(engine, kwargs, message)


NON_FINITE = [
    pytest.param(dict(guidance_scale=math.nan), "guidance_scale: must be a finite number, got nan", id="float nan"),
    pytest.param(dict(guidance_scale=math.inf), "guidance_scale: must be a finite number, got inf", id="float inf"),
    pytest.param(dict(seed=math.inf), "seed: expected a whole number, got inf", id="seed inf"),
]


@pytest.mark.parametrize("kwargs, message", NON_FINITE)
def test_non_finite_floats_in_engine(engine, kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(GenerateRequest(**{**VALID, **kwargs}))


def test_the_engine_serves_after_every_bad_input(engine):
    for _, kwargs, message in BAD:
        refused_by_engine(engine, kwargs, message)
    for row in NON_FINITE:
        with pytest.raises(InvalidRequest, match=row.values[1]):
            engine.generate(GenerateRequest(**{**VALID, **row.values[0]}))
    assert engine.generate(GenerateRequest(**VALID)).seeds == [1, 2, 3, 4]


def test_non_finite_floats_in_raw_json_are_clear_errors(app_server, client):
    """gradio_client refuses to send NaN/inf (not valid JSON), but a raw client can send NaN."""
    for token, message in (("NaN", "guidance_scale: must be a finite number, got nan"),
                           ("Infinity", "guidance_scale: must be a finite number, got inf")):
        body = f'{{"data": ["a red circle", "", 1, {token}, 2, 0, 0, "(No style)", "Euler"]}}'
        event = httpx.post(app_server.url + "gradio_api/call/generate", content=body,
                           headers={"content-type": "application/json"}, timeout=30).json()["event_id"]
        text = httpx.get(app_server.url + f"gradio_api/call/generate/{event}", timeout=60).text
        assert "event: error" in text and message in text, text
    assert_serves(client)


def test_missing_and_extra_arguments_are_refused_by_the_client(client):
    with pytest.raises(TypeError, match="No value provided for required argument: prompt"):
        client.predict(api_name="/generate", seed=3)
    with pytest.raises(TypeError, match="Parameter `scheduler` is not a valid key-word argument"):
        client.predict(api_name="/generate", prompt="a red circle", scheduler="Euler a")
    assert_serves(client)


INPUTS = "prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, height, style, sampler"


@pytest.mark.parametrize("values", [[], ["a red circle"], ["a red circle", "", 1, 5.0, 2, 0, 0, "(No style)"]],
                         ids=["none", "one", "eight"])
def test_too_few_values_in_a_raw_call_get_a_message_naming_the_inputs(app_server, client, values):
    message = f"generate takes 9 inputs ({INPUTS}); got {len(values)}"
    response = httpx.post(app_server.url + "gradio_api/call/generate", json={"data": values}, timeout=30)
    assert response.status_code == 422 and response.json()["error"].startswith(message), response.text
    # The queue route the page and gradio_client use: the same check, by fn_index.
    config = httpx.get(app_server.url + "config", timeout=30).json()
    fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
    response = httpx.post(app_server.url + "gradio_api/queue/join", timeout=30, json={
        "data": values, "fn_index": fn_index, "session_hash": "arity0test", "event_data": None, "trigger_id": None})
    assert response.status_code == 422 and response.json()["detail"].startswith(message), response.text
    assert_serves(client)


def test_engine_requires_a_prompt_argument():
    with pytest.raises(TypeError, match="prompt"):
        GenerateRequest()  # the engine's request type has no default prompt
    # the model is chosen per request by name (docs/models.md); None is the default, and the engine checks names
    assert GenerateRequest("a red circle").model is None and GenerateRequest("x", model="other").model == "other"


def test_api_error_message_is_the_engines_not_gradios(client):
    """The page's components have bounds (seed >= -1, steps <= 50), but they do not check API
    values: the engine's message, with the argument's name, is what the client sees."""
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as caught:
        client.predict(api_name="/generate", prompt="x", seed=-5)
    assert str(caught.value).startswith("seed: must be between -1 and")
    assert "less than minimum value" not in str(caught.value)


def test_info_is_json_serialisable(app_server):
    """The info as it goes over the wire (gradio_client would have decoded it already): strict
    JSON (no NaN or Infinity), every value a JSON type, the documented keys."""
    event = httpx.post(app_server.url + "gradio_api/call/generate", timeout=30,
                       json={"data": ["a red circle", "", 1, 5.0, 2, 0, 0, "(No style)", "Euler"]}).json()["event_id"]
    text = httpx.get(app_server.url + f"gradio_api/call/generate/{event}", timeout=60).text
    assert "event: complete" in text, text
    payload = [line[6:] for line in text.splitlines() if line.startswith("data: ")][-1]  # the completed event's

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    gallery, info = json.loads(payload, parse_constant=refuse)
    assert len(gallery) == 4 and isinstance(info, dict)
    assert {"seeds", "latency_s", "device_count", "device", "timings_s", "prompt", "negative_prompt",
            "guidance_scale", "num_inference_steps", "sampler", "width", "height", "model", "warnings",
            "style"} <= set(info)
    assert "user_prompt" not in info  # what the user typed goes to the browser's history, not the API
    assert json.loads(json.dumps(info, allow_nan=False)) == info
    # Numbers arrive as JSON numbers (not strings, not null for a NaN): a numpy value or a NaN would show here.
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    assert all(number(v) for v in [info["latency_s"], info["guidance_scale"], *info["timings_s"].values()]), info
    assert all(isinstance(v, int) for v in [*info["seeds"], info["device_count"], info["num_inference_steps"],
                                            info["width"], info["height"]]), info


def test_bad_input_shows_as_gr_error_in_the_page(app_server):
    """The page shows the engine's message as a gr.Error pop-up, then generates normally."""
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on this machine")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(app_server.url)
            page.get_by_label("Prompt").fill("  \t ")
            page.get_by_role("button", name="Generate").click()
            page.wait_for_selector("text=prompt: is empty", timeout=30_000)
            page.get_by_label("Prompt").fill("a red circle")
            page.get_by_role("button", name="Generate").click()
            page.wait_for_selector(r"text=/seed \d+/", timeout=60_000)
        finally:
            browser.close()
