"""The KubeRay RayService manifests (sdxl_engine/serving/deploy/kuberay/): parsed, and the fields
this project relies on checked against the code. Nothing here starts a cluster."""

import re
import shlex

import pytest
import yaml

from sdxl_engine.config import EngineConfig
from sdxl_engine.serving import cli, scaleout
from tests.helpers import ROOT

DEPLOY = ROOT / "sdxl_engine" / "serving" / "deploy" / "kuberay"
MANIFESTS = {"tpu": DEPLOY / "rayservice-tpu-v5e.yaml", "gpu": DEPLOY / "rayservice-gpu.yaml"}
FRONT_PORT = 7860


def load(kind: str) -> dict:
    """{kind of each document: document} of one manifest file."""
    docs = list(yaml.safe_load_all(MANIFESTS[kind].read_text()))
    return {doc["kind"]: doc for doc in docs}


def serve_app(service: dict) -> dict:
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    return config, app


def front_argv(head: dict) -> list[str]:
    """The flags of ``python app.py`` in the head container's command."""
    script = head["args"][0]
    match = re.search(r"exec python app\.py (.*)$", script)
    assert match, script
    return shlex.split(match.group(1))


def ray_pin() -> str:
    text = (ROOT / "requirements.txt").read_text()
    return re.search(r"^ray\[serve\]==(\S+)$", text, re.M).group(1)


@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_rayservice_runs_this_projects_engine_deployment(kind):
    from ray.serve.schema import ServeDeploySchema

    from sdxl_engine.serving import replicas

    service = load(kind)["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    config, app = serve_app(service)
    ServeDeploySchema.parse_obj(config)  # Ray Serve's own schema of a config file
    assert app["name"] == scaleout.APP_NAME
    module, _, name = app["import_path"].partition(":")
    assert module == replicas.__name__ and getattr(replicas, name) is replicas.app_builder
    assert app["route_prefix"] is None  # reached through the deployment handle only
    assert config["http_options"]["host"] == "127.0.0.1"  # Serve's proxy: inside its pod only
    scale, engine, resources = replicas.builder_settings(app["args"])
    assert engine == EngineConfig.load(app["args"]["engine"])  # every engine key is a config field
    expected = {"tpu": {"TPU": 4.0}, "gpu": {"GPU": 1.0}}[kind]
    assert resources == expected
    options = replicas.deployment_options(scale, scaleout.plan_replica([], scale, engine.cpu_devices, resources))
    assert options["max_ongoing_requests"] == 1 and options["name"] == scaleout.DEPLOYMENT_NAME
    assert {k: v for k, v in options["ray_actor_options"].items() if k != "num_cpus"} == (
        {"resources": {"TPU": 4.0}} if kind == "tpu" else {"num_gpus": 1.0})


@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_the_cluster_is_private_and_matches_the_front(kind):
    docs = load(kind)
    service = docs["RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin()
    assert cluster["authOptions"] == {"mode": "token", "secretName": "sdxl-ray-token"}  # a Secret made apart
    assert "Secret" not in docs  # no token in the repository
    assert service["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head_group = cluster["headGroupSpec"]
    assert head_group["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    (head,) = head_group["template"]["spec"]["containers"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in head["args"][0]
    # The front attaches to the RayService's application and offers as many slots as it has replicas.
    args = cli.parse_args(front_argv(head))
    _, app = serve_app(service)
    assert args.ray_address == "auto" and args.ray_app == app["name"]
    assert args.replicas == scaleout.Replicas.parse(app["args"]["replicas"])
    assert (args.host, args.port) == ("0.0.0.0", FRONT_PORT)
    assert FRONT_PORT in [p["containerPort"] for p in head["ports"]]
    front = docs["Service"]
    assert front["spec"]["type"] == "ClusterIP" and front["spec"]["ports"][0]["targetPort"] == FRONT_PORT
    assert front["spec"]["selector"].items() <= head_group["template"]["metadata"]["labels"].items()
    policy = docs["NetworkPolicy"]["spec"]
    open_ports = [rule for rule in policy["ingress"] if "from" not in rule]
    assert open_ports == [{"ports": [{"port": FRONT_PORT}]}]  # only the front is open to all
    for group in [head_group, *cluster["workerGroupSpecs"]]:
        assert policy["podSelector"]["matchLabels"].items() <= group["template"]["metadata"]["labels"].items()


def test_tpu_workers_are_whole_v5e_4_hosts_and_gpu_workers_one_gpu():
    for kind in ("tpu", "gpu"):
        cluster = load(kind)["RayService"]["spec"]["rayClusterConfig"]
        (group,) = cluster["workerGroupSpecs"]
        (worker,) = group["template"]["spec"]["containers"]
        assert worker["args"] == ["ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD"]
        _, app = serve_app(load(kind)["RayService"])
        scale = scaleout.Replicas.parse(app["args"]["replicas"])
        assert group["minReplicas"] >= scale.min_replicas and group["maxReplicas"] >= scale.max_replicas
        limits = worker["resources"]["limits"]
        if kind == "tpu":
            assert group["numOfHosts"] == 1 and cluster["enableInTreeAutoscaling"] is True
            assert group["template"]["spec"]["nodeSelector"] == {
                "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                "cloud.google.com/gke-tpu-topology": "2x2"}
            assert limits["google.com/tpu"] == "4" == str(int(app["args"]["replica_resources"]["TPU"]))
        else:
            assert limits["nvidia.com/gpu"] == "1" == str(app["args"]["replica_resources"]["GPU"])
        assert worker["resources"]["requests"] == limits


def test_both_manifests_use_one_image():
    images = set()
    for kind in ("tpu", "gpu"):
        cluster = load(kind)["RayService"]["spec"]["rayClusterConfig"]
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            images |= {c["image"] for c in group["template"]["spec"]["containers"]}
    assert len(images) == 1, images


def test_manifests_live_inside_the_package():
    assert all(path.is_file() and path.is_relative_to(ROOT / "sdxl_engine") for path in MANIFESTS.values())
    assert not (ROOT / "deploy").exists()
