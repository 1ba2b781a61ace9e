"""What a request hands back (service/delivery.py): the images saved to outputs_dir are the ones the client receives."""


from sdxl_engine.service import delivery, images
from sdxl_engine.service.delivery import deliver
from tests.helpers import FullDiskFile
from tests.serving.test_cli_settings import fake_result


def test_only_the_images_a_client_receives_are_saved(tmp_path):
    """An OpenAI n=2 or A1111 batch_size=1 request runs the engine's batch of 4; outputs_dir gets its 2 or 1."""
    for keep, seeds in ((2, [7, 8]), (1, [7]), (None, [7, 8, 9, 10])):
        out = tmp_path / f"outputs-{keep}"
        delivered = deliver(fake_result(), "a red circle", "(No style)", tmp_path / "served", str(out), keep=keep)
        names = sorted(p.name for p in out.iterdir())
        assert sorted(int(name.split("-seed")[1].split("-")[0]) for name in names) == seeds
        assert sorted(delivered.info["saved"]) == names and delivered.info["warnings"] == []
        assert len(delivered.paths) == 4  # the served copies: the protocol API picks its images from them


def test_a_full_disk_leaves_no_partial_file_in_the_outputs_folder(tmp_path, monkeypatch):
    """The outputs disk fills while the second image is written: the first is saved, the reply says the rest
    were not, and nothing else is left there (no ``.partial``, no part of a PNG)."""
    import builtins

    out, served, writes = tmp_path / "outputs", tmp_path / "served", []

    def fake_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        if str(path).startswith(str(out)):
            writes.append(path)
            if len(writes) > 1:
                return FullDiskFile(f, room=10)
        return f

    monkeypatch.setattr(images, "open", fake_open, raising=False)
    delivered = delivery.deliver(fake_result(), "a red circle", "(No style)", served, str(out))
    assert [p.name for p in out.iterdir()] == delivered.info["saved"] and len(delivered.info["saved"]) == 1
    assert delivered.info["warnings"] == ["3 of 4 images not saved to the server's outputs folder (OSError: No space "
                                          "left on device); download them instead"]


def test_a_request_for_fewer_images_than_its_calls_make_saves_and_answers_only_those(tmp_path):
    """The service runs whole batches and hands delivery the count the client receives of each call (n=2: the one
    call keeps 2; n=6 over a batch of 4: the first keeps 4, the second 2): outputs_dir gets exactly those."""
    from sdxl_engine.service.request import to_request
    from sdxl_engine.service.service import Service
    from tests.helpers import StepEngine, wait_until

    engine = StepEngine()
    engine.batch = 4  # the engine's usual batch
    for n_images, seeds in ((2, [10, 11]), (4, [10, 11, 12, 13]), (6, [10, 11, 12, 13, 14, 15])):
        out = tmp_path / f"outputs-{n_images}"
        service = Service(engine, slots=1, limit=1, outputs_dir=str(out))
        job = service.submit(to_request(prompt="a red circle", seed=10, num_inference_steps=1, images=n_images),
                             owner="a", front="openai")
        engine.go(2)
        wait_until(lambda job=job: job.done, "the job never finished", 30)
        service.close()
        assert job.result.seeds == seeds and len(job.result.pngs) == n_images
        saved = sorted(int(p.name.split("-seed")[1].split("-")[0]) for p in out.iterdir())
        assert saved == seeds


def test_the_pngs_carry_the_control_infotext_quoted_as_a1111_writes_it(tmp_path):
    """A result's control_infotext entries (engine/control.infotext) go into each PNG's A1111 parameters, each value
    JSON-quoted (it holds commas), as sd-webui-controlnet writes ``ControlNet 0: "Module: ..."``."""
    import io

    from PIL import Image

    def a1111_text(png: bytes) -> str:
        return Image.open(io.BytesIO(png)).info["parameters"]

    result = fake_result(1)
    entry = "Module: canny, Model: cn-a [1a2b3c4d], Weight: 0.8, Guidance End: 0.6"
    result.control_infotext = {"ControlNet 0": entry}
    text = a1111_text(deliver(result, "a red circle", "(No style)", tmp_path / "served").pngs[0])
    assert f'ControlNet 0: "{entry}"' in text.splitlines()[-1]
    assert "ControlNet" not in a1111_text(deliver(fake_result(1), "x", "(No style)", tmp_path / "plain").pngs[0])


def test_eta_is_written_as_a1111_writes_it_where_not_the_samplers_default():
    """A1111's Sampler.initialize: ``Eta DDIM`` (DDIM, default 0) or ``Eta`` (the k-diffusion samplers with an eta,
    default 1; TCD's gamma here, default 0.3) where eta is not the default; nothing for a sampler without an eta or a
    request without one; hires fix's second sampler counts too."""
    from types import SimpleNamespace

    from sdxl_engine.service.delivery import eta_parameters, mode_parameters

    def req(sampler, eta, hires_sampler=None):
        return SimpleNamespace(sampler=sampler, eta=eta, hires_sampler=hires_sampler)

    assert eta_parameters(req("DDIM", 1.0)) == {"Eta DDIM": 1.0} and eta_parameters(req("DDIM", 0.0)) == {}
    assert eta_parameters(req("Euler a", 0.5)) == {"Eta": 0.5} and eta_parameters(req("DPM++ 2M SDE", 1.0)) == {}
    assert eta_parameters(req("TCD", 0.3)) == {} and eta_parameters(req("TCD", 1.0)) == {"Eta": 1.0}
    assert eta_parameters(req("Euler", 0.5)) == {} and eta_parameters(req("DDIM", None)) == {}
    assert eta_parameters(req("Euler", 0.5, "DPM2 a")) == {"Eta": 0.5}
    assert eta_parameters(req("DDIM", 0.5, "Euler a")) == {"Eta DDIM": 0.5, "Eta": 0.5}
    full = SimpleNamespace(sampler="DDIM", eta=0.25, hires_sampler=None, schedule_type=None, image=None,
                           hires_scale=None, refiner_switch_at=None)
    assert mode_parameters(full) == {"Eta DDIM": 0.25}


def test_the_info_record_reports_eta_only_where_a_sampler_that_ran_takes_it(tmp_path):
    """The record (the jobs API's ``info``, and every front's) says ``eta`` as the infotext does: only where a sampler
    that ran takes one (schedulers.ETA_DEFAULTS, either pass of hires fix); Euler or DPM++ 2M ignore it, and a record
    that said ``eta: 0.5`` for them claimed a noise level that never ran."""
    import dataclasses

    def info(sampler, eta, hires_sampler=None):
        result = fake_result(1)
        result.request = dataclasses.replace(result.request, sampler=sampler, eta=eta, hires_sampler=hires_sampler)
        return deliver(result, "a red circle", "(No style)").info

    assert "eta" not in info("Euler", 0.5) and "eta" not in info("DPM++ 2M", 0.5)
    assert info("Euler a", 0.5)["eta"] == 0.5 and info("DDIM", 0.0)["eta"] == 0.0 and info("TCD", 0.3)["eta"] == 0.3
    assert "eta" not in info("Euler a", None)
    assert info("Euler", 0.5, hires_sampler="DPM2 a")["eta"] == 0.5
