"""The command line of ``python app.py``: flags, the settings' checks at start, and whether a share link can work.

Imports nothing heavy (no JAX, no Gradio): the process parses and checks its settings with it first
(serving.main.prepare), so a malformed one ends the start at once, before anything listens.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
from pathlib import Path

import httpx

from sdxl_engine.config import LORA_NAME, MODEL_DEFAULT_FIELDS, ConfigError, EngineConfig, lora_entries
from sdxl_engine.serving import logs
from sdxl_engine.serving.scaleout import Replicas, ScaleOutError, parse_resources

LOG = logging.getLogger(__name__)

# Engine settings whose flag is given once per value (argparse's append): {setting: (metavar, help)}; the setting
# joins them with os.pathsep.
REPEATED_FLAGS = {"lora": ("NAME=PATH", "a LoRA that prompts pick with <lora:NAME:WEIGHT>; repeat the flag for more "
                                        "(env SDXL_LORA: NAME=PATH entries separated by os.pathsep; .safetensors "
                                        "only)"),
                  "controlnet": ("PATH", "a ControlNet (a diffusers folder or a .safetensors file; named by its "
                                         "folder or file name) that requests' control units pick; repeat the flag "
                                         "for more (env SDXL_CONTROLNET: paths separated by os.pathsep; "
                                         "docs/controlnet.md)"),
                  "ip_adapter": ("PATH", "an IP-Adapter (h94/IP-Adapter's sdxl_models/*.safetensors, its image_encoder "
                                         "folder beside it; named by its file name) that requests' ip_adapter_units "
                                         "pick; repeat the flag for more (env SDXL_IP_ADAPTER: paths separated by "
                                         "os.pathsep; docs/ip-adapter.md)")}
# Engine settings whose flag may be repeated to offer several models by name (docs/models.md): the first value is the
# setting (the default), the others go to its list setting (os.pathsep-joined), before that list's own values.
MODEL_LIST_FLAGS = {"model": "models", "refiner": "refiners"}
SERVER_FLAGS = ("share", "host", "port", "history_secret", "log_level", "replicas", "ray_address", "ray_app",
                "replica_resources", "api_key", "public_api", "mcp", "callback_host", "job_keep_s",
                "job_keep_mb")  # from api_key on: the protocol APIs and the jobs API


def tcp_port(text: str) -> int:
    """argparse type for --port / GRADIO_SERVER_PORT: a whole number 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (a whole number from 1 to 65535)")
    return port


def log_level(text: str) -> str:
    """argparse type for --log-level / SDXL_LOG_LEVEL: DEBUG, INFO, WARNING or ERROR (any case)."""
    try:
        return logs.parse_level(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def environment_error(environ=os.environ) -> str | None:
    """Why GRADIO_SERVER_PORT or SDXL_LOG_LEVEL is unusable, or None. Check them before parsing the flags, whose
    defaults they are (argparse would blame the flag), and before importing Gradio, which converts the port
    with ``int()`` at import time (a traceback for ``abc``)."""
    for name, check in (("GRADIO_SERVER_PORT", tcp_port), (logs.ENV, log_level)):
        text = environ.get(name)
        if text is None:
            continue
        try:
            check(text)
        except argparse.ArgumentTypeError as err:
            return f"{name}: {err}"
    return None


def _replicas(text: str) -> Replicas:
    """argparse type for --replicas: a count (2) or an autoscaling range (1-4)."""
    try:
        return Replicas.parse(text)
    except ScaleOutError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _resources(text: str) -> dict[str, float]:
    """argparse type for --replica-resources: a JSON object of Ray resources."""
    try:
        return parse_resources(text)
    except ScaleOutError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _env_flag(name: str, default: bool = False) -> bool:
    """A switch's default from the environment: 1/true/yes/on or 0/false/no/off, else ``default``."""
    word = os.environ.get(name, "").strip().lower()
    return True if word in ("1", "true", "yes", "on") else False if word in ("0", "false", "no", "off") else default


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """Command-line flags: the server's, then one per engine setting (``--num-inference-steps 30``).

    A bad flag or GRADIO_SERVER_PORT exits 2 with argparse's one-line message.
    """
    parser = _Parser(description=description)
    parser.add_argument("--share", action="store_true", help="ask Gradio for a public link")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="address to listen on (env GRADIO_SERVER_NAME; default loopback only)")
    parser.add_argument("--port", type=tcp_port, default=os.environ.get("GRADIO_SERVER_PORT", "7860"),
                        help="TCP port (env GRADIO_SERVER_PORT)")
    parser.add_argument("--history-secret", default=None,
                        help="key of the browsers' history (env SDXL_HISTORY_SECRET; default: one made once and kept "
                             "in the cache folder, so history survives restarts; docs/page.md, \"History\")")
    parser.add_argument("--log-level", type=log_level, default=os.environ.get(logs.ENV, logs.DEFAULT_LEVEL),
                        help=f"log from this level up: {', '.join(logs.LEVELS)} (env {logs.ENV}; default "
                             f"{logs.DEFAULT_LEVEL}); one line per record on stderr: ISO time, level, logger, message")
    scale = parser.add_argument_group("scale-out on Ray Serve (README); without --replicas, Ray is not used")
    scale.add_argument("--replicas", type=_replicas, default=None,
                       help="engine replicas: a count (2) or an autoscaling range MIN-MAX (1-4)")
    scale.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (auto, or 10.0.0.2:6379) instead of starting a private one")
    scale.add_argument("--ray-app", default=None,
                       help="use this Serve application, already deployed (a KubeRay RayService's)")
    scale.add_argument("--replica-resources", type=_resources, default=None,
                       help='Ray resources of one replica, JSON such as \'{"TPU": 8}\' (default: a TPU host\'s '
                            "chips, 1 GPU, or a share of a CPU host)")
    for field in dataclasses.fields(EngineConfig):
        default = f"default {field.default!r}"
        if field.name in MODEL_DEFAULT_FIELDS:  # the model's engine_defaults.json may choose another (README)
            default = (f"default: the model's own, else {field.default!r}"
                       + f"; {EngineConfig.model} runs {SHIPPED % field.name}")
        if field.name in MODEL_LIST_FLAGS:  # --model A --model B: A the default, B chosen per request by name
            parser.add_argument("--" + field.name, dest=field.name, default=None, action="append",
                                help=f"engine setting {field.name} (env SDXL_{field.name.upper()}, {default}); repeat "
                                     f"the flag to offer several, chosen per request by name (the first is the "
                                     f"default; the others go to {MODEL_LIST_FLAGS[field.name]}: docs/models.md)")
            continue
        if field.name in REPEATED_FLAGS:  # --lora NAME=PATH, once per LoRA; --controlnet PATH
            metavar, text = REPEATED_FLAGS[field.name]
            parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, default=None, action="append",
                                metavar=metavar, help=text)
            continue
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, default=None,
                            help=f"engine setting {field.name} (env SDXL_{field.name.upper()}, {default})")
    # the protocol APIs (AUTOMATIC1111, OpenAI Images, MCP; docs/protocols.md). Server flags, not
    # engine settings: the key is never logged (the engine logs its config) and never sent to Ray replicas.
    apis = parser.add_argument_group("protocol APIs: AUTOMATIC1111 (/sdapi/v1), OpenAI Images (/v1), MCP "
                                     "(/gradio_api/mcp)")
    apis.add_argument("--api-key", default=os.environ.get("SDXL_API_KEY") or None,
                      help="require Authorization: Bearer KEY on those APIs (env SDXL_API_KEY; default: none)")
    apis.add_argument("--public-api", action="store_true", default=_env_flag("SDXL_PUBLIC_API"),
                      help="serve them on a share link without a key (env SDXL_PUBLIC_API=1); with --share and no "
                           "key they are off otherwise")
    apis.add_argument("--no-mcp", dest="mcp", action="store_false", default=_env_flag("SDXL_MCP", True),
                      help="do not serve the MCP tools at /gradio_api/mcp/ (env SDXL_MCP=0)")
    apis.add_argument("--callback-host", action="append", default=None,
                      help="a host the jobs API may POST finished jobs to (a job's callback_url); repeat for more "
                           "(env SDXL_CALLBACK_HOSTS, comma-separated; default: none, callbacks refused)")
    apis.add_argument("--job-keep-s", type=float, default=float(os.environ.get("SDXL_JOB_KEEP_S", "600")),
                      help="seconds a finished job's result is kept for GET /v1/jobs/{id} (default 600)")
    apis.add_argument("--job-keep-mb", type=float, default=float(os.environ.get("SDXL_JOB_KEEP_MB", "512")),
                      help="megabytes of finished jobs' images kept, the oldest dropped first (default 512)")
    args = parser.parse_args(argv)
    if args.callback_host is None:
        args.callback_host = [h for h in os.environ.get("SDXL_CALLBACK_HOSTS", "").split(",") if h.strip()]
    if args.replicas is None and (args.ray_address or args.ray_app or args.replica_resources):
        parser.error("--ray-address, --ray-app and --replica-resources need --replicas")
    return args


SHIPPED = "{shipped:%s}"  # in a flag's help: what the default model runs with, filled in by _Parser.format_help


class _Parser(argparse.ArgumentParser):
    """The parser of :func:`parse_args`; its help shows the default model's own defaults, read only when
    the help is printed (the reader imports the model loader, JAX with it: too heavy for every start)."""

    def format_help(self) -> str:
        from sdxl_engine.checkpoint.loading import engine_defaults

        shipped = engine_defaults(EngineConfig.model)
        for action in self._actions:
            if action.help and SHIPPED % action.dest in action.help:
                field = next(f for f in dataclasses.fields(EngineConfig) if f.name == action.dest)
                value = shipped.get(field.name, field.default)
                shown = "its native size" if field.name in ("width", "height") and value == 0 else repr(value)
                action.help = action.help.replace(SHIPPED % action.dest, shown)
        return super().format_help()


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine settings given on the command line (those not given are left to env and defaults);
    a repeated flag's values joined by os.pathsep, as its setting holds them."""
    overrides = {k: os.pathsep.join(v) if k in REPEATED_FLAGS else v for k, v in vars(args).items()
                 if k not in SERVER_FLAGS and v is not None}
    for single, several in MODEL_LIST_FLAGS.items():  # --model A --model B: model A, models B (then --models')
        values = overrides.pop(single, None)
        if values:
            overrides[single] = values[0]
            rest = [*values[1:], *([overrides[several]] if overrides.get(several) else [])]
            if rest:
                overrides[several] = os.pathsep.join(rest)
    return overrides


def check_outputs_dir(folder: str) -> None:
    """Make sure ``folder`` (the ``outputs_dir`` setting; "" = off) can take the saved PNGs: create
    it if missing, then write and delete a probe file in it, as saving will.

    Raises:
        ConfigError: the folder cannot be created or written (under a regular file, no permission,
            read-only file system), naming the folder and the reason.
    """
    if not folder:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"outputs_dir {folder!r} cannot hold the saved images ({reason}); "
                          "name a folder this user can write, or leave it empty to save nothing") from None


def check_lora_settings(config: EngineConfig) -> None:
    """Check the ``lora`` and ``lora_dir`` settings' files before anything starts: each ``--lora`` entry an
    existing ``.safetensors`` file (a pickle is never opened), ``--lora-dir`` a folder whose LoRA names are
    valid and not taken by an entry. The files' contents are read, and checked against the model, when the
    engine starts (checkpoint.lora: exit 1 there), with the model's own LoRAs (its loras.json).

    Raises:
        ConfigError: naming the entry or folder and what is wrong with it (the names' rules:
            config.lora_entries, checked when the config loads).
    """
    names: dict[str, Path] = {}
    for name, path in lora_entries(config.lora):
        file, entry = Path(path).expanduser(), f"lora: --lora '{name}={path}'"
        if file.suffix.lower() != ".safetensors":
            raise ConfigError(f"{entry}: not a .safetensors file ({file.suffix or 'no suffix'}); LoRAs are read from "
                              ".safetensors only, and pickles (.ckpt, .pt, .bin) are never opened")
        if not file.is_file():
            raise ConfigError(f"{entry}: no such file")
        names[name] = file
    if not config.lora_dir:
        return
    root, where = Path(config.lora_dir).expanduser(), f"lora_dir: --lora-dir {config.lora_dir!r}"
    if not root.is_dir():
        raise ConfigError(f"{where}: not a folder")
    for file in sorted(root.iterdir()):
        if file.suffix.lower() != ".safetensors" or not file.is_file():
            continue
        if not LORA_NAME.fullmatch(file.stem):
            raise ConfigError(f"{where}: LoRA name {file.stem!r} (its file's name) must be letters, digits, '_', '-' "
                              "or '.' (it is written in <lora:NAME:WEIGHT> tags)")
        if file.stem in names:
            raise ConfigError(f"{where}: two LoRAs named {file.stem!r} ({names[file.stem]} and {file}); each name once")
        names[file.stem] = file


def share_possible(local_url: str, api_server: str, timeout: float = 5.0, log=LOG.warning) -> bool:
    """Whether the share server ``api_server`` answers; if not, log one line saying the app stays local.

    Gradio itself would try, fail and print several lines of advice; offline, one clear line is
    enough. A custom share server (GRADIO_SHARE_SERVER_ADDRESS) is not probed.
    """
    if os.environ.get("GRADIO_SHARE_SERVER_ADDRESS"):
        return True
    try:
        httpx.get(api_server, timeout=timeout).raise_for_status()
        return True
    except (httpx.HTTPError, OSError) as err:
        log(f"[app] --share: no public link (cannot reach {httpx.URL(api_server).host}: "
            f"{type(err).__name__}); serving locally only at {local_url}")
        return False
