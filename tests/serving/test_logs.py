"""serving.logs without an app: the line format, ``--log-level`` (and SDXL_LOG_LEVEL) choosing what is written,
a bad level refused in one line. The app writing its log to a redirected file: tests/serving/test_logs_app.py."""

import io
import logging

import pytest

from sdxl_engine.serving import cli, logs
from tests.helpers import LOG_LINE


@pytest.fixture
def restored_logging():
    """The logging setup as it was before the test (configure changes the root logger and the package's level)."""
    root, package = logging.getLogger(), logging.getLogger(logs.PACKAGE)
    handlers, root_level, package_level = list(root.handlers), root.level, package.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(root_level)
    package.setLevel(package_level)


def emitted(level: str) -> list[str]:
    """The lines written with the log configured at ``level`` (as ``--log-level`` gives it), for one record of each
    level from a runtime module's logger and an INFO and a WARNING from another library's."""
    out = io.StringIO()
    logs.configure(cli.parse_args(["--log-level", level]).log_level, stream=out)
    engine = logging.getLogger("sdxl_engine.engine.local")
    engine.debug("[sdxl_engine] debug line")
    engine.info("[sdxl_engine] info line")
    engine.warning("[sdxl_engine] warning line")
    engine.error("[sdxl_engine] error line")
    logging.getLogger("httpx").info("library info line")
    logging.getLogger("httpx").warning("library warning line")
    return out.getvalue().splitlines()


def test_each_record_is_one_line_with_iso_time_level_logger_and_message(restored_logging):
    lines = emitted("INFO")
    parsed = [LOG_LINE.fullmatch(line) for line in lines]
    assert all(parsed), lines
    assert [(m[2], m[3], m[4]) for m in parsed] == [
        ("INFO", "sdxl_engine.engine.local", "[sdxl_engine] info line"),
        ("WARNING", "sdxl_engine.engine.local", "[sdxl_engine] warning line"),
        ("ERROR", "sdxl_engine.engine.local", "[sdxl_engine] error line"),
        ("WARNING", "httpx", "library warning line")]  # another library's INFO is its own bookkeeping


@pytest.mark.parametrize("level, messages", [
    ("DEBUG", ["debug line", "info line", "warning line", "error line", "library warning line"]),
    ("warning", ["warning line", "error line", "library warning line"]),  # any case
    ("ERROR", ["error line"]),  # the libraries' warnings too are below the level asked for
])
def test_the_log_level_chooses_what_is_written(restored_logging, level, messages):
    assert [LOG_LINE.fullmatch(line)[4].removeprefix("[sdxl_engine] ") for line in emitted(level)] == messages


def test_the_environment_sets_the_default_level_and_the_flag_wins(monkeypatch):
    monkeypatch.delenv(logs.ENV, raising=False)
    assert cli.parse_args([]).log_level == "INFO"
    monkeypatch.setenv(logs.ENV, "debug")
    assert cli.parse_args([]).log_level == "DEBUG"
    assert cli.parse_args(["--log-level", "error"]).log_level == "ERROR"


def test_a_bad_level_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["--log-level", "LOUD"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert done.value.code == 2 and len(errors) == 1, errors
    assert errors[0].endswith("error: argument --log-level: 'LOUD' is not a log level (DEBUG, INFO, WARNING or ERROR)")
    # from the environment: named as the variable, before the flags are parsed (serving.main.prepare: exit 2)
    assert cli.environment_error({logs.ENV: "verbose"}) == (
        "SDXL_LOG_LEVEL: 'verbose' is not a log level (DEBUG, INFO, WARNING or ERROR)")
    assert cli.environment_error({logs.ENV: "Warning"}) is None
    with pytest.raises(ValueError, match="^'' is not a log level"):
        logs.parse_level("")


def test_configuring_again_replaces_the_handler(restored_logging):
    first, second = io.StringIO(), io.StringIO()
    logs.configure("INFO", stream=first)
    logs.configure("INFO", stream=second)  # a Ray replica whose process had the handler already
    logging.getLogger("sdxl_engine.serving.server").info("[app] once")
    assert first.getvalue() == "" and len(second.getvalue().splitlines()) == 1


def test_the_signal_handlers_line_is_formatted_as_the_log():
    """StopSignals writes its last line itself (no logging locks in a signal handler): the same format."""
    match = LOG_LINE.fullmatch(logs.line(logging.WARNING, "sdxl_engine.serving.signals", "[app] SIGTERM a third time"))
    assert match and match.groups()[1:] == ("WARNING", "sdxl_engine.serving.signals", "[app] SIGTERM a third time")
