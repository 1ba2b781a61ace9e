"""serving/apis/jobs.py: /v1/jobs on a real Service over a stand-in engine whose steps wait for the test
(tests.helpers.StepEngine): 202 at once, the job by id for its owner only, its events in order, DELETE within a
step, 410 once dropped, callback hosts, errors in OpenAI's shape naming the field."""

import base64
import http.server
import json
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sdxl_engine.service.images import png_bytes
from sdxl_engine.service.jobs import JobStore
from sdxl_engine.service.service import Service
from sdxl_engine.serving.apis import jobs
from tests.helpers import StepEngine, wait_until


def owner_of(request) -> str:
    return request.headers.get("x-owner", "me")


def jobs_app(engine, store=None, hosts=()):
    service = Service(engine, slots=1, limit=3, store=store)
    app = FastAPI()
    app.include_router(jobs.router(service, owner_of, hosts))
    return TestClient(app), service


@pytest.fixture
def engine():
    engine = StepEngine()
    yield engine
    engine.go(1000)


def test_a_job_is_accepted_at_once_then_fetched_with_its_images(engine):
    client, _ = jobs_app(engine)
    accepted = client.post("/v1/jobs", json={"prompt": "a red circle", "seed": 12, "num_inference_steps": 2,
                                             "width": 48, "height": 32})
    assert accepted.status_code == 202 and accepted.headers["location"] == f"/v1/jobs/{accepted.json()['id']}"
    job_id = accepted.json()["id"]
    assert accepted.json()["status"] in ("queued", "running") and len(job_id) == 16
    running = client.get(f"/v1/jobs/{job_id}").json()
    assert running["status"] == "running" and running["images"] == [] and running["progress"]["steps"] == 2
    assert running["stage"] == "on device"  # the engine's stage (StepEngine's one); "waiting" while another runs
    engine.go(2)
    wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", "the job never finished")
    done = client.get(f"/v1/jobs/{job_id}").json()
    assert done["seeds"] == [12, 13] and done["error"] is None and done["info"]["width"] == 48
    png = base64.b64decode(done["images"][1])
    assert png.startswith(b"\x89PNG") and b"Seed: 13" in png  # A1111's parameters chunk
    assert done["progress"]["fraction"] == 1.0 and done["stage"] is None
    assert client.get("/v1/jobs").json()["jobs"] == [{"id": job_id, "status": "succeeded", "position": None}]


def test_a_job_is_invisible_to_another_owner(engine):
    client, service = jobs_app(engine)
    job_id = client.post("/v1/jobs", json={"prompt": "x", "num_inference_steps": 2}).json()["id"]
    for method in ("get", "delete"):
        other = getattr(client, method)(f"/v1/jobs/{job_id}", headers={"x-owner": "someone else"})
        assert other.status_code == 404 and other.json()["error"]["message"] == f"no job '{job_id}' of yours here"
    assert client.get(f"/v1/jobs/{job_id}/events", headers={"x-owner": "someone else"}).status_code == 404
    assert client.get("/v1/jobs", headers={"x-owner": "someone else"}).json() == {"jobs": []}
    assert not service.get(job_id, "me").cancelled.is_set()


def test_delete_stops_a_running_job_within_a_step_and_the_next_job_runs(engine):
    client, _ = jobs_app(engine)
    first = client.post("/v1/jobs", json={"prompt": "x", "num_inference_steps": 30}).json()["id"]
    second = client.post("/v1/jobs", json={"prompt": "y", "seed": 40, "num_inference_steps": 2}).json()
    assert second["status"] == "queued" and second["position"] == 0
    engine.go(2)
    wait_until(lambda: client.get(f"/v1/jobs/{first}").json()["progress"]["step"] == 2, "no step ran")
    stopped = client.delete(f"/v1/jobs/{first}")
    assert stopped.status_code == 200 and stopped.json()["status"] == "cancelled"
    assert engine.steps_seen <= 3  # the step that ran when the DELETE came, at most
    engine.go(2)
    wait_until(lambda: client.get(f"/v1/jobs/{second['id']}").json()["status"] == "succeeded", "the next job")
    assert client.get(f"/v1/jobs/{second['id']}").json()["seeds"] == [40, 41]


def test_delete_of_a_queued_job_removes_it_and_it_never_runs(engine):
    client, _ = jobs_app(engine)
    client.post("/v1/jobs", json={"prompt": "x", "seed": 1, "num_inference_steps": 1})
    queued = client.post("/v1/jobs", json={"prompt": "y", "seed": 99, "num_inference_steps": 1}).json()["id"]
    assert client.delete(f"/v1/jobs/{queued}").json()["status"] == "cancelled"
    engine.go(2)
    time.sleep(0.1)
    assert [call.seed for call in engine.calls] == [1]


def test_the_event_stream_tells_the_job_in_order_and_ends_with_it(engine):
    client, _ = jobs_app(engine)
    job_id = client.post("/v1/jobs", json={"prompt": "x", "seed": 5, "num_inference_steps": 3}).json()["id"]
    threading.Timer(0.2, engine.go, (3,)).start()
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        text = "".join(stream.iter_text())
    events = [(block.split("\n")[0][len("event: "):], json.loads(block.split("\n")[1][len("data: "):]))
              for block in text.strip().split("\n\n") if block.startswith("event:")]
    names = [name for name, _ in events]
    assert names[0] in ("queued", "started") and names[-1] == "succeeded"
    assert [data["step"] for name, data in events if name == "step"] == [1, 2, 3]
    assert "preview" in names and all(base64.b64decode(data["image"]).startswith(b"\x89PNG")
                                      for name, data in events if name == "preview")
    assert events[-1][1]["id"] == job_id and events[-1][1]["seeds"] == [5, 6]


def test_an_engine_reporting_steps_in_batches_still_streams_an_event_for_every_step():
    engine = StepEngine(reports=(1, 2, 8))  # as a fast device reports an 8-step job: steps 1, 2, then 3..8 at once
    client, _ = jobs_app(engine)
    job_id = client.post("/v1/jobs", json={"prompt": "x", "seed": 5, "num_inference_steps": 8}).json()["id"]
    threading.Timer(0.2, engine.go, (8,)).start()
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        text = "".join(stream.iter_text())
    events = [(block.split("\n")[0][len("event: "):], json.loads(block.split("\n")[1][len("data: "):]))
              for block in text.strip().split("\n\n") if block.startswith("event:")]
    steps = [(data["step"], data["steps"], data["call"], data["calls"]) for name, data in events if name == "step"]
    assert steps == [(step, 8, 0, 1) for step in range(1, 9)]
    previews = {data["step"] for name, data in events if name == "preview"}
    assert 8 in previews and previews <= {1, 2, 8}  # previews only at the reported steps
    engine.go(1000)


def test_a_dropped_result_is_gone_410(engine):
    client, _ = jobs_app(engine, store=JobStore(keep_s=0.0))
    job_id = client.post("/v1/jobs", json={"prompt": "x", "num_inference_steps": 1}).json()["id"]
    engine.go(1)
    wait_until(lambda: client.get(f"/v1/jobs/{job_id}").status_code == 410, "the result was never dropped")
    gone = client.get(f"/v1/jobs/{job_id}").json()["error"]["message"]
    assert gone.startswith(f"job '{job_id}' finished and its result is no longer kept")
    assert client.get(f"/v1/jobs/{job_id}").json()["error"]["type"] == "invalid_request_error"  # a 4xx: the client's
    assert client.get(f"/v1/jobs/{job_id}", headers={"x-owner": "other"}).status_code == 404


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"prompt": "x", "steps": 3}, 400, "steps", "steps: not a field of this API"),
    ({"prompt": 3}, 400, "prompt", "prompt: expected text, got int"),
    ({"prompt": "x", "seed": "seven"}, 400, "seed", "seed: "),
    ({"prompt": "x", "soft_mask": "yes"}, 400, "soft_mask", "soft_mask: expected true or false"),
    ({"negative_prompt": "x"}, 400, "prompt", "prompt: required"),
    ({"prompt": None, "negative_prompt": "x"}, 400, "prompt", "prompt: required"),
    ({"prompt": "x", "images": 0}, 400, "images", "images: 1 or more (leave it out for one engine call's images)"),
    ({"prompt": "x", "style": "Baroque"}, 400, "style", "style: unknown style 'Baroque'"),
    ({"prompt": "x", "schedule_type": "sideways"}, 400, "schedule_type", "schedule_type: unknown schedule type "
                                                                      "'sideways'; choose one of automatic, uniform"),
    ({"prompt": "x", "width": 56, "height": 32}, 400, "width/height", "width/height: "),
    ({"prompt": "x", "images": 9}, 400, "images", "images: this server makes 1 to 8 images"),
    ({"prompt": "x", "image": "not base64!"}, 400, "image", "image: "),
    ({"prompt": "x", "outpaint": [1, 2, 3, 4]}, 400, "outpaint", "outpaint: applies to image to image only"),
    ({"prompt": "x", "callback_url": "http://127.0.0.1:9/x"}, 400, "callback_url",
     "callback_url: this server calls no callback URLs"),
])
def test_a_bad_body_is_refused_naming_its_field_in_openais_shape(engine, body, status, param, message):
    client, service = jobs_app(engine)
    refused = client.post("/v1/jobs", json=body)
    assert refused.status_code == status
    error = refused.json()["error"]
    assert error["param"] == param and error["message"].startswith(message) and error["type"] == "invalid_request_error"
    assert service.jobs(None) == []


def test_an_image_job_decodes_its_base64_image_for_the_engine(engine):
    client, _ = jobs_app(engine)
    picture = np.zeros((32, 48, 3), np.uint8)
    picture[:, :, 0] = 200
    body = {"prompt": "x", "image": base64.b64encode(png_bytes(picture)).decode(), "strength": 0.5,
            "num_inference_steps": 2, "width": 48, "height": 32}
    assert client.post("/v1/jobs", json=body).status_code == 202
    wait_until(lambda: engine.calls, "the job never ran")
    call = engine.calls[0]
    assert call.strength == 0.5 and call.image.shape[-3:] == (32, 48, 3) and int(call.image[0, 0, 0, 0]) == 200


def test_the_cap_counts_jobs_with_the_clients_other_requests(engine):
    client, service = jobs_app(engine)
    for _ in range(3):
        assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
    over = client.post("/v1/jobs", json={"prompt": "x"})
    assert over.status_code == 429 and over.headers["retry-after"] == "5"
    assert "max_requests_per_client = 3" in over.json()["error"]["message"]
    # OpenAI's own 429, as /v1/images/generations answers it (one shape for every /v1 route)
    assert {k: over.json()["error"][k] for k in ("type", "code")} == {"type": "requests", "code": "rate_limit_exceeded"}


class Receiver(http.server.BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.got.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_finished_job_is_posted_to_its_callback_on_a_listed_host(engine):
    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client, _ = jobs_app(engine, hosts=("127.0.0.1",))
        url = f"http://127.0.0.1:{server.server_port}/done"
        with client:  # the app's event loop runs the callback
            job_id = client.post("/v1/jobs", json={"prompt": "x", "seed": 3, "num_inference_steps": 1,
                                                   "callback_url": url}).json()["id"]
            engine.go(1)
            wait_until(lambda: Receiver.got, "the callback never came")
        assert Receiver.got[0]["id"] == job_id and Receiver.got[0]["status"] == "succeeded"
        assert Receiver.got[0]["seeds"] == [3, 4]
        elsewhere = client.post("/v1/jobs", json={"prompt": "x", "callback_url": "http://example.com/x"})
        assert elsewhere.status_code == 400 and "'example.com' is not a host this server may call" in \
            elsewhere.json()["error"]["message"]
    finally:
        server.shutdown()


def test_control_units_are_objects_of_control_unit_fields_with_a_base64_image():
    picture = np.zeros((16, 24, 3), np.uint8)
    picture[:, :12] = 255
    image = base64.b64encode(png_bytes(picture)).decode()
    asked, _ = jobs.to_job_request({"prompt": "x", "control_units": [
        {"image": image, "model": "cn-a [1a2b3c4d]", "weight": 0.5, "guidance_end": 0.6, "module": "canny",
         "control_mode": 2}]}, "me")
    (unit,) = asked.engine.control_units
    assert (unit.model, unit.weight, unit.guidance_end, unit.module, unit.control_mode) == (
        "cn-a [1a2b3c4d]", 0.5, 0.6, "canny", 2)  # the engine validates and resolves them
    np.testing.assert_array_equal(unit.image, picture)
    for units, param in (({"image": image}, "control_units"), ([{"image": image, "enabled": True}],
                                                               "control_units[0].enabled"),
                         ([{"model": "cn-a"}], "control_units[0].image"),
                         ([{"model": "cn-a", "image": "bm90IGFuIGltYWdl"}], "control_units[0].image")):
        with pytest.raises(jobs.ApiError) as err:
            jobs.to_job_request({"prompt": "x", "control_units": units}, "me")
        assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_a_union_unit_takes_a_list_of_images_with_a_type_each():
    picture = np.zeros((16, 24, 3), np.uint8)
    image = base64.b64encode(png_bytes(picture)).decode()
    asked, _ = jobs.to_job_request({"prompt": "x", "control_units": [
        {"image": [image, image], "model": "union", "control_type": ["depth", "canny"]}]}, "me")
    (unit,) = asked.engine.control_units
    assert len(unit.images) == 2 and unit.control_type == ["depth", "canny"]  # the engine validates them
    with pytest.raises(jobs.ApiError) as err:
        jobs.to_job_request({"prompt": "x", "control_units": [{"image": [image, 3], "model": "union"}]}, "me")
    assert err.value.param == "control_units[0].image"


def test_the_schedule_type_is_taken_by_its_name(engine):
    """Issue #62: the jobs API takes the engine's fields by name, ``schedule_type`` (its names or A1111's labels)
    too: the engine runs the request with it."""
    client, _ = jobs_app(engine)
    assert client.post("/v1/jobs", json={"prompt": "x", "num_inference_steps": 2, "schedule_type": "SGM Uniform"}
                       ).status_code == 202
    wait_until(lambda: engine.calls, "the job never ran")
    assert engine.calls[0].schedule_type == "sgm_uniform"


def test_ip_adapter_units_are_objects_of_ip_adapter_unit_fields_with_base64_images():
    """``ip_adapter_units``: objects of IPAdapterUnit's fields, ``image`` one base64 image or a list of them; a
    refusal names the field."""
    picture = np.zeros((16, 24, 3), np.uint8)
    picture[:, :12] = 255
    image = base64.b64encode(png_bytes(picture)).decode()
    asked, _ = jobs.to_job_request({"prompt": "x", "ip_adapter_units": [
        {"image": image, "model": "ip-adapter_sdxl", "weight": 0.5, "guidance_end": 0.6},
        {"image": [image, image], "model": "ip-adapter-plus_sdxl_vit-h"}]}, "me")
    one, two = asked.engine.ip_adapter_units
    assert (one.model, one.weight, one.guidance_end) == ("ip-adapter_sdxl", 0.5, 0.6)
    np.testing.assert_array_equal(one.image, picture)
    assert len(two.image) == 2 and two.model == "ip-adapter-plus_sdxl_vit-h"
    for units, param in (({"image": image}, "ip_adapter_units"), ([{"image": image, "module": "x"}],
                                                                  "ip_adapter_units[0].module"),
                         ([{"model": "ip"}], "ip_adapter_units[0].image"),
                         ([{"model": "ip", "image": [image, 3]}], "ip_adapter_units[0].image[1]"),
                         ([{"model": "ip", "image": "bm90IGFuIGltYWdl"}], "ip_adapter_units[0].image")):
        with pytest.raises(jobs.ApiError) as err:
            jobs.to_job_request({"prompt": "x", "ip_adapter_units": units}, "me")
        assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_a_faceid_unit_sends_embeds_as_lists_of_floats():
    """An IP-Adapter FaceID unit: ``embeds`` (one face embedding as a list of floats, or a list of them) in place of
    ``image``, passed to the engine as sent (it checks the width and the values, naming the field)."""
    face = [0.5, -0.25, 0.125]
    asked, _ = jobs.to_job_request({"prompt": "x", "ip_adapter_units": [
        {"embeds": face, "model": "ip-adapter-faceid_sdxl", "weight": 0.7},
        {"embeds": [face, face], "model": "ip-adapter-faceid_sdxl"}]}, "me")
    one, two = asked.engine.ip_adapter_units
    assert (one.embeds, one.image, one.model, one.weight) == (face, None, "ip-adapter-faceid_sdxl", 0.7)
    assert two.embeds == [face, face] and two.image is None
