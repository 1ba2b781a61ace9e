"""Compiling the program: jit with shardings, lower, compile ahead of time, and the executable cache's key and
lookup (program/executables.py stores and loads; this module decides what a program's key is and when to store).

A program with the per-step hook (ProgramShape.step_hook) is three executables (generate.build_stages) that
:class:`SteppedExecutable` runs, the host driving the steps: it reports each chunk's last step to a receiver
(engine/steps.StepReceiver), fetches x0 for a preview when asked and stops when told, between two chunks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
import types
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax._src import compilation_cache  # reset_cache: JAX reads that switch once per process (persistent_cache_off)
from jax._src import config as jax_config  # its thread-local enable_compilation_cache switch has no public API
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sdxl_engine.checkpoint.loading import LoadedModel
from sdxl_engine.models import unet
from sdxl_engine.program.executables import ExecutableCache, key_digest, source_digest
from sdxl_engine.program.generate import (
    ProgramInputs,
    ProgramShape,
    build_generate,
    build_stages,
    latent_shape,
    loop_structure,
    static_options,
)
from sdxl_engine.program.sharding import DATA_AXIS, check_batch

STAGES = ("prepare", "advance", "finish")  # the executables of a stepped program, in the order they run
# shard_map's check of which values vary over the mesh's axes, off: the Pallas TPU kernels (layers.attention's
# "pallas_tpu") declare their outputs without it, which the check refuses; the program has no collective for the
# check to guard (every device runs its own images).
CHECK_VMA = False


@dataclasses.dataclass
class CompiledProgram:
    """An ahead-of-time compiled executable and what it took to build."""

    shape: ProgramShape
    executable: Callable  # (params, ProgramInputs) -> (images, finite); with step_hook a SteppedExecutable
    compile_s: float  # seconds to make it: lower + compile (a persistent-cache hit included) + the executable
    # cache's lookup and store; or, when loaded, the lookup and deserialization alone
    flops: float | None  # XLA's cost analysis of the whole program (all devices), if reported
    loaded: bool = False  # True: deserialized from the executable cache (nothing traced or compiled)
    cache_note: str = ""  # the executable cache's one-line account (loaded / why not / stored), "" without one


def jit_program(model: LoadedModel, shape: ProgramShape, mesh: Mesh):
    """``jax.jit`` of the sharded program with explicit in/out shardings (not yet compiled)."""
    check_batch(shape.batch, mesh)
    specs = ProgramInputs.specs(shape)
    sharded = jax.shard_map(build_generate(model, shape), mesh=mesh, in_specs=(P(), specs),
                            out_specs=(P(DATA_AXIS), P(DATA_AXIS)), check_vma=CHECK_VMA)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    batch = NamedSharding(mesh, P(DATA_AXIS))
    return jax.jit(sharded, in_shardings=(NamedSharding(mesh, P()), shardings), out_shardings=(batch, batch))


def jit_stages(model: LoadedModel, shape: ProgramShape, mesh: Mesh) -> dict[str, Callable]:
    """``jax.jit`` of each of the sharded stages (generate.Stages) by name (:data:`STAGES`), not yet compiled.

    The loop's state (generate.LoopFixed and the (latents, x0, history) carry) stays on the devices between the
    calls, each leaf split over ``data`` by its first axis (the device's images, or its CFG rows): one ``P("data")``
    prefix."""
    check_batch(shape.batch, mesh)
    specs, stages = ProgramInputs.specs(shape), build_stages(model, shape)
    data, whole = P(DATA_AXIS), P()
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    on_data, on_all = NamedSharding(mesh, data), NamedSharding(mesh, whole)

    def jit(fn, in_specs, in_shardings, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=CHECK_VMA),
                       in_shardings=in_shardings, out_shardings=on_data)

    return {"prepare": jit(stages.prepare, (whole, specs), (on_all, shardings), (data, data)),
            "advance": jit(stages.advance, (whole, specs, data, data, whole),
                           (on_all, shardings, on_data, on_data, on_all), data),
            "finish": jit(stages.finish, (whole, specs, data), (on_all, shardings, on_data), (data, data))}


def stage_arguments(jitted: dict[str, Callable], model: LoadedModel, params, shape: ProgramShape,
                    mesh: Mesh) -> dict[str, tuple]:
    """Each stage's abstract arguments by name, for ``jitted`` (:func:`jit_stages`' result); the loop state's from
    ``jax.eval_shape`` of its prepare."""
    abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
    fixed, carry = jax.eval_shape(jitted["prepare"], params, abstract)
    bounds = jax.ShapeDtypeStruct((2,), np.int32, sharding=NamedSharding(mesh, P()))
    return {"prepare": (params, abstract), "advance": (params, abstract, fixed, carry, bounds),
            "finish": (params, abstract, carry)}


def compile_program(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh, threads: int = 3) -> CompiledProgram:
    """Lower and compile ahead of time for ``shape``; ``params`` may be arrays or ShapeDtypeStructs. With
    ``step_hook``: its three stages (:class:`SteppedExecutable`), compiled on up to ``threads`` threads
    (:func:`in_parallel`; EngineConfig.compile_threads)."""
    start = time.perf_counter()
    if shape.step_hook:
        jitted = jit_stages(model, shape, mesh)
        args = stage_arguments(jitted, model, params, shape, mesh)
        lowered = {n: jitted[n].lower(*args[n]) for n in STAGES}  # tracing holds the GIL: one after another
        executable = SteppedExecutable(shape, mesh, in_parallel({n: lowered[n].compile for n in STAGES}, threads))
    else:
        abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
        executable = jit_program(model, shape, mesh).lower(params, abstract).compile()
    return CompiledProgram(shape=shape, executable=executable, compile_s=time.perf_counter() - start,
                           flops=_flops(executable))


def in_parallel(calls: dict[str, Callable[[], object]], threads: int = 3) -> dict[str, object]:
    """``{name: call()}``, the calls run on up to ``threads`` threads (1: one after another, on this one); the
    first exception raised is re-raised.

    XLA's compile and an executable's deserialization release the GIL, so a stepped program's three stages compile
    (or load) side by side: a start waits for the slowest stage, not for their sum (figures: docs/benchmarks.md,
    "On a TPU v5e chip")."""
    if len(calls) < 2 or threads < 2:
        return {name: call() for name, call in calls.items()}
    # JAX's config switches are per thread: the workers take the caller's persistent-cache switch (see
    # persistent_cache_off), or a compile inside that block would read and write the cache after all.
    switch = jax_config.enable_compilation_cache.value

    def run(call):
        with jax_config.enable_compilation_cache(switch):
            return call()

    with concurrent.futures.ThreadPoolExecutor(min(len(calls), threads), thread_name_prefix="stage") as pool:
        futures = {name: pool.submit(run, call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


class SteppedExecutable:
    """A program whose host runs the denoising steps: the compiled stages (generate.Stages) by name, called as
    one executable (``(params, inputs) -> (images, finite)``, every step, no reports) or through :meth:`run`.

    Its XLA figures are the stages': ``cost_analysis`` their sum (each loop counted once, as XLA counts the one
    program's ``fori_loop``), ``memory_analysis`` the largest stage's temporaries plus the loop state and the
    images that live across the calls."""

    def __init__(self, shape: ProgramShape, mesh: Mesh, stages: dict[str, Callable]):
        self.shape, self.stages = shape, stages
        self.shards = mesh.devices.size
        self.input_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), ProgramInputs.specs(shape))

    def __call__(self, params, inputs: ProgramInputs):
        return self.run(params, inputs)

    @property
    def output_shardings(self):
        """The shardings of (images, finite), finish's (each split over ``data``, as the one-executable program's)."""
        return self.stages["finish"].output_shardings

    def run(self, params, inputs: ProgramInputs, receiver: Callable | None = None):
        """The whole program on ``inputs``: prepare, the steps in chunks of advance, finish; returns finish's
        outputs on the devices, or None when ``receiver`` answered stop (no VAE: a stop costs at most a chunk).

        ``receiver(shard, step, x0) -> (stop, preview_next, next_report)`` (engine/steps.StepReceiver) is called for
        every shard after each chunk, with the chunk's last 0-based ``step`` and, when its previous answer asked for
        a preview, that shard's x0 (b_local, C, h, w) float32 numpy; ``next_report`` is the last step of the next
        chunk (the first chunk is one step). Without a receiver the steps run as one chunk."""
        first = int(np.asarray(inputs.start_step)) if self.shape.from_image else 0
        end = int(np.asarray(inputs.num_steps))
        inputs = jax.device_put(inputs, self.input_shardings)  # once, for every call below
        fixed, carry = self.stages["prepare"](params, inputs)
        if receiver is None:
            carry = self.stages["advance"](params, inputs, fixed, carry, np.array([first, end], np.int32))
            return self.stages["finish"](params, inputs, carry)
        # One chunk ahead: chunk k+1 is dispatched before the host waits for chunk k and reports it, so the devices
        # work while the host reports and dispatches (on a v5e that host time was about 6 ms a call). Chunk k+1's
        # length is the cadence of the answer the host had then (chunk k-1's); a preview asked after chunk k is chunk
        # k+1's x0, which every chunk returns anyway.
        def chunk(start: int, last: int, carry):
            stop_at = min(max(last, start), end - 1) + 1
            return stop_at, self.stages["advance"](params, inputs, fixed, carry, np.array([start, stop_at], np.int32))

        last, preview = first, False
        stop_at, carry = chunk(first, last, carry)
        while True:
            ahead = chunk(stop_at, last, carry) if stop_at < end else None
            x0 = np.asarray(carry[1]) if preview else None  # waits for this chunk either way
            if x0 is None:
                jax.block_until_ready(carry)
            parts = np.split(x0, self.shards) if x0 is not None else [None] * self.shards
            answers = [receiver(shard, stop_at - 1, parts[shard]) for shard in range(self.shards)]
            stop, preview, last = answers[-1]
            if stop:
                return None  # the chunk ahead still runs (at most one), its result dropped
            if ahead is None:
                return self.stages["finish"](params, inputs, carry)
            stop_at, carry = ahead

    def cost_analysis(self) -> dict:
        costs = [_first_cost(self.stages[n].cost_analysis()) for n in STAGES]
        return {k: sum(float(c.get(k) or 0.0) for c in costs) for k in ("flops", "bytes accessed")}

    def memory_analysis(self):
        memory = {n: self.stages[n].memory_analysis() for n in STAGES}
        state = memory["prepare"].output_size_in_bytes  # fixed and carry, on the devices through the loop
        return types.SimpleNamespace(temp_size_in_bytes=max(m.temp_size_in_bytes for m in memory.values()) + state,
                                     output_size_in_bytes=memory["finish"].output_size_in_bytes)

    def as_text(self) -> str:
        return "\n".join(self.stages[n].as_text() for n in STAGES)


def _first_cost(cost):
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def _flops(executable) -> float | None:
    try:
        cost = _first_cost(executable.cost_analysis())
        return float(cost["flops"]) if cost.get("flops") is not None else None
    except Exception:  # cost analysis is best-effort and backend-dependent
        return None


# The folders the program is traced from: every Python file in them, found when the key is made (not a
# hand-kept list, which would forget the next new file), is part of the executable-cache key. The weights'
# names, shapes and dtypes, and every component's config, are in the key as data (program_key).
_PACKAGE = Path(__file__).resolve().parents[1]
PROGRAM_FOLDERS = (_PACKAGE / "program", _PACKAGE / "models")


def program_sources() -> tuple[Path, ...]:
    """Every ``*.py`` under :data:`PROGRAM_FOLDERS`, sorted by path relative to the package."""
    return tuple(sorted((p for folder in PROGRAM_FOLDERS for p in folder.rglob("*.py")),
                        key=lambda p: p.relative_to(_PACKAGE).as_posix()))


@functools.cache
def _source_digest() -> str:
    return source_digest(program_sources(), root=_PACKAGE)


def program_key(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh) -> dict:
    """The executable cache's key for this program, computed without tracing.

    Everything static that the traced program depends on: the shape (batch, size, loop length,
    CFG mode, given latents), every component's config, the prediction type, the parameters'
    names, shapes, dtypes and shardings, the mesh (axis names, device ids in order), a hash of
    the source files it is traced from (:func:`program_sources`) and the feed-forward's GELU
    formula (models/unet.geglu_mode). The cache adds versions, backend, devices and JAX options
    (:func:`.executables.runtime_key`).
    """
    cfg = "" if shape.cfg else " without CFG"
    cfg += f", {shape.chunks} prompt chunks" if shape.chunks > 1 else ""
    cfg += ", image to image" if shape.init_image else ""
    cfg += ", inpainting" if shape.inpaint else ""
    cfg += ", with the refiner" if shape.refiner else ""
    cfg += ", hires first pass" if shape.latents_out else ""
    cfg += ", hires second pass" if shape.init_latents or shape.hires_noise else ""
    cfg += f", {len(shape.controlnets)} ControlNet units" if shape.controlnets else ""
    cfg += f", {len(shape.ip_adapters)} IP-Adapter units" if shape.ip_adapters else ""
    cfg += ", two model calls per step" if shape.two_calls else ""
    st = static_options(model, shape)  # what the traced program reads, so the key cannot miss it
    return {
        "program": f"{shape.width}x{shape.height} x {shape.batch} images, {shape.max_steps} steps{cfg}",
        "shape": dataclasses.asdict(st.shape),
        "model": {name: dataclasses.asdict(c.config) for name, c in st.components.items()},
        "prediction_type": st.prediction_type,
        "dtype": model.dtype,
        "params": key_digest([[jax.tree_util.keystr(path), list(x.shape), str(x.dtype),
                               str(getattr(x, "sharding", None))]
                              for path, x in jax.tree_util.tree_leaves_with_path(params)]),
        "mesh": {"axes": list(mesh.axis_names), "devices": [d.id for d in mesh.devices.flat]},
        "source": _source_digest(),
        "geglu": unet.geglu_mode(),  # a module setting the trace reads (tools.tpu_profile --geglu sets it)
        **({"controlnets": [dataclasses.asdict(c.config) for c in st.controlnets]} if st.controlnets else {}),
        **({"ip_adapters": [dataclasses.asdict(c.config) for c in st.ip_adapters]} if st.ip_adapters else {}),
        **({"refiner": {"model": {n: dataclasses.asdict(c.config) for n, c in st.refiner.components.items()},
                        "kind": dataclasses.asdict(st.refiner.kind)}} if st.refiner else {}),
    }


def program_family(model: LoadedModel, params) -> str:
    """What every program of ``model`` depends on besides its ProgramShape and the mesh, as a digest: the
    components' configs, the prediction type, the kind (an inpainting UNet), the dtype, the parameters' names,
    shapes, dtypes and shardings, and the refiner's configs and kind. Two models of one family run on the same
    executables (weights are arguments), so the engine keeps one set of compiled programs per family, never per
    model name (engine/local.py). The same facts as :func:`program_key`'s, read without a shape."""
    return key_digest({
        "model": {name: dataclasses.asdict(c.config) for name, c in model.components.items()},
        "prediction_type": model.scheduler_config.get("prediction_type", "epsilon"),
        "kind": dataclasses.asdict(model.kind),
        "dtype": model.dtype,
        "params": [[jax.tree_util.keystr(path), list(x.shape), str(x.dtype), str(getattr(x, "sharding", None))]
                   for path, x in jax.tree_util.tree_leaves_with_path(params)],
        "refiner": None if model.refiner is None else {
            "model": {n: dataclasses.asdict(c.config) for n, c in model.refiner.components.items()},
            "kind": dataclasses.asdict(model.refiner.kind)},
    })


def abstract_params(params):
    """``params`` as ShapeDtypeStructs with their shardings: what a compile needs of them, holding no memory (the
    engine's programs outlive the weights of a model dropped from the devices)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        params)


def cached_program(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh,
                   cache: ExecutableCache | None, threads: int = 3) -> CompiledProgram:
    """The program for ``shape``: loaded from ``cache`` when it holds a trusted entry, else compiled and stored.

    Without a cache this is :func:`compile_program`. A loaded program is neither traced, lowered
    nor compiled: its argument pytree is rebuilt from ``params`` and the abstract inputs (a stepped program's
    loop state from generate.loop_structure). A compiled one bypasses JAX's persistent compilation cache (see
    below), so a miss here is a full compile. A stepped program's three executables are stored and loaded as
    one: all three load, or all three compile, on up to ``threads`` threads. ``cache_note`` of the result says what
    the cache did, in one line.
    """
    if cache is None:
        return compile_program(model, params, shape, mesh, threads)
    start = time.perf_counter()
    key, devices = program_key(model, params, shape, mesh), list(mesh.devices.flat)
    trees = _trees(model, params, shape, mesh)
    found = in_parallel({name: functools.partial(cache.load, {**key, "stage": name} if name else key,
                                                 *trees[name], devices) for name in trees}, threads)
    if all(f.executable is not None for f in found.values()):
        executable = (found[""].executable if "" in found else
                      SteppedExecutable(shape, mesh, {n: found[n].executable for n in STAGES}))
        notes = "; ".join(f.note for f in found.values())
        return CompiledProgram(shape=shape, executable=executable, compile_s=time.perf_counter() - start,
                               flops=_flops(executable), loaded=True, cache_note=notes)
    note = next(f.note for f in found.values() if f.executable is None)
    # What is stored must come from a fresh compile: XLA:CPU (jaxlib 0.12) drops kernels when it re-serializes an
    # executable it deserialized, such as one JAX's persistent cache served (measured: the reloaded copy fails with
    # "Function multiply_add_fusion not found"). So this program bypasses that cache; everything else still uses it.
    hits = cache_counts()["hits"]
    with persistent_cache_off():
        program = compile_program(model, params, shape, mesh, threads)
    # The count is process-wide: a hit meanwhile is this compile's (another thread's block ended and turned the
    # cache back on) or another thread's compile. Either way store nothing; a later miss compiles and stores it.
    if cache_counts()["hits"] != hits:
        program.cache_note = f"{note}; not stored: JAX's persistent compilation cache served it"
    else:
        executables = program.executable.stages if shape.step_hook else {"": program.executable}
        stored = [cache.store({**key, "stage": name} if name else key, executables[name], devices, *trees[name])
                  for name in trees]
        program.cache_note = f"{note}; " + "; ".join(dict.fromkeys(stored))
    program.compile_s = time.perf_counter() - start
    return program


def _trees(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh) -> dict[str, tuple]:
    """{stage name ("" for a one-executable program): (in_tree, out_tree)}, rebuilt without tracing."""
    abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
    if not shape.step_hook:
        return {"": (jax.tree.structure(((params, abstract), {})), jax.tree.structure((0, 0)))}  # (images, finite)
    fixed, carry = loop_structure(model, shape)
    args = {"prepare": (params, abstract), "advance": (params, abstract, fixed, carry, 0),
            "finish": (params, abstract, carry)}
    outs = {"prepare": (fixed, carry), "advance": carry, "finish": (0, 0)}
    return {n: (jax.tree.structure((args[n], {})), jax.tree.structure(outs[n])) for n in STAGES}


@contextlib.contextmanager
def persistent_cache_off():
    """Compile without JAX's persistent compilation cache inside this block (this thread), then turn it back on.

    JAX's ``enable_compilation_cache(False)`` alone does not do it once the process has compiled with the cache:
    ``compilation_cache.is_cache_used`` keeps its first answer for the process (jax 0.12), so a later compile
    of a program the cache holds is served from it (measured: the executable cache then stored a 3.5 MB copy
    instead of 4.0 MB, and a new process that loaded it failed with "Function ..._fusion not found").
    ``reset_cache`` makes JAX ask again, here with the switch off and after the block with it back on.
    """
    with jax_config.enable_compilation_cache(False):
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            compilation_cache.reset_cache()


# Persistent compilation cache reads, counted process-wide from JAX's monitoring events, so
# the log can say whether a compile was served from the cache.
CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_cache_counts = {"hits": 0, "misses": 0}
_listening = False


def _count_cache_event(event: str, **_) -> None:
    if event in CACHE_EVENTS:
        _cache_counts[CACHE_EVENTS[event]] += 1


def cache_counts() -> dict[str, int]:
    """{"hits", "misses"} of the persistent compilation cache so far in this process."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_cache_event)
        _listening = True
    return dict(_cache_counts)
