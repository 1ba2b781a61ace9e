"""What the per-step hook costs: device time of one request with progress and previews on and off.

    python -m tools.bench --progress-cost [--model tiny-shapes] [--steps 20] [--runs 7]

One engine (progress off: its default program runs every step in one executable) and the same size's program
with the step hook (ProgramShape.step_hook: the host runs the steps in chunks), run on one request's inputs in
alternating rounds (timing.timed: every variant once per round, so a noisy neighbour slows them alike):

* ``both off``: the program without the hook;
* ``progress on, previews off``: the stepped program reporting to a StepReceiver, which asks for a report
  about every steps.REPORT_INTERVAL_S (chunks of that many steps; no latents leave the device);
* ``progress on, a call every step``: the same receiver, but a chunk of one step each time (an
  accelerator's cadence, where a step takes longer than the interval);
* ``previews every step``: the same, x0 sent and mapped to RGB at every step it can be (the worst case);
* ``previews auto``: preview_every -1, about twice a second.

Each is the program's call until its images are ready (what the engine's ``device`` timing counts).
Prints and returns the medians, the ratios to ``both off`` (of the medians, and paired: per round,
with quartiles), the extra milliseconds per step, and checks that all variants give the same bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdxl_engine.config import EngineConfig
from sdxl_engine.engine.local import Engine
from sdxl_engine.engine.steps import AUTO, StepReceiver
from sdxl_engine.program.compiling import cached_program
from sdxl_engine.program.generate import ProgramInputs, tokenize
from sdxl_engine.program.schedulers import make_schedule
from tools.timing import timed


def variants(engine: Engine, steps: int) -> tuple[dict, dict]:
    """({name: call that blocks until the images are ready}, {name: its last images})."""
    width, height = engine.limits.default_size
    plain = engine.program(width, height, True)  # progress off: no hook
    hooked = cached_program(engine.model, engine.params, dataclasses.replace(plain.shape, step_hook=True),
                            engine.mesh, engine.executables)
    ids, _ = tokenize(engine.model, "a red circle on a blue background")
    empty, _ = tokenize(engine.model, "")
    schedule = make_schedule("Euler", engine.model.scheduler_config, steps)
    inputs = ProgramInputs.build(ids, empty, True, list(range(engine.batch)), 5.0, schedule, steps,
                                 engine.config.max_inference_steps)
    out: dict = {}

    def run_plain():
        out["both off"] = np.asarray(plain.executable(engine.params, inputs)[0])

    def run_hooked(name: str, every: int, each_step: bool = False):
        def call():
            seen = []
            receiver = StepReceiver(engine.mesh.devices.size, steps, every, engine.latent_rgb, seen.append,
                                    lambda: False)
            if each_step:  # the devices call the host at every step, as before the receiver chose the cadence
                receiver = every_step(receiver)
            out[name] = np.asarray(hooked.executable.run(engine.params, inputs, receiver)[0])
            assert seen[-1].step == steps  # the host reports when the receiver asks, and at the last step
        return call

    fns = {"both off": run_plain, "progress on, previews off": run_hooked("progress on, previews off", 0),
           "progress on, a call every step": run_hooked("progress on, a call every step", 0, each_step=True),
           "previews every step": run_hooked("previews every step", 1),
           "previews auto": run_hooked("previews auto", AUTO)}
    return fns, out


def every_step(receiver: StepReceiver):
    """``receiver`` answering "call again at the next step" every time (the cadence before the receiver chose it)."""
    def call(shard, step, x0):
        stop, send, _ = receiver(shard, step, x0)
        return stop, send, step + 1
    return call


def main(args) -> dict:
    engine = Engine(EngineConfig.load({"model": args.model, "progress": False}), log=print).start()
    fns, out = variants(engine, args.steps)
    rounds: list = []
    result = timed(fns, args.runs, rounds)
    base = result["both off"]["median"]
    same = all(np.array_equal(out["both off"], images) for images in out.values())
    # Paired: each round's ratio to that round's "both off", then the median and quartiles over rounds,
    # which a slow stretch of the shared machine shifts far less than a ratio of medians.
    paired = {k: np.percentile([r[k] / r["both off"] for r in rounds], [25, 50, 75]).tolist() for k in result}
    report = {"model": args.model, "device": engine.device_summary, "steps": args.steps, "runs": args.runs,
              "size": engine.limits.default_size, "same_images": same,
              "median_s": {k: v["median"] for k, v in result.items()},
              "min_s": {k: v["min"] for k, v in result.items()},
              "ratio_to_both_off": {k: v["median"] / base for k, v in result.items()},
              "paired_ratio_quartiles": paired,
              "extra_ms_per_step": {k: (v["median"] - base) / args.steps * 1e3 for k, v in result.items()}}
    for name, r in result.items():
        q1, q2, q3 = paired[name]
        print(f"{name:28s} median {r['median']:.3f} s (min {r['min']:.3f}, max {r['max']:.3f}) "
              f"x{r['median'] / base:.3f}; paired x{q2:.3f} (quartiles {q1:.3f}-{q3:.3f})")
    print(f"same images in all variants: {same}")
    return report
