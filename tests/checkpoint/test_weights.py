"""Checkpoint formats and the errors a bad checkpoint gives (sdxl_engine/checkpoint/weights.py, loading.py)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sdxl_engine.checkpoint import weights
from sdxl_engine.checkpoint.loading import ModelLoadError, hub_files, load_folder, load_model
from sdxl_engine.checkpoint.writing import WEIGHT_FILES
from tests.helpers import FIXTURES, ROOT

pytestmark = pytest.mark.engine

UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    """A writable copy of the tiny-pt fixture (a diffusers-format SDXL saved by PyTorch classes)."""
    out = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-pt", out)
    return out


def load(folder, **kw):
    return load_folder(folder, "m", "float32", **kw)


def reference_unet() -> dict:
    return {k: np.asarray(v) for k, v in load(FIXTURES / "tiny-pt").params["unet"].items()}


@pytest.mark.slow  # writes and loads the model three more times (variant, shards)
def test_fp16_variant_and_sharded_index_load_the_same_weights(model_dir):
    tensors = load_file(str(model_dir / UNET_FILE))
    (model_dir / UNET_FILE).unlink()
    keys = sorted(tensors)
    half = len(keys) // 2
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": keys[:half],
              "diffusion_pytorch_model-00002-of-00002.safetensors": keys[half:]}
    for name, names in shards.items():
        save_file({k: tensors[k] for k in names}, str(model_dir / "unet" / name))
    index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
    (model_dir / "unet" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load(model_dir)
    assert weights.find_weight_files(model_dir / "unet") == [model_dir / "unet" / n for n in shards]
    expected = reference_unet()
    assert all(np.array_equal(np.asarray(sharded.params["unet"][k]), expected[k]) for k in expected)

    save_file({k: v.astype(np.float16) for k, v in tensors.items()},
              str(model_dir / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    fp16 = load(model_dir, variant="fp16")
    assert weights.find_weight_files(model_dir / "unet", "fp16")[0].name == "diffusion_pytorch_model.fp16.safetensors"
    for k in expected:
        np.testing.assert_array_equal(np.asarray(fp16.params["unet"][k]),
                                      expected[k].astype(np.float16).astype(np.float32))


def test_plain_weights_are_read_unless_a_variant_is_asked_for(model_dir):
    """A folder with both ``diffusion_pytorch_model.safetensors`` and its ``.fp16`` variant, here with
    other values (the plain ones + 1), so the values read tell which file was read: no variant reads
    the plain file, as diffusers' ``from_pretrained`` does; ``variant="fp16"`` the fp16 one."""
    tensors = load_file(str(model_dir / UNET_FILE))
    save_file({k: (v + 1).astype(np.float16) for k, v in tensors.items()},
              str(model_dir / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    expected = reference_unet()
    plain, fp16 = load(model_dir).params["unet"], load(model_dir, variant="fp16").params["unet"]
    assert plain.keys() == fp16.keys() == expected.keys()
    for k in expected:
        np.testing.assert_array_equal(np.asarray(plain[k]), expected[k], err_msg=k)
        np.testing.assert_array_equal(np.asarray(fp16[k]), (expected[k] + 1).astype(np.float16).astype(np.float32),
                                      err_msg=k)


def test_only_a_variant_present_is_used(model_dir):
    tensors = load_file(str(model_dir / UNET_FILE))
    (model_dir / UNET_FILE).unlink()
    save_file({k: v.astype(np.float16) for k, v in tensors.items()},
              str(model_dir / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    assert load(model_dir).params["unet"]["conv_in.weight"].dtype == np.float32  # cast to the target dtype


def test_bfloat16_target_from_float32_files(model_dir):
    model = load_folder(model_dir, "m", "bfloat16")
    assert {str(v.dtype) for c in model.params.values() for v in c.values()} == {"bfloat16"}


PICKLE_MARKER = "unpickled"


def evil_pickle(path: Path, marker: Path) -> None:
    """A .bin whose unpickling would create ``marker`` (what a malicious checkpoint can do)."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (Path.write_text, (marker, PICKLE_MARKER))

    path.write_bytes(pickle.dumps(Evil()))


def test_pickle_only_folder_is_refused_and_never_opened(model_dir, tmp_path):
    marker = tmp_path / "marker"
    (model_dir / UNET_FILE).unlink()
    evil_pickle(model_dir / "unet" / "diffusion_pytorch_model.bin", marker)
    with pytest.raises(ModelLoadError, match=r"unet: only pickle weights \(diffusion_pytorch_model.bin\).*never "
                                             r"opened.*\*\.safetensors"):
        load(model_dir)
    assert not marker.exists()


@pytest.mark.parametrize("case, message", [
    ("missing component", r"model_index.json has no unet; SDXL text-to-image needs"),
    ("missing component folder", r"unet/config.json is missing"),
    ("SD 1.5 folder", r"holds a StableDiffusionPipeline \(an SD 1.x/2.x folder\); this engine runs SDXL"),
    ("shape mismatch", r"diffusion_pytorch_model.safetensors: conv_in.weight has shape \(16, 4, 3, 3\) in the file, "
                       r"the config expects \(16, 4, 1, 1\)"),
    ("missing and unexpected keys", r"do not fit the unet config: 2 missing \(first: conv_out.bias, conv_out.weight\); "
                                    r"1 unexpected \(first: conv_final.weight\)"),
    ("truncated file", r"diffusion_pytorch_model.safetensors: truncated \(\d+ bytes, the header needs \d+\); "
                       r"download it again"),
    ("truncated in the header", r"diffusion_pytorch_model.safetensors: truncated \(\d+ bytes, the header needs "
                                r"\d+\); download it again"),  # was a JSONDecodeError (QA)
    ("truncated in the length", r"diffusion_pytorch_model.safetensors: truncated \(4 bytes, the header needs 8\); "
                                r"download it again"),  # was "unpack requires a buffer of 8 bytes" (QA)
    ("unsupported dtype", r"conv_in.bias is stored as I8; supported weight dtypes are F32, F16, BF16 and F64"),
    ("no weights", r"unet: no weights found; expected \*\.safetensors"),
    ("unsupported config", r"unet/config.json: unet config time_cond_proj_dim=256 is not supported"),
    ("sizes that do not fit", r"unet cross_attention_dim \(72, 72, 72\) must equal the two text encoders' hidden "
                              r"sizes together \(32 \+ 48\)"),
])
def test_bad_checkpoints_give_one_clear_error(model_dir, case, message):
    break_model(model_dir, case)
    with pytest.raises(ModelLoadError, match=message) as info:
        load(model_dir)
    assert "\n" not in str(info.value) and str(model_dir) in str(info.value)


def break_model(folder: Path, case: str) -> None:
    """Damage a copy of tiny-pt the way ``case`` says."""
    index = json.loads((folder / "model_index.json").read_text())
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    tensors = load_file(str(folder / UNET_FILE))
    if case == "missing component":
        del index["unet"]
    elif case == "missing component folder":
        shutil.rmtree(folder / "unet")
    elif case == "SD 1.5 folder":
        index = {"_class_name": "StableDiffusionPipeline", **{k: v for k, v in index.items()
                                                              if k not in ("_class_name", "text_encoder_2",
                                                                           "tokenizer_2")}}
    elif case == "shape mismatch":
        unet_config["conv_in_kernel"] = 1
    elif case == "missing and unexpected keys":
        tensors["conv_final.weight"] = tensors.pop("conv_out.weight")
        del tensors["conv_out.bias"]
        save_file(tensors, str(folder / UNET_FILE))
    elif case == "truncated file":
        data = (folder / UNET_FILE).read_bytes()
        (folder / UNET_FILE).write_bytes(data[: len(data) // 2])
    elif case == "truncated in the header":
        data = (folder / UNET_FILE).read_bytes()
        (folder / UNET_FILE).write_bytes(data[: 8 + int.from_bytes(data[:8], "little") // 2])
    elif case == "truncated in the length":
        (folder / UNET_FILE).write_bytes((folder / UNET_FILE).read_bytes()[:4])
    elif case == "unsupported dtype":
        tensors["conv_in.bias"] = tensors["conv_in.bias"].astype(np.int8)
        save_file(tensors, str(folder / UNET_FILE))
    elif case == "no weights":
        (folder / UNET_FILE).unlink()
    elif case == "unsupported config":
        unet_config["time_cond_proj_dim"] = 256
    elif case == "sizes that do not fit":
        unet_config["cross_attention_dim"] = 72
    (folder / "model_index.json").write_text(json.dumps(index))
    if (folder / "unet").exists():
        (folder / "unet" / "config.json").write_text(json.dumps(unet_config))


def test_a_local_folder_is_named_by_its_own_name_only(tmp_path):
    """Users see the model's name (page banner, API record, PNG parameters): a public link must not
    show the server's paths (QA: "Model: /tmp/qa/repo/tests/fixtures/tiny-pt")."""
    folder = tmp_path / "deep" / "my-sdxl-finetune"
    shutil.copytree(FIXTURES / "tiny-pt", folder)
    for given in (str(folder), str(folder) + "/"):
        assert load_model(given, dtype="float32", platform="cpu", cache_dir=str(tmp_path)).name == "my-sdxl-finetune"
    assert load_model("tiny-random", dtype="float32", platform="cpu",
                      cache_dir=str(tmp_path / "models")).name == "tiny-random"


def test_single_file_with_a_unet_alone_says_to_pass_it_as_unet(tmp_path):
    """Single files load (tests/checkpoint/test_single_file.py; parity: tests/checkpoint/test_single_file_parity.py);
    one holding only a UNet is named for what it is."""
    path = tmp_path / "sd_xl_base_1.0.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": np.zeros((4, 4), np.float32)}, str(path))
    with pytest.raises(ModelLoadError, match="holds a UNet alone; pass it as --unet PATH, with --model for the other "
                                             "parts"):
        load_model(str(path), dtype="float32", platform="cpu", cache_dir=str(tmp_path))


def test_hub_snapshot_takes_one_weight_set_per_component_and_no_pickles():
    files = ["model_index.json", "scheduler/scheduler_config.json", "tokenizer/vocab.json", "tokenizer/merges.txt",
             "tokenizer_2/vocab.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
             "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_flax_model.msgpack",
             "unet/diffusion_pytorch_model.bin", "vae/config.json", "vae/diffusion_pytorch_model.fp16.safetensors",
             "vae/diffusion_flax_model.msgpack", "text_encoder/config.json", "text_encoder/model.safetensors",
             "text_encoder/flax_model.msgpack", "text_encoder/model.fp16.safetensors", "text_encoder_2/config.json",
             "text_encoder_2/flax_model.msgpack", "text_encoder_2/pytorch_model.bin", "vae_1_0/config.json",
             "sd_xl_base_1.0.safetensors"]
    plain = hub_files(files)
    assert "unet/diffusion_pytorch_model.safetensors" in plain \
        and "unet/diffusion_pytorch_model.fp16.safetensors" not in plain
    assert "vae/diffusion_pytorch_model.fp16.safetensors" in plain  # the only safetensors there
    assert "text_encoder_2/flax_model.msgpack" in plain  # no safetensors: the Flax weights
    assert not any(f.endswith(".bin") for f in plain) and "sd_xl_base_1.0.safetensors" not in plain
    assert "unet/diffusion_flax_model.msgpack" not in plain
    fp16 = hub_files(files, "fp16")
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in fp16 \
        and "unet/diffusion_pytorch_model.safetensors" not in fp16
    assert "text_encoder/model.fp16.safetensors" in fp16


def test_unreachable_hub_gives_clear_error(tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE set (here after huggingface_hub was imported, which reads it only then) the
    engine looks in the local cache alone: the hub is never asked (its client retries for tens of
    seconds where there is no network), and the error says why."""
    from sdxl_engine.checkpoint import loading

    asked = []
    monkeypatch.setattr(loading.HfApi, "list_repo_files", lambda self, *a, **kw: asked.append(a) or [])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match=r"could not load SDXL model 'stabilityai/stable-diffusion-xl-base-1.0' "
                                             r"from the hub \(offline mode: HF_HUB_OFFLINE is set and the local cache "
                                             r"does not have it\)\..*"
                                             r"hf download stabilityai/stable-diffusion-xl-base-1.0"):
        load_model("stabilityai/stable-diffusion-xl-base-1.0", dtype="auto", platform="cpu", cache_dir=str(tmp_path))
    assert asked == []


PEAK_SCRIPT = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from sdxl_engine.checkpoint.loading import read_model_folder
from sdxl_engine.checkpoint import weights

def rss(field):  # kB in /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

folder = Path(sys.argv[1])
unet = read_model_folder(folder)["unet"]
files = weights.find_weight_files(folder / "unet")
jax.device_put(np.zeros(4, np.float32)).block_until_ready()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = rss("VmRSS")
params = weights.load_params(unet, files, jnp.bfloat16, jax.device_put)
jax.block_until_ready(params)
print(json.dumps({"base": base, "peak": rss("VmHWM"), "params_bytes": sum(v.nbytes for v in params.values())}))
"""


@pytest.mark.slow  # a fresh process loads a 369 MB checkpoint it wrote first
def test_loading_peak_memory_stays_near_the_target_size(tmp_path):
    """A 92 M-parameter UNet (SDXL's at 1/5 width) in float32 safetensors (369 MB) loads as bfloat16
    (184 MB) with the process's peak growing by at most 1.3x that: tensors are cast one at a time and
    the file's mapped pages are dropped as it is read."""
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-pt", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in ("text_encoder", "text_encoder_2", "vae"):
        shutil.copy(FIXTURES / "tiny-pt" / name / WEIGHT_FILES[name], folder / name)
    config = json.loads((ROOT / "sdxl_engine/checkpoint/configs/sdxl-base-1.0/unet/config.json").read_text())
    config.update(block_out_channels=[64, 128, 256], attention_head_dim=[1, 2, 4], cross_attention_dim=80,
                  projection_class_embeddings_input_dim=6 * 256 + 48)
    (folder / "unet" / "config.json").write_text(json.dumps(config))
    from sdxl_engine.models import build_component

    unet = build_component("unet", config)
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(weights._stored(s), dtype=np.float32) for k, s in unet.shapes.items()},
              str(folder / UNET_FILE))
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params_bytes"] > 150e6
    assert r["peak"] - r["base"] <= 1.3 * r["params_bytes"], r
