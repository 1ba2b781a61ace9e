"""Security probes: raw HTTP against the running app (the shared ``app_server``)."""

import json
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


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
                       json={"data": ["a red circle", "", 1, 7.0, 2, 0, 0, "(No style)", "Euler"]}, timeout=30).json()["event_id"]
    text = httpx.get(app_server.url + f"gradio_api/call/generate/{event}", timeout=60).text
    line = next(l for l in text.splitlines() if l.startswith("data: ") and '"path"' in l)
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
    paths += ["/gradio_api/file%3D/etc/passwd", "/static/../../../../etc/passwd", "/assets/%2e%2e/%2e%2e/%2e%2e/etc/passwd"]
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


def test_uploads_are_off_and_bodies_are_capped(app_server):
    response = httpx.post(app_server.url + "gradio_api/upload", files={"files": ("a.txt", b"hello")}, timeout=30)
    assert response.status_code == 404 and "uploads are off" in response.text
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

    for path in ("gradio_api/queue/join", "gradio_api/call/generate", "gradio_api/cancel"):
        response = httpx.post(app_server.url + path, content=chunks(), headers={"content-type": "application/json"},
                              timeout=30)
        assert response.status_code == 413 and "too large" in response.text, (path, response.status_code)


def test_guard_never_passes_more_than_the_cap_to_the_app():
    """The guard alone, on a dummy app: a chunked body stops at the cap; the app sees a disconnect."""
    import asyncio

    from sdxl_engine.serving import server as serving

    received, sent = [], []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            received.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                return

    async def run():
        chunks = [{"type": "http.request", "body": b"x" * 300_000, "more_body": True} for _ in range(10)]
        chunks.append({"type": "http.request", "body": b"", "more_body": False})

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/gradio_api/cancel", "headers": []}
        await serving.Guard(app, max_body=1_000_000)(scope, receive, send)

    asyncio.run(run())
    assert sum(len(m.get("body", b"")) for m in received) <= 1_000_000
    assert received[-1]["type"] == "http.disconnect"
    assert sent[0]["status"] == 413


def test_monitoring_and_flagging_are_off(app_server):
    assert httpx.get(app_server.url + "monitoring", timeout=30).status_code in (403, 404)
    info = httpx.get(app_server.url + "gradio_api/info", timeout=30).json()
    assert list(info["named_endpoints"]) == ["/generate"]
    assert not any("flag" in name for name in info["named_endpoints"])


def test_model_cannot_be_chosen_through_the_api(app_server):
    info = httpx.get(app_server.url + "gradio_api/info", timeout=30).json()
    names = [p["parameter_name"] for p in info["named_endpoints"]["/generate"]["parameters"]]
    assert "model" not in names and names[0] == "prompt"
    # An extra value in a raw call is ignored: the model stays the one the server was started with.
    event = httpx.post(app_server.url + "gradio_api/call/generate",
                       json={"data": ["a red circle", "", 1, 7.0, 2, 0, 0, "(No style)", "Euler", "stabilityai/other-model"]},
                       timeout=30).json()["event_id"]
    text = httpx.get(app_server.url + f"gradio_api/call/generate/{event}", timeout=60).text
    assert "event: complete" in text and '"model": "tiny-shapes"' in text


def test_server_listens_on_loopback_only(app_server):
    psutil = pytest.importorskip("psutil")
    listening = [c.laddr for c in psutil.Process(app_server.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_launch_defaults(monkeypatch):
    from sdxl_engine.serving import cli
    from sdxl_engine.serving import server as serving

    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    monkeypatch.setenv("GRADIO_SHARE", "True")  # launch(share=False) overrides Gradio's env switch
    args = cli.parse_args([])
    options = serving.launch_options(args.host, args.port, args.share)
    assert options["server_name"] == "127.0.0.1" and options["share"] is False
    assert options["ssr_mode"] is False and options["enable_monitoring"] is False and options["mcp_server"] is False
    assert options["allowed_paths"] == [] and options["max_file_size"] == "1mb"
    assert serving.launch_options("0.0.0.0", 7860, True)["share"] is True  # only when asked
