"""How the page is served: launch options, the guard and routes in place before the server listens, a clean stop.

:func:`launch_options` (loopback unless told otherwise, no share link unless asked, no SSR, no /monitoring,
1 MB upload cap); :func:`serve`: launch with :func:`before_listening` (guard.install_guard and the protocol
routes), keep Gradio's temp folder in bounds (janitor.TempJanitor), then on SIGTERM/SIGINT stop taking
requests, let the accepted ones finish (bounded) and return 0 (signals.StopSignals: a second signal is
ignored, a third exits at once with 128 + its number).

Exit statuses of ``python app.py``, the same everywhere: 0 after a clean stop; 2 for a bad flag or setting,
including one this machine cannot honour (``images_per_request`` that does not divide over the devices, a
size the model cannot make): the command must change; 1 when valid settings still fail to start (model
missing or corrupt, an engine failure, the port taken); 128 + the signal's number (143, 130) when a third
SIGTERM/SIGINT cut a stop short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from sdxl_engine.config import ConfigError, trusted_networks
from sdxl_engine.serving import gradio_internals
from sdxl_engine.serving.guard import MAX_IMAGE_BYTES, RequestGate, install_guard  # noqa: F401 (RequestGate: main.py's)
from sdxl_engine.serving.janitor import TempJanitor
from sdxl_engine.serving.signals import StopSignals  # noqa: F401 (serve's; imported from here by callers too)

LOG = logging.getLogger(__name__)

EXIT_START_FAILED = 1  # valid settings, yet the app could not start
EXIT_BAD_SETTING = 2  # a flag or setting must change (argparse uses 2 too)
QUIET_S = 2.0  # on shutdown, close once no HTTP request arrived for this long (image downloads)
DELIVER_S = 5.0  # on shutdown, the longest wait for the accepted calls' results to be written to their clients


def launch_options(host: str, port: int, share: bool) -> dict:
    """Keyword arguments for ``demo.launch``: the app's security defaults (see README). Gradio's own MCP server
    stays off: serving/apis serves MCP at ``/gradio_api/mcp/`` itself (apis/mcp_server.py)."""
    return dict(
        server_name=host, server_port=port,
        share=bool(share),  # explicit False: GRADIO_SHARE in the environment cannot open a link
        ssr_mode=False, enable_monitoring=False, mcp_server=False, strict_cors=True, show_error=False,
        run_history=False,  # Gradio's /runs page and its hub-bucket routes: not this app's
        # Per uploaded file (the image editor's, the only upload the guard lets through): one image's cap.
        max_file_size=MAX_IMAGE_BYTES, allowed_paths=[],
    )


FORWARDED_ALLOW_IPS = "FORWARDED_ALLOW_IPS"  # uvicorn's setting: the proxies whose forwarding headers it believes


def forwarded_allow_ips(trusted_proxies: str, share: bool = False) -> str:
    """uvicorn's ``FORWARDED_ALLOW_IPS`` for the ``trusted_proxies`` setting: its addresses and networks,
    comma-separated; "" trusts no one (uvicorn's own default trusts loopback, so any local process could
    name any client address). With ``share``, loopback too: Gradio's share tunnel reaches the server
    from there, and its server appends each visitor's address to X-Forwarded-For (as a Go reverse proxy
    does), so without it every visitor of the link would be one client.

    Raises:
        ConfigError: an entry that is not an IP address or network (config.trusted_networks).
    """
    networks = trusted_networks(trusted_proxies + (",127.0.0.1,::1" if share else ""))
    return ",".join(dict.fromkeys(str(n.network_address) if n.num_addresses == 1 else str(n) for n in networks))


def usable_output_dir(log=LOG.warning) -> str:
    """Make sure Gradio's output/temp folder (``GRADIO_TEMP_DIR``) is writable; fall back if not.

    Call before importing Gradio (it reads the folder once, at import). An unwritable
    folder logs one warning and switches ``GRADIO_TEMP_DIR`` to a fresh private temp folder.
    Returns the folder used.
    """
    wanted = os.environ.get("GRADIO_TEMP_DIR") or str(Path(tempfile.gettempdir()) / "gradio")
    try:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=wanted):
            pass
        return wanted
    except OSError as err:
        fallback = tempfile.mkdtemp(prefix="sdxl-demo-outputs-")
        log(f"[app] warning: output folder {wanted!r} is not writable ({err}); using {fallback}")
        os.environ["GRADIO_TEMP_DIR"] = fallback
        return fallback




def port_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (e.g. another process has it), or None.

    Checked before the engine starts, so a taken port ends the process at once, before any
    compile thread runs (a process that exits while XLA compiles can abort instead of exiting 1).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
            sock.bind(address)
    except OSError as err:
        return str(err)
    return None


def exit_status(error: BaseException) -> int:
    """The exit status for a start-up failure: 2 for a setting that must change, else 1."""
    return EXIT_BAD_SETTING if isinstance(error, ConfigError) else EXIT_START_FAILED


def start_error_line(error: BaseException) -> str:
    """The one ``error:`` line printed for a start-up failure."""
    if exit_status(error) == EXIT_BAD_SETTING:
        return f"error: bad setting: {error}"
    return f"error: the engine failed to start: {type(error).__name__}: {error}"


def before_listening(set_up):
    """A FastAPI ``lifespan`` (for ``demo.launch(app_kwargs={"lifespan": ...})``) that runs ``set_up(app)``
    at the application's startup: the ASGI lifespan protocol has the server run it before it accepts
    connections (uvicorn binds its socket only after startup completes), so routes, middleware and key
    checks added there are in place from the first connection. If ``set_up`` raises, the server does not start.
    ``set_up`` may return async context managers (the MCP server's session manager: apis.mount): each is entered
    before the first connection too, and exited, last first, when the app shuts down.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with contextlib.AsyncExitStack() as stack:
            for context in set_up(app) or ():
                await stack.enter_async_context(context)
            yield

    return lifespan


def serve(demo, engine, options: dict, gate: RequestGate, drain_s: float = 60.0, log=None,
          quiet_s: float = QUIET_S, signals: StopSignals | None = None, on_launch=None, requests=None) -> int:
    """Launch ``demo`` and block until it should stop; returns the process exit status.

    Returns :func:`exit_status` (after one ``error:`` line on stderr) when the engine fails to
    start, 1 when the server cannot listen, 0 after SIGTERM/SIGINT (:class:`StopSignals`: a second
    is ignored, a third exits at once): new calls are refused (raw HTTP 503 by the guard; the page's events,
    gradio_client and MCP by the service, ``requests``: its 503 text as an error), the calls already accepted
    (running or waiting) get up to ``drain_s`` seconds together to finish and reach their clients
    (including the clients' image downloads: the server closes after ``quiet_s`` seconds without a
    request). ``on_launch(app)``, if given, and the guard
    (:func:`install_guard`) are put in place before the server accepts its first connection
    (:func:`before_listening`; serving/apis mounts its routes and key check in ``on_launch``, which returns the
    async context managers the app's lifespan enters, as the MCP server's session manager). ``requests``
    (service.Service), if given: the service of every front (the per-client cap of
    ``engine.config.max_requests_per_client``, the waiting bound), closed with the gate, its queued and running jobs
    drained as the calls are. ``log``: where its lines go (tests collect them); None: the module loggers, each line
    at its level.
    """
    janitor_log, log = log, log or LOG.info
    if signals is None:
        signals = StopSignals()
    signals.install()  # again when given: Ray's start (--replicas) sets its own SIGTERM handler in between
    if signals.requested:  # a stop signal came while the process was starting: nothing served yet
        log("[app] stopping: a stop signal came before the server started")
        log("[app] stopped")
        return 0
    # Read by uvicorn when launch makes its server: who may name the client in X-Forwarded-For.
    os.environ[FORWARDED_ALLOW_IPS] = forwarded_allow_ips(engine.config.trusted_proxies, bool(options.get("share")))
    def set_up(app) -> list:
        from sdxl_engine.serving.apis.tools import optional_inputs  # here: this module stays light (main.prepare)

        contexts = (on_launch(app) if on_launch is not None else None) or []
        install_guard(app, gate, demo, optional_inputs())
        return contexts

    try:  # quiet: Gradio's own lines would advise "set share=True" even after --share was refused
        demo.launch(**options, prevent_thread_lock=True, quiet=True, app_kwargs={"lifespan": before_listening(set_up)})
    except OSError as err:  # e.g. the port is taken
        print(f"error: cannot serve on {options['server_name']}:{options['server_port']}: {err}",
              file=sys.stderr, flush=True)
        return EXIT_START_FAILED
    public = f" and public URL: {demo.share_url}" if demo.share_url else ""
    log(f"[app] Running on local URL: {demo.local_url}{public}")
    janitor_stop = threading.Event()  # set by this thread, never by a signal handler
    TempJanitor.for_config(demo, engine.config).start(janitor_stop, janitor_log)
    while not signals.requested:
        if engine.ready.is_set() and engine.error is not None:
            janitor_stop.set()
            print(start_error_line(engine.error), file=sys.stderr, flush=True)
            demo.close(verbose=False)
            return exit_status(engine.error)
        time.sleep(0.2)  # a signal interrupts the sleep and runs its handler; the flag is seen next round
    janitor_stop.set()
    gate.close()
    if requests is not None:
        requests.close()
    jobs_running, jobs_waiting = (0, 0) if requests is None else (requests.running, requests.waiting)
    log(f"[app] stopping: new requests are refused; finishing the ones already accepted "
        f"({jobs_running} running, {gradio_internals.waiting(demo) + jobs_waiting} waiting)")
    deadline = time.monotonic() + drain_s
    accepted = gradio_internals.live_events(demo)

    def wait_until(done) -> None:  # polls, so an ignored second signal is logged while waiting
        while not done() and time.monotonic() < deadline:
            signals.note_ignored(log)
            time.sleep(0.05)

    wait_until(lambda: requests is None or requests.idle())
    wait_until(lambda: gradio_internals.queue_idle(demo))
    idle_at = time.monotonic()
    # A finished call's result is written to its client's stream by another task: closing first would send the
    # client "Server stopped unexpectedly" in its place. A client that left is not waited for, nor, past
    # DELIVER_S, one that never reads its result.
    wait_until(lambda: not gradio_internals.undelivered(demo, accepted) or time.monotonic() - idle_at > DELIVER_S)
    # Clients fetch a result's images after the result itself: close only once quiet_s seconds
    # passed since the last result and since the last HTTP request (still within the deadline).
    wait_until(lambda: time.monotonic() - max(idle_at, gate.last_request) >= quiet_s)
    demo.close(verbose=False)
    signals.note_ignored(log)
    log("[app] stopped")
    return 0
