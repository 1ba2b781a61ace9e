"""How long a request would hold the devices, and the longest run a server accepts (``max_run_seconds``): a request
whose estimate is longer is refused before it waits or runs, naming the steps that fit, so that one client's
512x512 x 20-step request on a CPU does not hold every other client for minutes.

The estimate (issue #47: pixels x steps x images x the measured time per step) is

    seconds(program, steps) = work * (fixed_s + steps * step_s)

measured on the devices at start-up on the default size's program (``fixed_s``: its run with 0 denoising steps, the
text encoders and the VAE decode; ``step_s``: one more step), with ``work`` the program's size against that one by
XLA's cost analysis: the larger of its FLOPs ratio and its bytes-accessed ratio (on a CPU a large size's attention is
bound by memory traffic, which grows faster than its FLOPs: docs/benchmarks.md, "Run time admission"). A size that has
run once is estimated by its own measured step time from then on (an exponential average over its requests, which
follows a machine that got busier or quieter).
"""

from __future__ import annotations

import dataclasses
import threading

from sdxl_engine.engine.errors import InvalidRequest

SMOOTHING = 0.5  # weight of a size's newest request in its measured step time


@dataclasses.dataclass
class RunTimes:
    """Measured device seconds of the reference program and the longest run accepted.

    Attributes:
        limit_s: the longest estimated run accepted (``max_run_seconds``); 0 = no limit.
        ref_work: (FLOPs, bytes accessed) of the reference program (the default size's: compiling.program_work).
        fixed_s: its device seconds with 0 denoising steps (text encoders, VAE decode, transfers).
        step_s: its device seconds per denoising step.
        batch: images per request (for messages).
        measured: {(width, height): device seconds per step} of the sizes that ran.
    """

    limit_s: float
    ref_work: tuple[float, float]
    fixed_s: float
    step_s: float
    batch: int
    measured: dict = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def work(self, work: tuple[float, float]) -> float:
        """A program's (FLOPs, bytes accessed) as a multiple of the reference program's: the larger ratio."""
        return max(work[0] / self.ref_work[0], work[1] / self.ref_work[1])

    def seconds(self, width: int, height: int, work: tuple[float, float], steps: int) -> float:
        """Estimated device seconds of ``steps`` denoising steps on a ``width`` x ``height`` program of ``work``."""
        scale = self.work(work)
        step = self.measured.get((width, height), scale * self.step_s)
        return scale * self.fixed_s + steps * step

    def observe(self, width: int, height: int, work: tuple[float, float] | None, steps: int, device_s: float) -> None:
        """Learn from a request that ran ``steps`` steps at ``width`` x ``height`` in ``device_s`` device seconds."""
        if work is None or steps < 1 or device_s <= 0:
            return
        per_step = max(0.0, device_s - self.work(work) * self.fixed_s) / steps
        with self._lock:
            old = self.measured.get((width, height))
            self.measured[(width, height)] = per_step if old is None else \
                (1 - SMOOTHING) * old + SMOOTHING * per_step

    def refusal(self, runs: list[tuple[int, int, tuple[float, float] | None, int]]) -> InvalidRequest | None:
        """Why a request is refused, or None. ``runs``: (width, height, work, steps) of each program call it makes in
        order (hires fix: two); a program XLA reported no cost for is not estimated."""
        if not self.limit_s or any(work is None for _, _, work, _ in runs):
            return None
        total = sum(self.seconds(*run) for run in runs)
        if total <= self.limit_s:
            return None
        width, height, work, steps = runs[-1]
        room = self.limit_s - sum(self.seconds(*run) for run in runs[:-1]) - self.seconds(width, height, work, 0)
        per_step = self.seconds(width, height, work, 1) - self.seconds(width, height, work, 0)
        fit = int(room // per_step) if per_step > 0 and room > 0 else 0
        fits = f"at most {fit} steps at this size" if fit >= 1 else "no number of steps at this size"
        return InvalidRequest("num_inference_steps", f"{width}x{height}, {steps} steps x {self.batch} images would "
                                                     f"hold this server's devices about {total:.0f} s, over its "
                                                     f"limit of {self.limit_s:g} s (max_run_seconds): {fits}, "
                                                     "or a smaller size")
