"""Which models' weights are on the devices: a least-recently-used set bounded by bytes, loads on one loader thread,
and the weights of models dropped from the devices kept in host memory (bounded too) for a quicker reload.

A request for a resident model takes it at once (:meth:`Residency.acquire`); one for another model waits for its load
on the loader thread (``progress("loading model")``) while requests for resident models run on: nothing here holds
the devices' lock, and the loader never waits for a request except to drop a model one is using (the least
recently used idle one goes first; with none idle, the load waits for a release). A dropped model's arrays are
released when no request holds them: its weights are freed, or copied to the host cache first.

engine/local.py makes the :class:`Resident` (its ``load`` function: from the file, or from host arrays); nothing here
knows how a model is read or run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from sdxl_engine.engine.steps import wait_or_stop

LOG = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Resident:
    """One model whose weights are on the devices.

    Attributes:
        name: the model's name (the catalogue's).
        params: its parameters on the devices (with ``params["refiner"]`` when a refiner is attached).
        nbytes: the bytes its parameters take on the devices (all devices together).
        state: what else the engine keeps while it is resident (its LoRA mergers: they hold the params too).
        users: requests holding it now (:meth:`Residency.acquire` .. :meth:`Residency.release`).
    """

    name: str
    params: Any
    nbytes: int
    state: Any = None
    users: int = 0


def tree_bytes(params) -> int:
    """Bytes of every array in ``params`` on every device it is on (a replicated array counts once per device)."""
    total = 0
    for leaf in jax.tree.leaves(params):
        shards = getattr(leaf, "addressable_shards", None)
        total += sum(s.data.nbytes for s in shards) if shards else leaf.nbytes
    return total


def host_bytes(params) -> int:
    """Bytes of one host copy of ``params`` (each array once)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


class Residency:
    """The resident models, least recently used first, within ``capacity`` bytes of device memory, and the host cache
    of dropped models' weights within ``host_capacity`` bytes.

    Args:
        load: ``(name, host_params or None) -> Resident``: reads the model (from its file, or from the host cache's
            arrays) onto the devices; run on the loader thread; may raise (the waiting requests get the error).
        capacity: bytes of device memory the resident models' weights may take together (one model always fits: a
            model larger than this is still loaded alone).
        host_capacity: bytes of host memory the host cache may take (0: none, dropped weights are freed).
        log: where the lines go.

    Attributes:
        loads: models loaded so far (from files or the host cache), the start's first included.
        host_loads: of those, from the host cache.
        evictions: models dropped from the devices.
    """

    def __init__(self, load: Callable[[str, Any], Resident], capacity: int, host_capacity: int = 0,
                 log: Callable[[str], None] | None = None):
        self._load, self.capacity, self.host_capacity = load, capacity, host_capacity
        self._log = log or LOG.info
        self._resident: collections.OrderedDict[str, Resident] = collections.OrderedDict()  # least recent first
        self._host: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()  # name: (arrays, bytes)
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._changed = threading.Condition()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-loader")
        self.loads = self.host_loads = self.evictions = 0
        self.sizes: dict[str, int] = {}  # bytes of each model loaded so far (what the next load of it needs)

    # ---- what is resident --------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The resident models, least recently used first."""
        with self._changed:
            return list(self._resident)

    def host_names(self) -> list[str]:
        """The models whose weights the host cache holds, least recently used first."""
        with self._changed:
            return list(self._host)

    def peek(self, name: str) -> Resident | None:
        """``name``'s Resident if it is on the devices now (its place in the order unchanged), else None."""
        with self._changed:
            return self._resident.get(name)

    def add(self, resident: Resident) -> None:
        """Put a model loaded elsewhere (the engine's start) in the set, as the most recently used."""
        with self._changed:
            self._resident[resident.name] = resident
            self.sizes[resident.name] = resident.nbytes
            self.loads += 1

    # ---- requests --------------------------------------------------------------------------------
    def acquire(self, name: str, progress: Callable[[str], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> Resident:
        """``name``'s Resident, held for the caller until :meth:`release`: at once when it is resident, else after
        its load on the loader thread (``progress("loading model")`` first; requests for resident models are not
        held up meanwhile). A stop while it waits frees the caller at once (the load goes on).

        Raises: Stopped (``should_stop()`` said so); whatever the load raised."""
        while True:
            with self._changed:
                resident = self._resident.get(name)
                if resident is not None:
                    self._resident.move_to_end(name)
                    resident.users += 1
                    return resident
                future = self._pending.get(name)
                if future is None:
                    future = self._pending[name] = self._loader.submit(self._load_job, name)
            if progress is not None:
                progress("loading model")
            wait_or_stop(future, should_stop, "stopped before it started (its model still loads, for the next request)")
            # loaded: take it (a load for another model may have dropped it meanwhile: then it loads again)

    def release(self, resident: Resident) -> None:
        """The end of a request's hold on ``resident`` (:meth:`acquire`)."""
        with self._changed:
            resident.users -= 1
            self._changed.notify_all()

    # ---- the loader thread ----------------------------------------------------------------------
    def _load_job(self, name: str) -> None:
        try:
            with self._changed:  # first: making room moves others to the host cache, which may drop its oldest
                cached = self._host.pop(name, None)
            need = self.sizes.get(name) or max(self.sizes.values(), default=0)
            self._make_room(need)
            t0, from_host = time.perf_counter(), cached is not None
            resident = self._load(name, None if cached is None else cached[0])
            cached = None  # the host copy's arrays go with their last reference
            with self._changed:
                self._resident[name] = resident
                self.sizes[name] = resident.nbytes
                self.loads += 1
                self.host_loads += from_host
                self._changed.notify_all()
            self._log(f"[sdxl_engine] loaded model {name} in {time.perf_counter() - t0:.2f} s "
                      f"({resident.nbytes / 1e9:.2f} GB on the devices; resident: {', '.join(self.names())})")
        finally:
            with self._changed:
                self._pending.pop(name, None)

    def _make_room(self, need: int) -> None:
        """Drop least recently used models until ``need`` more bytes fit in :attr:`capacity` (or none is left); a
        model a request holds is dropped only when no idle one is left, and then once it is released."""
        while True:
            with self._changed:
                used = sum(r.nbytes for r in self._resident.values())
                if not self._resident or used + need <= self.capacity:
                    return
                idle = [r for r in self._resident.values() if r.users == 0]
                if not idle:
                    self._changed.wait(0.1)  # the requests holding them finish; then one is dropped
                    continue
                victim = idle[0]
                del self._resident[victim.name]
                self.evictions += 1
            self._keep_on_host(victim)
            self._log(f"[sdxl_engine] dropped model {victim.name} from the devices (least recently used; "
                      f"{'kept in host memory' if victim.name in self.host_names() else 'weights freed'})")

    def _keep_on_host(self, victim: Resident) -> None:
        """Copy a dropped model's weights to the host cache when it has room (least recently used copies dropped
        first); else let them go. Either way the device arrays are freed once nothing holds ``victim``."""
        size = host_bytes(victim.params)
        if size > self.host_capacity:
            victim.params = victim.state = None
            return
        host = jax.device_get(victim.params)
        victim.params = victim.state = None
        with self._changed:
            self._host[victim.name] = (host, size)
            while sum(b for _, b in self._host.values()) > self.host_capacity:
                self._host.popitem(last=False)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until no load is pending (tests, tools)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._changed:
                if not self._pending:
                    return
            time.sleep(0.01)
