"""checkpoint/controlnet.py: ControlNet folders and single files, names, A1111 hashes, sources and refusals."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdxl_engine.checkpoint.controlnet import (
    check_fits,
    controlnet_sources,
    load_controlnet,
    model_hash,
)
from sdxl_engine.checkpoint.weights import ModelLoadError
from tests.helpers import FIXTURES

FOLDER = FIXTURES / "tiny-pt-controlnet"
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def tiny_unet():
    from sdxl_engine.checkpoint.loading import read_model_folder

    return read_model_folder(FIXTURES / "tiny-pt")["unet"]


def quiet(_line):
    pass


def test_a_folder_loads_in_the_requested_dtype_with_its_name_and_hash(tiny_unet):
    net = load_controlnet("cn-a", FOLDER / "cn-a", "bfloat16", log=quiet)
    assert net.name == "cn-a" and net.dtype == "bfloat16"
    assert {str(v.dtype) for v in net.params.values()} == {"bfloat16"}  # the file is float16
    assert net.hash == model_hash(FOLDER / "cn-a" / WEIGHTS) and len(net.hash) == 8
    assert net.title == f"cn-a [{net.hash}]"
    check_fits(net, tiny_unet, 4, 4)
    other = load_controlnet("cn-b", FOLDER / "cn-b", "float32", log=quiet)
    assert other.architecture == net.architecture  # one architecture: one program for both


def test_a1111s_model_hash(tmp_path):
    """sd_models.model_hash: sha256 of the 64 KiB at offset 1 MiB, 8 hex digits (a smaller file: of nothing, as
    A1111's)."""
    import hashlib

    data = bytes(range(256)) * 8192  # 2 MiB
    (tmp_path / "big.safetensors").write_bytes(data)
    assert model_hash(tmp_path / "big.safetensors") == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    (tmp_path / "small.safetensors").write_bytes(b"x" * 100)
    assert model_hash(tmp_path / "small.safetensors") == hashlib.sha256(b"").hexdigest()[:8]


def test_a_single_file_without_a_config_reads_the_models_unet_config(tmp_path, tiny_unet):
    """A diffusers-layout file alone: ControlNetModel.from_unet's config from the model's UNet, the conditioning
    embedding's channels from the file's tensors; the same parameters as the folder."""
    shutil.copy(FOLDER / "cn-a" / WEIGHTS, tmp_path / "edges-xl.safetensors")
    folder = load_controlnet("cn-a", FOLDER / "cn-a", "float32", log=quiet)
    single = load_controlnet("edges-xl", tmp_path / "edges-xl.safetensors", "float32",
                             dataclasses.asdict(tiny_unet.config), log=quiet)
    assert single.name == "edges-xl" and single.architecture == folder.architecture
    assert single.component.config == folder.component.config
    for key, value in folder.params.items():
        assert np.array_equal(np.asarray(single.params[key]), np.asarray(value)), key


def test_a_single_file_with_a_config_beside_it(tmp_path):
    shutil.copy(FOLDER / "cn-a" / WEIGHTS, tmp_path / "edges.safetensors")
    shutil.copy(FOLDER / "cn-a" / "config.json", tmp_path / "edges.json")
    net = load_controlnet("edges", tmp_path / "edges.safetensors", "float32", log=quiet)
    assert net.component.config.residuals == 10


def test_sources_from_the_setting_and_a_folder(tmp_path):
    shutil.copytree(FOLDER / "cn-a", tmp_path / "dir" / "canny-xl")
    shutil.copy(FOLDER / "cn-b" / WEIGHTS, tmp_path / "dir" / "depth-xl.safetensors")
    (tmp_path / "dir" / "notes.txt").write_text("not a model")
    sources = controlnet_sources(str(FOLDER / "cn-a"), str(tmp_path / "dir"), ":")
    assert list(sources) == ["cn-a", "canny-xl", "depth-xl"]
    with pytest.raises(ModelLoadError, match="two ControlNets named 'cn-a'"):
        controlnet_sources(f"{FOLDER / 'cn-a'}:{FOLDER / 'cn-a'}", "", ":")
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        controlnet_sources(str(tmp_path / "missing"), "", ":")
    (tmp_path / "old.pth").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="a pickle"):
        controlnet_sources(str(tmp_path / "old.pth"), "", ":")
    with pytest.raises(ModelLoadError, match="not a folder"):
        controlnet_sources("", str(tmp_path / "missing"), ":")
    assert controlnet_sources("", "", ":") == {}


def test_refusals_name_the_file_and_what_to_do(tmp_path, tiny_unet):
    xs = tmp_path / "xs"
    shutil.copytree(FOLDER / "cn-a", xs)
    config = json.loads((xs / "config.json").read_text())
    (xs / "config.json").write_text(json.dumps({**config, "_class_name": "ControlNetXSAdapter"}))
    with pytest.raises(ModelLoadError, match="ControlNet-XS"):
        load_controlnet("xs", xs, "float32", log=quiet)
    (xs / "config.json").write_text(json.dumps({**config, "_class_name": "ControlNetUnionModel"}))
    with pytest.raises(ModelLoadError, match="num_trans_channel"):  # a union config needs its tokens at 16 wide
        load_controlnet("xs", xs, "float32", log=quiet)
    from safetensors.numpy import save_file

    save_file({"lora_unet_down.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "lora.safetensors"))
    with pytest.raises(ModelLoadError, match="ControlNet-LoRA"):
        load_controlnet("lora", tmp_path / "lora.safetensors", "float32", dataclasses.asdict(tiny_unet.config),
                        log=quiet)


def test_a_controlnet_for_another_unet_does_not_fit():
    from sdxl_engine.checkpoint.loading import swap_source

    net = load_controlnet("cn-a", FOLDER / "cn-a", "float32", log=quiet)
    conv_unet, _ = swap_source("unet", str(FIXTURES / "tiny-pt-conv" / "unet"), None)
    with pytest.raises(ModelLoadError, match="does not fit the model: its block_out_channels"):
        check_fits(net, conv_unet, 2, 4)


def test_controlnets_under_1_mib_share_one_short_hash_and_the_docs_say_so(tmp_path):
    """A1111's short hash reads 64 KiB at 1 MiB: every smaller file hashes no bytes, one hash for all (the fixtures'
    ControlNets among them); where the hash is listed (/controlnet/model_list, docs/protocols.md) the docs say so."""
    from tests.helpers import ROOT

    small = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    small[0].write_bytes(b"a" * 1000)
    small[1].write_bytes(b"b" * (1 << 20))  # 1 MiB exactly: nothing at the offset either
    shared = model_hash(small[0])
    assert shared == model_hash(small[1]) == model_hash(FOLDER / "cn-a" / WEIGHTS) == "e3b0c442"
    listed = next(line for line in (ROOT / "docs" / "protocols.md").read_text().splitlines()
                  if line.startswith("| `GET /controlnet/model_list`"))
    assert f"under 1 MiB shows the same, `[{shared}]`" in listed


def test_a_model_folders_own_controlnets_from_its_controlnets_json(tmp_path):
    """A model folder's controlnets.json names ControlNets shipped in it (a sub-folder or a file of the folder);
    a bad one is refused in one line naming the file; tiny-shapes ships its canny ControlNet, which fits it."""
    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.checkpoint.loading import (
        MODEL_CONTROLNETS_FILE,
        load_model,
        model_controlnets,
        read_model_controlnets,
    )

    folder = tmp_path / "model"
    (folder / "edges").mkdir(parents=True)
    (folder / MODEL_CONTROLNETS_FILE).write_text('{"_note": "shipped", "edges-net": "edges"}')
    assert read_model_controlnets(folder) == {"edges-net": folder / "edges"} == model_controlnets(str(folder))
    assert read_model_controlnets(tmp_path) == {} and model_controlnets("tiny-random") == {}
    for bad in ('{"e": "../edges"}', '{"e": "missing"}', '{"e": 3}'):
        (folder / MODEL_CONTROLNETS_FILE).write_text(bad)
        with pytest.raises(ModelLoadError, match=r"controlnets\.json: ControlNet 'e': .* is not a file of "):
            read_model_controlnets(folder)
    (folder / MODEL_CONTROLNETS_FILE).write_text('["e"]')
    with pytest.raises(ModelLoadError, match=r"controlnets\.json: expected a JSON object"):
        read_model_controlnets(folder)

    shipped = {"edges-net": folder / "edges", "cn-a": folder / "edges"}
    deployment = str(FIXTURES / "tiny-pt-controlnet" / "cn-a")
    assert controlnet_sources(deployment, "", ":", shipped) == {"cn-a": Path(deployment),  # the deployment's wins
                                                                 "edges-net": folder / "edges"}
    (name, path), = model_controlnets("tiny-shapes").items()
    assert (name, path) == ("tiny-shapes-canny", builtin.TINY_SHAPES_DIR / "controlnet-canny")
    model = load_model("tiny-shapes", dtype="float32", platform="cpu", cache_dir="")
    net = load_controlnet(name, path, "float32", None)
    check_fits(net, model.components["unet"], model.vae_scale_factor, model.latent_channels)
    example = json.loads((path / "example.json").read_text())
    assert "left" not in example["prompt"] and example["module"] == "none" and (path / example["image"]).is_file()
