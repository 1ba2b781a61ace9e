"""The engine's compiled programs, one per ProgramShape: compiled (or loaded from the executable cache) once, a new
size on the compile thread while requests at compiled sizes run, the least recently used beyond the size buckets
dropped. engine/local.py asks it for a plan's program; nothing here plans or runs a request."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.contract import clock
from sdxl_engine.engine.costs import CostTable, program_cost
from sdxl_engine.engine.errors import CompilesBusy
from sdxl_engine.engine.steps import wait_or_stop
from sdxl_engine.program.compiling import CompiledProgram, cache_counts, cached_program
from sdxl_engine.program.executables import ExecutableCache
from sdxl_engine.program.generate import ProgramShape
from sdxl_engine.program.schedulers import TWO_CALLS

LOG = logging.getLogger(__name__)


class Programs:
    """The compiled programs of one loaded model on one mesh, by :class:`ProgramShape`.

    ``model`` (loading.LoadedModel), ``params`` (its parameters on the devices: the shapes and shardings every
    program is compiled for), ``mesh``, ``batch`` (images per request), ``executables`` (the executable cache, or
    None), ``config`` (max_pending_compiles, max_resident_programs), ``compile_cache_dir`` (for the log line),
    ``sizes`` (the model's size buckets in pixels, whose programs are never dropped), ``log`` (where the lines go,
    tests collect them; None: this module's logger, each line at its level).

    Attributes:
        compiled: {ProgramShape: CompiledProgram}, the programs in memory.
        count: programs made so far (compiled, or loaded from the executable cache).
        pending: {ProgramShape: Future} of the compiles on the compile thread; pending_for: {client: the shape
            its request waits for}; used: {ProgramShape: clock() when a request last took it}.
    """

    def __init__(self, model, params, mesh, batch: int, executables: ExecutableCache | None, config: EngineConfig,
                 compile_cache_dir: str, sizes: tuple[tuple[int, int], ...],
                 log: Callable[[str], None] | None = None):
        self.model, self.params, self.mesh, self.batch = model, params, mesh, batch
        self.executables, self.config = executables, config
        self.compile_cache_dir, self.sizes = compile_cache_dir, sizes
        self._log, self._warn = log or LOG.info, log or LOG.warning
        self.compiled: dict[ProgramShape, CompiledProgram] = {}
        self.count = 0
        self._compile_lock = threading.Lock()  # one compile at a time (a request's, the background precompile's)
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-compile")
        self.pending: dict[ProgramShape, concurrent.futures.Future] = {}
        self.pending_for: dict[str, ProgramShape] = {}
        self._pending_lock = threading.Lock()
        self.used: dict[ProgramShape, float] = {}  # the size buckets' programs are never dropped
        # XLA's counts of every program made so far (engine/costs.py), kept when one is dropped
        self.costs = CostTable()

    def get(self, shape: ProgramShape) -> CompiledProgram:
        """``shape``'s program, compiled on this thread on first use (then kept): start-up, the warm-up and the
        background precompile."""
        if shape in self.compiled:
            return self.compiled[shape]
        with self._compile_lock:  # the background precompile may be compiling this one (or another) now
            if shape not in self.compiled:
                self._compile(shape)
        return self.compiled[shape]

    def params_for(self, shape: ProgramShape):
        """The params ``shape``'s program is compiled for: the model's, with ``shape.controlnets`` a loaded
        ControlNet's of each unit's architecture in ``params["controlnet"]`` (a request passes its units' own, of
        the same shapes); likewise ``shape.ip_adapters``' in ``params["ip_adapter"]``."""
        params = self.params
        if shape.controlnets:
            by_id = {net.architecture: net.params for net in self.model.controlnets.values()}
            params = {**params, "controlnet": tuple(by_id[a] for a in shape.controlnets)}
        if shape.ip_adapters:
            by_id = {a.architecture: a.layer_params for a in self.model.ip_adapters.values()}
            params = {**params, "ip_adapter": tuple(by_id[a] for a, _, _ in shape.ip_adapters)}
        return params

    def _compile(self, shape: ProgramShape) -> None:
        """Compile (or load) one program and log one line saying how; call with ``_compile_lock`` held."""
        before = cache_counts()
        program = cached_program(self.model, self.params_for(shape), shape, self.mesh, self.executables,
                                 self.config.compile_threads)
        self.costs.observe(shape, program_cost(program.executable))
        self.compiled[shape] = program
        self.count += 1
        after = cache_counts()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        what = f"{shape.width}x{shape.height} x {self.batch} images{'' if shape.cfg else ' without CFG'}"
        what += f", {shape.chunks} prompt chunks" if shape.chunks > 1 else ""
        what += ", image to image" if shape.init_image else ""
        what += ", inpainting" if shape.inpaint else ""
        what += ", with the refiner" if shape.refiner else ""
        what += ", hires first pass" if shape.latents_out else ", hires second pass" if shape.init_latents else ""
        what += f", {len(shape.controlnets)} ControlNet units" if shape.controlnets else ""
        what += f", {len(shape.ip_adapters)} IP-Adapter units" if shape.ip_adapters else ""
        what += f", two model calls per step ({', '.join(TWO_CALLS)})" if shape.two_calls else ""
        # One line either way; a missing or refused executable says why in the "compiled" line.
        if program.loaded:
            self._log(f"[sdxl_engine] loaded {what} in {program.compile_s:.2f} s (executable cache: "
                      f"{program.cache_note}; nothing traced or compiled)")
        elif self.executables:  # compiling.cached_program bypasses XLA's cache for what it stores
            self._log(f"[sdxl_engine] compiled {what} in {program.compile_s:.2f} s (executable cache: "
                      f"{program.cache_note}; compile cache: bypassed)")
        else:
            cache = (f"compile cache: {'hit' if hits and not misses else 'miss' if misses else 'not used'} "
                     f"({hits} hits, {misses} misses) in {self.compile_cache_dir}" if self.compile_cache_dir
                     else "compile cache off")
            self._log(f"[sdxl_engine] compiled {what} in {program.compile_s:.2f} s ({cache})")

    def precompile(self, shapes: list[ProgramShape], done: threading.Event) -> None:
        """Compile ``shapes`` in order on a daemon thread (the engine's background precompile); sets ``done``
        when it finished or stopped. A failure is logged; a request at that size compiles it then (and reports
        its own error)."""
        def run():
            t0 = time.perf_counter()
            try:
                for shape in shapes:
                    self.get(shape)
                self._log(f"[sdxl_engine] precompiled {len(shapes)} more programs in {time.perf_counter() - t0:.2f} s "
                          "in the background")
            except Exception as err:
                self._warn(f"[sdxl_engine] background precompile stopped: {type(err).__name__}: {err}")
            finally:
                done.set()

        threading.Thread(target=run, name="engine-precompile", daemon=True).start()

    def for_request(self, shape: ProgramShape, client: str, progress: Callable[[str], None],
                    should_stop: Callable[[], bool] | None) -> CompiledProgram:
        """A request's program; one not compiled yet compiles on the compile thread while this request waits
        (``progress("compiling")``) and requests at compiled sizes run on. A stop while it waits frees the request
        at once (the compile goes on: the size is ready for the next request). ``client``: the request's client
        (each waits for one new size at a time).

        Raises:
            CompilesBusy: the request's client waits for another new size already, or
                ``max_pending_compiles`` sizes compile already.
            Stopped: ``should_stop()`` said so while the request waited for its compile.
        """
        program = self.compiled.get(shape)
        if program is not None:
            self.used[shape] = clock()
            return program
        future = self._pending_compile(shape, client)
        progress("compiling")
        try:
            wait_or_stop(future, should_stop,
                         "stopped before it started (its size still compiles, for the next request)")
        finally:
            with self._pending_lock:
                if self.pending_for.get(client) == shape:
                    del self.pending_for[client]
        self.used[shape] = clock()
        return self.compiled[shape]

    def _pending_compile(self, shape: ProgramShape, client: str) -> concurrent.futures.Future:
        """The compile of ``shape``, started on the compile thread unless it runs already (see for_request)."""
        with self._pending_lock:
            future = self.pending.get(shape)
            if future is None:
                mine = self.pending_for.get(client)
                if mine is not None and mine != shape:
                    raise CompilesBusy(f"width/height: your request for {mine.width}x{mine.height} is still "
                                       "compiling; send this size once it is ready")
                if len(self.pending) >= self.config.max_pending_compiles:
                    sizes = ", ".join(f"{w}x{h}" for w, h in sorted((s.width, s.height) for s in self.pending))
                    raise CompilesBusy(f"width/height: {shape.width}x{shape.height} is not compiled yet and "
                                       f"{len(self.pending)} new sizes compile already ({sizes}; "
                                       "max_pending_compiles); retry in a minute, or use a compiled size")
                future = self.pending[shape] = self._compiler.submit(self._compile_new, shape)
            self.pending_for[client] = shape
            return future

    def _compile_new(self, shape: ProgramShape) -> None:
        """The compile thread's job: compile ``shape``, then no longer count it as pending (under the pending
        lock, which _pending_compile holds until the future is recorded, so the record always goes)."""
        try:
            with self._compile_lock:
                if shape not in self.compiled:
                    self._compile(shape)
            self.used[shape] = clock()  # the newest: never the one dropped to make room for itself
            self.drop_unused()
        finally:
            with self._pending_lock:
                self.pending.pop(shape, None)

    def _bucket(self, shape: ProgramShape) -> bool:
        """Whether ``shape``'s size is one of the model's size buckets (whose programs stay in memory)."""
        return (shape.width, shape.height) in self.sizes

    def drop_unused(self) -> None:
        """Keep at most ``max_resident_programs`` programs beyond the size buckets' in memory, dropping
        the least recently used (the executable cache, or XLA's, brings one back without compiling)."""
        extra = [shape for shape in list(self.compiled) if not self._bucket(shape)]
        extra.sort(key=lambda shape: self.used.get(shape, 0.0))
        for shape in extra[:max(0, len(extra) - self.config.max_resident_programs)]:
            self.compiled.pop(shape, None)
            self.used.pop(shape, None)
            self._log(f"[sdxl_engine] dropped the program for {shape.width}x{shape.height} (least recently used; "
                      f"max_resident_programs {self.config.max_resident_programs})")
