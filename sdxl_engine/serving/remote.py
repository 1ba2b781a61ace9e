"""The front's stand-in for the engine in scale-out mode: :class:`RemoteEngine` calls the Ray Serve replicas.

It implements engine.contract.EngineContract (``ready``, ``stage``, ``limits``, ``generate`` ...): starts a
private local Ray cluster or joins one, deploys the application (replicas.build_app; or, with ``app_name``,
uses an existing one), counts the ready replicas, streams a request's stages and steps from its replica,
cancels the call on a stop, retries a request on another replica when the one it was sent to died before the
request reached its devices, and reports any other loss as one clear error. Routing is Serve's: each call
goes to the less busy of two ready replicas picked at random ("power of two choices"), never to a replica
already running its one request.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import ScaleOut, clock, queue_seconds, wait_for_start
from sdxl_engine.engine.steps import StepEvent, Stopped
from sdxl_engine.engine.validation import GenerateRequest, Limits, validate
from sdxl_engine.serving.replicas import (
    LOCAL_TEMP_PREFIX,
    SERVE_LOGGING,
    Outcome,
    ReplicaConfigError,
    ReplicaInfo,
    ReplicaLost,
    ReplicaResult,
    ReplicaStartError,
    build_app,
    node_resources,
)
from sdxl_engine.serving.scaleout import (
    APP_NAME,
    DEPLOYMENT_NAME,
    REQUEST_TIMEOUT_S,
    ReplicaPlan,
    Replicas,
    plan_replica,
    ray_environment,
)

LOG = logging.getLogger(__name__)

POLL_S = 1.0  # the front reads Serve's replica counts this often


def start_failure(message: str) -> ReplicaStartError | ReplicaConfigError:
    """One clear error from Serve's message about replicas that failed to start: the replicas'
    own exception, by its class name and text (their tracebacks stay in the log above).

    A ConfigError inside the replicas (a setting their devices cannot honour) becomes
    ReplicaConfigError (exit status 2, like a bad flag); anything else ReplicaStartError.
    """
    lines = [line for line in message.splitlines()
             if line.strip() and not line[0].isspace()
             and not line.startswith(("Traceback", "RuntimeError: Traceback"))]
    name, sep, text = (lines[-1] if lines else message).partition(": ")
    kind = name.rsplit(".", 1)[-1]
    if not sep or not kind.isidentifier():
        return ReplicaStartError(f"no engine replica could start: {message.strip()}")
    if kind in ("ConfigError", "ShardingError", "ScaleOutError"):
        return ReplicaConfigError(f"{text} (in the engine replicas)")
    return ReplicaStartError(f"no engine replica could start: {kind}: {text}")


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

    Use :meth:`launch`; call :meth:`close` after the front drained. ``log``: where its lines go (tests collect
    them); None: this module's logger, each line at its level.
    """

    def __init__(self, config: EngineConfig, scale: Replicas, address: str | None = None, app_name: str = "",
                 resources: dict[str, float] | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 log: Callable[[str], None] | None = None):
        self.config = config
        self.defaults = config  # the replicas' resolved defaults once the first is ready (ReplicaInfo)
        self.scale = scale
        self.slots = scale.slots
        self.address = address
        self.app_name = app_name or APP_NAME
        self.owns_app = not app_name  # deployed here, so deleted here; an existing application is left running
        self.resources = resources
        self.request_timeout_s = request_timeout_s
        self._log, self._warn = log or LOG.info, log or LOG.warning
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
    def launch(cls, config: EngineConfig, scale: Replicas, **kwargs) -> RemoteEngine:
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
            what = f"join the Ray cluster at {self.address}" if self.address else "start a local Ray cluster"
            raise ReplicaStartError(f"could not {what}: {type(err).__name__}: {err}") from err
        self.startup["ray_s"] = time.perf_counter() - t0
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines here are Serve's own bookkeeping
        if self.owns_app:
            self.plan = plan_replica(node_resources(), self.scale, self.config.cpu_devices, self.resources)
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
            self._warn(f"[replicas] a ready replica did not describe itself ({type(err).__name__}); retrying")
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

        ``on_step`` hears the replica's StepEvents (with their previews) as they come;
        ``should_stop()`` is asked before the request leaves the front and at each step: when it says
        stop, the call is cancelled, which stops the replica's engine after its running step
        (EngineReplica.generate), and Stopped is raised here at once.

        The request is validated here first, unless it was already (bad input never travels; a random seed is
        drawn once, so a retry makes the same images); the replica's engine does not validate it again.
        Timings: the replica's ``prep``, ``device``, ``post``; ``queue`` from ``arrived`` until the call left the
        front; ``ray``, the rest of the round trip (routing, transfer, a retry); ``latency``, the whole round trip.

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
                self._warn(f"[replicas] a replica {lost.reason} before the request reached its devices; retrying once")
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
            self._warn(f"[replicas] warning: could not delete the Serve application ({type(err).__name__}: {err})")
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
