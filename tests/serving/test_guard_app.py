"""Security probes: raw HTTP against the running app (the shared ``app_server``)."""

import base64
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from sdxl_engine.serving import guard
from sdxl_engine.serving.apis import tools
from tests.helpers import ROOT, assert_serves

pytestmark = pytest.mark.e2e


def get(app_server, path, **kw):
    # httpx would normalise "../" and "%2e" in a URL; send the raw target exactly as an attacker would.
    with httpx.Client(base_url=app_server.url.rstrip("/"), timeout=30) as client:
        request = client.build_request("GET", "/", **kw)
        request.url = request.url.copy_with(raw_path=path.encode())
        return client.send(request)


@pytest.fixture(scope="module")
def output_file(app_server):
    """Server-side path and URL of an image the app generated (the one place files are served from)."""
    event = httpx.post(app_server.url + "gradio_api/call/generate",
                       json={"data": ["a red circle", "", 1, 7.0, 2, 0, 0, "(No style)", "Euler"]},
                       timeout=30).json()["event_id"]
    text = httpx.get(app_server.url + f"gradio_api/call/generate/{event}", timeout=60).text
    line = next(ln for ln in text.splitlines() if ln.startswith("data: ") and '"path"' in ln)
    item = json.loads(line[6:])[0][0]["image"]
    return item["path"], item["url"]


def test_generated_output_is_served(app_server, output_file):
    path, url = output_file
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200 and response.content[:8] == b"\x89PNG\r\n\x1a\n"


SECRETS = ["/etc/passwd", "/proc/self/environ", str(ROOT / "app.py"), str(ROOT / "README.md")]


def probe_paths(output_dir: str) -> list[str]:
    paths = []
    for prefix in ("/file=", "/gradio_api/file="):
        for secret in SECRETS:
            paths += [prefix + secret, prefix + "/" + secret]
        paths += [
            prefix + "app.py", prefix + "./app.py", prefix + "../../../../../../etc/passwd",
            prefix + output_dir + "/../../../../../../etc/passwd",
            prefix + output_dir + "/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
            prefix + "%2e%2e%2f%2e%2e%2f%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
            prefix + "%252e%252e%252f%252e%252e%252f%252e%252e%252fetc%252fpasswd",
            prefix + "%2Fetc%2Fpasswd", prefix + "%252Fetc%252Fpasswd",
            prefix + "..%5c..%5c..%5c..%5cetc%5cpasswd", prefix + "....//....//....//etc/passwd",
            prefix + output_dir + "%00/../../../../etc/passwd",
        ]
    paths += ["/gradio_api/file%3D/etc/passwd", "/static/../../../../etc/passwd",
              "/assets/%2e%2e/%2e%2e/%2e%2e/etc/passwd"]
    return paths


def test_no_file_outside_the_output_area_can_be_fetched(app_server, output_file):
    output_dir = str(Path(output_file[0]).parent)
    assert get(app_server, "/gradio_api/file=" + output_file[0]).status_code == 200  # the probe method works
    root_line = Path("/etc/passwd").read_text().splitlines()[0]
    app_text = (ROOT / "app.py").read_text()[:200]
    fetched = []
    for path in probe_paths(output_dir):
        response = get(app_server, path)
        body = response.text
        if response.status_code == 200 and (root_line in body or app_text in body or "PATH=" in body):
            fetched.append(path)
        assert response.status_code in (400, 403, 404, 405), (path, response.status_code, body[:100])
    assert fetched == []


def test_forged_host_and_foreign_origin_are_not_echoed(app_server):
    for path, method in (("/config", "GET"), ("/gradio_api/info", "GET"), ("/gradio_api/queue/join", "OPTIONS")):
        for host in ("evil.example", "127.0.0.1", None):
            for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
                headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
                if host:
                    headers["Host"] = host
                response = httpx.request(method, app_server.url.rstrip("/") + path, headers=headers, timeout=30)
                allowed = response.headers.get("access-control-allow-origin")
                assert allowed in (None, "") or allowed not in (origin, "*"), (path, host, origin, response.headers)
                assert "access-control-allow-credentials" not in response.headers or allowed is None


def test_loopback_origin_still_allowed(app_server):
    origin = app_server.url.rstrip("/")
    response = httpx.get(app_server.url + "config", headers={"Origin": origin}, timeout=30)
    assert response.headers.get("access-control-allow-origin") == origin


def test_another_sites_page_cannot_drive_gradios_routes(app_server):
    """Issue #47: ``POST /gradio_api/call/generate`` with only a foreign Origin was queued (200) while /sdapi, /v1
    and MCP answered 403. Now every state-changing route refuses it alike (403, one log line, nothing queued);
    the page itself (its own Origin) and gradio_client or curl (no Origin) still call."""
    start = len(app_server.log)
    call = {"data": ["a red circle", "", 1, 5.0, 2, 0, 0, "(No style)", "Euler"]}
    own = app_server.url.rstrip("/")
    for path, body in (("gradio_api/call/generate", call), ("gradio_api/queue/join", {**call, "fn_index": 0}),
                       ("sdapi/v1/interrupt", {}), ("gradio_api/mcp/", {})):
        for origin in ("http://evil.example", "null"):
            response = httpx.post(app_server.url + path, json=body, headers={"Origin": origin}, timeout=30)
            assert response.status_code == 403, (path, origin, response.status_code, response.text)
            assert "requests from another site's page are refused" in response.text
    log = log_barrier(app_server, start)
    assert log.count("requests from another site's page are refused") == 8 and "Traceback" not in log
    assert ("[app] refused POST '/gradio_api/call/generate': requests from another site's page are refused "
            "(Origin: http://evil.example is not this server)") in log
    for headers in ({"Origin": own}, {"Origin": own, "Sec-Fetch-Site": "same-origin"}, {}):
        response = httpx.post(app_server.url + "gradio_api/call/generate", json=call, headers=headers, timeout=30)
        assert response.status_code == 200, (headers, response.text)
        answer = httpx.get(app_server.url + f"gradio_api/call/generate/{response.json()['event_id']}", timeout=60)
        assert "event: complete" in answer.text, (headers, answer.text[-300:])


def png_bytes(size: int = 8, noise: bool = False) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8) if noise else np.full((size, size, 3), 90, np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=0)
    return buffer.getvalue()


def test_uploads_take_images_only_and_are_never_served(app_server):
    """Uploads were off; the page's image editor needs Gradio's upload route, so that one route takes images only:
    a file that is not a PNG, JPEG or WebP (by its bytes, whatever its name) is deleted and refused (415, saying
    so), a body over the images' cap gets 413, the other upload routes stay off, an uploaded image is never served
    back (not even to its sender), and the server answers as before."""
    url = app_server.url + "gradio_api/upload"
    for name, data in (("a.txt", b"hello"), ("fake.png", b"GIF89a" + b"\0" * 64), ("a.svg", b"<svg/>")):
        response = httpx.post(url, files={"files": (name, data)}, timeout=30)
        assert response.status_code == 415 and "PNG, JPEG or WebP images only" in response.text, (name, response.text)
    # One image and one text file in one body: all refused, none left behind.
    response = httpx.post(url, files=[("files", ("ok.png", png_bytes())), ("files", ("b.txt", b"hi"))], timeout=30)
    assert response.status_code == 415
    too_big = b"\x89PNG\r\n\x1a\n" + b"\0" * 48_000_000
    response = httpx.post(url, files={"files": ("big.png", too_big)}, timeout=60)
    assert response.status_code == 413 and "too large (limit 48 MB)" in response.text
    for path in ("upload", "gradio_api/upload_progress?upload_id=x"):
        assert httpx.post(app_server.url + path, files={"files": ("a.png", png_bytes())}, timeout=30).status_code == 404
    # An image passes, lies in Gradio's temp folder, and is not served (an upload is never a file of this app).
    response = httpx.post(url, files={"files": ("in.png", png_bytes(64, noise=True))}, timeout=30)
    assert response.status_code == 200, response.text
    (path,) = response.json()
    assert Path(path).read_bytes() == png_bytes(64, noise=True)
    assert get(app_server, f"/gradio_api/file={path}").status_code == 404
    assert get(app_server, f"/file={path}").status_code == 404
    # The refused files were deleted: only the image's folder came to stay.
    folders = {p.parent for p in Path(path).parent.parent.glob("*/*") if p.name in ("a.txt", "fake.png", "a.svg",
                                                                                     "ok.png", "b.txt", "big.png")}
    assert folders == set(), folders
    # A queued call naming an upload is refused unless it is the page's image event or a picture's upload (the
    # ControlNet's, the IP-Adapter's: every other event takes no files), and the server is healthy.
    file = {"path": path, "meta": {"_type": "gradio.FileData"}}
    image_event = next(dep for dep in page_dependencies(app_server) if dep["api_name"] == "img2img")
    control_event = next(dep for dep in page_dependencies(app_server) if dep["api_name"] == "control_upload")
    for dep in page_dependencies(app_server):
        if dep["api_name"] not in ("img2img", *guard.PICTURE_EVENTS):
            status, reply = call_page_event(app_server, dep, [file] * max(1, len(dep["inputs"])))
            assert status == 404 and "this app takes no files" in reply, (dep["api_name"], status, reply[:200])
    nine = ["a red circle", "", 1, 5.0, 2, 64, 64, "(No style)", "Euler"]
    # mode, strength, outpaint sides and pixels, refiner, model, schedule type
    rest = ["Image to image", 0.75, [], 16, 1.0, "", "Automatic"]
    for other in ("/etc/hostname", str(Path(path).parent / ".." / Path(path).parent.name / "other.png")):
        editor = {"background": {**file, "path": other}, "layers": [], "composite": None}
        status, reply = call_page_event(app_server, image_event, [*nine, editor, *rest])
        assert status == 404 and "this app takes no files" in reply, (other, status, reply[:200])
    # The image event takes the upload, makes 4 images from it and deletes it; it stays unserved.
    editor = {"background": file, "layers": [], "composite": None}
    status, reply = call_page_event(app_server, image_event, [*nine, editor, *rest])
    assert status == 200 and '"success": true' in reply.replace('"success":true', '"success": true'), reply[:300]
    assert not Path(path).exists()
    assert get(app_server, f"/gradio_api/file={path}").status_code == 404
    # The ControlNet picture's upload takes an upload (as base64 PNG text for the page) but no other file, and
    # deletes it too.
    response = httpx.post(url, files={"files": ("control.png", png_bytes(48, noise=True))}, timeout=30)
    (path,) = response.json()
    status, reply = call_page_event(app_server, control_event, [{**file, "path": "/etc/hostname"}])
    assert status == 404 and "this app takes no files" in reply, (status, reply[:200])
    status, reply = call_page_event(app_server, control_event, [{**file, "path": path}])
    assert status == 200 and '"success":true' in reply.replace(" ", "") and "iVBORw0KGgo" in reply, reply[:300]
    assert not Path(path).exists()
    # Its file box then holds the app's PNG of it (the picture's box the same file), which is served: the box's
    # download link (the upload's own was a 404).
    text, shown, box = json.loads(reply)["output"]["data"]
    assert shown["path"] == box["path"] != path and box["orig_name"] == "control.png"
    served = get(app_server, f"/gradio_api/file={box['path']}")
    assert served.status_code == 200 and served.content == base64.b64decode(text)
    assert httpx.get(app_server.url + "gradio_api/info", timeout=30).status_code == 200


def test_a_client_that_leaves_mid_upload_is_one_log_line(app_server):
    """Issue #47: a browser that drops an upload (a closed tab, a cancelled request) left a starlette ClientDisconnect
    traceback in the server log. Now: one line, and the server answers as before."""
    import socket
    from urllib.parse import urlsplit

    start = len(app_server.log)
    head = (b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"background.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + png_bytes(64, noise=True)[:2000])
    url = urlsplit(app_server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as connection:
        connection.sendall(b"POST /gradio_api/upload HTTP/1.1\r\nHost: " + url.netloc.encode() + b"\r\n"
                           b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n" + head)
        time.sleep(0.3)  # the server is reading the body when the client leaves
    deadline = time.monotonic() + 30
    while not any("upload cancelled" in line for line in app_server.log[start:]):
        assert time.monotonic() < deadline, "".join(app_server.log[start:])
        time.sleep(0.05)
    log = log_barrier(app_server, start)
    assert log.count("[app] upload cancelled: the client left before its body arrived (/gradio_api/upload)") == 1
    assert "Traceback" not in log and "ClientDisconnect" not in log, log
    response = httpx.post(app_server.url + "gradio_api/upload", files={"files": ("in.png", png_bytes())}, timeout=30)
    assert response.status_code == 200


def test_the_other_upload_routes_are_off_and_bodies_are_capped(app_server):
    response = httpx.post(app_server.url + "gradio_api/queue/join", content=b"{" + b" " * 2_000_000 + b"}",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413


def test_chunked_bodies_are_capped_too(app_server):
    """A body sent without Content-Length (chunked) is counted as it arrives: past 1 MB, 413."""
    def chunks():
        yield b'{"data": ["'
        for _ in range(40):
            yield b"a" * 50_000
        yield b'"]}'

    # (gradio_api/call/generate may carry a control image: its cap is the images' one, guard.IMAGE_TEXT_CALLS)
    for path in ("gradio_api/queue/join", "gradio_api/call/upscale", "gradio_api/cancel"):
        response = httpx.post(app_server.url + path, content=chunks(), headers={"content-type": "application/json"},
                              timeout=30)
        assert response.status_code == 413 and "too large" in response.text, (path, response.status_code)


def test_monitoring_and_flagging_are_off(app_server):
    assert httpx.get(app_server.url + "monitoring", timeout=30).status_code in (403, 404)
    info = httpx.get(app_server.url + "gradio_api/info", timeout=30).json()
    assert list(info["named_endpoints"]) == ["/generate", "/image_to_image"]
    assert not any("flag" in name for name in info["named_endpoints"])


def test_the_model_is_an_optional_last_input_named_in_a_raw_call(app_server):
    """Issue #49: /generate takes the model by name, as its last (optional) input. A raw call that leaves it out
    gets the server's default model; one that names an unknown model is refused with the names it offers (and the
    unknown name, cut short); a value in another input's place is that input's (the tenth is the refiner switch,
    1 = none: a model name there is refused naming it)."""
    info = httpx.get(app_server.url + "gradio_api/info", timeout=30).json()
    params = info["named_endpoints"]["/generate"]["parameters"]
    names = [p["parameter_name"] for p in params]
    model = names.index("model")  # schedule_type, the IP-Adapter's inputs and the union's control type: added later
    assert names[0] == "prompt" and names[model:] == ["model", "schedule_type", *tools.IP_NAMES,
                                                      tools.CONTROL_TYPE.name, tools.IP_EMBEDS.name], names
    assert params[model]["parameter_has_default"] and params[model + 1]["parameter_default"] == "Automatic"
    nine = ["a red circle", "", 1, 7.0, 2, 0, 0, "(No style)", "Euler"]
    defaults = [p["parameter_default"] for p in params[9:model]]

    def answer(data: list) -> str:
        event = httpx.post(app_server.url + "gradio_api/call/generate", json={"data": data}, timeout=30).json()
        return httpx.get(app_server.url + f"gradio_api/call/generate/{event['event_id']}", timeout=60).text

    text = answer([*nine, *defaults, "stabilityai/other-model"])
    assert "event: error" in text and "unknown model 'stabilityai/other-model'" in text, text[:300]
    assert "this server offers: tiny-shapes" in text, text[:300]
    text = answer([*nine, "stabilityai/other-model"])
    assert "refiner_switch_at: no refiner is loaded" in text, text[:300]
    assert '"model": "tiny-shapes"' in answer(nine)
    assert '"model": "tiny-shapes"' in answer([*nine, *defaults, "tiny-shapes"])
    # The input added after the model (issue #62): an unknown schedule type is refused naming it.
    text = answer([*nine, *defaults, "tiny-shapes", "Sideways"])
    assert "event: error" in text and "schedule_type: unknown schedule type 'Sideways'" in text, text[:300]
    # The IP-Adapter's (issue #60), after it: a reference image on a server without an adapter is refused naming it.
    reference = base64.b64encode(png_bytes(16)).decode()
    text = answer([*nine, *defaults, "tiny-shapes", "Automatic", reference, "ip-adapter_sdxl"])
    assert "event: error" in text and "ip_adapter_image: no IP-Adapter is loaded" in text, text[:300]
    # FaceID's face embedding (the last input), as a JSON list: refused likewise naming it.
    text = answer([*nine, *defaults, "tiny-shapes", "Automatic", "", "faceid", 1, 0, 1, None, [0.1] * 512])
    assert "event: error" in text and "ip_adapter_embeds: no IP-Adapter is loaded" in text, text[:300]


def test_server_listens_on_loopback_only(app_server):
    psutil = pytest.importorskip("psutil")
    listening = [c.laddr for c in psutil.Process(app_server.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


# --- What a client other than the page can reach --------------------------------------------

def page_dependencies(app_server) -> list[dict]:
    """The page's events that run a function on the server, as /config lists them (id, api_name, inputs, queue)."""
    config = httpx.get(app_server.url + "config", timeout=30).json()
    return [dep for dep in config["dependencies"] if dep.get("backend_fn")]


def log_barrier(app_server, start: int) -> str:
    """The server's log from line ``start`` on, once everything logged before this call has arrived.

    A /generate call with a unique unknown style is sent and read to its end; the server logs its
    refusal after every line it logged earlier, so once that line shows up the log is complete up
    to here (the marker line is left out)."""
    marker = f"log-barrier-{len(app_server.log)}-{time.monotonic_ns()}"
    event = httpx.post(app_server.url + "gradio_api/call/generate", timeout=30, json={
        "data": ["a red circle", "", 1, 5.0, 2, 0, 0, marker, "Euler"]}).json()["event_id"]
    assert "event: error" in httpx.get(app_server.url + f"gradio_api/call/generate/{event}", timeout=60).text
    deadline = time.monotonic() + 60
    while not any(marker in line for line in app_server.log[start:]):
        assert time.monotonic() < deadline, "the refusal line never reached the log"
        time.sleep(0.05)
    return "".join(line for line in app_server.log[start:] if marker not in line)


def call_page_event(app_server, dep: dict, data: list, event_data=None, session: str = "probe-session"):
    """Call event ``dep`` as the page does (queue/join, or run/predict for one that skips the queue); returns
    (HTTP status, the event's outcome message or the direct reply)."""
    body = {"data": data, "fn_index": dep["id"], "session_hash": session, "event_data": event_data,
            "trigger_id": None}
    if not dep["queue"]:
        response = httpx.post(app_server.url + "gradio_api/run/predict", json=body, timeout=60)
        return response.status_code, response.text
    response = httpx.post(app_server.url + "gradio_api/queue/join", json=body, timeout=30)
    if response.status_code != 200:
        return response.status_code, response.text
    event_id = response.json()["event_id"]
    with httpx.stream("GET", app_server.url + f"gradio_api/queue/data?session_hash={session}", timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and event_id in line and "process_completed" in line:
                return 200, line[6:]
    raise AssertionError(f"event {dep['api_name']} never completed")


def test_only_generate_is_callable_by_name(app_server):
    """Gradio answers /call|run|api/<name> for every event; here only /generate is an API endpoint,
    and a refused call (or one that names another event by fn_index) is one log line, no traceback."""
    deps = page_dependencies(app_server)
    names = {dep["api_name"] for dep in deps} - {"generate", "image_to_image"} | {"predict", "doesnotexist"}
    assert {"status_line", "remember", "restore", "refresh", "select_image", "load_example"} <= names
    start = len(app_server.log)
    calls = 0
    for name in sorted(names):
        for route in ("call", "call/v2", "run", "api"):
            response = httpx.post(app_server.url + f"gradio_api/{route}/{name}", json={"data": []}, timeout=30)
            assert response.status_code == 404 and "this app's API: /generate" in response.json()["error"], (
                route, name, response.status_code, response.text[:200])
            calls += 1
    restore = next(dep["id"] for dep in deps if dep["api_name"] == "restore")
    for route in ("call/generate", "run/generate"):  # the name is right, the fn_index picks another event
        response = httpx.post(app_server.url + f"gradio_api/{route}", json={
            "data": ["a red circle", "", 1, 7.0, 2, 0, 0, "(No style)", "Euler"], "fn_index": restore}, timeout=30)
        assert response.status_code == 404, (route, response.text[:200])
        calls += 1
    log = log_barrier(app_server, start)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert log.count("[app] refused POST") == calls and len(log.splitlines()) == calls, log


def test_unknown_result_streams_are_one_line(app_server):
    start = len(app_server.log)
    response = httpx.get(app_server.url + "gradio_api/call/generate/doesnotexist", timeout=30)
    assert response.status_code == 404 and "no such event" in response.text
    response = httpx.get(app_server.url + "gradio_api/queue/data?session_hash=nobody-here", timeout=30)
    assert response.status_code == 404 and "no such session" in response.text
    log = log_barrier(app_server, start)
    assert "Traceback" not in log and len(log.splitlines()) == 2, log


def test_page_events_given_values_the_page_never_sends_log_one_line_each(app_server):
    """Every server-side event, called the page's way with values of the wrong kind (and a select
    event's data naming a file): an error reply, at most one log line each, no traceback; the
    server still serves."""
    deps = page_dependencies(app_server)
    start = len(app_server.log)
    event_data = {"index": "first", "value": {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}}
    for dep in deps:
        status, reply = call_page_event(app_server, dep, [{"junk": [1, 2]}] * len(dep["inputs"]), event_data)
        # (a picture's upload takes one file only: the guard refuses anything else, before Gradio)
        assert status in (200, 500) or (dep["api_name"] in guard.PICTURE_EVENTS and status == 404), (
            dep["api_name"], status, reply[:200])
    log = log_barrier(app_server, start)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert len(log.splitlines()) <= len(deps), log
    config = httpx.get(app_server.url + "config", timeout=30).json()
    in_browser = [dep["id"] for dep in config["dependencies"] if not dep.get("backend_fn")]
    assert in_browser  # randomize, the resolution list, clear history, ... run in the browser only
    for fn_index in in_browser + [10_000]:  # those, and an event id the page does not have
        for queue in (True, False):
            status, reply = call_page_event(app_server, {"id": fn_index, "queue": queue, "api_name": "?"}, [])
            assert status == 404, (fn_index, queue, status, reply[:200])
    assert_serves(app_server.client())


def temp_files() -> set[Path]:
    return {p for p in Path(os.environ["GRADIO_TEMP_DIR"]).rglob("*") if p.is_file()}


def test_no_byte_a_client_sends_becomes_a_file(app_server):
    """The issue's probe (a history record whose "thumbnail" is an HTML page), sent to every event
    by name and the page's way, and a file object in the values: nothing new in the temp folder."""
    deps = page_dependencies(app_server)
    payload = base64.b64encode(b"<html><script>alert(1)</script></html>" * 100).decode()
    record = {"style": "(No style)", "seeds": [1], "thumbs": [f"data:image/jpeg;base64,{payload}"], "prompt": "x",
              "negative_prompt": "", "guidance_scale": 5, "num_inference_steps": 2, "width": 64, "height": 64,
              "time": "now", "model": "tiny-shapes"}
    before = temp_files()
    for dep in deps:
        data = [[record]] * len(dep["inputs"])
        httpx.post(app_server.url + f"gradio_api/call/{dep['api_name']}", json={"data": data}, timeout=30)
        call_page_event(app_server, dep, data, {"index": 0, "value": None})
    assert temp_files() - before == set()
    fetched = {"path": "http://127.0.0.1:9/x.png", "url": "http://127.0.0.1:9/x.png",
               "meta": {"_type": "gradio.FileData"}}
    for dep in deps:
        status, reply = call_page_event(app_server, dep, [fetched] * max(1, len(dep["inputs"])))
        assert status == 404 and "this app takes no files" in reply, (dep["api_name"], status, reply[:200])
    assert temp_files() - before == set()
    # Gradio routes the page never uses, which write what a client sent: deep_link saves the session's
    # component values (which the page events above just set from the client's record) as state.json;
    # process_recording writes an uploaded video.
    for prefix in ("gradio_api/", ""):
        response = httpx.get(app_server.url + f"{prefix}deep_link?session_hash=probe-session", timeout=30)
        assert response.status_code == 404 and "not an endpoint of this app" in response.text, response.text
    response = httpx.post(app_server.url + "gradio_api/process_recording", timeout=30,
                          files={"video": ("v.mp4", b"\0" * 1000, "video/mp4")}, data={"params": "{}"})
    assert response.status_code == 404 and "not an endpoint of this app" in response.text, response.text
    assert temp_files() - before == set()
    assert httpx.get(app_server.url + "gradio_api/runs", timeout=30).status_code == 404  # run_history off


def test_a_result_read_twice_is_refused_not_left_open(app_server):
    """A /call/generate result can be read once; a second read of the same event id is a 404 with one
    log line (Gradio would keep that stream open with heartbeats for ever)."""
    event = httpx.post(app_server.url + "gradio_api/call/generate",
                       json={"data": ["a red circle", "", 3, 5.0, 2, 0, 0, "(No style)", "Euler"]}, timeout=30)
    url = app_server.url + f"gradio_api/call/generate/{event.json()['event_id']}"
    assert "event: complete" in httpx.get(url, timeout=120).text
    start = len(app_server.log)
    with httpx.stream("GET", url, timeout=30) as again:  # the status comes at once; a stream left open never ends
        assert again.status_code == 404, again.status_code
        assert "no such event" in again.read().decode()
    log = log_barrier(app_server, start)
    assert len(log.splitlines()) == 1 and "Traceback" not in log, log


def test_no_server_function_feeds_the_history_gallery(app_server):
    """The history's thumbnails go from the browser's own records to its gallery (HISTORY_JS): no
    event that runs on the server outputs to it, so none turns a record into a file."""
    config = httpx.get(app_server.url + "config", timeout=30).json()
    history = next(c["id"] for c in config["components"] if c["props"].get("elem_id") == "history")
    feeding = [dep for dep in config["dependencies"] if history in dep["outputs"]]
    assert feeding and all(not dep["backend_fn"] and dep["js"] for dep in feeding), feeding


def test_only_files_the_app_created_are_served(app_server, output_file):
    """A file someone else put in Gradio's temp folder, or a copy of an output under another name,
    is not served (Gradio itself serves anything there); the app's own PNGs are."""
    temp = Path(os.environ["GRADIO_TEMP_DIR"])
    probe = temp / "nu-probe" / "secret.txt"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("not for clients")
    copy = Path(output_file[0]).with_name("copy-of-output.png")
    copy.write_bytes(Path(output_file[0]).read_bytes())
    start = len(app_server.log)
    for target in (probe, copy, temp / "nu-probe"):
        for prefix in ("/gradio_api/file=", "/gradio_api/file/", "/file="):
            for method in ("GET", "HEAD"):
                response = httpx.request(method, app_server.url.rstrip("/") + prefix + str(target), timeout=30)
                assert response.status_code == 404 and b"not for clients" not in response.content, (prefix, target)
    assert get(app_server, "/gradio_api/proxy=http://127.0.0.1:9/x").status_code == 404
    assert get(app_server, "/gradio_api/file=http://127.0.0.1:9/x").status_code == 404
    assert httpx.get(output_file[1], timeout=30).status_code == 200
    log = log_barrier(app_server, start)
    assert "Traceback" not in log and len(log.splitlines()) == 20, log
