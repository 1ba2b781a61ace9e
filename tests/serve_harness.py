"""A small server for tests/serving/test_server_shutdown_app.py: the app's own ``server.serve`` around a cheap page.

``python tests/serve_harness.py stops PORT N`` runs ``serve`` N times in a row in this process,
each time around a stand-in for a launched page (no HTTP server: launching and closing Gradio
would dominate a test of signal handling), printing ``serve returned <status>`` after each.

``python tests/serve_harness.py page PORT DIR`` serves a real Gradio page through ``serve``
(Guard, RequestGate, the service, as ``python app.py`` does) with one endpoint, ``/generate(prompt)``: a client
of a real service (sdxl_engine.service.Service, one slot, the app's per-client cap) over a stand-in engine
(:class:`HoldEngine`), followed as the page's events follow theirs (handler.follow). It returns
``"done: <prompt>"``; a prompt ``hold:<name>`` runs until the file ``DIR/<name>`` (or ``DIR/all``) exists (so a
test decides when a call ends, without timing); ``fail`` fails in the engine (a gr.Error with its message).
``GET /harness/service`` answers the service's ``{"waiting", "running"}`` (Gradio's queue holds nothing: the
service's line is where calls wait). Settings come from the environment as for the app
(``SDXL_MAX_REQUESTS_PER_CLIENT``); ``HARNESS_SET_UP_S=S`` makes serve's ``on_launch`` take S seconds (as
mounting the protocol APIs takes some), so a test can watch what a client gets meanwhile; ``HARNESS_LOOP_LAG_S=S``
stalls Gradio's event loop for S seconds once each call's completion is queued, before its result stream can send
it (:func:`lag_completions`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from sdxl_engine.config import EngineConfig
from sdxl_engine.serving import logs, server


def ready_engine(config: EngineConfig) -> SimpleNamespace:
    """What ``serve`` reads of an engine: started, no error, its config."""
    ready = threading.Event()
    ready.set()
    return SimpleNamespace(ready=ready, error=None, config=config)


class EmptyQueue:
    """What ``serve`` reads of Gradio's queue: nothing queued, nothing running."""

    event_ids_to_events: dict = {}
    active_jobs: list = []

    async def push(self, body, request, username):
        raise AssertionError("no call reaches a page that is not served")

    def __len__(self):
        return 0


class LaunchedPage:
    """What ``serve`` uses of a launched ``gr.Blocks``, without an HTTP server behind it."""

    def __init__(self, port: int):
        from starlette.applications import Starlette

        self.app = Starlette()
        self.local_url = f"http://127.0.0.1:{port}/"
        self.share_url = None
        self.fns, self.blocks, self.temp_file_sets = {}, {}, []
        self.GRADIO_CACHE = tempfile.gettempdir()  # the temp-folder janitor's root: nothing of this page is in it
        self._queue = EmptyQueue()

    def launch(self, **_options):
        pass

    def get_api_info(self):
        return {"named_endpoints": {}}

    def close(self, verbose=True):
        pass


def stops(port: int, count: int) -> int:
    config = EngineConfig.load()
    engine = ready_engine(config)
    for _ in range(count):
        status = server.serve(LaunchedPage(port), engine, {"server_name": "127.0.0.1", "server_port": port},
                              server.RequestGate(), quiet_s=0.0)
        print(f"serve returned {status}", flush=True)
        if status != 0:
            return status
    return 0


def lag_completions(seconds: float) -> None:
    """Stall Gradio's event loop for ``seconds`` right after it queues a call's completion for the call's result
    stream (``Queue.send_message``), as a loaded machine may: the call is then done (the service idle, the
    queue idle) while its client has not been sent the result; a close in that window must wait for the stream."""
    from gradio import queueing
    from gradio.server_messages import ProcessCompletedMessage

    send = queueing.Queue.send_message

    def lagging(self, event, message):
        if isinstance(message, ProcessCompletedMessage):  # runs first in the loop's next step, before the stream
            asyncio.get_running_loop().call_soon(time.sleep, seconds)
        return send(self, event, message)

    queueing.Queue.send_message = lagging


class HoldEngine:
    """What the service calls of an engine (contract.EngineContract's generate, ready, limits, batch): one 8 x 8
    image per call, after a ``hold:<name>`` prompt's file appears (stopped meanwhile when its job is); the prompt
    ``fail`` fails as a request the engine could not make does (GenerationError)."""

    batch = 1
    stage, started, startup, device_summary = "ready", 0.0, {}, "1 x cpu"

    def __init__(self, config: EngineConfig, folder: Path):
        from sdxl_engine.engine.validation import Limits

        self.config, self.folder = config, folder
        self.ready = threading.Event()
        self.ready.set()
        self.error = None
        self.limits = Limits(max_seed=2**31 - 1, max_steps=50, sizes=((8, 8),), default_size=(8, 8), default_steps=1,
                             default_guidance=5.0)

    def generate(self, request, progress=None, arrived=None, on_step=None, should_stop=None):
        import numpy as np

        from sdxl_engine.engine.contract import GenerateResult
        from sdxl_engine.engine.errors import GenerationError
        from sdxl_engine.engine.steps import Stopped

        if request.prompt == "fail":
            raise GenerationError("refused: the prompt says fail")
        if request.prompt.startswith("hold:"):
            release = self.folder / request.prompt[len("hold:"):]
            deadline = time.monotonic() + 300  # a generous bound: the test creates the file
            while not (release.exists() or (self.folder / "all").exists()) and time.monotonic() < deadline:
                if should_stop is not None and should_stop():
                    raise Stopped("stopped before its first step")
                time.sleep(0.02)
        return GenerateResult(np.zeros((1, 8, 8, 3), np.uint8), [request.seed], request,
                              {"latency": 0.0, "queue": 0.0, "prep": 0.0, "device": 0.0, "post": 0.0}, [], 1,
                              self.device_summary, "hold")


def page(port: int, folder: Path) -> int:
    import gradio as gr

    from sdxl_engine.service.request import to_request
    from sdxl_engine.service.service import Service
    from sdxl_engine.serving import handler

    if os.environ.get("HARNESS_LOOP_LAG_S"):
        lag_completions(float(os.environ["HARNESS_LOOP_LAG_S"]))
    config = EngineConfig.load()
    engine = HoldEngine(config, folder)
    requests = Service(engine, slots=1, limit=config.max_requests_per_client, max_waiting=config.max_queue_size)

    with gr.Blocks() as demo:
        prompt, out = gr.Textbox(), gr.Textbox()

        async def generate(prompt: str, request: gr.Request = None) -> str:
            # as the page's events: a job of the caller's, followed until its images (handler.follow)
            outs = [out async for out in handler.follow(requests, to_request(prompt=prompt), request,
                                                          gone=handler.client_gone(demo))]
            return f"done: {outs[-1][1]['prompt']}"

        generate.__annotations__["request"] = gr.Request  # not the text "gr.Request": Gradio finds it by its type

        prompt.submit(generate, prompt, out, api_name="generate", concurrency_limit=None)
    demo.queue(api_open=False)  # as the app's: the service's line is the bounded one
    set_up_s = float(os.environ.get("HARNESS_SET_UP_S", "0"))

    def set_up(app) -> None:
        app.add_api_route("/harness/service", lambda: {"waiting": requests.waiting, "running": requests.running})
        if set_up_s:
            time.sleep(set_up_s)

    return server.serve(demo, engine, server.launch_options("127.0.0.1", port, False), server.RequestGate(),
                        quiet_s=0.0, on_launch=set_up, requests=requests)


if __name__ == "__main__":
    logs.configure()  # as python app.py does (serving.main.prepare): serve's lines on stderr, one per record
    mode, port = sys.argv[1], int(sys.argv[2])
    sys.exit(stops(port, int(sys.argv[3])) if mode == "stops" else page(port, Path(sys.argv[3])))
