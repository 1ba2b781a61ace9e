"""Security settings checked without an app: the HTTP guard's body cap, the launch defaults, the cross-site rule,
the upload route's bookkeeping."""

import json
from pathlib import Path

import pytest


def test_guard_never_passes_more_than_the_cap_to_the_app():
    """The guard alone, on a dummy app: a chunked body stops at the cap; the app sees a disconnect."""
    import asyncio

    from sdxl_engine.serving import guard as serving

    received, sent = [], []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            received.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                return

    async def run(path):
        chunks = [{"type": "http.request", "body": b"x" * 300_000, "more_body": True} for _ in range(10)]
        chunks.append({"type": "http.request", "body": b"", "more_body": False})

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        await serving.Guard(app, max_body=1_000_000)(scope, receive, send)

    asyncio.run(run("/v1/images/generations"))  # passed on as it comes
    assert sum(len(m.get("body", b"")) for m in received) <= 1_000_000
    assert received[-1]["type"] == "http.disconnect"
    assert sent[0]["status"] == 413
    received.clear(), sent.clear()
    asyncio.run(run("/gradio_api/cancel"))  # not read by the guard (a cancel is Gradio's): passed on, cut at the cap
    assert sum(len(m.get("body", b"")) for m in received) <= 1_000_000
    assert received[-1]["type"] == "http.disconnect" and sent[0]["status"] == 413


def test_a_raw_call_without_the_later_optional_inputs_gets_their_defaults_and_one_with_too_few_a_422():
    """A raw /generate call with the nine values of its first release reaches Gradio with the refiner switch's
    default appended (what gradio_client sends); eight values get a 422 naming the nine, then the optional one."""
    import asyncio
    import json

    from sdxl_engine.serving import guard as serving

    names = ("prompt", "negative_prompt", "seed", "guidance_scale", "num_inference_steps", "width", "height",
             "style", "sampler", "refiner_switch_at")
    nine = ["a red circle", "", 1, 7, 2, 0, 0, "(No style)", "Euler"]
    received, sent = [], []

    async def app(scope, receive, send):
        received.append((dict(scope["headers"])[b"content-length"], await receive()))

    def post(path, payload):
        body = json.dumps(payload).encode()

        async def run():
            chunks = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return chunks.pop(0)

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": path,
                     "headers": [(b"content-length", str(len(body)).encode())]}
            await serving.Guard(app, inputs={"generate": names}, fns={3: "generate"},
                                defaults={"generate": (0.8,)})(scope, receive, send)
        asyncio.run(run())

    post("/gradio_api/call/generate", {"data": nine})
    post("/gradio_api/queue/join", {"data": nine, "fn_index": 3, "session_hash": "s"})
    post("/gradio_api/call/generate", {"data": [*nine, 1.0]})  # sent whole: as it is
    assert [json.loads(m["body"])["data"] for _, m in received] == [[*nine, 0.8], [*nine, 0.8], [*nine, 1.0]]
    assert [int(length) for length, m in received] == [len(m["body"]) for _, m in received]
    assert json.loads(received[1][1]["body"])["session_hash"] == "s"
    assert sent == []
    post("/gradio_api/call/generate", {"data": nine[:8]})
    assert len(received) == 3 and sent[0]["status"] == 422
    assert json.loads(sent[1]["body"])["error"].startswith(
        "generate takes 9 inputs (prompt, negative_prompt, seed, guidance_scale, num_inference_steps, width, "
        "height, style, sampler); got 8. Send every value in this order; refiner_switch_at may follow them")


def test_launch_defaults(monkeypatch):
    from sdxl_engine.serving import cli
    from sdxl_engine.serving import server as serving

    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    monkeypatch.setenv("GRADIO_SHARE", "True")  # launch(share=False) overrides Gradio's env switch
    args = cli.parse_args([])
    options = serving.launch_options(args.host, args.port, args.share)
    assert options["server_name"] == "127.0.0.1" and options["share"] is False
    assert options["ssr_mode"] is False and options["enable_monitoring"] is False and options["mcp_server"] is False
    # Per uploaded file: one image's cap (the page's image editor is the one upload the guard lets through).
    assert options["allowed_paths"] == [] and options["max_file_size"] == 16 * 1024 * 1024
    assert serving.launch_options("0.0.0.0", 7860, True)["share"] is True  # only when asked


def test_only_the_image_tools_and_the_image_routes_may_send_more_than_1_mb():
    """A 2 MB body passes on the image routes (txt2img too: ControlNet units' images), a raw call or queue/join of
    image_to_image or generate (its control_image) and an MCP tools/call of them; the same size of any other call,
    join or MCP message is the 1 MB cap's 413 and never reaches the app."""
    import asyncio
    import json

    from sdxl_engine.serving import guard as serving

    def post(path: str, body: bytes, fns=None) -> tuple[int, int]:
        received, sent = [], []

        async def app(scope, receive, send):
            message = await receive()
            received.append(message)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        async def run():
            chunks = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return chunks.pop(0) if chunks else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": path,
                     "headers": [(b"content-length", str(len(body)).encode())]}
            await serving.Guard(app, max_body=1_000_000, fns=fns)(scope, receive, send)

        asyncio.run(run())
        return sent[0]["status"], sum(len(m.get("body", b"")) for m in received)

    pad = "x" * 2_000_000
    fns = {3: "generate", 7: "image_to_image", 9: "upscale"}
    tool_call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "image_to_image",
                                                                             "arguments": {"image": pad}}}
    passed = [("/sdapi/v1/img2img", {"init_images": [pad]}), ("/v1/images/edits", {"x": pad}),
              ("/gradio_api/call/image_to_image", {"data": [pad]}), ("/gradio_api/queue/join", {"fn_index": 7,
                                                                                                 "data": [pad]}),
              ("/gradio_api/mcp/", tool_call), ("/sdapi/v1/txt2img", {"prompt": pad}),
              ("/gradio_api/call/generate", {"data": [pad]}), ("/gradio_api/queue/join", {"fn_index": 3,
                                                                                          "data": [pad]}),
              ("/gradio_api/mcp/", {**tool_call, "params": {"name": "generate", "arguments": {"prompt": pad}}}),
              ("/controlnet/detect", {"controlnet_input_images": [pad]})]
    for path, payload in passed:
        body = json.dumps(payload).encode()
        assert post(path, body, fns) == (200, len(body)), path
    refused = [("/v1/images/generations", {"prompt": pad}), ("/gradio_api/call/upscale", {"data": [pad]}),
               ("/gradio_api/queue/join", {"fn_index": 9, "data": [pad]}),
               ("/gradio_api/mcp/", {**tool_call, "params": {"name": "other", "arguments": {"prompt": pad}}}),
               ("/gradio_api/mcp", {"jsonrpc": "2.0", "method": "tools/list", "pad": pad})]
    for path, payload in refused:
        assert post(path, json.dumps(payload).encode(), fns) == (413, 0), path
    small = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
    assert post("/gradio_api/mcp/", small, fns) == (200, len(small))


def test_a_large_image_call_is_parsed_once_and_reaches_gradio_cleaned_and_completed(monkeypatch):
    """A 2 MB queue/join of the image event through every check (the cap, the routes, the select data cut, the raw
    call's optional inputs): its body is parsed once and encoded once, and Gradio reads the rewritten body with its
    own Content-Length."""
    import asyncio
    import json
    import types

    from sdxl_engine.serving import guard as serving

    routes = object.__new__(serving.Routes)  # the routes of a page whose queued events are 3 and 7
    routes.demo = types.SimpleNamespace(fns={})  # its event table names none of them: no ControlNet upload
    routes.api_names, routes.queued, routes.direct = frozenset({"generate"}), frozenset({3, 7}), frozenset()
    payload = {"fn_index": 7, "session_hash": "s", "data": ["x" * 2_000_000, 0.5],
               "event_data": {"index": 2, "value": {"image": {"path": "/etc/passwd"}}}}
    body = json.dumps(payload).encode()
    received = []

    async def app(scope, receive, send):
        received.append((dict(scope["headers"])[b"content-length"], await receive()))

    async def run():
        chunks = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return chunks.pop(0)

        async def send(message):
            raise AssertionError(f"answered by the guard: {message}")

        scope = {"type": "http", "method": "POST", "path": "/gradio_api/queue/join",
                 "headers": [(b"content-length", str(len(body)).encode())]}
        await serving.Guard(app, max_body=1_000_000, routes=routes, inputs={"image_to_image": ("image", "strength",
                                                                                              "seed")},
                            fns={3: "generate", 7: "image_to_image"}, defaults={"image_to_image": (42,)})(
            scope, receive, send)

    counts = {"loads": 0, "dumps": 0}
    loads, dumps = json.loads, json.dumps

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(json, "loads", counted("loads", loads))
    monkeypatch.setattr(json, "dumps", counted("dumps", dumps))
    asyncio.run(run())
    monkeypatch.undo()
    assert counts == {"loads": 1, "dumps": 1}
    (length, message), = received
    seen = json.loads(message["body"])
    assert int(length) == len(message["body"])
    assert seen["data"] == ["x" * 2_000_000, 0.5, 42]  # the optional seed filled in
    assert seen["event_data"] == {"index": 2, "value": None, "selected": True}  # the client's file object cut


# --- requests from another site's page: one rule for every route (guard.cross_site_refusal) ---------------------

GRADIO_POSTS = ("/gradio_api/call/generate", "/gradio_api/queue/join", "/gradio_api/run/predict", "/gradio_api/upload",
                "/gradio_api/cancel", "/gradio_api/mcp/")


def post_through_the_guard(path: str, headers: dict, method: str = "POST", content: bytes = b"{}"):
    """``method path`` with ``headers`` and the body ``content`` through the Guard alone (no Routes), to an app that
    notes the call and answers 200 with the body it received; served at http://127.0.0.1:7860 (its Host header).
    Returns (response, paths the app saw, log)."""
    import asyncio

    import httpx

    from sdxl_engine.serving import guard as serving

    ran, log = [], []

    async def app(scope, receive, send):
        ran.append(scope["path"])
        received = (await receive()).get("body", b"")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": received})

    async def go():
        transport = httpx.ASGITransport(app=serving.Guard(app, log=log.append))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7860") as client:
            return await client.request(method, path, headers=headers, content=content)

    return asyncio.run(go()), ran, log


@pytest.mark.parametrize("headers", [
    {"origin": "http://evil.example"},  # issue #47: curl (or an older browser) with a foreign Origin alone
    {"origin": "https://evil.example", "sec-fetch-site": "cross-site"},
    {"sec-fetch-site": "same-site"},
    {"origin": "null"},  # a sandboxed frame or a file:// page
    {"origin": "http://127.0.0.1.evil.example"},
    {"origin": "http://127.0.0.1:7861"},  # another port is another origin
])
def test_gradios_routes_refuse_another_sites_page_as_the_protocols_do(headers):
    """A foreign Origin on /gradio_api/call/generate was queued (200) while /sdapi, /v1 and MCP answered 403: the
    Guard refuses every state-changing request on Gradio's routes by the protocols' rule, before Gradio runs."""
    for path in GRADIO_POSTS:
        response, ran, log = post_through_the_guard(path, headers)
        assert response.status_code == 403 and ran == [], (path, response.text)
        assert response.json()["detail"].startswith("requests from another site's page are refused")
        assert log == [f"[app] refused POST {path!r}: {response.json()['detail']}"]


@pytest.mark.parametrize("headers", [
    {},  # gradio_client, curl
    {"origin": "http://127.0.0.1:7860", "sec-fetch-site": "same-origin"},  # the page itself
    {"origin": "http://127.0.0.1:7860"},  # the page, in a browser without Sec-Fetch-Site
    {"origin": "https://sd.example", "sec-fetch-site": "same-origin"},  # the page behind a proxy that rewrote Host
    {"sec-fetch-site": "none"},  # typed by the user
])
def test_the_page_and_api_clients_still_reach_gradio(headers):
    for path in set(GRADIO_POSTS) - {"/gradio_api/upload"}:  # uploads pass only with the demo's Routes (test_guard_app)
        response, ran, _ = post_through_the_guard(path, headers)
        assert response.status_code == 200 and ran == [path], (path, response.text)


def test_reads_and_the_protocol_routes_pass_the_guard_on():
    """GET is never refused (CORS keeps its answer from another site); /sdapi and /v1 are refused by the same rule
    in their own error shapes (apis.CrossSiteGuard, inside the Guard)."""
    response, ran, _ = post_through_the_guard("/gradio_api/info", {"origin": "http://evil.example"}, method="GET")
    assert response.status_code == 200
    for path in ("/sdapi/v1/txt2img", "/v1/images/generations"):
        response, ran, _ = post_through_the_guard(path, {"origin": "http://evil.example"})
        assert response.status_code == 200 and ran == [path]


def test_same_origin_compares_host_and_port_as_a_browser_sends_them():
    from sdxl_engine.serving.guard import same_origin

    assert same_origin("http://127.0.0.1:7860", "127.0.0.1:7860")
    assert same_origin("https://abc.gradio.live", "abc.gradio.live")  # the share link: default port left out
    assert same_origin("https://abc.gradio.live", "abc.gradio.live:443") and same_origin("http://[::1]:80", "[::1]")
    assert same_origin("HTTP://Name.Example", "name.example")
    assert not same_origin("http://127.0.0.1:7860", "127.0.0.1:7861")
    assert not same_origin("https://name.example", "name.example:80")
    assert not same_origin("null", "127.0.0.1:7860") and not same_origin("http://x", "")
    assert not same_origin("http://x:port", "x") and not same_origin("ftp://x", "x")


# --- uploads: the editor's own uploads are never taken by another request's end; a client that leaves is one line

class UploadDemo:
    """What the guard's upload check and handler.discard_uploads read of a gr.Blocks: its upload set (Gradio's
    first temp file set) and its blocks."""

    def __init__(self):
        self.upload_file_set: set = set()
        self.temp_file_sets = [self.upload_file_set]
        self.blocks: dict = {}


PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32


def upload_through_the_guard(demo, app, body: bytes = b"--b--\r\n", chunks: list | None = None):
    """POST /gradio_api/upload through the Guard (with ``demo``'s Routes) to ``app``; returns (what the guard sent,
    its log). ``chunks``: the request's receive messages (default: ``body`` whole)."""
    import asyncio

    from sdxl_engine.serving import guard as serving

    routes = serving.Routes.__new__(serving.Routes)  # only .demo is read on the upload route
    routes.demo = demo
    sent, log = [], []
    messages = list(chunks or [{"type": "http.request", "body": body, "more_body": False}])

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/gradio_api/upload", "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=b")]
             + ([] if chunks else [(b"content-length", str(len(body)).encode())])}
    asyncio.run(serving.Guard(app, routes=routes, log=log.append)(scope, receive, send))
    return sent, log


def gradio_upload(demo, path, during=None):
    """An ASGI app doing what Gradio's upload route does: read the body, write ``path`` (named by its content, so
    an upload of the same bytes writes the same path), record it as an upload, call ``during()`` (what runs at that
    moment elsewhere), answer the path."""
    import json as json_module
    import os as os_module

    async def app(scope, receive, send):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RuntimeError("ClientDisconnect")  # starlette's request.stream() raises it here
            if not message.get("more_body"):
                break
        os_module.makedirs(os_module.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(PNG)
        demo.upload_file_set.add(path)
        if during is not None:
            during()
        body = json_module.dumps([path]).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


def test_another_requests_end_never_takes_an_upload_being_written(tmp_path):
    """Issue #47: the editor uploads its unchanged picture again and again while a stroke is drawn, and Gradio
    names an upload by its content: the same path. The image event's end deleted that path, so an upload of the
    same bytes written at that moment was checked after the delete: 415 "the upload was not written" for the
    editor's own upload (and a queued request naming the path lost its picture). Now a request's end leaves a path
    that is being uploaded, or was uploaded again since the request arrived, to the janitor."""
    from sdxl_engine.engine.contract import clock
    from sdxl_engine.serving import guard as serving
    from sdxl_engine.serving.handler import discard_uploads

    demo = UploadDemo()
    path = str(tmp_path / "5ee0" / "background.png")
    arrived = clock()  # the request that named the first upload of these bytes
    # That request ends (handler.image_function's finally) while Gradio writes the same bytes for the editor again.
    sent, log = upload_through_the_guard(demo, gradio_upload(demo, path, during=lambda: discard_uploads(demo, [path])))
    assert sent[0]["status"] == 200 and json.loads(sent[1]["body"]) == [path] and log == []
    assert open(path, "rb").read() == PNG
    discard_uploads(demo, [path], arrived)  # a request that arrived before this upload: the path is not its alone
    assert open(path, "rb").read() == PNG
    discard_uploads(demo, [path], clock())  # one that arrived after it: deleted, with its folder
    assert not (tmp_path / "5ee0").exists()
    assert serving.UPLOADS.remove([path], clock()) == [path]  # gone already: nothing to keep


def test_upload_files_delete_only_what_no_upload_may_still_use(tmp_path):
    from sdxl_engine.serving.guard import UploadFiles

    files = UploadFiles(limit=2)
    paths = []
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.png").write_bytes(PNG)
        paths.append(str(tmp_path / name / "x.png"))
    files.uploaded(paths[:1], now=10.0)
    with files.writing():
        assert files.remove(paths, since=20.0) == []  # another upload is being written
        assert sorted(files.remove(paths[1:], since=20.0, writers=1)) == paths[1:]  # the caller's own only
    assert files.remove(paths[:1], since=10.0) == [] and files.remove(paths[:1], since=10.5) == paths[:1]
    assert not any(Path(p).exists() for p in paths) and not (tmp_path / "a").exists()
    files.uploaded(paths, now=30.0)  # at most ``limit`` paths are remembered, the newest
    assert paths[0] not in files._last and len(files._last) == 2


def test_a_client_that_leaves_mid_upload_is_one_log_line():
    """The body is read whole before Gradio sees it: a client that closes its connection mid-upload never reaches
    Gradio (whose parser raised starlette's ClientDisconnect: a traceback per upload, and a half-written temp file
    left behind); the guard logs one line and answers nothing (no one is there to read it)."""
    demo = UploadDemo()
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        raise AssertionError("Gradio got an upload that never arrived whole")

    sent, log = upload_through_the_guard(demo, app, chunks=[
        {"type": "http.request", "body": b"--b\r\nContent-Disposition: form-data", "more_body": True},
        {"type": "http.disconnect"}])
    assert sent == [] and reached == []
    assert log == ["[app] upload cancelled: the client left before its body arrived (/gradio_api/upload)"]


def test_a_call_whose_body_is_no_valid_json_is_told_so_and_one_not_an_object_too():
    """``{bad`` to /gradio_api/call/generate is not valid JSON (422 with the parser's reason); ``[1]`` is valid JSON
    but no object (422, "not a JSON object"); neither reaches Gradio."""
    import asyncio

    import gradio as gr

    from sdxl_engine.serving import guard as serving

    with gr.Blocks() as demo:
        text = gr.Textbox()
        gr.Button().click(lambda x: x, text, text, api_name="generate")
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    def post(body: bytes):
        chunks = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/gradio_api/call/generate",
                 "headers": [(b"content-length", str(len(body)).encode())]}
        asyncio.run(serving.Guard(app, routes=serving.Routes(demo), log=lambda line: None)(scope, receive, send))
        return sent[-2]["status"], json.loads(sent[-1]["body"])["error"]

    assert post(b"{bad") == (422, "the request body is not valid JSON (Expecting property name enclosed in double "
                                  "quotes: line 1 column 2 (char 1))")
    assert post(b"[1]") == (422, "the request body is not a JSON object")
    assert reached == []


def test_an_mcp_body_nested_past_the_parsers_depth_gets_the_mcp_servers_parse_error_not_a_500():
    """A 400 kB body nested 200 000 levels under the 1 MB cap made the MCP server's json.loads raise RecursionError
    (a 500 and a traceback in the log): the guard answers it as that server answers a body that is no JSON (400,
    JSON-RPC -32700) with one log line, and it never reaches the app; a shallow message still does."""
    deep = ('{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "a": ' + "[" * 200_000 + "]" * 200_000 + "}").encode()
    response, ran, log = post_through_the_guard("/gradio_api/mcp/", {}, content=deep)
    assert (response.status_code, response.json()) == (400, {"jsonrpc": "2.0", "id": "server-error",
                                                             "error": {"code": -32700,
                                                                       "message": "Parse error: nested too deeply"}})
    assert ran == [] and len(log) == 1 and "nested too deeply" in log[0]
    small = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "a": [[[1]]]}).encode()
    response, ran, _ = post_through_the_guard("/gradio_api/mcp/", {}, content=small)
    assert response.status_code == 200 and ran == ["/gradio_api/mcp/"] and response.content == small
