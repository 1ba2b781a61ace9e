"""tools/shapes.run_steps: the step loop tools/train_lcm.py and tools/train_controlnet.py share."""

import numpy as np

from tools import shapes


def test_the_step_loop_logs_the_mean_loss_calls_back_after_each_step_and_stops_at_the_time_limit():
    """The mean loss of each stretch of ``log_every`` steps (and of the last, shorter one) is logged and kept, the
    state is carried from step to step, ``after`` sees each step with the history so far; a time limit of 0 minutes
    stops after the first step, logged."""
    lines, seen = [], []

    def step(state, i):
        return state + [i], np.float32(i)  # the loss of step i is i

    state, progress = shapes.run_steps(step, [], 5, 2, 60.0, lines.append,
                                       lambda i, state, p: seen.append((i, len(state), list(p.history))))
    assert state == [1, 2, 3, 4, 5] and progress.done == 5 and progress.train_s >= 0
    assert progress.history == [(2, 1.5), (4, 3.5), (5, 5.0)]
    assert [line.split(" (")[0] for line in lines] == ["step 2/5 loss 1.50000", "step 4/5 loss 3.50000",
                                                       "step 5/5 loss 5.00000"]
    assert all(line.endswith(" s/step)") for line in lines)
    assert seen == [(1, 1, []), (2, 2, [(2, 1.5)]), (3, 3, [(2, 1.5)]), (4, 4, [(2, 1.5), (4, 3.5)]),
                    (5, 5, [(2, 1.5), (4, 3.5), (5, 5.0)])]
    lines.clear()
    state, progress = shapes.run_steps(step, [], 5, 2, 0.0, lines.append)
    assert state == [1] and progress.done == 1 and progress.history == []
    assert lines == ["time limit: stopping after 1 steps"]
