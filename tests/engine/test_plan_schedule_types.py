"""A schedule type on the compiled engine (tiny-shapes, 64 x 64): karras makes other images than automatic with no
new compile; automatic is the request without the field; an unknown name or one DDIM does not take is refused
naming ``schedule_type``; the PNG's infotext says ``Schedule type: Karras`` and reads back."""

import numpy as np
import pytest

from sdxl_engine.engine.validation import GenerateRequest, InvalidRequest
from sdxl_engine.service.delivery import deliver
from sdxl_engine.serving.apis.a1111 import generation_parameters, sampler_of

pytestmark = pytest.mark.engine


def gen(engine, **kw):
    return engine.generate(GenerateRequest("a red circle", **{"seed": 3, "num_inference_steps": 4, "width": 64,
                                                               "height": 64, "sampler": "Euler", **kw}))


def test_karras_differs_from_automatic_and_compiles_nothing(tiny_shapes_engine):
    automatic = gen(tiny_shapes_engine)  # compiles 64 x 64 if no test did yet
    before = tiny_shapes_engine.compile_count
    karras = gen(tiny_shapes_engine, schedule_type="Karras")
    default = gen(tiny_shapes_engine, schedule_type="automatic")
    assert tiny_shapes_engine.compile_count == before
    assert np.abs(karras.images.astype(int) - automatic.images).mean() > 1.0
    assert np.array_equal(default.images, automatic.images)
    assert karras.request.schedule_type == "karras" and automatic.request.schedule_type == "automatic"
    text = deliver(karras, "a red circle", "None").pngs[0]
    fields = generation_parameters(parameters_of(text))
    assert (fields["Sampler"], fields["Schedule type"]) == ("Euler", "Karras")
    assert sampler_of(fields["Sampler"], fields["Schedule type"]) == ("Euler", "karras")
    assert "Schedule type" not in parameters_of(deliver(automatic, "a red circle", "None").pngs[0])


def parameters_of(png: bytes) -> str:
    import io

    from PIL import Image

    return Image.open(io.BytesIO(png)).info["parameters"]


@pytest.mark.parametrize("fields, message", [
    ({"schedule_type": "polyexponential"}, "schedule_type: unknown schedule type 'polyexponential'; choose one of "
                                           "automatic, uniform, karras, exponential, sgm_uniform, simple, beta"),
    ({"schedule_type": 7}, "schedule_type: expected a schedule type's name (text), got int 7"),
    ({"sampler": "DDIM", "schedule_type": "karras"}, "schedule_type: DDIM keeps its own timesteps"),
])
def test_refusals_name_the_field(tiny_shapes_engine, fields, message):
    with pytest.raises(InvalidRequest) as err:
        gen(tiny_shapes_engine, **fields)
    assert err.value.field == "schedule_type" and str(err.value).startswith(message)


def test_dpm_2m_sde_is_reproducible_per_seed_and_compiles_nothing(tiny_shapes_engine):
    """DPM++ 2M SDE draws fresh noise each step (its d coefficient): the same seed makes the same images, another
    seed others, it differs from DPM++ 2M's ODE, and with karras it is A1111's "DPM++ 2M SDE Karras"; all on the
    program every sampler shares."""
    gen(tiny_shapes_engine)
    before = tiny_shapes_engine.compile_count
    sde = gen(tiny_shapes_engine, sampler="DPM++ 2M SDE", num_inference_steps=6)
    again = gen(tiny_shapes_engine, sampler="dpm++ 2m sde", num_inference_steps=6)
    other = gen(tiny_shapes_engine, sampler="DPM++ 2M SDE", num_inference_steps=6, seed=4)
    ode = gen(tiny_shapes_engine, sampler="DPM++ 2M", num_inference_steps=6)
    karras = gen(tiny_shapes_engine, sampler="DPM++ 2M SDE", num_inference_steps=6, schedule_type="karras")
    assert tiny_shapes_engine.compile_count == before
    assert np.array_equal(sde.images, again.images) and sde.request.sampler == "DPM++ 2M SDE"
    for different in (other, ode, karras):
        assert np.abs(different.images.astype(int) - sde.images).mean() > 1.0
    fields = generation_parameters(parameters_of(deliver(karras, "a red circle", "None").pngs[0]))
    assert sampler_of(fields["Sampler"], fields["Schedule type"]) == ("DPM++ 2M SDE", "karras")
    assert sampler_of("DPM++ 2M SDE Karras", None) == ("DPM++ 2M SDE", "karras")  # A1111's older combined name


def test_the_two_call_samplers_share_one_more_program_and_round_trip(tiny_shapes_engine):
    """Heun, DPM2, DPM++ SDE and DPM2 a on the trained tiny-shapes: after the first of them compiles the two-call
    program, the four and their schedule types compile nothing; each makes other images than the others and than
    Euler, the same again for the same seed (DPM++ SDE's and DPM2 a's noise per seed); the infotext's Sampler and
    Schedule type read back as the pair, as do A1111's older combined names ("DPM++ SDE Karras", "DPM2 a Karras")."""
    gen(tiny_shapes_engine, sampler="Heun", num_inference_steps=2)
    before = tiny_shapes_engine.compile_count
    runs = {(s, t): gen(tiny_shapes_engine, sampler=s, num_inference_steps=6, schedule_type=t)
            for s in ("Heun", "DPM2", "DPM++ SDE", "DPM2 a") for t in (None, "karras")}
    again = gen(tiny_shapes_engine, sampler="dpm++ sde", num_inference_steps=6)
    again_a = gen(tiny_shapes_engine, sampler="dpm2 a", num_inference_steps=6)
    euler = gen(tiny_shapes_engine, num_inference_steps=6)
    assert tiny_shapes_engine.compile_count == before
    assert np.array_equal(again.images, runs["DPM++ SDE", None].images)
    assert np.array_equal(again_a.images, runs["DPM2 a", None].images)
    keys = list(runs)
    for i, a in enumerate(keys):
        assert np.abs(euler.images.astype(int) - runs[a].images).mean() > 1.0, a
        for b in keys[i + 1:]:
            assert np.abs(runs[a].images.astype(int) - runs[b].images).mean() > 1.0, (a, b)
    for sampler in ("Heun", "DPM2", "DPM++ SDE", "DPM2 a"):
        fields = generation_parameters(parameters_of(deliver(runs[sampler, "karras"], "a red circle", "None").pngs[0]))
        assert sampler_of(fields["Sampler"], fields["Schedule type"]) == (sampler, "karras")
        assert sampler_of(f"{sampler} Karras", None) == (sampler, "karras")


def test_restart_runs_on_the_two_call_program_reproducibly_and_round_trips(tiny_shapes_engine):
    """Restart (A1111's restart_sampler) on the trained tiny-shapes: Euler -> Restart -> Heun compiles the two-call
    program at most once (none if another test did) and nothing after; at 20 steps (one restart stretch, its jump's
    noise from the seed) the same seed makes the same images, another seed others, and Restart's Automatic is its
    Karras; it differs from Heun with karras (the restart steps) and from Euler; each reported step is one of its 20
    (the progress counts the user's steps); the infotext says "Sampler: Restart" and reads back, as does the older
    combined "Restart Karras"."""
    gen(tiny_shapes_engine)
    before = tiny_shapes_engine.compile_count
    steps = []
    restart = tiny_shapes_engine.generate(
        GenerateRequest("a red circle", seed=3, num_inference_steps=20, width=64, height=64, sampler="Restart"),
        on_step=lambda event: steps.append((event.step, event.steps)))
    assert tiny_shapes_engine.compile_count - before <= 1  # the two-call program, unless a test compiled it
    compiled = tiny_shapes_engine.compile_count
    again = gen(tiny_shapes_engine, sampler="restart", num_inference_steps=20)
    karras = gen(tiny_shapes_engine, sampler="Restart", num_inference_steps=20, schedule_type="karras")
    other = gen(tiny_shapes_engine, sampler="Restart", num_inference_steps=20, seed=4)
    heun = gen(tiny_shapes_engine, sampler="Heun", num_inference_steps=20, schedule_type="karras")
    euler = gen(tiny_shapes_engine, num_inference_steps=20)
    assert tiny_shapes_engine.compile_count == compiled
    assert np.array_equal(restart.images, again.images) and np.array_equal(restart.images, karras.images)
    for different in (other, heun, euler):
        assert np.abs(different.images.astype(int) - restart.images).mean() > 1.0
    assert steps and steps[-1] == (20, 20) and all(total == 20 for _, total in steps)
    text = parameters_of(deliver(restart, "a red circle", "None").pngs[0])
    fields = generation_parameters(text)
    assert fields["Sampler"] == "Restart" and "Schedule type" not in fields
    assert sampler_of(fields["Sampler"], fields.get("Schedule type")) == ("Restart", None)
    assert sampler_of("Restart Karras", None) == ("Restart", "karras")


@pytest.mark.parametrize("sampler, schedule_type, older_name", [
    ("DPM++ 3M SDE", "exponential", "DPM++ 3M SDE Exponential"), ("DPM++ 3M SDE", "karras", "DPM++ 3M SDE Karras"),
    ("UniPC", "karras", "UniPC Karras"), ("LMS", "karras", "LMS Karras")])
def test_the_multistep_samplers_run_on_the_shared_program_and_round_trip(tiny_shapes_engine, sampler, schedule_type,
                                                                         older_name):
    """DPM++ 3M SDE (fresh noise per step, third order), UniPC (predictor-corrector) and LMS (fourth order on the
    derivatives): the same seed makes the same images, another seed and the two-step samplers others, a schedule type
    others again, no compile after Euler's program (LMS's history entries are traced too); the infotext's Sampler and
    Schedule type read back as the pair, as does A1111's older combined name ("LMS Karras": LMS + karras)."""
    gen(tiny_shapes_engine)
    before = tiny_shapes_engine.compile_count
    first = gen(tiny_shapes_engine, sampler=sampler, num_inference_steps=6)
    again = gen(tiny_shapes_engine, sampler=sampler.lower(), num_inference_steps=6)
    typed = gen(tiny_shapes_engine, sampler=sampler, num_inference_steps=6, schedule_type=schedule_type)
    others = [gen(tiny_shapes_engine, sampler=s, num_inference_steps=6) for s in ("DPM++ 2M", "DPM++ 2M SDE")]
    if sampler.endswith("SDE"):
        others.append(gen(tiny_shapes_engine, sampler=sampler, num_inference_steps=6, seed=4))
    assert tiny_shapes_engine.compile_count == before
    assert np.array_equal(first.images, again.images) and first.request.sampler == sampler
    for different in (typed, *others):
        assert np.abs(different.images.astype(int) - first.images).mean() > 1.0
    fields = generation_parameters(parameters_of(deliver(typed, "a red circle", "None").pngs[0]))
    assert sampler_of(fields["Sampler"], fields["Schedule type"]) == (sampler, schedule_type)
    assert sampler_of(older_name, None) == (sampler, schedule_type)
