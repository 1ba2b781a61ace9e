"""Settings that misled a new user, through a real
``python app.py``: an outputs folder that cannot take the images, or limits below what would run, stop
the start with one line; a real app's start log says what it runs. The checks without an app are
tests/serving/test_cli_settings.py.
"""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, RunningApp, free_port, log_message

pytestmark = pytest.mark.e2e


ENV = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}


def start_errors(*runs: tuple[list[str], dict]) -> list[tuple[int, list[str], str]]:
    """Run ``python app.py`` once per (args, env) at the same time; (exit status, its ``error:``
    lines, all output) of each, in order. A run that still serves after 240 s fails the test."""
    procs = [subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(free_port()), *args], cwd=ROOT,
                              env={**ENV, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, env in runs]
    results, started = [], []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                started.append((out + err)[-3000:])
            results.append((proc.returncode, [line for line in (out + err).splitlines()
                                              if line.startswith("error:")], out + err))
    finally:  # none left serving, whatever happened
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if started:
        pytest.fail("the app started instead of refusing the setting:\n" + "\n---\n".join(started))
    return results


def test_an_unusable_outputs_dir_stops_the_start_with_one_line(tmp_path):
    """Under a regular file (flag and environment variable), or a regular file itself: exit 2, one line."""
    regular = tmp_path / "notes.txt"
    regular.write_text("not a folder")
    runs = [(["--outputs-dir", str(regular / "out")], {}), ([], {"SDXL_OUTPUTS_DIR": str(regular / "out")}),
            (["--outputs-dir", str(regular)], {})]
    for (status, errors, output), (args, env) in zip(start_errors(*runs), runs):
        folder = args[1] if args else env["SDXL_OUTPUTS_DIR"]
        reason = "Not a directory" if folder.endswith("out") else "File exists"
        assert status == 2, output[-3000:]
        assert errors == [f"error: bad setting: outputs_dir {folder!r} cannot hold the saved images ({reason}); "
                          "name a folder this user can write, or leave it empty to save nothing"], output[-3000:]
        assert "Traceback" not in output
    assert regular.read_text() == "not a folder"


def test_start_refuses_limits_below_what_would_run():
    """Exit 2 and one line: a step limit below tiny-shapes' own 8 steps; a seed range below 4 images
    (known only once the engine sees its 4 devices)."""
    (steps, steps_errors, steps_out), (seeds, seeds_errors, seeds_out) = start_errors(
        (["--max-inference-steps", "5"], {}), (["--max-seed", "0"], {}))
    assert steps == 2 and steps_errors == [
        "error: bad setting: num_inference_steps (8, not set, so the default of model 'tiny-shapes', from its "
        "engine_defaults.json) exceeds max_inference_steps (5): set num_inference_steps to 5 or less, or raise "
        "max_inference_steps"], steps_out[-3000:]
    assert seeds == 2 and seeds_errors == [
        "error: bad setting: max_seed (0) leaves 1 distinct seed for the 4 images of a request, so some would be "
        "identical: set max_seed to 3 or more"], seeds_out[-3000:]
    assert "Traceback" not in steps_out + seeds_out


def test_a_real_app_logs_what_it_runs_and_reports_a_broken_outputs_folder(tmp_path):
    out = tmp_path / "outputs"
    app = RunningApp("--outputs-dir", str(out))
    try:
        client = app.client()
        log = "".join(app.log)
        messages = [log_message(line) for line in app.log]
        config_line = next(line for line in messages if line.startswith("[sdxl_engine] config: "))
        assert "'num_inference_steps': 'model default, else 20'" in config_line
        assert "'sampler': \"model default, else 'Euler'\"" in config_line
        assert "[sdxl_engine] the model's defaults (engine_defaults.json): {'sampler': 'Euler', " \
               "'num_inference_steps': 8}" in log
        assert "[sdxl_engine] the engine's defaults, which the model does not choose: {'guidance_scale': 5.0}" in log
        assert "[sdxl_engine] compiling 64x64 x 4 images, unless the executable cache has them ..." in messages
        gallery, info = client.predict(prompt="a red circle dog 👍🏽", seed=5, api_name="/generate")
        assert info["num_inference_steps"] == 8 and info["seeds"] == [5, 6, 7, 8]
        assert info["warnings"] == ["prompt: tiny-shapes was not trained on these words, so they do not steer its "
                                    "images, but they still change them: dog, 👍🏽"]
        assert sorted(info["saved"]) == sorted(p.name for p in out.iterdir()) and str(tmp_path) not in str(info)
        for path in out.iterdir():
            path.unlink()
        out.rmdir()
        out.write_text("")  # the folder is gone, a file in its place
        gallery, info = client.predict(prompt="a red circle", seed=5, api_name="/generate")
        assert len(gallery) == 4 and "saved" not in info
        assert info["warnings"] == ["images not saved to the server's outputs folder (FileExistsError: File exists); "
                                    "download them instead"]
    finally:
        app.stop()
