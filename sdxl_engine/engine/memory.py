"""What a request's program needs of memory to run, and what this server has for it: a request that cannot fit is
refused before it compiles (when the sizes seen so far say it cannot) or before it runs (XLA's count of its compiled
program says so), never started. On CPU devices the buffers come out of the host's memory, and a run past it is
killed by the kernel with every client's requests (a 768x768 request did that on a 23 GB machine: docs/benchmarks.md,
"Memory admission").

The need is XLA's own count, per device, of the compiled executable (costs.ProgramCost.run_bytes: its temporaries
and outputs; the weights are resident already and counted out of the capacity), or before it compiles its estimate
from the sizes compiled so far (costs.CostTable). The capacity is what the devices have
free once the engine is ready (its weights loaded, its first program warmed up), less a reserve for a compile
running beside the request, or the ``max_run_memory_gb`` setting.
"""

from __future__ import annotations

import dataclasses
import os

from sdxl_engine.engine.costs import CostTable, ProgramCost, fit
from sdxl_engine.engine.errors import InvalidRequest
from sdxl_engine.program.generate import ProgramShape

RESERVE = 0.15  # of the free memory at ready: a compile beside the request, Python and the server's own buffers
GB = 1e9


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


@dataclasses.dataclass
class MemoryBudget:
    """The memory a run may take and the needs of the programs compiled so far.

    Attributes:
        capacity: bytes a run may take, in the pool the devices share (``pool`` devices' needs add up in it).
        pool: devices whose buffers come out of one memory: all of them on CPU (the host's), 1 on accelerators.
        where: what the capacity is, for messages ("host memory", "memory per device").
        multiple: the model's size multiple in pixels (the largest size that fits is a multiple of it).
        batch: images per request (for messages).
    """

    capacity: int
    pool: int
    where: str
    multiple: int
    batch: int

    @classmethod
    def measure(cls, mesh, multiple: int, batch: int, limit_gb: float = 0.0) -> MemoryBudget:
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

    def largest_square(self, shape: ProgramShape, costs: CostTable) -> int:
        """The side, a multiple of :attr:`multiple`, of the largest square size whose estimated need fits (0 when
        none does or nothing is known). With one size known it grows as the pixels' square from it: a size it names
        fits."""
        points = costs.points(shape, "run_bytes")
        if not points or not self.capacity:
            return 0
        a, b = fit(points) if len(points) > 1 else (0.0, max(v / (p * p) for p, v in points.items()))
        side = self.multiple
        while self.need(int(a * (side + self.multiple) ** 2 + b * (side + self.multiple) ** 4)) <= self.capacity:
            side += self.multiple
            if side > 65_536:
                break
        return side if self.need(int(a * side ** 2 + b * side ** 4)) <= self.capacity else 0

    def refusal(self, shape: ProgramShape, cost: ProgramCost | None, costs: CostTable,
                field: str = "width") -> InvalidRequest | None:
        """Why a request whose program has ``shape`` is refused (naming ``field``: the hires fix's second pass is
        ``hires_scale``), or None. ``cost``: XLA's counts of its compiled program, or CostTable's estimate before it
        compiles (refused only when over by a tenth, so that the estimate's error never refuses what would fit: a size
        near the limit compiles and is counted)."""
        if cost is None or not self.capacity:
            return None
        need = self.need(int(cost.run_bytes))
        if need <= (self.capacity if cost.counted else 1.1 * self.capacity):
            return None
        side = self.largest_square(shape, costs)
        fits = f"at most {side}x{side} (or as many pixels) on this server" if side else "no size fits on this server"
        how = ("XLA's count of its compiled program" if cost.counted else "estimated from the sizes compiled so far")
        shared = f" ({cost.run_bytes / GB:.2f} GB on each of {self.pool} devices)" if self.pool > 1 else ""
        return InvalidRequest(field, f"{shape.width}x{shape.height} x {self.batch} images needs {need / GB:.1f} GB "
                                     f"to run{shared}, {how}, and this server has {self.capacity / GB:.1f} GB of "
                                     f"{self.where} for a run: {fits}; choose a smaller size")
