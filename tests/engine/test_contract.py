"""The engine contract both engines implement, the one request clock, and the one home of Gradio internals."""

import re

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.engine


def test_the_local_engine_implements_the_contract_before_and_after_start(engine):
    from sdxl_engine.engine.contract import EngineContract, ModelDescription
    from sdxl_engine.engine.local import Engine

    unstarted = Engine(engine.config, log=lambda *_: None)
    assert isinstance(unstarted, EngineContract)  # every member exists before start (None until set)
    assert (unstarted.mesh, unstarted.batch, unstarted.limits, unstarted.model) == (None, None, None, None)
    assert unstarted.defaults == unstarted.config and unstarted.scale_out() is None
    assert isinstance(engine, EngineContract) and isinstance(engine.model, ModelDescription)
    assert engine.scale_out() is None
    # The limits' defaults are the engine's resolved defaults.
    assert (engine.limits.default_steps, engine.limits.default_guidance, engine.limits.default_sampler) == (
        engine.defaults.num_inference_steps, engine.defaults.guidance_scale, engine.defaults.sampler)


def test_the_ray_front_implements_the_contract_without_starting_ray():
    pytest.importorskip("ray")
    import ray

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.engine.contract import EngineContract, ScaleOut
    from sdxl_engine.serving.remote import RemoteEngine, ReplicaCounts
    from sdxl_engine.serving.scaleout import Replicas

    front = RemoteEngine(EngineConfig.load({}, environ={}), Replicas(2, 2), log=lambda *_: None)  # not launched
    assert isinstance(front, EngineContract) and not ray.is_initialized()
    assert front.scale_out() == ScaleOut("0 of 2 replicas ready", False)
    front.replicas = ReplicaCounts(ready=2, settled=True)
    assert front.scale_out() == ScaleOut("2 of 2 replicas ready", True)


def test_the_page_never_probes_an_engine():
    text = (ROOT / "app.py").read_text() + (ROOT / "sdxl_engine/serving/handler.py").read_text()
    assert not re.search(r"\b(getattr|hasattr)\(engine\b", text)


def test_queue_seconds_starts_at_the_earlier_of_arrival_and_call():
    from sdxl_engine.engine.contract import queue_seconds

    assert queue_seconds(None, 10.0, 12.5) == 2.5  # arrival unknown: from the call
    assert queue_seconds(7.0, 10.0, 12.5) == 5.5  # waited in Gradio's queue before the call
    assert queue_seconds(11.0, 10.0, 12.5) == 2.5  # an arrival after the call counts from the call
    assert queue_seconds(None, 10.0, 9.0) == 0.0  # never negative



def test_gradio_version_check_is_one_line_and_matches_the_pin():
    from sdxl_engine.serving import gradio_internals

    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines() if "==" in line)
    assert pins["gradio[mcp]"].split()[0] == gradio_internals.GRADIO_VERSION  # the mcp extra: the MCP server
    lines = []
    assert gradio_internals.check_version(lines.append, installed=gradio_internals.GRADIO_VERSION) and lines == []
    assert not gradio_internals.check_version(lines.append, installed="99.0.0")
    assert len(lines) == 1 and lines[0].startswith("[app] warning: Gradio 99.0.0 is installed")


def test_gradio_internals_are_used_in_one_module_only():
    """Gradio's undocumented attributes appear nowhere in serving/ or app.py but gradio_internals.py."""
    internal = re.compile(r"\._queue\b|temp_file_sets|middleware_stack|keep_in_cache|GRADIO_CACHE|event_ids_to_events"
                          r"|pending_messages_per_session|pending_event_ids_session|active_jobs|demo\.fns\b|fn\._id\b")
    files = [ROOT / "app.py", *sorted((ROOT / "sdxl_engine/serving").glob("*.py"))]
    found = {f.name: m.group() for f in files if f.name != "gradio_internals.py"
             for m in [internal.search(re.sub(r'(?s)""".*?"""|#[^\n]*', "", f.read_text()))] if m}
    assert found == {}


@pytest.mark.slow  # a fresh interpreter importing the serving package
def test_the_process_main_imports_no_gradio_before_its_environment_check():
    """app.py runs serving.main.prepare before importing Gradio (which reads GRADIO_TEMP_DIR
    at import): importing the module that holds it must not import Gradio already."""
    import subprocess
    import sys

    code = ("import sys, sdxl_engine.serving.main\n"
            "print(sorted(m for m in sys.modules if m == 'gradio' or m.startswith('gradio.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
