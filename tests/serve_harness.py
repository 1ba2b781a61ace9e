"""A small server for tests/serving/test_server_shutdown_app.py: the app's own ``server.serve`` around a cheap page.

``python tests/serve_harness.py stops PORT N`` runs ``serve`` N times in a row in this process,
each time around a stand-in for a launched page (no HTTP server: launching and closing Gradio
would dominate a test of signal handling), printing ``serve returned <status>`` after each.

``python tests/serve_harness.py page PORT DIR`` serves a real Gradio page through ``serve``
(Guard, Admission, RequestGate, as ``python app.py`` does) with one queued endpoint,
``/generate(prompt)``, run through ``RequestGate.run`` with concurrency 1 as the app's. It
returns ``"done: <prompt>"``; a prompt ``hold:<name>`` first waits until the file ``DIR/<name>``
exists (so a test decides when a call ends, without timing); ``fail`` raises ``gr.Error``.
Settings come from the environment as for the app (``SDXL_MAX_REQUESTS_PER_CLIENT``);
``HARNESS_SET_UP_S=S`` makes serve's ``on_launch`` take S seconds (as mounting the protocol APIs takes
some), so a test can watch what a client gets meanwhile; ``HARNESS_LOOP_LAG_S=S`` stalls Gradio's event loop
for S seconds once each call's completion is queued, before its result stream can send it (:func:`lag_completions`).
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
    stream (``Queue.send_message``), as a loaded machine may: the call is then done (``gate.in_flight`` 0, the
    queue idle) while its client has not been sent the result; a close in that window must wait for the stream."""
    from gradio import queueing
    from gradio.server_messages import ProcessCompletedMessage

    send = queueing.Queue.send_message

    def lagging(self, event, message):
        if isinstance(message, ProcessCompletedMessage):  # runs first in the loop's next step, before the stream
            asyncio.get_running_loop().call_soon(time.sleep, seconds)
        return send(self, event, message)

    queueing.Queue.send_message = lagging


def page(port: int, folder: Path) -> int:
    import gradio as gr

    if os.environ.get("HARNESS_LOOP_LAG_S"):
        lag_completions(float(os.environ["HARNESS_LOOP_LAG_S"]))

    def generate(prompt: str) -> str:
        if prompt == "fail":
            raise gr.Error("refused: the prompt says fail", print_exception=False)
        if prompt.startswith("hold:"):
            release = folder / prompt[len("hold:"):]
            deadline = time.monotonic() + 300  # a generous bound: the test creates the file
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return f"done: {prompt}"

    gate = server.RequestGate()
    with gr.Blocks() as demo:
        prompt, out = gr.Textbox(), gr.Textbox()
        prompt.submit(lambda p: gate.run(generate, p), prompt, out, api_name="generate", concurrency_id="engine",
                      concurrency_limit=1)
    config = EngineConfig.load()
    demo.queue(max_size=config.max_queue_size)
    set_up_s = float(os.environ.get("HARNESS_SET_UP_S", "0"))
    return server.serve(demo, ready_engine(config), server.launch_options("127.0.0.1", port, False), gate,
                        quiet_s=0.0, on_launch=lambda app: time.sleep(set_up_s) if set_up_s else None)


if __name__ == "__main__":
    logs.configure()  # as python app.py does (serving.main.prepare): serve's lines on stderr, one per record
    mode, port = sys.argv[1], int(sys.argv[2])
    sys.exit(stops(port, int(sys.argv[3])) if mode == "stops" else page(port, Path(sys.argv[3])))
