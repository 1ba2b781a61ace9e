"""engine/local.Engine at sizes beyond its buckets: any multiple of the model's block within max_pixels is
served; a size not compiled yet compiles on the engine's compile thread while requests at compiled sizes
run on; a stop while waiting for it frees the request at once; each client waits for one new size at a
time, and at most max_pending_compiles compile; programs beyond the buckets' are kept least-recently-used.
The compile itself is held on an event (or stood in for), so no test waits for a real compile."""

import dataclasses
import threading

import numpy as np
import pytest

from sdxl_engine.engine.errors import CompilesBusy
from sdxl_engine.engine.steps import Stopped
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest, Limits, size_of

pytestmark = pytest.mark.engine


def request(**kw):
    return GenerateRequest("a red circle", **{"seed": 1, "num_inference_steps": 2, **kw})


@pytest.fixture
def held_compiles(engine, monkeypatch):
    """Compiles of new sizes wait for ``release`` and then stand in the default program (never run here)."""
    release, started = threading.Event(), []
    default = next(iter(engine.programs.compiled.values()))

    def compile_held(shape):
        started.append((shape.width, shape.height))
        assert release.wait(60)
        engine.programs.compiled[shape] = default

    monkeypatch.setattr(engine.programs, "_compile", compile_held)
    yield release, started
    release.set()
    for future in list(engine.programs.pending.values()):
        future.result(60)
    for shape in [s for s in engine.programs.compiled if (s.width, s.height) not in engine.limits.sizes]:
        engine.programs.compiled.pop(shape)


def test_a_new_size_compiles_while_a_compiled_size_is_served_and_a_stop_frees_its_request(engine, held_compiles):
    release, started = held_compiles
    stop, outcome, stages = threading.Event(), {}, []

    def new_size():
        try:
            engine.generate(request(width=96, height=48, client="a"), progress=stages.append,
                            should_stop=stop.is_set)
        except BaseException as err:
            outcome["error"] = err

    waiter = threading.Thread(target=new_size)
    waiter.start()
    while not started:
        threading.Event().wait(0.01)
    served = engine.generate(request(client="b"))  # the default size, compiled: served during the compile
    assert served.images.shape == (4, 64, 64, 3) and waiter.is_alive() and stages == ["compiling"]
    stop.set()
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(outcome["error"], Stopped)
    assert str(outcome["error"]) == "stopped before it started (its size still compiles, for the next request)"
    assert not engine.is_compiled(96, 48)  # still compiling: the next request at the size finds it ready
    release.set()
    for future in list(engine.programs.pending.values()):
        future.result(60)
    assert engine.is_compiled(96, 48) and engine.programs.pending == {} and engine.programs.pending_for == {}


def test_each_client_waits_for_one_new_size_and_a_few_compile_at_once(engine, held_compiles, monkeypatch):
    release, started = held_compiles
    stop = threading.Event()
    monkeypatch.setattr(engine.programs, "config", dataclasses.replace(engine.programs.config, max_pending_compiles=2))
    threads = [threading.Thread(target=lambda c=c, w=w: pytest.raises(Stopped, engine.generate, request(
        width=w, height=48, client=c), should_stop=stop.is_set)) for c, w in (("a", 96), ("b", 112))]
    for t in threads:
        t.start()
    while len(engine.programs.pending_for) < 2:
        threading.Event().wait(0.01)
    with pytest.raises(CompilesBusy, match=r"^width/height: your request for 96x48 is still compiling; send this "
                                           r"size once it is ready$"):
        engine.generate(request(width=128, height=48, client="a"))
    with pytest.raises(CompilesBusy, match=r"^width/height: 128x48 is not compiled yet and 2 new sizes compile "
                                           r"already \(96x48, 112x48; max_pending_compiles\)"):
        engine.generate(request(width=128, height=48, client="c"))
    stop.set()
    for t in threads:
        t.join(10)
    assert engine.generate(request(client="a")).images.shape[0] == 4  # refusals left nothing behind


def test_sizes_beyond_the_buckets_are_any_multiple_within_the_pixel_budget():
    limits = Limits(max_seed=9, max_steps=50, sizes=((64, 64), (80, 48)), default_size=(64, 64), default_steps=8,
                    default_guidance=5.0, multiple=16, max_pixels=128 * 128)
    assert size_of(96, 48, limits) == (96, 48) and size_of(128, 128, limits) == (128, 128)
    assert size_of(0, 48, limits) == (64, 48) and size_of(None, None, limits) == (64, 64)
    with pytest.raises(InvalidRequest, match=r"^width/height: 144x128 is 18432 pixels; this server makes up to 16384 "
                                             r"\(max_pixels\), any multiple of 16 pixels per side \(the model's sizes: "
                                             r"64x64, 80x48\)$"):
        size_of(144, 128, limits)
    with pytest.raises(InvalidRequest, match=r"^height: 40 is not a multiple of 16 pixels"):
        size_of(64, 40, limits)
    buckets_only = dataclasses.replace(limits, max_pixels=0)
    with pytest.raises(InvalidRequest, match=r"^width/height: 96x48 is not a supported size; choose one of 64x64, "
                                             r"80x48 \(0 = the model's default\)$"):
        size_of(96, 48, buckets_only)


def test_the_engines_budget_is_four_native_areas_and_at_least_a_megapixel(engine):
    assert engine.limits.max_pixels == 1024 * 1024  # tiny-random: native 64 x 64, so the megapixel floor


def test_programs_beyond_the_buckets_are_kept_least_recently_used(engine, monkeypatch):
    monkeypatch.setattr(engine.programs, "config", dataclasses.replace(engine.programs.config, max_resident_programs=2))
    monkeypatch.setattr(engine.programs, "compiled", dict(engine.programs.compiled))
    monkeypatch.setattr(engine.programs, "used", {})
    monkeypatch.setattr(engine.programs, "_log", lambda line: logged.append(line))
    logged, buckets = [], set(engine.programs.compiled)
    shapes = [engine.planner.shape(w, 48) for w in (96, 112, 128)]
    for t, shape in enumerate(shapes):
        engine.programs.compiled[shape] = object()
        engine.programs.used[shape] = float(t)
    engine.programs.used[shapes[0]] = 10.0  # used again since: the least recently used is now 112x48
    engine.programs.drop_unused()
    assert set(engine.programs.compiled) == buckets | {shapes[0], shapes[2]}
    assert logged == ["[sdxl_engine] dropped the program for 112x48 (least recently used; max_resident_programs 2)"]


def test_a_new_size_compiled_past_the_limit_drops_an_older_one_not_itself(engine, held_compiles, monkeypatch):
    release, _ = held_compiles
    release.set()
    monkeypatch.setattr(engine.programs, "config", dataclasses.replace(engine.programs.config, max_resident_programs=1))
    older = engine.planner.shape(112, 48)
    engine.programs.compiled[older] = object()
    engine.programs.used[older] = 5.0  # used before the new size (clock() is far past 5 s), after "never" (0)
    with pytest.raises(Stopped):  # the compile stands in the default program; the request is stopped after it
        engine.generate(request(width=96, height=48, client="a"), should_stop=lambda: engine.is_compiled(96, 48))
    for future in list(engine.programs.pending.values()):
        future.result(60)
    assert engine.is_compiled(96, 48) and older not in engine.programs.compiled


def test_a_new_size_runs_for_real_once_compiled(engine):
    """One real compile of a size no bucket has: the images come at that size, deterministic per seed."""
    assert not engine.is_compiled(96, 48)
    try:
        first = engine.generate(request(width=96, height=48))
        again = engine.generate(request(width=96, height=48))
    finally:
        for shape in [s for s in engine.programs.compiled if (s.width, s.height) == (96, 48)]:
            engine.programs.compiled.pop(shape)
    assert first.images.shape == (4, 48, 96, 3)
    np.testing.assert_array_equal(first.images, again.images)
