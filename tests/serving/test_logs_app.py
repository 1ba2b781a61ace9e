"""The log of a real ``python app.py`` redirected to a file, as ``nohup python app.py > app.log 2>&1 &`` (Docker and
systemd the same): its lines reach the file while the app runs, each with its time and level; a bad
``--log-level`` or ``SDXL_LOG_LEVEL`` stops the start with one line. The format and levels without an app:
tests/serving/test_logs.py.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import LOG_LINE, ROOT, free_port, log_message

pytestmark = pytest.mark.e2e

READY = "[sdxl_engine] ready in "


def test_a_log_redirected_to_a_file_fills_while_the_app_runs(tmp_path):
    """Started with stdout and stderr into a file (not the pipe tests.helpers.RunningApp reads, and without
    PYTHONUNBUFFERED, which RunningApp sets and which would hide the fault): the ready line is in the file while
    the app serves, not at its exit, as a log line (ISO time, INFO, the engine's logger); so is the stop."""
    log_file = tmp_path / "app.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open(log_file, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(free_port())], cwd=ROOT,
                                env={**env, "GRADIO_ANALYTICS_ENABLED": "False"}, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while READY not in log_file.read_text():
            assert proc.poll() is None, f"the app exited ({proc.returncode}):\n{log_file.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no ready line in the file in 240 s:\n{log_file.read_text()[-3000:]}"
            time.sleep(0.2)
        assert proc.poll() is None  # still serving: the line came while it runs
        lines = log_file.read_text().splitlines()
        ready = next(LOG_LINE.fullmatch(line) for line in lines if READY in line)
        assert ready and ready[2] == "INFO" and ready[3] == "sdxl_engine.engine.local", lines
        assert ready[4].startswith(READY)
        url = next(LOG_LINE.fullmatch(line) for line in lines if "[app] Running on local URL" in line)
        assert url and url[2] == "INFO", lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = log_file.read_text().splitlines()
    assert log_message(lines[-1]) == "[app] stopped" and LOG_LINE.fullmatch(lines[-1]), lines[-5:]
    assert "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize("args, env, expected", [
    (["--log-level", "LOUD"], {}, "error: argument --log-level: 'LOUD' is not a log level (DEBUG, INFO, WARNING or "
                                  "ERROR)"),
    ([], {"SDXL_LOG_LEVEL": "verbose"}, "error: bad setting: SDXL_LOG_LEVEL: 'verbose' is not a log level (DEBUG, "
                                        "INFO, WARNING or ERROR)"),
])
def test_a_bad_log_level_stops_the_start_with_one_line(args, env, expected):
    result = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", str(free_port()), *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and errors[0].endswith(expected), result.stderr  # argparse's names the program first
