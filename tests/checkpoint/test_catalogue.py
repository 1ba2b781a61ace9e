"""The models a server offers by name (checkpoint/catalogue.py): names, --models-dir, A1111 hashes, titles, rescan."""

import hashlib
import shutil

import pytest

from sdxl_engine.checkpoint import catalogue
from sdxl_engine.checkpoint.catalogue import Catalogue, ModelEntry, entry_name
from sdxl_engine.config import ConfigError, EngineConfig
from tests.helpers import FIXTURES

SINGLE = FIXTURES / "tiny-single" / "tiny-sdxl-sgm.fp16.safetensors"
REFINER_FILE = FIXTURES / "tiny-single-refiner" / "tiny-refiner-sgm.fp16.safetensors"
LORA_FILE = FIXTURES / "tiny-pt-lora" / "kohya.safetensors"


@pytest.fixture
def models_dir(tmp_path):
    """A1111's models/Stable-diffusion: a diffusers folder, an SDXL single file, a refiner file, a LoRA, a note."""
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(FIXTURES / "tiny-pt", root / "folder-model")
    shutil.copy(SINGLE, root / "single.safetensors")
    shutil.copy(REFINER_FILE, root / "refiner.safetensors")
    shutil.copytree(FIXTURES / "tiny-pt-refiner", root / "refiner-folder", ignore=shutil.ignore_patterns("*.npz"))
    shutil.copy(LORA_FILE, root / "a-lora.safetensors")
    (root / "notes.txt").write_text("not a model")
    (root / "empty-folder").mkdir()
    return root


def test_names_are_the_folders_and_files_without_extension(tmp_path):
    assert entry_name("tiny-shapes") == "tiny-shapes"
    assert entry_name("stabilityai/stable-diffusion-xl-base-1.0") == "stabilityai/stable-diffusion-xl-base-1.0"
    assert entry_name("owner/repo/juggernaut.safetensors") == "juggernaut"
    assert entry_name(str(SINGLE)) == "tiny-sdxl-sgm.fp16"
    assert entry_name(str(FIXTURES / "tiny-pt") + "/") == "tiny-pt"


def test_the_first_model_is_the_default_then_the_flags_then_the_folder(models_dir):
    lines = []
    found = Catalogue(["tiny-shapes", "tiny-random"], str(models_dir), log=lines.append)
    assert found.default == "tiny-shapes"
    assert found.names() == ["tiny-shapes", "tiny-random", "folder-model", "single"]
    assert found.model(None).spec == "tiny-shapes"
    assert found.model("single") == ModelEntry("single", str(models_dir / "single.safetensors"), from_dir=True)
    # a LoRA and a refiner file are not models; each skipped with one line naming it
    assert any("a-lora.safetensors" in line for line in lines)
    assert any("refiner.safetensors" in line and "refiner" in line for line in lines)
    with pytest.raises(KeyError):
        found.model("a-lora")


def test_the_refiners_folder_holds_refiners_only(models_dir):
    found = Catalogue(["tiny-shapes"], refiners=[], refiners_dir=str(models_dir), log=lambda _: None)
    assert found.names(refiners=True) == ["refiner-folder", "refiner"]  # in the folder's path order
    assert found.refiner(None).name == "refiner-folder"


def test_two_flags_with_one_name_are_refused_naming_both(tmp_path):
    other = tmp_path / "elsewhere" / "tiny-sdxl-sgm.fp16.safetensors"
    other.parent.mkdir()
    shutil.copy(SINGLE, other)
    with pytest.raises(ConfigError, match="both named 'tiny-sdxl-sgm.fp16'"):
        Catalogue([str(SINGLE), str(other)])
    with pytest.raises(ConfigError, match="not a folder"):
        Catalogue(["tiny-shapes"], str(tmp_path / "missing"))


def test_hashes_are_a1111s_sha256_computed_in_the_background(models_dir):
    found = Catalogue(["tiny-shapes"], str(models_dir), log=lambda _: None)
    found.wait_hashes(60)
    single = found.info("single")
    sha = hashlib.sha256(SINGLE.read_bytes()).hexdigest()
    assert (single.sha256, single.hash, single.title) == (sha, sha[:10], f"single [{sha[:10]}]")
    assert single.filename == str((models_dir / "single.safetensors").resolve())
    folder = found.info("folder-model")  # a folder: its weight files in path order
    files = sorted((models_dir / "folder-model").rglob("*.safetensors"),
                   key=lambda p: p.relative_to(models_dir / "folder-model").as_posix())
    assert folder.sha256 == hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    assert found.info("tiny-shapes").default and not single.default
    # a model made in memory has no file: no hash, its title is its name (A1111's rule)
    memory = Catalogue(["sdxl-base-random"])
    memory.wait_hashes(10)
    assert (memory.info("sdxl-base-random").hash, memory.info("sdxl-base-random").title) == (None, "sdxl-base-random")


def test_a_listing_never_waits_for_a_hash(models_dir, monkeypatch):
    import threading

    release = threading.Event()
    real = catalogue.sha256_of

    def slow(files):
        release.wait(30)
        return real(files)

    monkeypatch.setattr(catalogue, "sha256_of", slow)
    found = Catalogue(["tiny-shapes"], str(models_dir), log=lambda _: None)
    infos = found.infos()  # at once, while the hashing thread waits
    assert [i.hash for i in infos] == [None, None, None] and infos[2].title == "single"
    release.set()
    found.wait_hashes(60)
    assert found.info("single").hash is not None


def test_a_client_may_name_a_model_by_its_a1111_title(models_dir):
    found = Catalogue(["tiny-shapes"], str(models_dir), log=lambda _: None)
    found.wait_hashes(60)
    title = found.info("single").title
    assert found.find("single") == found.find(title) == found.find(f" {title} ") == "single"
    assert found.find("single [0000000000]") is None  # a known hash that differs
    assert found.find("nothing") is None and found.find("nothing [abc]") is None


def test_rescan_sees_models_added_and_removed(models_dir):
    found = Catalogue(["tiny-shapes"], str(models_dir), log=lambda _: None)
    shutil.copy(SINGLE, models_dir / "added.safetensors")
    (models_dir / "single.safetensors").unlink()
    assert found.rescan() == (["added"], ["single"])
    assert found.names() == ["tiny-shapes", "added", "folder-model"]
    assert found.rescan() == ([], [])


def test_settings_and_repeated_flags():
    from sdxl_engine.serving.cli import engine_overrides, parse_args

    args = parse_args(["--model", "a", "--model", "b", "--model", "c", "--models-dir", "dir", "--refiner", "r1",
                       "--refiner", "r2", "--max-resident-models", "2"])
    overrides = engine_overrides(args)
    assert overrides == {"model": "a", "models": "b:c", "models_dir": "dir", "refiner": "r1", "refiners": "r2",
                         "max_resident_models": "2"}
    config = EngineConfig.load(overrides, environ={})
    assert (config.model, catalogue.split_specs(config.models), config.max_resident_models) == ("a", ["b", "c"], 2)
    assert engine_overrides(parse_args(["--model", "only"])) == {"model": "only"}  # one: as before
    with pytest.raises(ConfigError, match="max_resident_models must be 0"):
        EngineConfig.load({"max_resident_models": -1}, environ={})
    with pytest.raises(ConfigError, match="max_host_models must be -1"):
        EngineConfig.load({"max_host_models": -2}, environ={})
