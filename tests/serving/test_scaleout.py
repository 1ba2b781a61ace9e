"""Scale-out on Ray Serve: ``python app.py --replicas N`` (docs/scale-out.md).

The checks without a cluster: flags, resource plans, the front's retry rule with a stand-in
handle, a start failure's line. The app on its own Ray cluster is tests/serving/test_scaleout_ray_app.py.
"""

import pytest

from sdxl_engine.config import EngineConfig
from sdxl_engine.serving import cli
from sdxl_engine.serving.scaleout import Replicas, ScaleOutError, plan_replica

LOST = "the replica running this request stopped"


@pytest.mark.parametrize("text, expected", [("2", (2, 2)), (" 1-4 ", (1, 4)), ("3-3", (3, 3))])
def test_replicas_flag_takes_a_count_or_a_range(text, expected):
    replicas = Replicas.parse(text)
    assert (replicas.min_replicas, replicas.max_replicas) == expected
    assert replicas.slots == expected[1]


@pytest.mark.parametrize("text, message", [("0", "at least 1"), ("two", "a count"), ("4-1", "MIN <= MAX"),
                                           ("1-", "a count"), ("-2", "a count")])
def test_bad_replica_counts_are_refused(text, message):
    with pytest.raises(ScaleOutError, match=message):
        Replicas.parse(text)


def test_serve_options_fixed_or_autoscaling():
    assert Replicas(2, 2).serve_options() == {"num_replicas": 2}
    auto = Replicas(1, 4).serve_options()["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 1.0,
                    "upscale_delay_s": 5.0, "downscale_delay_s": 120.0}


def test_each_replica_owns_its_devices():
    tpu_host = {"CPU": 24.0, "TPU": 4.0, "TPU-v5litepod-4-head": 1.0}
    assert plan_replica([{"CPU": 4.0}, tpu_host, tpu_host], Replicas(2, 2), 4).ray_actor_options() == {
        "num_cpus": 1.0, "resources": {"TPU": 4.0}}
    assert plan_replica([{"CPU": 8.0, "GPU": 2.0}], Replicas(2, 2), 4).ray_actor_options() == {
        "num_cpus": 1.0, "num_gpus": 1.0}
    two_cores = plan_replica([{"CPU": 2.0}], Replicas(2, 2), 4)  # this machine: 1 CPU and 2 CPU devices each
    assert (two_cores.num_cpus, two_cores.cpu_devices) == (1.0, 2)
    assert plan_replica([{"CPU": 2.0}], Replicas(1, 1), 4).cpu_devices == 4
    assert plan_replica([{"CPU": 16.0}], Replicas(3, 3), 4).cpu_devices == 1  # 4 // 3 rounded to a divisor of 4
    assert plan_replica([{"CPU": 2.0}, {"CPU": 2.0}], Replicas(1, 4), 4).num_cpus == 1.0  # 2 per node at most
    override = plan_replica([{"CPU": 2.0}], Replicas(2, 2), 4, {"CPU": 1.0, "TPU": 8.0})
    assert override.ray_actor_options() == {"num_cpus": 1.0, "resources": {"TPU": 8.0}}
    with pytest.raises(ScaleOutError, match="no CPU, GPU or TPU"):
        plan_replica([{"memory": 1e9}], Replicas(1, 1), 4)


def test_scaleout_flags_are_server_flags(capsys):
    args = cli.parse_args(["--replicas", "1-3", "--replica-resources", '{"TPU": 4}', "--ray-address", "auto"])
    assert args.replicas == Replicas(1, 3) and args.replica_resources == {"TPU": 4.0}
    assert cli.engine_overrides(args) == {}  # none of them reaches the engine's config
    for argv, message in ((["--ray-address", "auto"], "need --replicas"), (["--replicas", "0"], "at least 1"),
                          (["--replicas", "2", "--replica-resources", "[4]"], "JSON object")):
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


class FakeStream:
    """A streaming handle call: yields ``events``; an exception instance among them is raised there."""

    def __init__(self, events):
        self.events = events
        self.cancelled = False

    def __iter__(self):
        for event in self.events:
            if isinstance(event, BaseException):
                raise event
            yield event

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """Stands in for the deployment handle: each call takes the next scripted stream."""

    def __init__(self, streams):
        self.streams = list(streams)
        self.calls = 0

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.calls += 1
        self.last = FakeStream(self.streams.pop(0))
        return self.last


def remote_engine(streams):
    """A RemoteEngine that is ready and calls ``FakeHandle(streams)`` instead of a Serve deployment."""
    from sdxl_engine.engine.validation import Limits
    from sdxl_engine.serving.remote import RemoteEngine  # imports Ray: only the tests that need it load it

    engine = RemoteEngine(EngineConfig.load({}), Replicas(2, 2), log=lambda *_: None)
    engine.limits = Limits(max_seed=2**32 - 1, max_steps=50, sizes=((64, 64),), default_size=(64, 64),
                           default_steps=20, default_guidance=5.0, multiple=16)
    engine.ready.set()
    engine._handle = FakeHandle(streams)
    return engine


def fake_result(replica: str):
    import numpy as np

    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.serving.replicas import Outcome, ReplicaResult

    return Outcome(result=ReplicaResult(
        images=np.zeros((4, 64, 64, 3), np.uint8), seeds=[1, 2, 3, 4], request=GenerateRequest("x", seed=1),
        timings={"prep": 0.01, "device": 0.5, "post": 0.01, "latency": 0.52, "queue": 0.0}, warnings=[],
        device_count=2, device_summary="2 × cpu", model="tiny-shapes", replica=replica))


def test_a_replica_lost_before_the_device_is_retried_once_elsewhere():
    from ray.exceptions import ActorDiedError

    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.serving.replicas import Stage

    engine = remote_engine([[Stage("preparing"), ActorDiedError()],
                            [Stage("preparing"), Stage("on device"), Stage("to host"), fake_result("b")]])
    stages = []
    result = engine.generate(GenerateRequest("a red circle", seed=1), progress=stages.append)
    assert engine._handle.calls == 2 and result.replica == "b"
    assert stages == ["preparing", "preparing", "on device", "to host"]
    assert "before this request reached its devices; replica b made it instead" in result.warnings[0]
    assert set(result.timings) == {"prep", "device", "post", "queue", "ray", "latency"}
    assert result.timings["ray"] >= 0 and result.timings["latency"] >= 0  # (the stand-in replica took no time)


def test_a_replica_lost_on_the_device_is_one_clear_error():
    from ray.exceptions import ActorDiedError

    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.serving.replicas import ReplicaLost, Stage

    engine = remote_engine([[Stage("preparing"), Stage("on device"), ActorDiedError()]])
    with pytest.raises(ReplicaLost, match=LOST + r" \(ActorDiedError\); nothing came back. Please retry"):
        engine.generate(GenerateRequest("a red circle", seed=1))
    assert engine._handle.calls == 1  # never sent twice: it may have been the request that broke the replica


def test_the_replicas_steps_reach_the_front_in_order_with_their_previews():
    """the replica streams StepEvents (EngineReplica.generate); the front hands each to on_step."""
    import numpy as np

    from sdxl_engine.engine.steps import StepEvent
    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.serving.replicas import Stage

    preview = np.full((4, 8, 8, 3), 7, np.uint8)
    engine = remote_engine([[Stage("preparing"), Stage("on device"), StepEvent(1, 3, None, 0.1),
                             StepEvent(2, 3, preview, 0.2), StepEvent(3, 3, None, 0.3), Stage("to host"),
                             fake_result("a")]])
    stages, steps = [], []
    result = engine.generate(GenerateRequest("a red circle", seed=1), progress=stages.append, on_step=steps.append)
    assert result.replica == "a" and stages == ["preparing", "on device", "to host"]
    assert [(e.step, e.steps) for e in steps] == [(1, 3), (2, 3), (3, 3)]
    assert steps[1].preview is preview and steps[0].preview is None


def test_a_stop_at_a_step_cancels_the_replicas_call_at_once():
    """should_stop() is asked at each step: Stopped names the step; the call is cancelled (the replica
    stops its engine when Serve closes its stream); later steps and the result are not waited for."""
    from sdxl_engine.engine.steps import StepEvent, Stopped
    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.serving.replicas import Stage

    engine = remote_engine([[Stage("on device"), StepEvent(1, 50), StepEvent(2, 50), StepEvent(3, 50),
                             AssertionError("read past the stop"), fake_result("a")]])
    steps = []
    with pytest.raises(Stopped, match=r"^stopped after step 2 of 50$"):
        engine.generate(GenerateRequest("a red circle", seed=1), on_step=steps.append,
                        should_stop=lambda: len(steps) >= 1)
    assert [e.step for e in steps] == [1] and engine._handle.last.cancelled
    engine = remote_engine([[fake_result("a")]])
    with pytest.raises(Stopped, match="before it started"):
        engine.generate(GenerateRequest("a red circle", seed=1), should_stop=lambda: True)
    assert engine._handle.calls == 0


def test_replica_errors_come_back_as_the_engines_types():
    from sdxl_engine.engine.errors import GenerationError
    from sdxl_engine.engine.faults import InjectedFault
    from sdxl_engine.engine.validation import InvalidRequest
    from sdxl_engine.serving.replicas import Outcome, ReplicaError

    with pytest.raises(InvalidRequest, match="^seed: must be") as err:
        Outcome.failure(InvalidRequest("seed", "must be between -1 and 5")).raise_error()
    assert err.value.field == "seed"
    from sdxl_engine.engine.steps import Stopped

    with pytest.raises(Stopped, match="^stopped after step 3 of 20$"):  # the replica's own stop
        Outcome.failure(Stopped("stopped after step 3 of 20")).raise_error()
    for error, kind in ((GenerationError("non-finite pixels"), GenerationError),
                        (InjectedFault("injected"), InjectedFault), (KeyError("x"), ReplicaError)):
        with pytest.raises(kind):
            Outcome.failure(error).raise_error()


def test_replica_errors_cross_ray_pickled_as_themselves():
    """Ray pickles the Outcome from the replica's process to the front's: each engine error comes back as its
    own type with its fields (never looked up by class name or matched by message text); anything else as a
    ReplicaError naming its type."""
    import pickle

    from sdxl_engine.engine.errors import CompilesBusy, EngineNotReady, GenerationError
    from sdxl_engine.engine.steps import Stopped
    from sdxl_engine.engine.validation import InvalidRequest
    from sdxl_engine.serving.replicas import Outcome, ReplicaError

    for error in (InvalidRequest("width/height", "2048x1024 is 2097152 pixels"), Stopped("stopped after step 3 of 20"),
                  CompilesBusy("width/height: 2 new sizes compile already"), EngineNotReady("the engine failed"),
                  GenerationError("non-finite pixels")):
        crossed = pickle.loads(pickle.dumps(Outcome.failure(error)))
        with pytest.raises(type(error)) as raised:
            crossed.raise_error()
        assert type(raised.value) is type(error) and str(raised.value) == str(error)
    with pytest.raises(InvalidRequest) as raised:
        pickle.loads(pickle.dumps(Outcome.failure(InvalidRequest("seed", "must be between -1 and 5")))).raise_error()
    assert (raised.value.field, raised.value.message) == ("seed", "must be between -1 and 5")
    with pytest.raises(ReplicaError, match=r"^ZeroDivisionError: division by zero$"):
        pickle.loads(pickle.dumps(Outcome.failure(ZeroDivisionError("division by zero")))).raise_error()


def test_replicas_that_cannot_start_give_one_clear_error():
    """Serve's message (its own words, then the replica's traceback) becomes the replica's exception
    line; a setting the replicas' devices cannot honour exits 2 like any bad setting."""
    from sdxl_engine.serving import server
    from sdxl_engine.serving.remote import start_failure
    from sdxl_engine.serving.replicas import ReplicaConfigError, ReplicaStartError

    message = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
               "or initial health check failing. See controller logs for details. Error:\n"
               "ray::ServeReplica:sdxl:SDXLEngine.initialize_and_get_metadata() (pid=3592, ip=127.0.0.1)\n"
               '  File "replica.py", line 1928, in initialize\nRuntimeError: Traceback (most recent call last):\n'
               '  File "loading.py", line 297, in load_model\n    raise ModelLoadError(...)\n'
               "sdxl_engine.checkpoint.weights.ModelLoadError: model './x' is neither a built-in name, an existing "
               "directory nor a hub id.\n")
    err = start_failure(message)
    assert isinstance(err, ReplicaStartError) and server.exit_status(err) == 1
    assert str(err) == ("no engine replica could start: ModelLoadError: model './x' is neither a built-in name, "
                        "an existing directory nor a hub id.")
    bad = start_failure(message.replace("sdxl_engine.checkpoint.weights.ModelLoadError: model './x' is neither a "
                                        "built-in name, an existing directory nor a hub id.",
                                        "sdxl_engine.program.sharding.ShardingError: images_per_request (3) must be a "
                                        "positive multiple of the device count (2)"))
    assert isinstance(bad, ReplicaConfigError) and server.exit_status(bad) == 2
    assert server.start_error_line(bad).startswith("error: bad setting: images_per_request (3)")


