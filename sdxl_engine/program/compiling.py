"""Compiling the program: jit with shardings, lower, compile ahead of time, and the executable cache's key and
lookup (program/executables.py stores and loads; this module decides what a program's key is and when to store)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path

import jax
from jax._src import compilation_cache  # reset_cache: JAX reads that switch once per process (persistent_cache_off)
from jax._src import config as jax_config  # its thread-local enable_compilation_cache switch has no public API
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sdxl_engine.checkpoint.loading import LoadedModel
from sdxl_engine.program.executables import ExecutableCache, key_digest, source_digest
from sdxl_engine.program.generate import ProgramInputs, ProgramShape, build_generate, latent_shape, static_options
from sdxl_engine.program.sharding import DATA_AXIS, check_batch
from sdxl_engine.program.step_hook import STEP_HOOK


@dataclasses.dataclass
class CompiledProgram:
    """An ahead-of-time compiled executable and what it took to build."""

    shape: ProgramShape
    executable: Callable  # (params, ProgramInputs) -> (images, finite)
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
                            out_specs=(P(DATA_AXIS), P(DATA_AXIS)))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    batch = NamedSharding(mesh, P(DATA_AXIS))
    return jax.jit(sharded, in_shardings=(NamedSharding(mesh, P()), shardings), out_shardings=(batch, batch))


def compile_program(model: LoadedModel, params, shape: ProgramShape, mesh: Mesh) -> CompiledProgram:
    """Lower and compile ahead of time for ``shape``; ``params`` may be arrays or ShapeDtypeStructs."""
    start = time.perf_counter()
    abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
    executable = jit_program(model, shape, mesh).lower(params, abstract).compile()
    return CompiledProgram(shape=shape, executable=executable, compile_s=time.perf_counter() - start,
                           flops=_flops(executable))


def _flops(executable) -> float | None:
    try:
        cost = executable.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops")) if cost and cost.get("flops") is not None else None
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
    names, shapes, dtypes and shardings, the mesh (axis names, device ids in order) and a hash
    of the source files it is traced from (:func:`program_sources`). The cache adds versions,
    backend, devices and JAX options (:func:`.executables.runtime_key`).
    """
    cfg = "" if shape.cfg else " without CFG"
    cfg += f", {shape.chunks} prompt chunks" if shape.chunks > 1 else ""
    cfg += ", image to image" if shape.init_image else ""
    cfg += ", inpainting" if shape.inpaint else ""
    cfg += ", with the refiner" if shape.refiner else ""
    cfg += ", hires first pass" if shape.latents_out else ""
    cfg += ", hires second pass" if shape.init_latents or shape.hires_noise else ""
    cfg += f", {len(shape.controlnets)} ControlNet units" if shape.controlnets else ""
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
        **({"controlnets": [dataclasses.asdict(c.config) for c in st.controlnets]} if st.controlnets else {}),
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
                   cache: ExecutableCache | None) -> CompiledProgram:
    """The program for ``shape``: loaded from ``cache`` when it holds a trusted entry, else compiled and stored.

    Without a cache this is :func:`compile_program`. A loaded program is neither traced, lowered
    nor compiled: its argument pytree is rebuilt from ``params`` and the abstract inputs. A
    compiled one bypasses JAX's persistent compilation cache (see below), so a miss here is a
    full compile. ``cache_note`` of the result says what the cache did, in one line.
    """
    if cache is None:
        return compile_program(model, params, shape, mesh)
    start = time.perf_counter()
    abstract = ProgramInputs.abstract(shape, latent_shape(model, shape.height, shape.width), mesh)
    in_tree, out_tree = jax.tree.structure(((params, abstract), {})), jax.tree.structure((0, 0))  # (images, finite)
    key, devices = program_key(model, params, shape, mesh), list(mesh.devices.flat)
    found = cache.load(key, in_tree, out_tree, devices,
                       host_callback=STEP_HOOK.call if shape.step_hook else None)  # the step hook restored
    if found.executable is not None:
        return CompiledProgram(shape=shape, executable=found.executable, compile_s=time.perf_counter() - start,
                               flops=_flops(found.executable), loaded=True, cache_note=found.note)
    # What is stored must come from a fresh compile: XLA:CPU (jaxlib 0.12) drops kernels when it re-serializes an
    # executable it deserialized, such as one JAX's persistent cache served (measured: the reloaded copy fails with
    # "Function multiply_add_fusion not found"). So this program bypasses that cache; everything else still uses it.
    hits = cache_counts()["hits"]
    with persistent_cache_off():
        program = compile_program(model, params, shape, mesh)
    # The count is process-wide: a hit meanwhile is this compile's (another thread's block ended and turned the
    # cache back on) or another thread's compile. Either way store nothing; a later miss compiles and stores it.
    if cache_counts()["hits"] != hits:
        program.cache_note = f"{found.note}; not stored: JAX's persistent compilation cache served it"
    else:
        program.cache_note = f"{found.note}; {cache.store(key, program.executable, devices, in_tree, out_tree)}"
    program.compile_s = time.perf_counter() - start
    return program


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
