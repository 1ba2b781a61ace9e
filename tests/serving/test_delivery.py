"""What a request hands back (serving/delivery.py): the images saved to outputs_dir are the ones the client receives."""


import gradio as gr
from starlette.requests import Request

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


def test_a_protocol_request_for_fewer_images_tells_the_calls_that_end_it(tmp_path, monkeypatch):
    """apis.core.generate hands ``keep`` to the engine call whose images are cut (n=2: that call keeps 2; n=6 over
    a batch of 4: the first keeps all, the second 2), through the request service to handle_generate; the page's
    event asks the service for one batch (images 0: its client receives the whole batch)."""
    import asyncio
    from types import SimpleNamespace

    from sdxl_engine.serving import handler
    from sdxl_engine.serving.apis import core
    from sdxl_engine.serving.guard import RequestGate
    from sdxl_engine.serving.progress import JOBS
    from sdxl_engine.serving.service import RequestService
    from tests.serving.apis.test_apis import StartedEngine
    from tests.serving.apis.test_core import RouteRequest

    kept = []

    def handle(engine, *values, job, keep=None, slots=None, **kwargs):
        kept.append(keep)
        JOBS.deliver(job, [b"png"] * 4)  # as handler.handle_generate does
        return [(str(tmp_path / f"{i}.png"), "") for i in range(4)], {"seeds": [values[2] + i for i in range(4)]}, {}

    engine = StartedEngine()
    engine.limits = SimpleNamespace(max_seed=2**32 - 1)
    service = RequestService(engine, handle, RequestGate(), slots=1, limit=1)
    monkeypatch.setattr(core, "check", lambda engine, call, client: None)  # the handler builds every call's request
    for n_images, expected in ((2, [2]), (4, [None]), (6, [None, 2])):
        kept.clear()
        call = core.Call("a red circle", seed=1, images=n_images)
        generated = asyncio.run(core.generate(service, RouteRequest(), call, ("openai", "10.0.0.1")))
        assert kept == expected and len(generated.pngs) == n_images

    heard = []

    async def follow(requests, asked, *args, **kwargs):  # what the page's event submits to the service
        heard.append(asked.images)
        yield [], {}

    monkeypatch.setattr(handler, "follow", follow)
    generate = handler.api_function(None, SimpleNamespace(guidance_scale=5.0, num_inference_steps=8, sampler="Euler",
                                                          refiner=""),
                                    SimpleNamespace(put=lambda *a: None))

    async def run():
        return [out async for out in generate("a red circle", progress=lambda *a, **k: None,
                                              request=gr.Request(request=Request({"type": "http", "headers": []})))]

    asyncio.run(run())
    assert heard == [0]  # the engine's batch, every image kept
