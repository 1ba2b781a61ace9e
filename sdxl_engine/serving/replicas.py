"""The engine as a Ray Serve deployment of N replicas, and the front's stand-in for it.

Imported only in scale-out mode (``python app.py --replicas N``): this module imports Ray, which
the single-process default never loads. One Gradio front keeps the page, the queue and the API;
each replica is a Serve replica (its own process) holding one :class:`~sdxl_engine.engine.Engine`
on its own devices, and the front calls them through a deployment handle:

- :class:`EngineReplica`: the deployment's class. Its constructor loads the model and compiles
  (Serve routes nothing to a replica before its constructor returned: a starting replica is
  "STARTING", never "RUNNING"); ``check_health`` fails once its device failed, so Serve replaces
  it; ``generate`` streams the engine's stages and denoising steps (with their previews), then the
  result, and stops the engine after the running step when the front cancels the call.
- :func:`build_app` / :func:`app_builder`: the Serve application (``max_ongoing_requests=1``:
  one request at a time per replica), from the command line or from a Serve config file
  (KubeRay's ``serveConfigV2``, ``import_path: sdxl_engine.serving.replicas:app_builder``).
- :class:`RemoteEngine`: what the page uses instead of the local engine: the same contract
  (engine.contract.EngineContract: ``ready``, ``stage``, ``limits``, ``generate`` ...); it starts a private local Ray cluster or
  joins one, deploys (or, with ``app_name``, uses an existing application), counts the ready
  replicas, retries a request on another replica when the one it was sent to died before the
  request reached its devices, and reports any other loss as one clear error.

Routing is Serve's: each call goes to the less busy of two ready replicas picked at random
("power of two choices"), never to a replica already running its one request; with two
replicas that is the least busy one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import AsyncIterator, Callable

import jax
import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError

from sdxl_engine.engine import faults
from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.engine.contract import ScaleOut, clock, queue_seconds
from sdxl_engine.engine.local import CompilesBusy, Engine, EngineNotReady, GenerateResult, GenerationError, wait_for_start
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, validate
from sdxl_engine.engine.steps import StepEvent, Stopped
from sdxl_engine.serving.scaleout import (APP_NAME, DEPLOYMENT_NAME, GRACEFUL_SHUTDOWN_S, HEALTH_CHECK_PERIOD_S, HEALTH_CHECK_TIMEOUT_S,
                       MAX_ONGOING_REQUESTS, REQUEST_TIMEOUT_S, ReplicaPlan, Replicas, plan_replica,
                       ray_environment)

POLL_S = 1.0  # the front reads Serve's replica counts this often
SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}  # replicas' own prints still reach the log
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
    def failure(cls, err: BaseException) -> "Outcome":
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
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.device_error: BaseException | None = None
        self.engine = Engine(config)  # its log lines reach the front's log, prefixed with this replica's pid
        self.engine.start()
        print(f"[sdxl_engine] Serve replica {self.replica_id} ready (pid {os.getpid()})", flush=True)

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
        engine is asked to stop, which it does after the running step (issue #23; a sync generator would
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
            print(f"[sdxl_engine] Serve replica {self.replica_id}: request {err} (its call was cancelled)", flush=True)
            put(Outcome.failure(err))
        except (InvalidRequest, EngineNotReady, GenerationError, CompilesBusy) as err:  # the user's: no traceback
            put(Outcome.failure(err))
        except Exception as err:  # unexpected: the traceback stays in this replica's log
            traceback.print_exc()
            if isinstance(err, jax.errors.JaxRuntimeError):  # the runtime failed, not the request: replace us
                self.device_error = err
            put(Outcome.failure(err))


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
    return build_app(config, replicas, plan_replica([] if override else _node_resources(), replicas,
                                                    config.cpu_devices, override))


def builder_settings(args: dict) -> tuple[Replicas, EngineConfig, dict[str, float]]:
    """(replicas, engine config, replica resources) from :func:`app_builder`'s ``args``.

    Raises:
        ConfigError: a bad engine setting or replica count.
    """
    replicas = Replicas.parse(str(args.get("replicas", "1")))
    config = EngineConfig.load(args.get("engine") or {})
    return replicas, config, {k: float(v) for k, v in (args.get("replica_resources") or {}).items()}


def start_failure(message: str) -> ReplicaStartError | ReplicaConfigError:
    """One clear error from Serve's message about replicas that failed to start: the replicas'
    own exception, by its class name and text (their tracebacks stay in the log above).

    A ConfigError inside the replicas (a setting their devices cannot honour) becomes
    ReplicaConfigError (exit status 2, like a bad flag); anything else ReplicaStartError.
    """
    lines = [line for line in message.splitlines()
             if line.strip() and not line[0].isspace() and not line.startswith(("Traceback", "RuntimeError: Traceback"))]
    name, sep, text = (lines[-1] if lines else message).partition(": ")
    kind = name.rsplit(".", 1)[-1]
    if not sep or not kind.isidentifier():
        return ReplicaStartError(f"no engine replica could start: {message.strip()}")
    if kind in ("ConfigError", "ShardingError", "ScaleOutError"):
        return ReplicaConfigError(f"{text} (in the engine replicas)")
    return ReplicaStartError(f"no engine replica could start: {kind}: {text}")


def _node_resources() -> list[dict[str, float]]:
    """The ``Resources`` of every alive node of the connected cluster."""
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


@dataclasses.dataclass(frozen=True)
class ReplicaCounts:
    """Serve's view of the replicas: how many are RUNNING (taking requests) and STARTING, and
    whether the deployment has as many as it wants (``settled``)."""

    ready: int = 0
    starting: int = 0
    settled: bool = False


class RemoteEngine:
    """The front's engine in scale-out mode: the local Engine's contract, served by Serve replicas.

    Implements :class:`~sdxl_engine.engine.contract.EngineContract`, as the local
    :class:`~sdxl_engine.engine.local.Engine`: ``ready`` (set once one replica is ready, or
    start-up failed), ``stage``, ``started``, ``error``, ``startup``, ``device_summary`` (one
    replica's devices), ``batch``, ``config``, ``defaults``, ``model`` (``name``, ``dtype``),
    ``limits``, ``scale_out()`` (the replica counts); plus ``replicas`` (:class:`ReplicaCounts`),
    ``scale`` (:class:`Replicas`) and ``slots`` (the page's concurrency: one request per replica).

    Use :meth:`launch`; call :meth:`close` after the front drained.
    """

    def __init__(self, config: EngineConfig, scale: Replicas, address: str | None = None, app_name: str = "",
                 resources: dict[str, float] | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S, log=print):
        self.config = config
        self.defaults = config  # the replicas' resolved defaults once the first is ready (ReplicaInfo)
        self.scale = scale
        self.slots = scale.slots
        self.address = address
        self.app_name = app_name or APP_NAME
        self.owns_app = not app_name  # deployed here, so deleted here; an existing application is left running
        self.resources = resources
        self.request_timeout_s = request_timeout_s
        self._log = log
        self.stage = "starting Ray"
        self.started = clock()
        self.startup: dict[str, float] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.replicas = ReplicaCounts()
        self.device_summary = ""
        self.batch: int | None = None
        self.model: _ModelName | None = None
        self.limits: Limits | None = None
        self.plan: ReplicaPlan | None = None
        self._temp_dir = ""
        self._handle = None
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    # ---- start-up -------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig, scale: Replicas, **kwargs) -> "RemoteEngine":
        """Start or join Ray in this thread (call it from the main thread, before the server
        installs its signal handlers), then deploy and watch the replicas in a background thread.

        Raises:
            ReplicaStartError: Ray could not be started or joined.
            ScaleOutError: the cluster has nothing to place a replica on.
        """
        engine = cls(config, scale, **kwargs)
        engine._connect()
        engine._watcher = threading.Thread(target=engine._deploy_and_watch, name="replica-watch", daemon=True)
        engine._watcher.start()
        return engine

    def _connect(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.address:
                ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=True)
            else:
                self._temp_dir = tempfile.mkdtemp(prefix=LOCAL_TEMP_PREFIX)
                ray_environment(private=True)  # main.start_engine did before importing Ray; this covers other callers
                ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, _temp_dir=self._temp_dir,
                         logging_level=logging.WARNING, log_to_driver=True)
        except Exception as err:  # Ray's own errors (ConnectionError, RuntimeError, ValueError, ...)
            self._remove_temp_dir()
            raise ReplicaStartError(f"could not {'join the Ray cluster at ' + self.address if self.address else
                                    'start a local Ray cluster'}: {type(err).__name__}: {err}") from err
        self.startup["ray_s"] = time.perf_counter() - t0
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines here are Serve's own bookkeeping
        if self.owns_app:
            self.plan = plan_replica(_node_resources(), self.scale, self.config.cpu_devices, self.resources)
        where = f"joined {self.address}" if self.address else f"local cluster, temp folder {self._temp_dir}"
        self._log(f"[replicas] Ray {ray.__version__}: {where} in {self.startup['ray_s']:.1f} s; "
                  + (f"deploying {self.scale.describe()}, each {self.plan.describe()}" if self.plan else
                     f"using the Serve application {self.app_name!r}"))

    def _deploy_and_watch(self) -> None:
        try:
            if self.owns_app:
                self.stage = f"deploying {self.scale.describe()}"
                serve.start(proxy_location="Disabled", logging_config=SERVE_LOGGING)  # no HTTP proxy: handles only
                target = serve.RunTarget(build_app(self.config, self.scale, self.plan), name=self.app_name,
                                         route_prefix=None, logging_config=SERVE_LOGGING)
                serve.run_many([target], wait_for_applications_running=False)
            self._handle = serve.get_app_handle(self.app_name)
        except Exception as err:
            self._fail(ReplicaStartError(f"could not deploy the engine on Ray Serve: {type(err).__name__}: {err}"))
            return
        logged: tuple[int, int] | None = None  # the (ready, starting) counts last logged
        while not self._closing.wait(POLL_S):
            try:
                status = serve.status().applications.get(self.app_name)
            except Exception as err:  # the cluster went away; keep the last counts and say so once
                self.stage = f"cannot read Serve's status ({type(err).__name__})"
                continue
            deployment = status.deployments.get(DEPLOYMENT_NAME) if status else None
            if deployment is None:
                continue
            states = {getattr(k, "value", k): v for k, v in deployment.replica_states.items()}
            healthy = getattr(deployment.status, "value", deployment.status) == "HEALTHY"
            self.replicas = ReplicaCounts(ready=states.get("RUNNING", 0), starting=states.get("STARTING", 0),
                                          settled=healthy and states.get("RUNNING", 0) >= self.scale.min_replicas)
            if not self.ready.is_set():
                if getattr(deployment.status, "value", deployment.status) == "DEPLOY_FAILED":
                    self._fail(start_failure(deployment.message))
                    return
                self.stage = (f"replicas loading the model and compiling: {self.replicas.ready} of "
                              f"{self.scale.min_replicas} ready")
                if self.replicas.ready:
                    self._first_ready()
            counts = (self.replicas.ready, self.replicas.starting)
            if self.ready.is_set() and (self.replicas.settled or logged) and counts != logged:
                logged = counts  # once all are up, then at every change (a replica lost, replaced, scaled)
                self._log(f"[replicas] {self.count_text()} at {time.perf_counter() - self.started:.1f} s")

    def count_text(self) -> str:
        """``2 of 2 replicas ready`` (``, 1 starting``), or ``1 replica ready (autoscaling 1-4)``."""
        counts, scale = self.replicas, self.scale
        text = (f"{counts.ready} replica{'' if counts.ready == 1 else 's'} ready (autoscaling "
                f"{scale.min_replicas}-{scale.max_replicas})" if scale.autoscaling
                else f"{counts.ready} of {scale.max_replicas} replicas ready")
        return text + (f", {counts.starting} starting" if counts.starting else "")

    def scale_out(self) -> ScaleOut:
        """The replica counts as the page shows them (the contract's scale-out description)."""
        return ScaleOut(self.count_text(), self.replicas.settled)

    def _first_ready(self) -> None:
        """Learn the model, limits and devices from a ready replica; then the page serves."""
        try:
            info: ReplicaInfo = self._handle.describe.remote().result(timeout_s=60)
        except Exception as err:  # it may have died since; the next poll tries again
            self._log(f"[replicas] a ready replica did not describe itself ({type(err).__name__}); retrying")
            return
        self.model = _ModelName(info.model_name, info.dtype)
        self.batch, self.device_summary, self.limits = info.batch, info.device_summary, info.limits
        self.defaults = info.defaults
        self.startup.update({f"replica_{k}": v for k, v in info.startup.items()})
        self.startup["ready_s"] = clock() - self.started
        self.stage = "ready"
        self.ready.set()
        self._log(f"[replicas] first replica ready ({info.replica}, pid {info.pid} on {info.node}, "
                  f"{info.device_summary}) in {self.startup['ready_s']:.1f} s; serving")

    def _fail(self, err: BaseException) -> None:
        self.error = err
        self.stage = f"failed: {err}"
        self.ready.set()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until one replica is ready. Raises EngineNotReady if start-up failed or timed out."""
        wait_for_start(self, timeout)

    # ---- requests -------------------------------------------------------------------------
    def generate(self, request: GenerateRequest, ready_timeout: float | None = None,
                 progress: Callable[[str], None] | None = None, arrived: float | None = None,
                 on_step: Callable | None = None, should_stop: Callable[[], bool] | None = None) -> ReplicaResult:
        """Run one request on a replica; the local Engine.generate's contract, plus ``replica``.

        Issue #23: ``on_step`` hears the replica's StepEvents (with their previews) as they come;
        ``should_stop()`` is asked before the request leaves the front and at each step: when it says
        stop, the call is cancelled, which stops the replica's engine after its running step
        (EngineReplica.generate), and Stopped is raised here at once.

        The request is validated here first (bad input never travels; a random seed is drawn once,
        so a retry makes the same images). Timings: the replica's ``prep``, ``device``, ``post``;
        ``queue`` from ``arrived`` until the call left the front; ``ray``, the rest of the round
        trip (routing, transfer, a retry); ``latency``, the whole round trip.

        Raises:
            InvalidRequest, EngineNotReady, GenerationError: as the local engine.
            ReplicaLost: the replica died or did not answer in ``request_timeout_s`` after the
                request reached its devices (or on the second replica tried).
            ReplicaError: the replica failed with an unexpected error.
        """
        called = clock()
        self.wait_ready(ready_timeout)
        request = validate(request, self.limits)
        if should_stop is not None and should_stop():
            raise Stopped("stopped before it started")
        report = progress or (lambda stage: None)
        sent = clock()
        outcome, retried = None, ""
        for attempt in (1, 2):
            try:
                outcome = self._call(request, report, on_step, should_stop)
                break
            except _Lost as lost:
                if lost.on_device or attempt == 2:
                    raise ReplicaLost(f"the replica running this request {lost.reason}; nothing came back. Please "
                                      "retry: the other replicas serve, and Serve replaces the lost one.") from lost
                retried = lost.reason
                self._log(f"[replicas] a replica {lost.reason} before the request reached its devices; retrying once")
        if outcome.result is None:
            outcome.raise_error()
        back = clock()
        result = outcome.result
        remote = result.timings["prep"] + result.timings["device"] + result.timings["post"]
        result.timings.update(queue=queue_seconds(arrived, called, sent),
                              ray=max(0.0, back - sent - remote), latency=back - sent)
        if retried:
            result.warnings.append(f"a replica {retried} before this request reached its devices; "
                                   f"replica {result.replica} made it instead")
        return result

    def _call(self, request: GenerateRequest, report: Callable[[str], None], on_step: Callable | None,
              should_stop: Callable[[], bool] | None) -> Outcome:
        """One try on one replica. Raises _Lost when the replica died or timed out, Stopped when
        ``should_stop()`` said so at a step (the call is cancelled: the replica stops too)."""
        response = self._handle.options(stream=True).generate.remote(request)
        timer = threading.Timer(self.request_timeout_s, response.cancel)
        timer.daemon = True
        timer.start()
        on_device = False
        try:
            for event in response:
                if isinstance(event, Outcome):
                    return event
                if isinstance(event, StepEvent):
                    if should_stop is not None and should_stop():
                        response.cancel()
                        raise Stopped(f"stopped after step {event.step} of {event.steps}")
                    if on_step is not None:
                        on_step(event)
                    continue
                on_device = on_device or event.name == "on device"
                report(event.name)
        except RequestCancelledError as err:
            raise _Lost(f"did not answer within {self.request_timeout_s:.0f} s", on_device) from err
        except RayActorError as err:  # ActorDiedError (process gone), ActorUnavailableError (unreachable)
            raise _Lost(f"stopped ({type(err).__name__})", on_device) from err
        finally:
            timer.cancel()
        raise _Lost("ended its answer without a result", on_device)

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching; delete the application if it was deployed here, stop a private cluster
        (or leave a joined one), and remove the private cluster's temp folder."""
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(POLL_S * 3)
        try:
            if self.owns_app and ray.is_initialized():  # the replicas are idle: the front drained before
                # Only our application, even on our own cluster: ray.shutdown() below stops that one with
                # Serve's controller in it, after this process stopped printing the cluster's log.
                # (serve.shutdown() kills the controller while this process still waits on it, and the
                # raylet logs each of those calls as a failed task: noise on every clean stop.)
                serve.delete(self.app_name)
        except Exception as err:  # the cluster may be gone already; shutting down goes on
            self._log(f"[replicas] warning: could not delete the Serve application ({type(err).__name__}: {err})")
        finally:
            ray.shutdown()
            self._remove_temp_dir()
        self._log("[replicas] Serve application deleted and Ray " + ("left" if self.address else "stopped"))

    def _remove_temp_dir(self) -> None:
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


class _Lost(Exception):
    """One try's replica died or timed out; ``on_device`` says whether the request had reached its devices."""

    def __init__(self, reason: str, on_device: bool):
        super().__init__(reason)
        self.reason = reason
        self.on_device = on_device


@dataclasses.dataclass(frozen=True)
class _ModelName:
    """``engine.model`` as the page reads it: the name and the dtype."""

    name: str
    dtype: str

