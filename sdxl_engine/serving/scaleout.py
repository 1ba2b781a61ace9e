"""Scale-out settings without Ray: how many engine replicas, what each one owns, how Serve scales them.

``python app.py --replicas N`` (or ``MIN-MAX``) is parsed and planned here, so the command line
and the single-process default never import Ray; :mod:`sdxl_engine.serving.replicas` does, and
only the scale-out branch of main.start_engine imports it.

Names follow Ray Serve's: a *replica* is one copy of the engine (one process owning one host's
devices, or a share of a CPU host), ``num_replicas`` a fixed count, ``min_replicas`` /
``max_replicas`` the bounds of Serve's autoscaling on ongoing requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
from collections.abc import Mapping, MutableMapping, Sequence

from sdxl_engine.config import ConfigError

APP_NAME = "sdxl"  # the Serve application the front deploys (or, with --ray-app, joins)
DEPLOYMENT_NAME = "SDXLEngine"  # the engine's Serve deployment (its replicas' class)
MAX_ONGOING_REQUESTS = 1  # per replica: one request at a time on its devices, as the single-process engine
# Serve's autoscaling on ongoing requests (--replicas MIN-MAX), the documented defaults (README):
# one ongoing request per replica is the target (a replica runs one at a time, so anything waiting
# asks for another replica); scale up after 5 s of that, down after 120 s of less (a replica takes
# seconds to minutes to load and compile, so it is not given back at the first quiet moment).
AUTOSCALING_DEFAULTS = {"target_ongoing_requests": 1.0, "upscale_delay_s": 5.0, "downscale_delay_s": 120.0}
REQUEST_TIMEOUT_S = 300.0  # the front gives up on a replica that has not answered a request in this long
HEALTH_CHECK_PERIOD_S = 5.0  # Serve asks each running replica this often whether its engine still works
HEALTH_CHECK_TIMEOUT_S = 30.0  # ...and replaces it when it does not answer within this long (3 times in a row)
GRACEFUL_SHUTDOWN_S = 5.0  # a replica being stopped finishes its request for at most this long (the front drained)


class ScaleOutError(ConfigError):
    """A scale-out flag this command or cluster cannot honour (exit status 2, like any bad setting)."""


@dataclasses.dataclass(frozen=True)
class Replicas:
    """How many replicas: ``min_replicas == max_replicas`` is a fixed count, else Serve autoscales between them."""

    min_replicas: int
    max_replicas: int

    @classmethod
    def parse(cls, text: str) -> Replicas:
        """``"2"`` -> 2 fixed replicas; ``"1-4"`` -> autoscaling from 1 to 4.

        Raises:
            ScaleOutError: not a count or a range of whole numbers with 1 <= MIN <= MAX.
        """
        low, sep, high = str(text).strip().partition("-")
        try:
            lo, hi = int(low), int(high if sep else low)
        except ValueError:
            raise ScaleOutError(f"replicas must be a count (2) or a range MIN-MAX (1-4), got {text!r}") from None
        if lo < 1:
            raise ScaleOutError(f"replicas: at least 1 replica (a replica takes minutes to load and compile, so the "
                                f"page does not scale to zero), got {text!r}")
        if hi < lo:
            raise ScaleOutError(f"replicas: MIN-MAX needs MIN <= MAX, got {text!r}")
        return cls(lo, hi)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas

    @property
    def slots(self) -> int:
        """Requests that may run at once (the page's concurrency limit): one per replica, at most."""
        return self.max_replicas * MAX_ONGOING_REQUESTS

    def describe(self) -> str:
        """``2 replicas`` or ``1-4 replicas (autoscaling)``, for the log and the page."""
        if self.autoscaling:
            return f"{self.min_replicas}-{self.max_replicas} replicas (autoscaling)"
        return f"{self.max_replicas} replica{'s' if self.max_replicas > 1 else ''}"

    def serve_options(self) -> dict:
        """The deployment options Serve takes for this count: ``num_replicas`` or ``autoscaling_config``."""
        if not self.autoscaling:
            return {"num_replicas": self.max_replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "initial_replicas": self.min_replicas, **AUTOSCALING_DEFAULTS}}


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """What one replica asks Ray for, and how many CPU devices its JAX presents.

    Attributes:
        num_cpus: Ray CPU share (whole CPUs on a CPU host, so replicas do not oversubscribe it).
        num_gpus: Ray GPUs (1 per replica on GPU hosts).
        resources: other Ray resources, e.g. ``{"TPU": 4}``: a TPU v5e-4 host's chips, whole.
        cpu_devices: the engine's ``cpu_devices`` inside the replica (only used without an accelerator).
    """

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    cpu_devices: int

    def ray_actor_options(self) -> dict:
        """Serve's ``ray_actor_options`` for the deployment."""
        options: dict = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def describe(self) -> str:
        """e.g. ``1 CPU, 2 CPU devices`` or ``1 CPU, TPU 4``, for the log."""
        parts = [f"{self.num_cpus:g} CPU"] + ([f"{self.num_gpus:g} GPU"] if self.num_gpus else [])
        parts += [f"{name} {amount:g}" for name, amount in self.resources.items()]
        if not self.num_gpus and not self.resources:
            parts.append(f"{self.cpu_devices} CPU device{'s' if self.cpu_devices > 1 else ''}")
        return ", ".join(parts)


def parse_resources(text: str) -> dict[str, float]:
    """``--replica-resources`` JSON (``{"TPU": 8}``, ``{"CPU": 4, "GPU": 1}``) -> {resource: amount}.

    Raises:
        ScaleOutError: not a JSON object of non-negative numbers.
    """
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ScaleOutError(f"replica_resources must be a JSON object such as '{{\"TPU\": 4}}': {err}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                              and not isinstance(v, bool) and v >= 0 for k, v in value.items()):
        raise ScaleOutError(f"replica_resources must be a JSON object of resource amounts >= 0 such as "
                            f"'{{\"TPU\": 4}}', got {text!r}")
    return {k: float(v) for k, v in value.items()}


def _devices_for_four(devices: int) -> int:
    """The largest of 4, 2, 1 that is <= ``devices``: four images per request still divide evenly."""
    return next(n for n in (4, 2, 1) if n <= max(devices, 1))


def plan_replica(nodes: Sequence[Mapping[str, float]], replicas: Replicas, cpu_devices: int,
                 override: Mapping[str, float] | None = None) -> ReplicaPlan:
    """Decide one replica's Ray resources from the cluster's nodes (``ray.nodes()``' ``Resources``).

    * A node with TPUs: each replica takes a host's chips whole (``{"TPU": 4}`` on a v5e-4; the
      most chips any node has), so one replica per TPU host, its JAX seeing all 4 chips.
    * Else a node with GPUs: ``{"GPU": 1}`` per replica.
    * Else CPUs only: the smallest node's CPUs are split between the replicas that may share it
      (whole CPUs, at least 1), and so are ``cpu_devices`` (rounded down to 4, 2 or 1 so that four
      images still divide): 2 replicas on a 2-core host get 1 CPU and 2 CPU devices each.
      Replicas beyond what the CPUs hold wait for a place (Serve reports them as starting).

    ``override`` (``--replica-resources``) replaces the choice: ``CPU`` and ``GPU`` map to
    ``num_cpus`` / ``num_gpus``, anything else is a custom resource.

    Raises:
        ScaleOutError: no node reports any CPU, GPU or TPU.
    """
    if override:
        extra = {k: v for k, v in override.items() if k not in ("CPU", "GPU")}
        return ReplicaPlan(num_cpus=override.get("CPU", 1.0), num_gpus=override.get("GPU", 0.0), resources=extra,
                           cpu_devices=_devices_for_four(max(1, int(override.get("CPU", 1)))))
    tpus = max((node.get("TPU", 0.0) for node in nodes), default=0.0)
    if tpus:
        return ReplicaPlan(num_cpus=1.0, num_gpus=0.0, resources={"TPU": tpus}, cpu_devices=cpu_devices)
    if any(node.get("GPU", 0.0) for node in nodes):
        return ReplicaPlan(num_cpus=1.0, num_gpus=1.0, resources={}, cpu_devices=cpu_devices)
    cpus = [node.get("CPU", 0.0) for node in nodes if node.get("CPU", 0.0) > 0]
    if not cpus:
        raise ScaleOutError("the Ray cluster reports no CPU, GPU or TPU to place an engine replica on")
    per_node = math.ceil(replicas.max_replicas / len(cpus))  # replicas that may share one node
    share = max(1, int(min(cpus) // per_node))
    return ReplicaPlan(num_cpus=float(share), num_gpus=0.0, resources={},
                       cpu_devices=_devices_for_four(max(1, cpu_devices // per_node)))


def ray_environment(private: bool, environ: MutableMapping[str, str] = os.environ) -> None:
    """Prepare the environment for Ray: call it before Ray is imported (Ray reads some of these
    once, at import). Ray's processes inherit them.

    * ``RAY_DEDUP_LOGS=0``: every replica's start-up lines reach the front's log, not one merged copy.
    * ``RAY_COLOR_PREFIX=0``: the ``(ServeReplica:... pid=...)`` prefix of those lines without ANSI
      colour codes (the log is a file or a journal as often as a terminal).
    * ``RAY_SERVE_SLOW_STARTUP_WARNING_S``: Serve warns about a replica still in its constructor
      after this many seconds; a replica loads and compiles there, which the front already
      reports as a stage, so the warning waits as long as the front gives a request
      (:data:`REQUEST_TIMEOUT_S`).

    With ``private`` (a local cluster of our own, no ``--ray-address``) also:

    * ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's local-only mode (its default on macOS and
      Windows): the node's address is 127.0.0.1, so Ray's processes (GCS, raylet, workers,
      agents, metrics) listen on loopback. The one exception is Serve's: each replica's
      inter-deployment gRPC server binds all interfaces, and takes no call without the token.
    * Token authentication (Ray's default for a new local cluster) with a fresh random token
      that lives only in this environment, so Ray writes none to ``~/.ray/auth_token``; it is
      never logged; ``RAY_AUTH_MODE=token`` says so (Ray warns when it picks token mode itself). A
      ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` already set is respected.
    * No usage statistics leave the machine (``RAY_USAGE_STATS_ENABLED=0``).
    """
    environ.setdefault("RAY_DEDUP_LOGS", "0")
    environ.setdefault("RAY_COLOR_PREFIX", "0")
    environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", str(int(REQUEST_TIMEOUT_S)))
    if not private:
        return
    environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & environ.keys():
        environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        environ["RAY_AUTH_MODE"] = "token"  # Ray's default, said explicitly: Ray then logs no WARNING about it
    environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
