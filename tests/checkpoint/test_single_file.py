"""Single files and swapped parts without a compile: every tensor of tiny-pt's sgm single file
lands on tiny-pt's parameter in float16, bfloat16 and float32 files; other architectures are refused by name;
markers, leftovers, missing and truncated files; --unet / --vae in either layout, with or without prefix;
--timestep-spacing; the settings and flags.

The files are made here from ``tests/fixtures/tiny-single`` (``python -m tools.make_fixtures single``, which
proved them in diffusers); the values compared are tiny-pt's own, read by the folder loader.
"""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sdxl_engine.checkpoint import loading, single_file, weights
from sdxl_engine.checkpoint.loading import ModelLoadError, load_model, read_model_folder
from sdxl_engine.config import ConfigError, EngineConfig
from sdxl_engine.serving.cli import engine_overrides, parse_args
from tests.helpers import FIXTURES, ROOT

SINGLE = FIXTURES / "tiny-single"
SGM = SINGLE / "tiny-sdxl-sgm.fp16.safetensors"
TINY_PT = FIXTURES / "tiny-pt"
LOAD = dict(dtype="float32", platform="cpu", cache_dir="unused")


@pytest.fixture(scope="module")
def components():
    return read_model_folder(TINY_PT)


@pytest.fixture(scope="module")
def tiny_params(components):
    """tiny-pt's parameters as the folder loader reads them (float32, the modules' layout)."""
    return {name: weights.load_params(c, weights.find_weight_files(TINY_PT / name), np.float32)
            for name, c in components.items()}


@pytest.fixture(scope="module")
def sgm():
    return load_file(str(SGM))


def write(path, tensors):
    save_file(tensors, str(path))
    return path


def assert_params(loaded, expected, cast):
    for name in expected:
        assert loaded[name].keys() == expected[name].keys(), name
        for key, value in expected[name].items():
            np.testing.assert_array_equal(np.asarray(loaded[name][key], np.float32),
                                          cast(value).astype(np.float32), err_msg=f"{name} {key}")


def test_every_sgm_tensor_lands_on_tiny_pts_parameter(tiny_params, sgm):
    """The fixture (float16) holds tiny-pt's weights; 718 + 152 + 36 + 53 parameters from 948 tensors: OpenCLIP's
    fused in_proj (3 layers, weight and bias) makes 3 each, logit_scale is no weight."""
    assert len(sgm) == 948 and "conditioner.embedders.1.model.logit_scale" in sgm
    model = load_model(str(SGM), model_config=str(TINY_PT), **LOAD)
    assert model.name == "tiny-sdxl-sgm.fp16.safetensors" and model.dtype == "float32"
    assert model.scheduler_config == json.loads((TINY_PT / "scheduler" / "scheduler_config.json").read_text())
    assert_params(model.params, tiny_params, lambda v: v.astype(np.float16))


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_float32_and_bfloat16_files(tmp_path, tiny_params, sgm, stored):
    """The same file stored in float32 and bfloat16 reads the same values (bfloat16: float16's rounded again),
    and a bfloat16 target holds them in bfloat16."""
    dtype = np.float32 if stored == "float32" else jnp.bfloat16
    path = write(tmp_path / f"tiny-{stored}.safetensors", {k: v.astype(dtype) for k, v in sgm.items()})
    model = load_model(str(path), model_config=str(TINY_PT), **LOAD)
    assert_params(model.params, tiny_params, lambda v: v.astype(np.float16).astype(dtype))
    if stored == "bfloat16":
        model = load_model(str(path), model_config=str(TINY_PT), dtype="bfloat16", platform="cpu", cache_dir="x")
        assert {p.dtype for c in model.params.values() for p in c.values()} == {jnp.dtype(jnp.bfloat16)}


def test_unused_tensors_are_named_in_one_line(tmp_path, sgm):
    tensors = {**sgm, "model_ema.decay": np.ones((), np.float32), "model_ema.num_updates": np.ones((), np.float32),
               "cond_stage_model.transformer.text_model.final_layer_norm.weight": np.ones(4, np.float16)}
    lines = []
    load_model(str(write(tmp_path / "with-ema.safetensors", tensors)), model_config=str(TINY_PT), log=lines.append,
               **LOAD)
    assert [line for line in lines if "not used" in line] == [
        "[sdxl_engine] with-ema.safetensors: not used, 3 tensors: model_ema.* (2), cond_stage_model.* (1)"]


def test_v_prediction_and_zero_terminal_snr_markers(tmp_path, sgm):
    """``v_pred``: prediction_type v_prediction, as ComfyUI and A1111 read the marker; the scheduler config's
    other fields stay. ``ztsnr`` sets rescale_betas_zero_snr, honoured as diffusers does: the model loads with
    it, and only DDIM (which cannot step from the infinite terminal sigma) is refused, per request."""
    lines = []
    path = write(tmp_path / "vpred.safetensors", {**sgm, "v_pred": np.zeros(0, np.float32)})
    config = load_model(str(path), model_config=str(TINY_PT), log=lines.append, **LOAD).scheduler_config
    assert config["prediction_type"] == "v_prediction" and config["rescale_betas_zero_snr"] is False
    assert config["timestep_spacing"] == "leading"
    assert ("[sdxl_engine] vpred.safetensors: scheduler {'prediction_type': 'v_prediction'} (the file's markers)"
            in lines)
    path = write(tmp_path / "ztsnr.safetensors", {**sgm, "v_pred": np.zeros(0, np.float32),
                                                  "ztsnr": np.zeros(0, np.float32)})
    checkpoint = single_file.inspect_checkpoint(path)
    assert checkpoint.scheduler_changes() == {"prediction_type": "v_prediction", "rescale_betas_zero_snr": True}
    config = load_model(str(path), model_config=str(TINY_PT), **LOAD).scheduler_config
    assert config["prediction_type"] == "v_prediction" and config["rescale_betas_zero_snr"] is True


def zeros(*keys):
    return {k: np.zeros(1, np.float16) for k in keys}


@pytest.mark.parametrize("keys, message", [
    (["conditioner.embedders.0.model.transformer.resblocks.9.mlp.c_proj.bias", "model.diffusion_model.out.2.bias"],
     "is an SDXL refiner single file (model.diffusion_model.*, first_stage_model.*, conditioner.embedders.0.model.*), "
     "but the configs of tiny-pt are a base model's; pass --model-config DIR with a refiner's configs"),
    (["cond_stage_model.transformer.text_model.final_layer_norm.bias", "model.diffusion_model.out.2.bias"],
     "is a Stable Diffusion 1.x checkpoint (cond_stage_model.transformer.*, one CLIP text encoder); this engine "
     "runs SDXL"),
    (["cond_stage_model.model.token_embedding.weight", "model.diffusion_model.out.2.bias"],
     "is a Stable Diffusion 2.x checkpoint (cond_stage_model.model.*, OpenCLIP-H); this engine runs SDXL"),
    (["model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"],
     "is a Stable Diffusion 3 checkpoint (joint_blocks.*); this engine runs SDXL"),
    (["double_blocks.0.img_attn.norm.key_norm.scale"], "is a Flux checkpoint (double_blocks.*); this engine runs SDXL"),
    (["edm_mean", "conditioner.embedders.1.model.ln_final.bias", "model.diffusion_model.out.2.bias"],
     "is a Playground v2.5 checkpoint (edm_mean): SDXL's architecture with an EDM scheduler and latent statistics "
     "this engine does not implement"),
    (["model.diffusion_model.input_blocks.0.0.weight"],
     "holds a UNet alone; pass it as --unet PATH, with --model for the other parts"),
    (["encoder.down.0.block.0.conv1.weight"], "holds a VAE alone; pass it as --vae PATH, with --model for the other "
                                             "parts"),
    (["lora_unet_down_blocks_0.alpha"], "is not an SDXL single-file checkpoint: none of its keys are SDXL's "
                                        "(model.diffusion_model.*, conditioner.embedders.1.model.*); first keys: "
                                        "lora_unet_down_blocks_0.alpha"),
])
def test_other_architectures_are_refused_by_name(tmp_path, keys, message):
    path = write(tmp_path / "other.safetensors", zeros(*keys))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), model_config=str(TINY_PT), **LOAD)
    assert str(err.value) == f"{path} {message}"


def test_missing_tensors_are_named(tmp_path, sgm):
    gone = ["model.diffusion_model.out.2.bias", "model.diffusion_model.middle_block.1.proj_in.weight"]
    path = write(tmp_path / "cut.safetensors", {k: v for k, v in sgm.items() if k not in gone})
    with pytest.raises(ModelLoadError, match=r"cut.safetensors \(unet, model.diffusion_model.\*\): the weights do not "
                                             r"fit the unet config: 2 missing \(first: conv_out.bias, "
                                             r"mid_block.attentions.0.proj_in.weight\)"):
        load_model(str(path), model_config=str(TINY_PT), **LOAD)


def test_a_file_without_its_vae_needs_vae(tmp_path, sgm, tiny_params):
    """Fine-tunes shipped without a VAE: one line saying so; with --vae they load."""
    path = write(tmp_path / "no-vae.safetensors", {k: v for k, v in sgm.items() if not k.startswith("first_stage")})
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), model_config=str(TINY_PT), **LOAD)
    assert str(err.value) == f"{path} has no vae (no first_stage_model.* tensors); pass --vae PATH"
    params = load_model(str(path), model_config=str(TINY_PT), vae=str(TINY_PT / "vae"), **LOAD).params
    assert_params({"vae": params["vae"]}, {"vae": tiny_params["vae"]}, lambda v: v)


def test_a_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "partial.safetensors"
    path.write_bytes(SGM.read_bytes()[:1_000_000])
    with pytest.raises(ModelLoadError, match=r"partial.safetensors: truncated \(1000000 bytes, the header needs "
                                             r"\d+\); download it again"):
        load_model(str(path), model_config=str(TINY_PT), **LOAD)


def test_pickles_and_other_files_are_refused_unopened(tmp_path):
    for name, message in (("model.ckpt", "is a pickle checkpoint (.ckpt); it is never opened"),
                          ("notes.txt", "is a file but not .safetensors")):
        path = tmp_path / name
        path.write_bytes(b"\x80\x04 not to be opened")
        with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_model(str(path), **LOAD)


def test_model_config_must_be_a_folder_and_only_for_single_files(tmp_path):
    with pytest.raises(ModelLoadError, match="--model-config '/nonexistent': no such folder"):
        load_model(str(SGM), model_config="/nonexistent", **LOAD)
    with pytest.raises(ModelLoadError, match="is for single-file models"):
        load_model(str(TINY_PT), model_config=str(TINY_PT), **LOAD)


def test_hub_files_offline_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match=r"could not get the --model single file "
                                             r"'someone/sdxl-finetune/model.safetensors' from the hub .*"
                                             r"\(offline mode: HF_HUB_OFFLINE is set\)"):
        load_model("someone/sdxl-finetune/model.safetensors", **LOAD)
    # The shipped configs have no CLIP vocabulary: it comes from SDXL base's repository (here one not cached).
    monkeypatch.setattr(loading, "SDXL_BASE_REPO", "nobody/not-cached")
    with pytest.raises(ModelLoadError, match=r"sdxl-base-1.0/tokenizer has no vocabulary \(vocab.json \+ merges.txt\) "
                                             r"and CLIP's could not be read from nobody/not-cached \(\w+, offline "
                                             r"mode\): pass --model-config DIR, a diffusers SDXL folder with "
                                             r"tokenizer/ and tokenizer_2/"):
        load_model(str(SGM), **LOAD)


# --- the refiner's single file ---------------------------------------------------------------------------------

REFINER_FILE = FIXTURES / "tiny-single-refiner" / "tiny-refiner-sgm.fp16.safetensors"
TINY_REFINER = FIXTURES / "tiny-pt-refiner"


def test_a_refiner_single_file_loads_as_the_refiner_folder_it_came_from():
    """tiny-pt-refiner written in sd_xl_refiner_1.0's layout (tools/fixtures_refiner_single.py: OpenCLIP as
    embedder 0, no CLIP-L) loads as the folder does: the same kind (text_encoder_2 only, 5 time ids, the aesthetic
    score, no force-zero), no tokenizer, the same tokenizer_2, and every parameter the folder's rounded to float16
    (as the file stores them), exactly; the log line says what it is."""
    lines = []
    loaded = load_model(str(REFINER_FILE), model_config=str(TINY_REFINER), log=lines.append, **LOAD)
    folder = loading.load_folder(TINY_REFINER, "tiny-pt-refiner", "float32")
    assert loaded.kind == folder.kind and loaded.kind.refiner and loaded.kind.text_encoders == ("text_encoder_2",)
    assert loaded.tokenizer is None and loaded.tokenizer_2.get_vocab() == folder.tokenizer_2.get_vocab()
    assert loaded.components.keys() == folder.components.keys() == {"text_encoder_2", "unet", "vae"}
    assert loaded.scheduler_config == folder.scheduler_config and loaded.name == REFINER_FILE.name
    assert_params(loaded.params, folder.params, lambda a: np.asarray(a).astype(np.float16))
    assert lines == [f"[sdxl_engine] {REFINER_FILE.name}: refiner single file, configs of tiny-pt-refiner"]
    checkpoint = single_file.inspect_checkpoint(REFINER_FILE)
    assert checkpoint.refiner and checkpoint.leftovers == [] and "text_encoder" not in checkpoint.parts
    assert len(checkpoint.parts["text_encoder_2"]) == 41  # 3 layers x 12 + 5: logit_scale set aside, not a weight


def test_a_refiner_file_and_base_configs_do_not_mix():
    """A refiner file with a base model's configs, or a base file with a refiner's, is one line naming both and
    the setting to change (before any tensor is read)."""
    with pytest.raises(ModelLoadError) as err:
        load_model(str(SGM), model_config=str(TINY_REFINER), flag="--refiner", **LOAD)
    assert str(err.value) == (
        f"{SGM} is an SDXL base-type single file (model.diffusion_model.*, first_stage_model.*, "
        "conditioner.embedders.0.transformer.*, conditioner.embedders.1.model.*), but the configs of tiny-pt-refiner "
        "are an SDXL refiner's; "
        "pass --refiner-config DIR with a base model's configs")
    with pytest.raises(ModelLoadError, match=r"tiny-refiner-sgm.fp16.safetensors is an SDXL refiner single file .* "
                                             r"configs of tiny-pt are a base model's; pass --model-config DIR"):
        load_model(str(REFINER_FILE), model_config=str(TINY_PT), **LOAD)


def test_a_refiner_file_without_configs_reads_the_refiner_repos(tmp_path, monkeypatch):
    """No --refiner-config: the refiner repository's configs (diffusers' from_single_file does the same); offline
    with nothing cached, one line says to pass --refiner-config."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(loading, "SDXL_REFINER_REPO", "nobody/not-cached")
    with pytest.raises(ModelLoadError, match=r"^an SDXL refiner single file needs the refiner's configs, and "
                                             r"nobody/not-cached's could not be read \(\w+, offline mode\): pass "
                                             r"--refiner-config DIR, a diffusers SDXL refiner folder"):
        load_model(str(REFINER_FILE), flag="--refiner", **LOAD)


# --- swapped parts -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def swap_unet():
    return {k: v.astype(np.float32) for k, v in load_file(str(SINGLE / "unet-swap.bf16.safetensors")).items()}


def test_unet_file_in_diffusers_layout_with_and_without_prefix(tmp_path, components, swap_unet, tiny_params):
    expected = {k: weights.to_module_layout(v) for k, v in swap_unet.items()}
    for prefix in ("", "unet."):
        path = write(tmp_path / f"unet-{prefix or 'plain.'}safetensors", {prefix + k: v for k, v in swap_unet.items()})
        model = load_model(str(TINY_PT), unet=str(path), **LOAD)
        assert_params({"unet": model.params["unet"]}, {"unet": expected}, lambda v: v)
        assert_params({"vae": model.params["vae"]}, {"vae": tiny_params["vae"]}, lambda v: v)


def test_unet_from_an_sgm_file_names_the_rest_unused(tmp_path, sgm, tiny_params):
    """An sgm file as --unet: its model.diffusion_model.* in LDM layout; the other parts are named, not used."""
    lines = []
    model = load_model(str(TINY_PT), unet=str(SGM), log=lines.append, **LOAD)
    assert_params({"unet": model.params["unet"]}, {"unet": tiny_params["unet"]}, lambda v: v.astype(np.float16))
    assert ("[sdxl_engine] tiny-sdxl-sgm.fp16.safetensors: not used (not unet), 230 tensors: first_stage_model.* "
            "(152), conditioner.embedders.1.model.* (42), conditioner.embedders.0.transformer.* (36)") in lines
    prefix = "model.diffusion_model."
    unprefixed = {k[len(prefix):]: v for k, v in sgm.items() if k.startswith(prefix)}
    model = load_model(str(TINY_PT), unet=str(write(tmp_path / "ldm-unet.safetensors", unprefixed)), **LOAD)
    assert_params({"unet": model.params["unet"]}, {"unet": tiny_params["unet"]}, lambda v: v.astype(np.float16))


def test_vae_in_every_layout(tmp_path, sgm, tiny_params):
    """LDM file with and without first_stage_model., a diffusers component folder, a model folder's vae/."""
    ldm = load_file(str(SINGLE / "vae-ldm.safetensors"))
    swapped = load_model(str(TINY_PT), vae=str(SINGLE / "vae-ldm.safetensors"), **LOAD).params["vae"]
    prefixed = write(tmp_path / "vae-prefixed.safetensors", {"first_stage_model." + k: v for k, v in ldm.items()})
    assert_params({"vae": load_model(str(TINY_PT), vae=str(prefixed), **LOAD).params["vae"]}, {"vae": swapped},
                  lambda v: np.asarray(v))
    assert not np.array_equal(np.asarray(swapped["decoder.conv_out.bias"]), tiny_params["vae"]["decoder.conv_out.bias"])
    # The sgm file's own VAE, given as --vae to the sgm model, and tiny-pt's VAE folder (and model folder):
    for vae in (str(SGM), str(TINY_PT / "vae"), str(TINY_PT)):
        lines = []
        params = load_model(str(SGM), model_config=str(TINY_PT), vae=vae, log=lines.append, **LOAD).params["vae"]
        assert "[sdxl_engine] tiny-sdxl-sgm.fp16.safetensors: first_stage_model.* (152) replaced by --vae" in lines
        cast = (lambda v: v.astype(np.float16)) if vae == str(SGM) else (lambda v: v)
        assert_params({"vae": params}, {"vae": tiny_params["vae"]}, cast)


def test_a_swap_that_does_not_fit_says_which_tensor(tmp_path):
    """tiny-pt-conv's VAE (other layers) as a file against tiny-pt's VAE config: the folder loader's message."""
    with pytest.raises(ModelLoadError, match=r"diffusion_pytorch_model.safetensors \(vae, diffusers layout\): the "
                                             r"weights do not fit the vae config: 30 missing \(first: "
                                             r"decoder.up_blocks.1.upsamplers.0.conv.bias, .*; 34 unexpected"):
        load_model(str(TINY_PT), vae=str(FIXTURES / "tiny-pt-conv" / "vae" / "diffusion_pytorch_model.safetensors"),
                   **LOAD)
    with pytest.raises(ModelLoadError, match="--unet '/nonexistent/unet.safetensors': no such file or folder"):
        load_model(str(TINY_PT), unet="/nonexistent/unet.safetensors", **LOAD)
    (tmp_path / "unet.ckpt").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match=r"unet.ckpt is a pickle checkpoint \(.ckpt\); it is never opened"):
        load_model(str(TINY_PT), unet=str(tmp_path / "unet.ckpt"), **LOAD)


def test_a_swapped_folder_config_must_fit_the_other_parts(tmp_path):
    folder = tmp_path / "unet"
    shutil.copytree(TINY_PT / "unet", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 72}))
    with pytest.raises(ModelLoadError, match=r"unet cross_attention_dim \(72, 72, 72\) must equal the two text "
                                             r"encoders' hidden sizes together"):
        load_model(str(TINY_PT), unet=str(folder), **LOAD)


def test_timestep_spacing_replaces_the_schedulers():
    assert load_model(str(TINY_PT), timestep_spacing="trailing", **LOAD).scheduler_config["timestep_spacing"] == \
        "trailing"
    assert load_model(str(TINY_PT), **LOAD).scheduler_config["timestep_spacing"] == "leading"
    with pytest.raises(ModelLoadError, match="--timestep-spacing 'sideways': choose leading, trailing, linspace"):
        load_model(str(TINY_PT), timestep_spacing="sideways", **LOAD)


def test_settings_and_flags():
    config = EngineConfig.load({"unet": "u.safetensors"}, environ={
        "SDXL_MODEL": "m.safetensors", "SDXL_MODEL_CONFIG": "cfg", "SDXL_VAE": "v",
        "SDXL_TIMESTEP_SPACING": "trailing", "SDXL_REFINER": "r.safetensors", "SDXL_REFINER_CONFIG": "rcfg"})
    assert (config.model, config.model_config, config.unet, config.vae, config.timestep_spacing) == (
        "m.safetensors", "cfg", "u.safetensors", "v", "trailing")
    assert (config.refiner, config.refiner_config) == ("r.safetensors", "rcfg")
    with pytest.raises(ConfigError, match="timestep_spacing must be leading, trailing or linspace"):
        EngineConfig.load({"timestep_spacing": "late"}, environ={})
    args = parse_args(["--model", "m.safetensors", "--model-config", "cfg", "--unet", "u", "--vae", "v",
                       "--timestep-spacing", "trailing", "--refiner", "r.safetensors", "--refiner-config", "rcfg"])
    assert engine_overrides(args) == {"model": "m.safetensors", "model_config": "cfg", "unet": "u", "vae": "v",
                                      "timestep_spacing": "trailing", "refiner": "r.safetensors",
                                      "refiner_config": "rcfg"}


def test_ldm_block_indices_follow_layers_per_block(components):
    """SDXL's layout (2 layers per block, 3 blocks): input_blocks 1-2 block 0, 3 its downsampler, ... 7-8; output
    blocks 0-2 up block 0 with its upsampler in 2, ..., 6-8 the last (no upsampler)."""
    down, downsamplers, up, upsamplers = single_file.unet_block_tables(components["unet"].config)
    assert down == {1: (0, 0), 2: (0, 1), 4: (1, 0), 5: (1, 1), 7: (2, 0), 8: (2, 1)}
    assert downsamplers == {3: 0, 6: 1}
    assert up == {i: (i // 3, i % 3) for i in range(9)} and upsamplers == {0: 2, 1: 5}


def test_full_size_sdxl_base_single_file_keys_map_one_to_one():
    """Every tensor of full-size SDXL base's single file (sdxl-base-sgm-keys.json: sd_xl_base_1.0's names, made
    by inverting diffusers' conversion, ``make_fixtures sgm-keys``) is one parameter of the real configs' modules,
    shapes included: 2514 tensors (the real file's 2515 less CLIP-L's position_ids buffer)."""
    shapes = json.loads((FIXTURES / "sdxl-base-sgm-keys.json").read_text())
    assert len(shapes) == 2514
    components = read_model_folder(ROOT / "sdxl_engine" / "checkpoint" / "configs" / "sdxl-base-1.0")
    shapes["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = [1, 77]
    infos = {k: weights.TensorInfo(SGM, k, "F16", tuple(s)) for k, s in shapes.items()
             if k not in single_file.NOT_WEIGHTS}  # logit_scale: inspect_checkpoint sets it aside
    for name, component in components.items():
        prefix = single_file.PREFIXES[name]
        plan, unexpected = single_file.plan_component(
            component, {k[len(prefix):]: v for k, v in infos.items() if k.startswith(prefix)}, "ldm")
        assert unexpected == [] and plan.keys() == component.shapes.keys(), name
        assert {k: weights.module_shape(s.shape) for k, s in plan.items()} == dict(component.shapes), name
    left = [k for k in shapes if not k.startswith(tuple(single_file.PREFIXES.values()))]
    assert left == []
