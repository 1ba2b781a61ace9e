"""How long a request would hold the devices, and the longest run a server accepts (``max_run_seconds``): a request
whose estimate is longer is refused before it waits or runs, naming the steps that fit, so that one client's
512x512 x 20-step request on a CPU does not hold every other client for minutes.

The estimate (issue #47: pixels x steps x images x the measured time per step) is

    seconds(program, steps) = work * (fixed_s + steps * step_s)

measured on the devices at start-up on the default size's program (``fixed_s``: its run with 0 denoising steps, the
text encoders and the VAE decode; ``step_s``: each step more), with ``work`` the program's size against that one by
XLA's counts (costs.ProgramCost): the largest of its FLOPs, bytes-accessed and temporary-memory ratios. On a CPU a
large size's attention is bound by its temporaries' traffic, which grows faster than its FLOPs (at 512x512 against
64x64: 137 x the step time, 127 x the FLOPs, 182 x the bytes accessed, 584 x the temporaries: docs/benchmarks.md,
"Run time admission"); the largest ratio errs on the long side. A size that has run once is estimated by its own
measured step time from then on (an exponential average over its requests, which follows a machine that got busier
or quieter). A run's step time is what its fixed part's estimate leaves, but never less than its share of the run in
the estimate's own split: the fixed part's estimate errs long too, and a 1-step run of a size once left ~0 s a step,
after which that size's 50 steps were accepted and held the devices 82 s against a 30 s limit (a new user's find).
"""

from __future__ import annotations

import dataclasses
import threading

from sdxl_engine.engine.costs import ProgramCost
from sdxl_engine.engine.errors import InvalidRequest

SMOOTHING = 0.5  # weight of a size's newest request in its measured step time


@dataclasses.dataclass
class RunTimes:
    """Measured device seconds of the reference program and the longest run accepted.

    Attributes:
        limit_s: the longest estimated run accepted (``max_run_seconds``); 0 = no limit.
        ref: XLA's counts of the reference program (the default size's).
        fixed_s: its device seconds with 0 denoising steps (text encoders, VAE decode, transfers).
        step_s: its device seconds per denoising step.
        batch: images per request (for messages).
        measured: {(width, height, calls): device seconds per step} of the sizes that ran, ``calls`` the program's
            model calls per step (2 for schedulers.TWO_CALLS: their program, ProgramShape.two_calls, whose XLA
            counts already hold both calls, is measured on its own).
    """

    limit_s: float
    ref: ProgramCost
    fixed_s: float
    step_s: float
    batch: int
    measured: dict = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def work(self, cost: ProgramCost) -> float:
        """A program's counts as a multiple of the reference program's: the largest ratio."""
        return max(cost.flops / self.ref.flops, cost.accessed / self.ref.accessed, cost.run_bytes / self.ref.run_bytes)

    def seconds(self, width: int, height: int, cost: ProgramCost, steps: int, calls: int = 1) -> float:
        """Estimated device seconds of ``steps`` denoising steps on a ``width`` x ``height`` program of ``cost`` with
        ``calls`` model calls per step."""
        scale = self.work(cost)
        step = self.measured.get((width, height, calls), scale * self.step_s)
        return scale * self.fixed_s + steps * step

    def observe(self, width: int, height: int, cost: ProgramCost | None, steps: int, device_s: float,
                calls: int = 1) -> None:
        """Learn from a request that ran ``steps`` steps of ``calls`` model calls at ``width`` x ``height`` in
        ``device_s`` device seconds."""
        if cost is None or steps < 1 or device_s <= 0:
            return
        work = self.work(cost)
        fixed, step = work * self.fixed_s, work * self.step_s  # the estimate's split
        per_step = max(device_s - fixed, device_s * steps * step / (fixed + steps * step)) / steps
        with self._lock:
            old = self.measured.get((width, height, calls))
            self.measured[(width, height, calls)] = per_step if old is None else \
                (1 - SMOOTHING) * old + SMOOTHING * per_step

    def refusal(self, runs: list[tuple[int, int, ProgramCost | None, int, int]],
                field: str = "num_inference_steps") -> InvalidRequest | None:
        """Why a request is refused (naming ``field``: the hires fix's is ``hires_steps``), or None. ``runs``:
        (width, height, cost, steps, model calls per step) of each program call it makes in order (hires fix: two;
        Engine._runs); a program without counts is not estimated. Over the limit by a tenth for an estimated cost (a
        size not compiled yet), so that the estimate's error never refuses what would fit: a size near the limit
        compiles and is counted."""
        if not self.limit_s or any(cost is None for _, _, cost, _, _ in runs):
            return None
        total = sum(self.seconds(*run) for run in runs)
        if total <= self.limit_s * (1 if all(cost.counted for _, _, cost, _, _ in runs) else 1.1):
            return None
        width, height, cost, steps, calls = runs[-1]
        room = self.limit_s - sum(self.seconds(*run) for run in runs[:-1]) - self.seconds(width, height, cost, 0, calls)
        per_step = self.seconds(width, height, cost, 1, calls) - self.seconds(width, height, cost, 0, calls)
        fit = int(room // per_step) if per_step > 0 and room > 0 else 0
        fits = (f"at most {fit} step{'s' if fit > 1 else ''} to run at this size" if fit >= 1
                else "no number of steps at this size")
        if not all(cost.counted for _, _, cost, _, _ in runs):  # XLA's counts, once compiled, may say otherwise
            fits += " by an estimate (this size has not compiled yet)"
        about = f"{total:.0f}" if total >= 10 else f"{total:.1f}"
        # "to run": image to image runs the last steps of its schedule (strength), fewer than the field says
        return InvalidRequest(field, f"{width}x{height} x {self.batch} images, {steps} step{'s' if steps > 1 else ''} "
                                     f"to run, would hold this server's devices about {about} s, over its limit "
                                     f"of {self.limit_s:g} s (max_run_seconds): {fits}, or a smaller size")
