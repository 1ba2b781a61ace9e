"""Scale-out on Ray Serve end to end: ``python app.py --replicas N`` (docs/scale-out.md).

First the default app never importing Ray. Then one ``--replicas 2`` app with its own private Ray cluster
(the TEST-ONLY fault switch on, for simulated device time; HOME in a temporary folder), shared by
the tests after it: serving in parallel, the page's banner, nothing of Ray exposed, a load with
no call lost, a replica killed under load, SIGTERM (it stops the app and checks that nothing of
Ray is left, so it runs last). Each of them needs only the app, not what an earlier test did.
Every replica gets one CPU (``--replica-resources '{"CPU": 1}'``). Throughput against one
replica is a benchmark's question (tools/loadtest.py, docs/benchmarks.md), not a test's. The checks
without a cluster (flags, resource plans, the front's retry rule) are tests/serving/test_scaleout.py.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from tests.helpers import ROOT, log_message, wait_until
from tools import loadtest

pytestmark = pytest.mark.e2e

REPLICA_ARGS = ["--replica-resources", '{"CPU": 1}']  # every replica: one CPU (and one CPU device)
LOAD_S = 10  # seconds of load
CHROMIUM = Path("/usr/bin/chromium")  # as tests/serving/test_page_browser.py drives it: Debian's Chromium, offline
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CAPTION = re.compile(r"^seed (\d+)(?: · ([^·]+))? · (\d+\.\d\d) s$")
LOST = "the replica running this request stopped"  # as tests/serving/test_scaleout.py


def test_python_app_py_without_the_flag_never_imports_ray(tmp_path):
    """The default start path (flags, config, the local engine started, the service and the page built) loads no
    Ray module."""
    code = ("import sys, app\n"
            "from sdxl_engine.config import EngineConfig\n"
            "from sdxl_engine.service.service import Service\n"
            "from sdxl_engine.serving import cli, main\n"
            "args = cli.parse_args([])\n"
            "engine, concurrency = main.start_engine(EngineConfig.load(cli.engine_overrides(args)), args)\n"
            "app.build_demo(Service(engine, slots=concurrency), engine.config, engine)\n"
            "ray = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "open(sys.argv[1], 'w').write(f'{concurrency} {ray}')\n"
            "import os; os._exit(0)\n")
    # The answer goes to a file: the engine's start-up thread logs to stdout meanwhile, and a print of the answer
    # could land in the middle of one of its lines.
    answer = tmp_path / "answer.txt"
    out = subprocess.run([sys.executable, "-c", code, str(answer)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # one request on the devices, and one more page slot per new size that may compile meanwhile (the default 2)
    assert answer.read_text() == "3 []"


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def app2(home):
    for attempt in range(2):
        app = loadtest.ServedApp(["--replicas", "2", *REPLICA_ARGS],
                                 # a preview every 5 steps: the previews through Ray come whatever this machine's pace
                                 env={"SDXL_FAULT_INJECTION": "1", "HOME": str(home), "SDXL_PREVIEW_EVERY": "5"})
        try:
            # Generous: both replicas may compile at once on a loaded machine (no earlier app warmed the cache).
            app.wait_for("[replicas] 2 of 2 replicas ready", timeout=600)
            break
        except RuntimeError:
            app.stop()
            # The free port the test chose before the start can be taken by one of Ray's own processes (its
            # workers listen on ports of their own) before Gradio binds it: once, start again on another port.
            if attempt or "Cannot find empty port" not in app.log:
                raise
    yield app
    if app.proc.poll() is None:
        app.stop()


def slow_call(client, seconds: float, seed: int = 1):
    return client.submit(api_name="/generate", seed=seed, **loadtest.slow_request(seconds))


def test_two_replicas_serve_two_requests_at_once(app2):
    from gradio_client import Client

    from sdxl_engine.serving import page

    clients = [Client(app2.url, verbose=False) for _ in range(2)]
    jobs = [slow_call(c, 3.0, seed) for seed, c in enumerate(clients, 1)]
    infos = [job.result(timeout=60)[1] for job in jobs]
    # In parallel: two replicas, and neither request waited for the other's 3 s on the device (in
    # Gradio's queue or on the way to a replica). Judged from each request's own timings, not from
    # wall time, which this shared machine's load stretches.
    assert len({info["replica"] for info in infos}) == 2, infos
    for info in infos:
        t = info["timings_s"]
        assert t["device"] >= 3.0 and 0 < t["ray"] < 1.0 and t["queue"] < 2.0, t
        assert t["latency"] == pytest.approx(t["prep"] + t["device"] + t["post"] + t["ray"], abs=0.01)
        assert info["device"] == "1 × cpu" and len(info["seeds"]) == 4
        line = page.status_line(info)
        assert f"(replica `{info['replica']}`)" in line and f"ray {t['ray']:.2f} s" in line


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)")
def test_page_works_and_its_banner_counts_the_ready_replicas(app2):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 1400})
            blocked = []
            context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("http://127.0.0.1:")
                          else (blocked.append(route.request.url), route.abort()))
            page = context.new_page()
            page.goto(app2.url, wait_until="load", timeout=60_000)
            page.wait_for_selector("#engine-status", timeout=30_000)
            page.wait_for_function("document.querySelector('#engine-status')?.innerText.includes('replicas ready')",
                                   timeout=30_000)
            banner = page.inner_text("#engine-status")
            assert "2 of 2 replicas ready on Ray Serve, each on 1 × cpu" in banner, banner
            page.fill("#prompt textarea", "a red circle on a blue background")
            page.click("#generate")
            page.wait_for_function("document.querySelector('#result-status')?.innerText.includes('images on')",
                                   timeout=60_000)
            status = page.inner_text("#result-status")
            assert "4 images on 1 × cpu (replica" in status and " · ray " in status, status
            items = page.locator("#gallery .grid-container .gallery-item")
            assert items.count() == 4 and CAPTION.match(items.nth(0).locator(".caption-label").inner_text().strip())
            assert "2 of 2 replicas ready" in page.inner_text("#engine-status")
            assert blocked == []
        finally:
            browser.close()


def test_the_replicas_steps_and_previews_reach_the_client_and_a_cancel_stops_the_replica(app2):
    """Progress through Ray: job.status() shows the replica's steps in order and job.outputs() its
    previews; a cancel after step 5 of 50 stops the replica's engine after its running step (its log
    line names a step before 50) and the front logs its one line."""
    from gradio_client import Client

    client = Client(app2.url, verbose=False)
    job = client.submit(api_name="/generate", prompt="a red circle", seed=3, num_inference_steps=50)
    seen, deadline = [], time.monotonic() + 120
    while not job.done() and time.monotonic() < deadline and not (seen and seen[-1][0] >= 5):
        for unit in job.status().progress_data or []:
            if unit.unit == "steps" and unit.index is not None and (not seen or seen[-1] != (unit.index, unit.length)):
                seen.append((unit.index, unit.length))
        time.sleep(0.01)
    assert seen and seen[-1][0] >= 5 and all(n == 50 for _, n in seen), seen
    steps = [k for k, _ in seen]
    assert steps == sorted(set(steps)), seen
    job.cancel()
    app2.wait_for("(cancelled); nothing saved", timeout=60)
    app2.wait_for("(its call was cancelled)", timeout=60)
    line = next(x for x in app2.log.splitlines() if "(its call was cancelled)" in x)
    stopped_at = int(re.search(r"request stopped after step (\d+) of 50", line).group(1))
    assert 5 <= stopped_at < 50, line
    previews = client.submit(api_name="/generate", prompt="a red circle", seed=3, num_inference_steps=30)
    gallery, info = previews.result(timeout=120)
    captions = [out[0][0]["caption"] for out in previews.outputs() if isinstance(out, (list, tuple)) and out and out[0]]
    assert any(c.startswith("preview · step ") for c in captions[:-1]) \
        and captions[-1].startswith("seed 3 · "), captions
    assert len(gallery) == 4 and info["num_inference_steps"] == 30


def test_two_clients_run_at_once_and_each_sees_and_stops_only_its_own_request(app2):
    """Two replicas, two clients at once, each request on its own: two A1111 clients (two addresses) each see their
    own request's steps in /progress (50 and 45) while both run, and one's /interrupt stops its own only (the other
    gives its images); then two gradio_client jobs at once each see their own steps, and a cancel of one stops it
    only."""
    import threading

    import httpx
    from gradio_client import Client

    # A1111: two addresses (127.0.0.2 reaches a server on 127.0.0.1)
    me = httpx.Client(base_url=app2.url + "sdapi/v1", timeout=300)
    other = httpx.Client(base_url=app2.url + "sdapi/v1", timeout=300,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    answers = {}

    def txt2img(name, client, steps, seed):
        answers[name] = client.post("/txt2img", json={"prompt": "a red circle", "steps": steps, "seed": seed})

    threads = [threading.Thread(target=txt2img, args=("me", me, 50, 31)),
               threading.Thread(target=txt2img, args=("other", other, 45, 32))]
    for thread in threads:
        thread.start()
    states = {}

    def both_past_step_2():
        states.update(me=me.get("/progress").json()["state"], other=other.get("/progress").json()["state"])
        return all(state["sampling_step"] >= 2 for state in states.values())

    wait_until(both_past_step_2, "both A1111 requests at step 2 at once", 120)
    assert (states["me"]["sampling_steps"], states["other"]["sampling_steps"]) == (50, 45), states
    assert me.post("/interrupt").json() == {"interrupted": True}
    for thread in threads:
        thread.join(300)
    mine, theirs = answers["me"].json(), answers["other"].json()
    assert json.loads(mine["info"])["interrupted"] is True and mine["images"] == []
    info = json.loads(theirs["info"])
    # ran to its end: A1111's default batch_size 1, one image
    assert info.get("interrupted") is not True and len(theirs["images"]) == 1 and info["steps"] == 45, info

    # gradio_client: two jobs at once, one cancelled
    cancelled_before = app2.log.count("(its call was cancelled)")
    jobs = {steps: Client(app2.url, verbose=False).submit(api_name="/generate", prompt="a red circle", seed=steps,
                                                          num_inference_steps=steps) for steps in (50, 45)}
    seen = {steps: [] for steps in jobs}

    def both_jobs_past_step_3():
        for steps, job in jobs.items():
            for unit in job.status().progress_data or []:
                if unit.unit == "steps" and unit.index is not None:
                    seen[steps].append((unit.index, unit.length))
        return all(any(index >= 3 for index, _ in seen[steps]) for steps in jobs)

    wait_until(both_jobs_past_step_3, "both jobs at step 3 at once", 120)
    jobs[50].cancel()
    gallery, info = jobs[45].result(timeout=300)
    assert len(gallery) == 4 and info["num_inference_steps"] == 45  # ran to its end
    assert {length for _, length in seen[50]} == {50} and {length for _, length in seen[45]} == {45}, seen
    wait_until(lambda: app2.log.count("(its call was cancelled)") > cancelled_before, "the cancel's log line", 60)
    time.sleep(1)  # a second cancel line, had the other request been stopped too, would be in by now
    assert app2.log.count("(its call was cancelled)") == cancelled_before + 1

    # the jobs API: two jobs at once, one on each replica; a DELETE stops its own, the other ends with its images
    jobs_api = httpx.Client(base_url=app2.url + "v1/jobs/", timeout=300)
    ids = {steps: httpx.post(app2.url + "v1/jobs", json={"prompt": "a red circle", "seed": steps,
                                                         "num_inference_steps": steps}).json()["id"]
           for steps in (50, 45)}
    wait_until(lambda: all(jobs_api.get(job_id).json()["progress"]["step"] >= 3 for job_id in ids.values()),
               "both jobs at step 3 at once", 120)
    stopped = jobs_api.delete(ids[50]).json()
    assert stopped["status"] == "cancelled" and stopped["images"] == [] and stopped["progress"]["step"] < 50
    wait_until(lambda: jobs_api.get(ids[45]).json()["status"] == "succeeded", "the other job never finished", 300)
    done = jobs_api.get(ids[45]).json()
    assert len(done["images"]) == 4 and done["progress"]["steps"] == 45 and done["info"]["replica"]


def test_only_the_front_is_reachable_and_ray_listens_on_loopback_only(app2):
    """No Serve HTTP proxy, no dashboard UI; every socket the app's processes listen on (the Gradio
    front, and all of the private Ray cluster: GCS, raylet, workers, agents, metrics) is loopback."""
    tree = process_tree(app2.proc.pid)
    commands = [" ".join(p.cmdline()) for p in tree if p.is_running()]
    assert any("ServeReplica" in c for c in commands) and not any("ProxyActor" in c for c in commands), commands
    listening = []
    for proc in tree:
        try:
            listening += [(conn.laddr.ip, conn.laddr.port, " ".join(proc.cmdline())[:60])
                          for conn in proc.net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    assert ("127.0.0.1", app2.port) in [(ip, port) for ip, port, _ in listening]
    exposed = [entry for entry in listening if entry[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert len(listening) > 5 and not {8265, 8000} & {port for _, port, _ in listening}, listening
    # One exception, Serve's own: each replica's inter-deployment gRPC server binds [::] (hard-coded in
    # Serve 2.60). It takes no call without the cluster's token (here: fresh, in the environment only).
    assert len(exposed) <= 2 and all("ServeReplica" in command for _, _, command in exposed), exposed
    for _, port, _ in exposed:
        with grpc.insecure_channel(f"{outside_address()}:{port}") as channel:
            call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest", request_serializer=bytes,
                                       response_deserializer=bytes)
            with pytest.raises(grpc.RpcError) as refused:
                call(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value


def outside_address() -> str:
    """This machine's first non-loopback IPv4 address (127.0.0.1 if it has none)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family.name == "AF_INET" and not address.address.startswith("127."):
                return address.address
    return "127.0.0.1"


def test_two_replicas_serve_a_load_without_losing_a_call(app2):
    """4 clients for LOAD_S seconds, requests of 1.5 s simulated device time: every call gives its 4 images."""
    report = loadtest.run(app2.url, clients=4, seconds=LOAD_S, timeout=60, request=loadtest.slow_request(1.5))
    print("\n2 replicas:", json.dumps(report))
    assert report["calls_ok"] >= 4 and report["calls_failed"] == 0 and report["errors"] == {}, report
    assert report["throughput_images_per_s"] * report["elapsed_s"] == pytest.approx(4 * report["calls_ok"], rel=1e-2)


def test_a_replica_killed_under_load(app2):
    loss = loadtest.replica_loss(app2, clients=4, device_s=2.0)
    print("\nreplica loss:", json.dumps(loss))
    assert loss["in_flight"], loss
    for call in loss["in_flight"]:  # each ends within 60 s: a result or the one clear error
        assert call["ended_after_kill_s"] < 60
        assert call["ok"] or LOST in call["error"], call
    assert loss["errors_after"] == [], loss  # new calls go to the survivor
    assert loss["survivor_ok"] >= 1 and loss["replacement"] and loss["replacement"] not in loss["replicas_before"]
    # Serve replaces the replica: the replacement served (above: within replica_loss's window, 240 s) and the
    # front counts it (below). How fast is the loadtest's figure (docs/benchmarks.md, on a quiet machine: 9.9 s), not a
    # bound here: on a loaded CI machine every stage of it (Serve noticing, a worker process, imports, load,
    # compile) stretches several-fold (one CI run: 72 s, with the replacement's own start-up 27 s against 3 s quiet).
    deadline = time.monotonic() + 60  # the front's count is back to 2 (it logs every change)
    while not last_count(app2).startswith("[replicas] 2 of 2 replicas ready at"):
        assert time.monotonic() < deadline, last_count(app2)
        time.sleep(0.2)
    assert any(log_message(line).startswith("[replicas] 1 of 2 replicas ready") for _, line in app2.lines)


def last_count(app) -> str:
    """The message of the front's last "[replicas] N of M replicas ready" log line."""
    return next((message for _, line in reversed(app.lines) if " replicas ready" in line
                 and (message := log_message(line)).startswith("[replicas] ")), "")


def test_sigterm_drains_then_deletes_the_deployment_and_leaves_nothing(app2, home):
    from gradio_client import Client

    tree = process_tree(app2.proc.pid)
    assert any("ServeReplica" in " ".join(p.cmdline()) for p in tree if p.is_running())
    temp = Path(next(line.split("temp folder ")[1].split(" in ")[0] for _, line in app2.lines if "temp folder" in line))
    assert temp.is_dir() and not temp.is_relative_to(home)
    from gradio_client.utils import Status

    job = slow_call(Client(app2.url, verbose=False), 3.0)
    deadline = time.monotonic() + 30
    while job.status().code not in (Status.PROCESSING, Status.PROGRESS):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    code, took = app2.stop()
    gallery, info = job.result(timeout=30)  # accepted before SIGTERM: served
    assert len(gallery) == 4 and info["replica"]
    assert code == 0 and took < 60, (code, took)
    assert "[replicas] Serve application deleted and Ray stopped" in app2.log
    # A plain log: no colour codes, no WARNING for the token mode the app chose, and no
    # Ray line about the clean stop itself (serve.shutdown() left two "Task ServeController... failed").
    assert "\x1b[" not in app2.log and "Token authentication" not in app2.log
    stop = app2.log.index("[app] stopping")
    assert "(raylet)" not in app2.log[stop:] and "ServeController" not in app2.log[stop:], app2.log[stop:]
    deadline = time.monotonic() + 15
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree):
        assert time.monotonic() < deadline, [" ".join(p.cmdline())[:80] for p in tree if p.is_running()]
        time.sleep(0.2)
    assert not temp.exists()  # Ray's temp folder: under the system temp folder, removed
    assert list(home.iterdir()) == []  # nothing under HOME (no ~/.ray/auth_token: the token lives in the environment)
