"""engine/durations: a request's device time estimated from the start-up measurement and XLA's counts of its program,
refused over ``max_run_seconds`` naming the steps that fit; a size that ran is estimated by its own time."""

import dataclasses

import pytest

from sdxl_engine.engine.costs import ProgramCost
from sdxl_engine.engine.durations import RunTimes
from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest

REF = ProgramCost(run_bytes=4e6, flops=1.0e9, accessed=1.0e8)  # the reference program's counts


def times(limit: float = 30.0) -> RunTimes:
    return RunTimes(limit, REF, fixed_s=0.1, step_s=0.02, batch=4)


def test_work_is_the_largest_of_the_flops_the_bytes_accessed_and_the_temporaries_ratio():
    runs = times()
    assert runs.work(ProgramCost(8e6, 4.0e9, 8.0e8)) == 8.0  # memory traffic grows faster than FLOPs: it sets the time
    assert runs.work(ProgramCost(8e6, 6.0e9, 2.0e8)) == 6.0
    assert runs.work(ProgramCost(2.4e9, 1.3e11, 1.8e10)) == 600.0  # 512x512 on a CPU: the temporaries' 584 x
    # 384x256 of work 8: 8 x (0.1 + 20 x 0.02) = 4.0 s
    assert runs.seconds(384, 256, ProgramCost(8e6, 4.0e9, 8.0e8), 20) == pytest.approx(4.0)


def test_a_size_that_ran_is_estimated_by_its_own_step_time():
    runs, cost = times(), ProgramCost(8e6, 4.0e9, 8.0e8)
    runs.observe(384, 256, cost, 10, device_s=0.8 + 10 * 0.5)  # 0.5 s per step measured
    assert runs.measured == {(384, 256, 1): pytest.approx(0.5)}
    assert runs.seconds(384, 256, cost, 20) == pytest.approx(0.8 + 20 * 0.5)
    assert runs.seconds(256, 384, cost, 20) == pytest.approx(4.0)  # another size: still scaled
    runs.observe(384, 256, cost, 10, device_s=0.8 + 10 * 0.3)
    assert runs.measured[(384, 256, 1)] == pytest.approx(0.4)  # the average follows the newer request
    runs.observe(384, 256, None, 10, 99.0)  # no counts, no steps: nothing learnt
    runs.observe(384, 256, cost, 0, 99.0)
    assert runs.measured[(384, 256, 1)] == pytest.approx(0.4)
    # a two-call sampler's program (schedulers.TWO_CALLS) at the size is measured apart: its step is two calls
    assert runs.seconds(384, 256, cost, 20, calls=2) == pytest.approx(4.0)  # scaled by its own XLA counts until run
    runs.observe(384, 256, cost, 10, device_s=0.8 + 10 * 0.9, calls=2)
    assert runs.measured[(384, 256, 2)] == pytest.approx(0.9) and runs.measured[(384, 256, 1)] == pytest.approx(0.4)
    assert runs.refusal([(384, 256, cost, 20, 2)]) is None  # 0.8 + 20 x 0.9 s
    assert "at most 32 steps to run" in runs.refusal([(384, 256, cost, 40, 2)]).message  # (30 - 0.8) / 0.9


def test_a_short_run_that_took_less_than_the_fixed_estimate_still_counts_its_steps():
    """A 1-step run shorter than the fixed part's estimate (which errs long): its step is its share of the run in the
    estimate's split (here 0.16 of 0.96), not 0 s, so the size's 50 steps stay refused (a new user's 30 s limit once
    held the devices 82 s after a 1-step run)."""
    runs, cost = times(limit=3.0), ProgramCost(8e6, 4.0e9, 8.0e8)  # x8: 0.8 s fixed, 0.16 s a step
    runs.observe(384, 256, cost, 1, device_s=0.48)
    assert runs.measured[(384, 256, 1)] == pytest.approx(0.48 * 0.16 / 0.96)
    assert runs.seconds(384, 256, cost, 50) == pytest.approx(0.8 + 50 * 0.08)
    assert "at most 27 steps to run" in runs.refusal([(384, 256, cost, 50, 1)]).message  # (3 - 0.8) / 0.08
    runs.observe(256, 384, cost, 1, device_s=1.2)  # the fixed estimate held: the rest is the step
    assert runs.measured[(256, 384, 1)] == pytest.approx(0.4)


def test_a_refusal_names_the_steps_that_fit_and_they_do_fit():
    runs = times(limit=3.0)
    cost = ProgramCost(2e7, 2.0e9, 5.0e8)  # x5: 0.5 s fixed, 0.1 s per step
    err = runs.refusal([(320, 192, cost, 40, 1)])
    assert isinstance(err, InvalidRequest) and err.field == "num_inference_steps"
    assert err.message == ("320x192 x 4 images, 40 steps to run, would hold this server's devices about 4.5 s, "
                           "over its limit of 3 s (max_run_seconds): at most 25 steps to run at this size, or a "
                           "smaller size")
    assert runs.refusal([(320, 192, cost, 24, 1)]) is None and runs.refusal([(320, 192, cost, 26, 1)]) is not None
    # hires fix: the first pass's time counts against the second's room, and the field is the hires steps
    hires = runs.refusal([(160, 96, cost, 4, 1), (320, 192, cost, 40, 1)], field="hires_steps")
    assert hires.field == "hires_steps" and "at most 16 steps to run" in hires.message
    assert "1 step to run, would" in times(limit=0.65).refusal([(320, 192, cost, 1, 1), (320, 192, cost, 1, 1)]).message
    assert "at most 1 step to run at this size," in times(limit=0.65).refusal([(320, 192, cost, 4, 1)]).message
    assert "no number of steps" in runs.refusal([(640, 384, ProgramCost(1e8, 40.0e9, 1.0e9), 1, 1)]).message
    assert times(limit=0).refusal([(4096, 4096, ProgramCost(1e20, 1e20, 1e20), 50, 1)]) is None  # 0: no limit
    assert runs.refusal([(320, 192, None, 40, 1)]) is None  # a program without counts is not estimated
    # an estimate (a size not compiled yet) is refused only when over by a tenth
    guess = dataclasses.replace(cost, counted=False)
    assert runs.refusal([(320, 192, guess, 27, 1)]) is None and runs.refusal([(320, 192, guess, 29, 1)]) is not None
    # its steps that fit are an estimate's, and said to be (a new user ran them, and the counts refused them)
    assert "at most 25 steps to run at this size by an estimate (this size has not compiled yet), or a smaller " \
        "size" in runs.refusal([(320, 192, guess, 40, 1)]).message


@pytest.mark.engine
def test_the_engine_measures_at_start_and_refuses_a_run_over_the_limit_before_it_runs(engine, monkeypatch):
    """The shared tiny-random engine measured its default program at start; with a limit of that program's 10 steps, a
    20-step request is refused naming at most 10 steps (nothing ran: no step was measured for it), a 6-step one
    runs and its size is measured."""
    measured = engine.run_times
    assert measured is not None and measured.fixed_s > 0 and measured.step_s > 0 and measured.limit_s == 30.0
    width, height = engine.limits.default_size
    cost = engine.programs.costs.estimate(engine.planner.shape(width, height))
    fresh = dataclasses.replace(measured, measured={})  # the start-up figures alone (other tests' requests measured)
    limit = fresh.seconds(width, height, cost, 10) + 1e-9
    monkeypatch.setattr(engine, "run_times", dataclasses.replace(fresh, limit_s=limit))
    with pytest.raises(InvalidRequest) as refused:
        engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=20))
    assert refused.value.field == "num_inference_steps"
    assert "at most 10 steps to run at this size" in refused.value.message
    assert engine.run_times.measured == {}
    served = engine.generate(GenerateRequest("a red circle", seed=1, num_inference_steps=6))
    assert served.images.shape[0] == 4 and (width, height, 1) in engine.run_times.measured
