"""What a request's program needs of memory to run, and what this server has for it: a request that cannot fit is
refused before it compiles (when the sizes seen so far say it cannot) or before it runs (XLA's count of its compiled
program says so), never started. On CPU devices the buffers come out of the host's memory, and a run past it is
killed by the kernel with every client's requests (a 768x768 request did that on a 23 GB machine: docs/benchmarks.md,
"Memory admission").

The need is XLA's own count, per device, of the compiled executable (``memory_analysis()``: its temporaries and
outputs; the weights are resident already and counted out of the capacity). The capacity is what the devices have
free once the engine is ready (its weights loaded, its first program warmed up), less a reserve for a compile
running beside the request, or the ``max_run_memory_gb`` setting.
"""

from __future__ import annotations

import dataclasses
import os

from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.program.generate import ProgramShape

RESERVE = 0.15  # of the free memory at ready: a compile beside the request, Python and the server's own buffers
GB = 1e9


def program_bytes(executable) -> int | None:
    """Bytes one device needs to run ``executable`` beyond its arguments: XLA's ``memory_analysis()`` temporaries
    plus outputs (the per-request inputs are a few MB and the weights are resident). None where the backend does
    not report it."""
    try:
        analysis = executable.memory_analysis()
    except Exception:  # not implemented on some backends or for some executables: no figure, no check
        return None
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes) + int(analysis.output_size_in_bytes)


def host_available_bytes() -> int:
    """The host memory the kernel could give this process now: ``MemAvailable`` of /proc/meminfo (Linux), else the
    free physical pages (os.sysconf)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_free_bytes(devices) -> int | None:
    """The least free memory of ``devices`` (accelerators: ``memory_stats()`` bytes_limit - bytes_in_use), or None
    when a device does not report it."""
    free = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free) if free else None


def _kind(shape: ProgramShape) -> ProgramShape:
    """``shape`` without its size: programs of one kind differ in memory by their size only."""
    return dataclasses.replace(shape, width=0, height=0)


@dataclasses.dataclass
class MemoryBudget:
    """The memory a run may take and the needs of the programs compiled so far.

    Attributes:
        capacity: bytes a run may take, in the pool the devices share (``pool`` devices' needs add up in it).
        pool: devices whose buffers come out of one memory: all of them on CPU (the host's), 1 on accelerators.
        where: what the capacity is, for messages ("host memory", "memory per device").
        multiple: the model's size multiple in pixels (the largest size that fits is a multiple of it).
        batch: images per request (for messages).
        seen: {program kind: {pixels per image: bytes per device}} of the programs compiled so far.
    """

    capacity: int
    pool: int
    where: str
    multiple: int
    batch: int
    seen: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def measure(cls, mesh, multiple: int, batch: int, limit_gb: float = 0.0) -> "MemoryBudget":
        """The budget of the devices of ``mesh`` now (call once the engine is ready): ``limit_gb`` GB when set (>
        0), else what they have free less :data:`RESERVE`."""
        devices = list(mesh.devices.flat)
        cpu = devices[0].platform == "cpu"
        pool, where = (len(devices), "host memory") if cpu else (1, "memory per device")
        if limit_gb > 0:
            return cls(int(limit_gb * GB), pool, where + " (max_run_memory_gb)", multiple, batch)
        free = host_available_bytes() if cpu else device_free_bytes(devices)
        if free is None:  # an accelerator that reports nothing: XLA's own out-of-memory error still refuses a run
            return cls(0, pool, where, multiple, batch)
        return cls(int(free * (1 - RESERVE)), pool, where, multiple, batch)

    def need(self, per_device: int) -> int:
        """Bytes of the capacity a program taking ``per_device`` bytes on each device takes."""
        return per_device * self.pool

    def observe(self, shape: ProgramShape, per_device: int | None) -> None:
        """Record what a compiled program of ``shape`` needs (``program_bytes``)."""
        if per_device is not None:
            self.seen.setdefault(_kind(shape), {})[shape.width * shape.height] = per_device

    def estimate(self, shape: ProgramShape) -> int | None:
        """A low estimate of the bytes per device a program of ``shape`` needs, from the programs of its kind seen so
        far: the count of that size, or with two sizes or more the least-squares a*p + b*p^2 (a, b >= 0; memory grows
        with the pixels, the convolutions' activations, and with their square, attention's scores over the latent
        tokens); None otherwise."""
        points = self.seen.get(_kind(shape), {})
        pixels = shape.width * shape.height
        if pixels in points:
            return points[pixels]
        if len(points) < 2:  # one size alone cannot tell its constant part (text encoders) from what scales
            return None
        a, b = _fit(points)
        return int(a * pixels + b * pixels * pixels)

    def largest_square(self, shape: ProgramShape) -> int:
        """The side, a multiple of :attr:`multiple`, of the largest square size whose estimated need fits (0 when
        none does or nothing is known). With one size seen it grows as the pixels' square: a size it names fits."""
        points = self.seen.get(_kind(shape))
        if not points or not self.capacity:
            return 0
        a, b = _fit(points) if len(points) > 1 else (0.0, max(v / (p * p) for p, v in points.items()))
        side = self.multiple
        while self.need(int(a * (side + self.multiple) ** 2 + b * (side + self.multiple) ** 4)) <= self.capacity:
            side += self.multiple
            if side > 65_536:
                break
        return side if self.need(int(a * side ** 2 + b * side ** 4)) <= self.capacity else 0

    def refusal(self, shape: ProgramShape, per_device: int | None, counted: bool) -> InvalidRequest | None:
        """Why a request whose program has ``shape`` is refused, or None. ``per_device``: XLA's count for its compiled
        program (``counted``), or :meth:`estimate`'s before it compiles (refused only when over by a tenth, so that
        the estimate's error never refuses what would fit: a size near the limit compiles and is counted)."""
        if per_device is None or not self.capacity:
            return None
        need = self.need(per_device)
        if need <= (self.capacity if counted else 1.1 * self.capacity):
            return None
        side = self.largest_square(shape)
        fits = f"at most {side}x{side} (or as many pixels) on this server" if side else "no size fits on this server"
        how = ("XLA's count of its compiled program" if counted else "estimated from the sizes compiled so far")
        shared = f" ({per_device / GB:.2f} GB on each of {self.pool} devices)" if self.pool > 1 else ""
        return InvalidRequest("width", f"{shape.width}x{shape.height} x {self.batch} images needs {need / GB:.1f} GB "
                                       f"to run{shared}, {how}, and this server has {self.capacity / GB:.1f} GB of "
                                       f"{self.where} for a run: {fits}; choose a smaller size")


def _fit(points: dict[int, int]) -> tuple[float, float]:
    """(a, b) >= 0 of bytes = a * pixels + b * pixels^2 through ``points`` ({pixels: bytes}), least squares; with one
    point, the line through it (b = 0)."""
    if len(points) == 1:
        [(p, v)] = points.items()
        return v / p, 0.0
    # Normal equations of the two-term least squares, in pixels scaled to millions (well conditioned).
    xs = [(p / 1e6, v) for p, v in points.items()]
    s2 = sum(x ** 2 for x, _ in xs)
    s3 = sum(x ** 3 for x, _ in xs)
    s4 = sum(x ** 4 for x, _ in xs)
    t1 = sum(x * v for x, v in xs)
    t2 = sum(x * x * v for x, v in xs)
    det = s2 * s4 - s3 * s3
    a, b = ((t1 * s4 - t2 * s3) / det, (s2 * t2 - s3 * t1) / det) if det else (t1 / s2, 0.0)
    if a < 0:  # the best fit with b alone
        a, b = 0.0, t2 / s4
    elif b < 0:  # the best fit with a alone
        a, b = t1 / s2, 0.0
    return a / 1e6, b / 1e12
