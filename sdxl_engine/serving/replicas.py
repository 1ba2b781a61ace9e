"""The engine as a Ray Serve deployment: one replica per process, each holding one engine on its devices.

Imported only in scale-out mode (``python app.py --replicas N``): it imports Ray, which the single-process
default never loads. :class:`EngineReplica` is the deployment's class: its constructor loads the model and
compiles (Serve routes nothing to a replica before that); ``check_health`` fails once its device failed, so
Serve replaces it; ``generate`` streams the engine's stages and steps (with their previews), then one
:class:`Outcome` (the result, or the engine's own exception), and stops the engine after the running step
when the front cancels the call. :func:`build_app` / :func:`app_builder`: the Serve application
(``max_ongoing_requests=1``), from the command line or a Serve config file (KubeRay's ``serveConfigV2``,
``import_path: sdxl_engine.serving.replicas:app_builder``). The front that calls it is remote.RemoteEngine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable

import jax
import ray
from ray import serve

from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.engine import faults
from sdxl_engine.engine.contract import GenerateResult
from sdxl_engine.engine.errors import CompilesBusy, EngineNotReady, GenerationError
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.steps import StepEvent, Stopped
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits
from sdxl_engine.serving import logs
from sdxl_engine.serving.scaleout import (
    DEPLOYMENT_NAME,
    GRACEFUL_SHUTDOWN_S,
    HEALTH_CHECK_PERIOD_S,
    HEALTH_CHECK_TIMEOUT_S,
    MAX_ONGOING_REQUESTS,
    ReplicaPlan,
    Replicas,
    plan_replica,
)

LOG = logging.getLogger(__name__)

SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}  # Serve's own lines; the engine's: logs.configure
LOCAL_TEMP_PREFIX = "sdxl-ray-"  # the private cluster's Ray temp folder, under the system temp folder


class ReplicaStartError(RuntimeError):
    """Ray could not be started or joined, or no replica could start (the message says why)."""


class ReplicaConfigError(ConfigError):
    """No replica could start because of a setting its devices cannot honour (exit status 2)."""


class ReplicaLost(GenerationError):
    """The replica running a request died or stopped answering after the request reached its devices.

    A GenerationError, so the page shows its message as it is: the user can retry at once (the
    other replicas serve; Serve replaces the lost one).
    """


class ReplicaError(RuntimeError):
    """A replica failed a request with an unexpected error (its traceback is in the replica's log)."""


class ReplicaUnhealthy(RuntimeError):
    """Raised by a replica's health check once its device failed: Serve then replaces the replica."""


# The errors a replica hands back as they are (picklable, each the user's to act on or a stop): the front
# raises the same type with the same fields, so nothing is matched by name or message text.
ENGINE_ERRORS = (InvalidRequest, EngineNotReady, GenerationError, CompilesBusy, Stopped, faults.InjectedFault)


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """What the front learns from a ready replica (the same for all: one config, one model).

    Attributes:
        replica: Serve's id of the replica that answered (stable for the replica's life).
        pid: its process id. node: its node's IP address.
        model_name, dtype: the loaded model. batch: images per request.
        device_summary: the replica's devices, e.g. ``2 × cpu`` or ``4 × TPU v5 lite``.
        limits: what requests may ask for (sizes, steps, seeds).
        defaults: the replica engine's resolved defaults (config.resolve_defaults).
        startup: the replica's start-up stages in seconds (``load_s``, ``compile_s``, ``ready_s``).
    """

    replica: str
    pid: int
    node: str
    model_name: str
    dtype: str
    batch: int
    device_summary: str
    limits: Limits
    defaults: EngineConfig
    startup: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Stage:
    """Streamed by a replica as the engine enters a stage (``preparing``, ``on device``, ...)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The last item a replica streams: the result, or the error itself (its type crosses Ray pickled)."""

    result: GenerateResult | None = None
    error: BaseException | None = None

    @classmethod
    def failure(cls, err: BaseException) -> Outcome:
        """The outcome of a failed request: the engine's own error (one of :data:`ENGINE_ERRORS`, whose type the
        front raises again), or any other exception as a ReplicaError with its type's name and text."""
        return cls(error=err if isinstance(err, ENGINE_ERRORS) else ReplicaError(f"{type(err).__name__}: {err}"))

    def raise_error(self) -> None:
        """Raise the replica's error again in the front."""
        raise self.error


@dataclasses.dataclass
class ReplicaResult(GenerateResult):
    """A GenerateResult that also names the replica that made it (``info["replica"]`` on the page)."""

    replica: str = ""


class EngineReplica:
    """One Serve replica: an Engine on this replica's devices (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        """Load the model and compile, before Serve sends this replica any request.

        Raises whatever the engine's start raises (Serve retries, then reports the deployment failed).
        """
        # A replica is a process of its own: without this handler its INFO lines (stages, compiles, ready) would be
        # dropped. On stderr, which Ray copies to the front's log prefixed with this replica's pid.
        logs.configure(_replica_log_level())
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.device_error: BaseException | None = None
        self.engine = Engine(config)
        self.engine.start()
        LOG.info(f"[sdxl_engine] Serve replica {self.replica_id} ready (pid {os.getpid()})")

    def check_health(self) -> None:
        """Serve's health check. Raises ReplicaUnhealthy once a request hit a device failure."""
        if self.device_error is not None:
            raise ReplicaUnhealthy(f"the engine's device failed: {self.device_error}")

    def describe(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(replica=self.replica_id, pid=os.getpid(), node=ray.util.get_node_ip_address(),
                           model_name=engine.model.name, dtype=str(engine.model.dtype), batch=engine.batch,
                           device_summary=engine.device_summary, limits=engine.limits, defaults=engine.defaults,
                           startup=dict(engine.startup))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Stage | StepEvent | Outcome]:
        """Run one request; stream a Stage per engine stage and a StepEvent per denoising step (its
        preview, if any, is (batch, h, w, 3) uint8 at latent resolution: a few kB), then one Outcome.

        The engine runs in a thread of its own so its stages and steps can be streamed as they happen.
        An async generator, because Serve cancels only those: when the front cancels the call (its
        client's Stop, or its request_timeout_s), Serve raises CancelledError at the ``await`` and the
        engine is asked to stop, which it does after the running step (a sync generator would
        run on to the end). This generator returns only once the engine's thread has ended, so the
        replica never runs two requests at once.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        worker = threading.Thread(target=self._run, name="engine-request", daemon=True,
                                  args=(request, lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                                        stop.is_set))
        worker.start()
        try:
            while True:
                event = await events.get()
                yield event
                if isinstance(event, Outcome):
                    return
        finally:
            stop.set()  # closed before its Outcome: the front gave up on the call
            worker.join()  # one step at most once asked to stop; this replica takes no request meanwhile

    def _run(self, request: GenerateRequest, put: Callable, should_stop: Callable[[], bool]) -> None:
        try:
            result = self.engine.generate(request, progress=lambda stage: put(Stage(stage)), on_step=put,
                                          should_stop=should_stop)
            fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(GenerateResult)}
            put(Outcome(result=ReplicaResult(**fields, replica=self.replica_id)))
        except Stopped as err:  # the front cancelled the call: one line in this replica's log
            LOG.info(f"[sdxl_engine] Serve replica {self.replica_id}: request {err} (its call was cancelled)")
            put(Outcome.failure(err))
        except (InvalidRequest, EngineNotReady, GenerationError, CompilesBusy) as err:  # the user's: no traceback
            put(Outcome.failure(err))
        except Exception as err:  # unexpected: the traceback stays in this replica's log
            LOG.exception(f"[sdxl_engine] Serve replica {self.replica_id}: the engine raised {type(err).__name__}")
            if isinstance(err, jax.errors.JaxRuntimeError):  # the runtime failed, not the request: replace us
                self.device_error = err
            put(Outcome.failure(err))


def _replica_log_level() -> str:
    """The replica's log level: ``SDXL_LOG_LEVEL`` (a private cluster's replicas inherit the front's, which
    serving.main sets from ``--log-level``), else the default; a bad one is said once and the default used."""
    try:
        return logs.parse_level(os.environ.get(logs.ENV, logs.DEFAULT_LEVEL))
    except ValueError as err:
        LOG.warning(f"[sdxl_engine] {logs.ENV}: {err}; logging from {logs.DEFAULT_LEVEL}")
        return logs.DEFAULT_LEVEL


def deployment_options(replicas: Replicas, plan: ReplicaPlan) -> dict:
    """The Serve deployment options of the engine: one request at a time per replica, the
    replica's Ray resources, health checks, the replica count or autoscaling bounds."""
    return dict(name=DEPLOYMENT_NAME, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                ray_actor_options=plan.ray_actor_options(), health_check_period_s=HEALTH_CHECK_PERIOD_S,
                health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
                logging_config=SERVE_LOGGING, **replicas.serve_options())


def build_app(config: EngineConfig, replicas: Replicas, plan: ReplicaPlan) -> serve.Application:
    """The Serve application: :class:`EngineReplica` with :func:`deployment_options`.

    Each replica's engine gets ``config`` with ``cpu_devices`` from ``plan`` (used only on a host
    without an accelerator).
    """
    deployment = serve.deployment(EngineReplica, **deployment_options(replicas, plan))
    return deployment.bind(dataclasses.replace(config, cpu_devices=plan.cpu_devices))


def app_builder(args: dict) -> serve.Application:
    """Serve application builder for a Serve config file (KubeRay's ``serveConfigV2``).

    ``args``: ``replicas`` (``"2"`` or ``"1-4"``), ``replica_resources`` (``{"TPU": 4}``; give it:
    nodes that an autoscaler has not started yet cannot be seen, and without it the connected
    cluster's nodes decide), ``engine`` (EngineConfig overrides, e.g. ``{"model":
    "stabilityai/stable-diffusion-xl-base-1.0"}``; the rest comes from ``SDXL_*`` variables and
    defaults).

    Raises:
        ConfigError: a bad engine setting or replica count.
    """
    replicas, config, override = builder_settings(args)
    return build_app(config, replicas, plan_replica([] if override else node_resources(), replicas,
                                                    config.cpu_devices, override))


def builder_settings(args: dict) -> tuple[Replicas, EngineConfig, dict[str, float]]:
    """(replicas, engine config, replica resources) from :func:`app_builder`'s ``args``.

    Raises:
        ConfigError: a bad engine setting or replica count.
    """
    replicas = Replicas.parse(str(args.get("replicas", "1")))
    config = EngineConfig.load(args.get("engine") or {})
    return replicas, config, {k: float(v) for k, v in (args.get("replica_resources") or {}).items()}


def node_resources() -> list[dict[str, float]]:
    """The ``Resources`` of every alive node of the connected cluster."""
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
