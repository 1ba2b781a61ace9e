"""Which models are on the devices (engine/residency.py), with fake loads: LRU within the bytes, loads on the loader
thread never holding up requests for resident models, no thrash, a model in use never dropped under its request,
the host cache."""

import threading
import time

import numpy as np
import pytest

from sdxl_engine.engine.residency import Residency, Resident
from sdxl_engine.engine.steps import Stopped

SIZE = 1000  # bytes of every fake model


class Loads:
    """A fake ``load``: records each call; a model whose name is in ``hold`` waits for its event."""

    def __init__(self):
        self.calls: list[tuple[str, bool]] = []
        self.hold: dict[str, threading.Event] = {}

    def __call__(self, name, host):
        self.calls.append((name, host is not None))
        if name in self.hold:
            self.hold[name].wait(30)
        params = host if host is not None else {"w": np.full(SIZE // 8, hash(name) % 1000, np.float64)}
        return Resident(name, params, SIZE, state=f"mergers of {name}")


def take(residency, name, **kwargs):
    resident = residency.acquire(name, **kwargs)
    residency.release(resident)
    return resident


def test_least_recently_used_model_is_dropped_for_a_new_one():
    loads = Loads()
    residency = Residency(loads, capacity=2 * SIZE, log=lambda _: None)
    for name in "ABA":
        take(residency, name)
    assert residency.names() == ["B", "A"] and residency.loads == 2
    take(residency, "C")  # B is the least recently used
    assert residency.names() == ["A", "C"] and residency.evictions == 1
    assert loads.calls == [("A", False), ("B", False), ("C", False)]


def test_alternating_between_resident_models_loads_nothing():
    loads = Loads()
    residency = Residency(loads, capacity=2 * SIZE, log=lambda _: None)
    for name in "AB" * 20:
        take(residency, name)
    assert residency.loads == 2 and residency.evictions == 0


def test_requests_for_resident_models_never_wait_for_a_load():
    loads = Loads()
    residency = Residency(loads, capacity=2 * SIZE, log=lambda _: None)
    take(residency, "A")
    loads.hold["B"] = threading.Event()
    progress: list[str] = []
    waiting = threading.Thread(target=take, args=(residency, "B"), kwargs={"progress": progress.append})
    waiting.start()
    while ("B", False) not in loads.calls:
        time.sleep(0.01)
    t0 = time.perf_counter()
    for _ in range(10):  # while B loads
        take(residency, "A")
    assert time.perf_counter() - t0 < 0.5 and waiting.is_alive()
    assert progress == ["loading model"]
    loads.hold["B"].set()
    waiting.join(10)
    assert residency.names() == ["A", "B"]


def test_one_load_per_model_however_many_wait_and_a_stop_frees_a_waiter():
    loads = Loads()
    residency = Residency(loads, capacity=2 * SIZE, log=lambda _: None)
    loads.hold["A"] = threading.Event()
    threads = [threading.Thread(target=take, args=(residency, "A")) for _ in range(3)]
    for thread in threads:
        thread.start()
    with pytest.raises(Stopped, match="its model still loads"):
        take(residency, "A", should_stop=lambda: True)
    loads.hold["A"].set()
    for thread in threads:
        thread.join(10)
    assert loads.calls == [("A", False)]


def test_a_model_in_use_is_not_dropped_under_its_request():
    loads = Loads()
    residency = Residency(loads, capacity=SIZE, log=lambda _: None)
    held = residency.acquire("A")  # a request runs on A
    done = threading.Thread(target=take, args=(residency, "B"))
    done.start()
    time.sleep(0.3)
    assert residency.names() == ["A"] and held.params is not None  # B's load waits for A's release
    residency.release(held)
    done.join(10)
    assert residency.names() == ["B"] and held.params is None  # dropped once released: nothing keeps its weights


def test_dropped_weights_go_to_the_host_cache_and_come_back_from_it():
    loads = Loads()
    residency = Residency(loads, capacity=SIZE, host_capacity=SIZE, log=lambda _: None)
    first = take(residency, "A")
    weights = first.params["w"].copy()
    take(residency, "B")  # A to the host
    assert residency.host_names() == ["A"] and first.params is None and first.state is None
    again = take(residency, "A")  # from the host cache; B to the host, within its room
    assert loads.calls[-1] == ("A", True) and residency.host_loads == 1
    np.testing.assert_array_equal(again.params["w"], weights)
    assert residency.host_names() == ["B"]
    take(residency, "C")  # A to the host, B out of it: the cache holds one
    assert residency.host_names() == ["A"]


def test_a_failed_load_reaches_its_request_and_the_next_one_tries_again():
    residency_calls = []

    def load(name, host):
        residency_calls.append(name)
        if len(residency_calls) == 1:
            raise OSError("disk unplugged")
        return Resident(name, {}, SIZE)

    residency = Residency(load, capacity=SIZE, log=lambda _: None)
    with pytest.raises(OSError, match="disk unplugged"):
        take(residency, "A")
    assert take(residency, "A").name == "A" and residency_calls == ["A", "A"]
