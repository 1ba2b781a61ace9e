"""The process's life: ``python app.py`` from its flags to its exit status.

app.py holds the page only and hands its builder here (this package never imports app.py):

1. :func:`prepare`, the process's first step, before Gradio or JAX is imported: the stop signals
   handled from here on (signals.StopSignals), a usable port variable for Gradio (which reads
   ``GRADIO_SERVER_PORT`` at import), the flags parsed, the log configured (serving.logs: one line per
   record on stderr, ``--log-level``), a writable temp folder for Gradio (``GRADIO_TEMP_DIR``, also read at
   import), and every setting checked: a malformed one exits 2 with one ``error:`` line, before anything
   listens.
2. :func:`main`: a stop that came during the imports ends here (status 0); the port probe, the engine
   started in the background (:func:`start_engine`: the local one, or the Ray front with
   ``--replicas``), the service (sdxl_engine.service: every request's line and cap) and the page built as one of
   its clients, served until a stop
   (server.serve: the exit statuses).
3. :func:`run`: :func:`main`, then ``os._exit`` with its status.

This module imports nothing heavy at its own import (Gradio, JAX and the handler load in :func:`main`),
so step 1 runs first.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from sdxl_engine.serving import logs  # standard library only
from sdxl_engine.serving.signals import StopSignals  # standard library only

LOG = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sdxl_engine.config import EngineConfig


@dataclasses.dataclass
class Start:
    """What :func:`prepare` established: the stop signals (installed), the flags and the checked engine settings."""

    signals: StopSignals
    args: argparse.Namespace
    config: EngineConfig


def prepare(title: str, argv: list[str] | None = None) -> Start:
    """The process's first step (app.py calls it before importing Gradio; see the module docstring).

    Exits (``SystemExit``) with status 2 and one line for a bad flag (argparse's, ``--log-level`` included),
    an unusable ``GRADIO_SERVER_PORT`` or ``SDXL_LOG_LEVEL``, or a malformed or unusable setting (``error: bad
    setting: ...``): a value EngineConfig refuses (the LoRA names included), an ``outputs_dir`` that cannot be
    written, a LoRA entry that is not an existing ``.safetensors`` file (cli.check_lora_settings). ``--help``
    exits 0. These ``error:`` lines are the command's answer, written as they are (as argparse writes its own),
    not log records.
    """
    signals = StopSignals()  # first: from here on a stop signal ends in a clean stop, not the default kill
    signals.install()
    from sdxl_engine.config import ConfigError, EngineConfig  # light: no JAX, no Gradio (the imports below too)
    from sdxl_engine.serving import cli, server

    if (bad_env := cli.environment_error()) is not None:
        print(f"error: bad setting: {bad_env}", file=sys.stderr)
        sys.exit(server.EXIT_BAD_SETTING)
    args = cli.parse_args(argv, title)
    logs.configure(args.log_level)  # before the first line the process logs
    # The private Ray cluster's replicas inherit this process's environment: they log at the same level.
    os.environ[logs.ENV] = args.log_level
    # What still writes to stdout (Ray's copies of its workers' output) reaches a redirected log line by line,
    # not in blocks: stdout is block-buffered when it is not a terminal.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    server.usable_output_dir()
    try:
        config = EngineConfig.load(cli.engine_overrides(args))
        cli.check_outputs_dir(config.outputs_dir)
        cli.check_lora_settings(config)
    except ConfigError as err:
        print(server.start_error_line(err), file=sys.stderr)
        sys.exit(server.EXIT_BAD_SETTING)
    return Start(signals, args, config)


def main(argv: list[str] | None, build_demo: Callable, css: str, title: str, start: Start | None = None) -> int:
    """Start the engine in the background, serve the page; returns the exit status (see server.serve).

    Args:
        argv: the command line without the program name (None: ``sys.argv[1:]``); not read when
            ``start`` is given.
        build_demo: app.build_demo: ``(requests, page config, engine, history_secret=)`` -> gr.Blocks, where
            ``requests`` is the service (service.service.Service) its events submit to.
        css: the page's CSS (``demo.launch(css=...)``). title: the page's title, also in ``--help``.
        start: what :func:`prepare` returned (None: it runs now).
    """
    start = start or prepare(title, argv)

    from sdxl_engine.checkpoint.loading import ModelLoadError
    from sdxl_engine.config import ConfigError
    from sdxl_engine.service.jobs import JobStore
    from sdxl_engine.service.service import Service
    from sdxl_engine.serving import apis, cli, gradio_internals, server
    from sdxl_engine.serving.handler import page_defaults

    args, config, signals = start.args, start.config, start.signals
    if signals.requested:  # during the imports: nothing started yet, nothing to drain
        LOG.info("[app] stopping: a stop signal came before the server started")
        LOG.info("[app] stopped")
        return 0
    gradio_internals.check_version()
    try:
        page_config = page_defaults(config)
    except (ConfigError, ModelLoadError) as err:
        print(server.start_error_line(err), file=sys.stderr)
        return server.exit_status(err)
    if (taken := server.port_error(args.host, args.port)) is not None:
        print(f"error: cannot serve on {args.host}:{args.port}: {taken}", file=sys.stderr)
        return server.EXIT_START_FAILED
    try:
        engine, concurrency = start_engine(config, args)
    except (ConfigError, RuntimeError) as err:  # a bad scale-out setting (2); Ray could not start or join (1)
        print(server.start_error_line(err), file=sys.stderr)
        return server.exit_status(err)
    gate = server.RequestGate()
    requests = Service(engine, slots=concurrency, limit=config.max_requests_per_client,
                       max_waiting=config.max_queue_size, outputs_dir=config.outputs_dir,
                       store=JobStore(keep_s=args.job_keep_s, keep_bytes=int(args.job_keep_mb * 2**20)))
    demo = build_demo(requests, page_config, engine, history_secret=args.history_secret)
    # api_open False: every event goes through the queue (no POST /run/<api>), as the guard expects. No max_size:
    # Gradio's queue holds an event only until it starts, at once; the service's line is bounded (max_waiting).
    demo.queue(api_open=False)
    share = args.share and cli.share_possible(f"http://{args.host}:{args.port}/", gradio_internals.share_server())
    access = apis.access_for(args.api_key, share, args.public_api, args.mcp)  # the protocol APIs
    flags = {"api": access.apis, "share": bool(share), "api_key_required": bool(access.key), "mcp": access.mcp,
             "max_requests_per_client": config.max_requests_per_client,  # A1111's cmd-flags: nothing secret
             "callback_hosts": tuple(args.callback_host)}
    try:
        return server.serve(demo, engine, {**server.launch_options(args.host, args.port, share),
                                           "css": css}, gate, signals=signals,
                            requests=requests,
                            on_launch=lambda app: apis.mount(app, requests, access, flags, page_config))
    finally:
        if args.replicas is not None:
            engine.close()  # after the drain: delete the Serve application, stop the private Ray cluster


def start_engine(config: EngineConfig, args) -> tuple:
    """(engine, page concurrency): the local engine started in the background (one request on the devices
    at a time, while new sizes compile), or with ``--replicas`` the stand-in for the Ray Serve replicas (one request
    per replica). Both implement engine.contract.EngineContract."""
    if args.replicas is None:
        from sdxl_engine.engine.local import Engine

        # One request on the devices at a time (Engine.generate's lock); one more slot per new size that may
        # compile meanwhile, so a compile never holds up requests at compiled sizes.
        return Engine(config).start_in_background(), 1 + config.max_pending_compiles
    from sdxl_engine.serving import scaleout

    scaleout.ray_environment(private=args.ray_address is None)  # before Ray's import, which reads it
    # Imported only here: without --replicas `python app.py` never loads Ray (docs/scale-out.md).
    from sdxl_engine.serving import remote

    engine = remote.RemoteEngine.launch(config, args.replicas, address=args.ray_address, app_name=args.ray_app,
                                          resources=args.replica_resources)
    return engine, engine.slots


def run(build_demo: Callable, css: str, title: str, argv: list[str] | None = None,
        start: Start | None = None) -> NoReturn:
    """:func:`main`, then end the process with its status, without interpreter teardown."""
    status = main(argv, build_demo, css, title, start)
    # No interpreter teardown: a stop while the engine still compiles in its background thread
    # would tear down JAX under that thread (a segfault after "[app] stopped"). Everything the
    # process owns is closed by now; only the output buffers are left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
