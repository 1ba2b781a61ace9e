"""Progress, previews and Stop as a gradio_client caller sees them: `python app.py` in a subprocess."""

import time

import numpy as np
import pytest
from PIL import Image

from tests.helpers import RunningApp, log_message

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def previews_app(tmp_path_factory):
    """The default app (tiny-shapes) with a preview at every step and an outputs folder."""
    outputs = tmp_path_factory.mktemp("outputs")
    app = RunningApp(env={"SDXL_PREVIEW_EVERY": "1", "SDXL_OUTPUTS_DIR": str(outputs)})
    app.outputs = outputs
    yield app
    app.stop()


@pytest.fixture(scope="module")
def one_device_app(tmp_path_factory):
    """The default app on one CPU device (steps long enough that a cancel lands mid-request on a busy
    machine, where the client's view of the steps lags) with an outputs folder."""
    outputs = tmp_path_factory.mktemp("outputs")
    app = RunningApp(env={"SDXL_CPU_DEVICES": "1", "SDXL_OUTPUTS_DIR": str(outputs)})
    app.outputs = outputs
    yield app
    app.stop()


def watch(job, until=None, timeout=240):
    """The (index, length) steps job.status() showed, in the order seen, polled until the job is done
    (or ``until(steps)`` is true)."""
    seen, deadline = [], time.monotonic() + timeout
    while not job.done() and time.monotonic() < deadline:
        for unit in job.status().progress_data or []:
            if unit.unit == "steps" and unit.index is not None and (not seen or seen[-1] != (unit.index, unit.length)):
                seen.append((unit.index, unit.length))
        if until is not None and until(seen):
            break
        time.sleep(0.01)
    return seen


def images(gallery) -> np.ndarray:
    return np.stack([np.asarray(Image.open(item["image"]).convert("RGB")) for item in gallery])


def test_steps_reach_the_client_in_order(app_server):
    """The default app (previews about twice a second): job.status() shows "k/N steps", k rising. The devices
    report about every 0.1 s of fast steps (engine/steps.py), Gradio sends the latest progress every few ms and a
    yielded preview's status replaces it, so many k are not seen; a few are."""
    job = app_server.client().submit(api_name="/generate", prompt="a red circle", seed=4, num_inference_steps=40)
    seen = watch(job)
    job.result(timeout=60)
    assert seen and all(length == 40 for _, length in seen)
    steps = [index for index, _ in seen]
    assert steps == sorted(set(steps)) and len(steps) >= 3 and steps[-1] <= 40, seen


def test_previews_come_before_the_images_which_are_those_without_previews(previews_app, app_server):
    job = previews_app.client().submit(api_name="/generate", prompt="a red circle", seed=4, num_inference_steps=12)
    gallery, info = job.result(timeout=120)
    outputs = [out for out in job.outputs() if isinstance(out, (list, tuple)) and out and out[0]]
    captions = [[item["caption"] for item in out[0]] for out in outputs]
    previews = [c[0] for c in captions if c[0].startswith("preview · step ")]
    # x0 comes for steps 2..11 (step 1 is asked for by no earlier call, step 12's images follow)
    assert previews and previews == sorted(previews, key=lambda c: int(c.split()[-1].split("/")[0]))
    assert {int(c.split()[-1].split("/")[0]) for c in previews} <= set(range(2, 12))
    assert len(captions[-1]) == 4 and captions[-1][0].startswith("seed 4 · ")
    assert all(len(c) == 1 and c[0].startswith("preview") for c in captions[:-1])  # every preview before the images
    preview = Image.open(outputs[0][0][0]["image"])
    assert preview.size == (32, 32)  # the batch in one 2 x 2 grid at latent resolution: the browser scales it up
    # the final images replace the previews and are those of an app with previews about twice a second
    plain, _ = app_server.client().predict(api_name="/generate", prompt="a red circle", seed=4, num_inference_steps=12)
    assert np.array_equal(images(gallery), images(plain))
    assert info["seeds"] == [4, 5, 6, 7]


def test_cancel_after_step_5_of_50_frees_the_app_and_keeps_nothing(one_device_app):
    client = one_device_app.client()
    saved_before = set(one_device_app.outputs.iterdir())
    log_before = len(one_device_app.log)
    job = client.submit(api_name="/generate", prompt="a blue square", seed=8, num_inference_steps=50)
    seen = watch(job, until=lambda steps: steps and steps[-1][0] >= 5)
    assert seen and seen[-1][0] >= 5
    job.cancel()
    cancelled = time.monotonic()
    _, info = client.predict(api_name="/generate", prompt="a blue square", seed=8, num_inference_steps=4)
    per_step = info["timings_s"]["device"] / 4
    # the steps left never ran: the next request waited for one step at most (and the cancel's round trip)
    assert info["timings_s"]["queue"] < 3 * per_step + 1.0, info["timings_s"]
    assert time.monotonic() - cancelled < 30 * per_step + 10
    time.sleep(0.5)
    lines = [line for line in one_device_app.log[log_before:] if log_message(line).startswith("[app] request stopped")]
    assert len(lines) == 1 and "of 50 (cancelled); nothing saved" in lines[0], lines
    saved = set(one_device_app.outputs.iterdir()) - saved_before
    stamps = {p.name.rsplit("-seed", 1)[0] for p in saved}  # <time>-<request id>: one request's PNGs only
    assert len(saved) == 4 and len(stamps) == 1 and sorted(p.name.rsplit("-seed", 1)[1] for p in saved) == [
        "10-a-blue-square.png", "11-a-blue-square.png", "8-a-blue-square.png", "9-a-blue-square.png"]


def test_a_cancel_during_a_compile_means_the_request_never_runs(one_device_app):
    """The first request at 80x48 compiles inside it; cancelled then (before its generator ever yielded: the
    event awaits its job), it still never runs: Gradio cancels the event's task, which stops its job in
    the service, and the engine asks before it starts (or, if the compile was quick, at the next step). Nothing is
    saved."""
    client = one_device_app.client()
    saved_before = set(one_device_app.outputs.iterdir())
    log_before = len(one_device_app.log)
    job = client.submit(api_name="/generate", prompt="a green triangle", seed=21, num_inference_steps=50,
                        width=80, height=48)
    deadline = time.monotonic() + 120
    while not any((unit.desc or "").startswith("Compiling 80x48 once") for unit in job.status().progress_data or []):
        assert time.monotonic() < deadline and not job.done(), one_device_app.log[log_before:]
        time.sleep(0.02)
    job.cancel()
    deadline = time.monotonic() + 180
    while not (lines := [x for x in one_device_app.log[log_before:]
                         if log_message(x).startswith("[app] request stopped")]):
        assert time.monotonic() < deadline, one_device_app.log[log_before:]
        time.sleep(0.1)
    assert len(lines) == 1 and "(cancelled); nothing saved" in lines[0], lines
    assert "before it started" in lines[0] or " of 50 " in lines[0], lines
    _, info = client.predict(api_name="/generate", prompt="a green triangle", seed=21, num_inference_steps=2,
                             width=80, height=48)  # the app serves on, at the size it compiled
    assert info["width"] == 80 and info["timings_s"]["queue"] < 5.0, info["timings_s"]
    saved = set(one_device_app.outputs.iterdir()) - saved_before
    assert len(saved) == 4 and {p.name.rsplit("-seed", 1)[1] for p in saved} == {
        "21-a-green-triangle.png", "22-a-green-triangle.png", "23-a-green-triangle.png", "24-a-green-triangle.png"}
    assert len({p.name.rsplit("-seed", 1)[0] for p in saved}) == 1  # the second request's only
