"""checkpoint/lora.py: key rules, scales, refusals, sources and hashes (no compile; tiny-pt's configs).

The files come from tests/fixtures/tiny-pt-lora (made by ``python -m tools.make_fixtures lora``) or are
written here from them (renamed keys, changed shapes) to check each rule against the same numbers.
"""

import hashlib
import json
import math
import re
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sdxl_engine.checkpoint import lora
from sdxl_engine.checkpoint.loading import read_model_folder
from sdxl_engine.checkpoint.weights import ModelLoadError
from tests.helpers import FIXTURES

LORA_DIR = FIXTURES / "tiny-pt-lora"
KOHYA, PEFT = LORA_DIR / "kohya.safetensors", LORA_DIR / "peft.safetensors"


@pytest.fixture(scope="module")
def components():
    return read_model_folder(FIXTURES / "tiny-pt")


def by_key(item: lora.Lora) -> dict:
    return {(layer.component, layer.key): layer for layer in item.layers}


def delta(layer: lora.LoraLayer) -> np.ndarray:
    return layer.up @ layer.down


def test_kohya_sgm_names_map_to_the_modules_diffusers_maps_them_to(components):
    """The hand-written kohya file (sgm names): every layer lands where diffusers' _convert_unet_lora_key and
    _maybe_map_sgm_blocks_to_diffusers put it (the fixture tool checked diffusers adapted all of them)."""
    item = lora.read_lora("ink", KOHYA, components)
    keys = by_key(item)
    assert item.format == "kohya" and len(item.layers) == 39
    expected = {
        "input_blocks_0_0": "conv_in", "out_2": "conv_out", "time_embed_0": "time_embedding.linear_1",
        "label_emb_0_2": "add_embedding.linear_2", "input_blocks_1_0_in_layers_2": "down_blocks.0.resnets.0.conv1",
        "input_blocks_1_0_emb_layers_1": "down_blocks.0.resnets.0.time_emb_proj",
        "input_blocks_3_0_op": "down_blocks.0.downsamplers.0.conv",
        "input_blocks_4_0_skip_connection": "down_blocks.1.resnets.0.conv_shortcut",
        "input_blocks_8_1_transformer_blocks_1_attn2_to_q":
            "down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_q",
        "middle_block_2_out_layers_3": "mid_block.resnets.1.conv2",
        "output_blocks_2_2_conv": "up_blocks.0.upsamplers.0.conv",
        "output_blocks_5_2_conv": "up_blocks.1.upsamplers.0.conv",
        "output_blocks_5_1_proj_out": "up_blocks.1.attentions.2.proj_out",
        "output_blocks_6_0_skip_connection": "up_blocks.2.resnets.0.conv_shortcut",
        "output_blocks_8_0_in_layers_2": "up_blocks.2.resnets.2.conv1",
    }
    file = load_file(str(KOHYA))
    for kohya_name, module in expected.items():
        layer = keys[("unet", module + ".weight")]
        down = file[f"lora_unet_{kohya_name}.lora_down.weight"]
        alpha = float(file[f"lora_unet_{kohya_name}.alpha"])
        np.testing.assert_array_equal(layer.down, down.reshape(down.shape[0], -1))
        np.testing.assert_allclose(layer.up,
                                   file[f"lora_unet_{kohya_name}.lora_up.weight"].reshape(layer.up.shape[0], -1)
                                   * alpha / down.shape[0], rtol=1e-6)
    assert ("text_encoder", "encoder.layers.1.mlp.fc1.weight") in keys  # te1: transformers' text_model. dropped
    assert ("text_encoder_2", "text_model.encoder.layers.2.mlp.fc2.weight") in keys
    conv = keys[("unet", "conv_in.weight")]
    assert conv.down.shape == (4, 4 * 3 * 3) and conv.up.shape == (16, 4)  # LoCon: (rank, in*kh*kw), (out, rank)


def test_peft_scale_comes_from_the_saved_lora_config(components):
    """diffusers' save_lora_weights stores LoraConfig (r 4, lora_alpha 8): PEFT's scaling alpha / r = 2."""
    item = lora.read_lora("p", PEFT, components)
    file = load_file(str(PEFT))
    layer = by_key(item)[("unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight")]
    np.testing.assert_allclose(layer.up,
                               file["unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight"]
                               * 2.0, rtol=1e-6)
    assert item.format == "diffusers" and {c for c, _ in by_key(item)} == {"unet", "text_encoder", "text_encoder_2"}
    assert ("text_encoder", "encoder.layers.0.self_attn.q_proj.weight") in by_key(item)


def test_without_metadata_the_peft_scale_is_1_and_rslora_uses_sqrt(components, tmp_path):
    tensors = load_file(str(PEFT))
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain))
    ref = by_key(lora.read_lora("p", PEFT, components))
    layers = by_key(lora.read_lora("p", plain, components))
    for k in ref:
        np.testing.assert_allclose(layers[k].up * 2.0, ref[k].up, rtol=1e-6)
    config = {"unet.lora_alpha": 8, "unet.r": 4, "unet.use_rslora": True,
              "unet.alpha_pattern": {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": 2}}
    rs = tmp_path / "rs.safetensors"
    save_file(tensors, str(rs), metadata={"lora_adapter_metadata": json.dumps(config)})
    layers = by_key(lora.read_lora("p", rs, components))
    q = ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight")
    np.testing.assert_allclose(layers[q].up * 2.0 / (2 / math.sqrt(4)), ref[q].up, rtol=1e-6)
    other = ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k.weight")
    np.testing.assert_allclose(layers[other].up * 2.0 / (8 / math.sqrt(4)), ref[other].up, rtol=1e-6)


Q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"


def test_peft_alpha_pattern_matches_a_module_name_suffix_as_peft_does(components, tmp_path):
    """PEFT's get_pattern_key: a pattern key matches a module whose name ends with it at a dot
    (``(.*\\.)?key$``), so ``attn1.to_q`` (alpha 2) reaches every block's attn1.to_q (scale 2/4), not attn2's
    or to_k (8/4), and a text encoder's ``q_proj`` pattern only its own component."""
    tensors = load_file(str(PEFT))
    config = {"unet.lora_alpha": 8, "unet.r": 4, "unet.alpha_pattern": {"attn1.to_q": 2},
              "text_encoder.lora_alpha": 8, "text_encoder.r": 4, "text_encoder.alpha_pattern": {"q_proj": 1}}
    path = write(tmp_path, tensors, "pattern.safetensors", metadata={"lora_adapter_metadata": json.dumps(config)})
    layers = by_key(lora.read_lora("p", path, components))
    scales = {}
    for (component, key), layer in layers.items():
        stored = tensors[f"{component}.{key[:-len('.weight')]}.lora_B.weight"]  # this file's names are ours
        scale = layer.up[0, 0] / stored.reshape(layer.up.shape)[0, 0]
        np.testing.assert_allclose(layer.up, stored.reshape(layer.up.shape) * scale, rtol=1e-6)
        scales[(component, key)] = round(float(scale), 6)
    q = [k for k in scales if k[0] == "unet" and k[1].endswith("attn1.to_q.weight")]
    assert len(q) >= 2 and all(scales[k] == 0.5 for k in q)  # every block's, by suffix
    assert all(v == 2.0 for k, v in scales.items() if k[0] == "unet" and k not in q)
    te_q = [k for k in scales if k[0] == "text_encoder" and k[1].endswith("q_proj.weight")]
    assert te_q and all(scales[k] == 0.25 for k in te_q)
    assert all(v == 1.0 for k, v in scales.items() if k[0] == "text_encoder_2")  # no config for it: 1


def test_peft_pattern_keys_are_grouped_regexes_on_the_peft_module_name(components, tmp_path):
    """PEFT groups the key, ``(.*\\.)?(attn1.to_q|attn2.to_k)$``, so each alternative is a suffix (ungrouped,
    the second alternative would have to be the whole name); and a text encoder's names are transformers'
    (``text_model.encoder...``), so a key written from there matches although ours drops ``text_model.``."""
    tensors = load_file(str(PEFT))
    config = {"unet.lora_alpha": 8, "unet.r": 4, "unet.alpha_pattern": {"attn1.to_q|attn2.to_k": 4},
              "text_encoder.lora_alpha": 8, "text_encoder.r": 4,
              "text_encoder.alpha_pattern": {r"text_model\.encoder\.layers\.0\.self_attn\.q_proj": 1}}
    path = write(tmp_path, tensors, "grouped.safetensors", metadata={"lora_adapter_metadata": json.dumps(config)})
    layers = by_key(lora.read_lora("g", path, components))
    scale = {k: float(layer.up[0, 0] / tensors[f"{k[0]}.{k[1][:-len('.weight')]}.lora_B.weight"].reshape(
        layer.up.shape)[0, 0]) for k, layer in layers.items()}
    matched = {k for k in scale if k[0] == "unet" and k[1].endswith(("attn1.to_q.weight", "attn2.to_k.weight"))}
    assert any("attn2.to_k" in k[1] for k in matched) and any("attn1.to_q" in k[1] for k in matched)
    assert {k: round(v, 6) for k, v in scale.items() if k[0] == "unet"} == {
        k: 1.0 if k in matched else 2.0 for k in scale if k[0] == "unet"}
    assert round(scale[("text_encoder", "encoder.layers.0.self_attn.q_proj.weight")], 6) == 0.25
    assert round(scale[("text_encoder", "encoder.layers.1.self_attn.q_proj.weight")], 6) == 2.0


def test_peft_pattern_keys_match_only_at_a_dot(components, tmp_path):
    """PEFT's ``(.*\\.)?(key)$``: a key is a whole dotted suffix of the module's name, so ``n1.to_q`` (alpha 2, rank
    8) touches no module, not even attn1.to_q, whose name merely ends with those characters (every unet scale stays
    8 / 4 = 2); ``0.attn1.to_q`` (a suffix starting at a dot) reaches transformer_blocks.0's attn1.to_q only."""
    tensors = load_file(str(PEFT))
    config = {"unet.lora_alpha": 8, "unet.r": 4, "unet.alpha_pattern": {"n1.to_q": 2}, "unet.rank_pattern": {
              "n1.to_q": 8}}
    path = write(tmp_path, tensors, "dots.safetensors", metadata={"lora_adapter_metadata": json.dumps(config)})
    layers = by_key(lora.read_lora("d", path, components))

    def scales(layers):
        return {k: round(float(layer.up[0, 0] / tensors[f"unet.{k[1][:-len('.weight')]}.lora_B.weight"].reshape(
            layer.up.shape)[0, 0]), 6) for k, layer in layers.items() if k[0] == "unet"}

    got = scales(layers)
    assert any(k[1].endswith("attn1.to_q.weight") for k in got) and set(got.values()) == {2.0}
    config["unet.alpha_pattern"], config["unet.rank_pattern"] = {"0.attn1.to_q": 2}, {}
    path = write(tmp_path, tensors, "dot.safetensors", metadata={"lora_adapter_metadata": json.dumps(config)})
    got = scales(by_key(lora.read_lora("d", path, components)))
    matched = {k for k in got if k[1].endswith("transformer_blocks.0.attn1.to_q.weight")}
    assert matched and any(k[1].endswith("attn1.to_q.weight") and k not in matched for k in got)
    assert got == {k: 0.5 if k in matched else 2.0 for k in got}


def test_diffusers_alpha_keys_divide_by_the_rank(components, tmp_path):
    """diffusers' own kohya conversion keeps alpha as ``<module>.alpha`` beside lora_A/lora_B: the scale is
    alpha / rank (2 / 4 here), and a module without one keeps 1 (no metadata). Delta by hand: 0.5 * B @ A."""
    tensors = load_file(str(PEFT))
    down, up = tensors[f"unet.{Q}.lora_A.weight"], tensors[f"unet.{Q}.lora_B.weight"]
    assert down.shape[0] == 4
    path = write(tmp_path, {**tensors, f"unet.{Q}.alpha": np.float32(2.0)}, "alpha.safetensors")
    layers = by_key(lora.read_lora("a", path, components))
    np.testing.assert_allclose(delta(layers[("unet", Q + ".weight")]), 0.5 * up.astype(np.float64) @ down,
                               rtol=1e-5, atol=1e-7)
    other = f"{Q[:-len('to_q')]}to_k"
    np.testing.assert_allclose(delta(layers[("unet", other + ".weight")]),
                               tensors[f"unet.{other}.lora_B.weight"].astype(np.float64)
                               @ tensors[f"unet.{other}.lora_A.weight"], rtol=1e-5, atol=1e-7)


def test_older_diffusers_names_give_the_same_deltas(components, tmp_path):
    """lora.down/lora.up and the attention-processor names (to_q_lora) read as diffusers'
    convert_unet_state_dict_to_peft renames them: the same layers and numbers as the PEFT file."""
    old = {}
    for key, value in load_file(str(PEFT)).items():
        key = key.replace(".lora_A.weight", ".lora.down.weight").replace(".lora_B.weight", ".lora.up.weight")
        for proj, name in (("attn1.to_q.lora", "attn1.processor.to_q_lora"),
                           ("self_attn.q_proj.lora", "self_attn.to_q_lora")):
            key = key.replace(proj + ".", name + ".")
        old[key] = value
    assert any("processor.to_q_lora.down.weight" in k for k in old) and any("self_attn.to_q_lora.up" in k for k in old)
    path = tmp_path / "old.safetensors"
    save_file(old, str(path))
    ref, got = by_key(lora.read_lora("p", PEFT, components)), by_key(lora.read_lora("p", path, components))
    assert got.keys() == ref.keys()
    for k in ref:  # no metadata in the old file: scale 1 where the PEFT file's is 2
        np.testing.assert_allclose(delta(got[k]) * 2, delta(ref[k]), rtol=1e-5, atol=1e-7)


def test_kohya_diffusers_style_unet_names_read_like_sgm_names(components, tmp_path):
    """kohya files for diffusers' UNet (lora_unet_down_blocks_1_attentions_0_...) map by the same rule."""
    renamed = {}
    for key, value in load_file(str(KOHYA)).items():
        renamed[key.replace("lora_unet_input_blocks_4_1_", "lora_unet_down_blocks_1_attentions_0_")
                .replace("lora_unet_input_blocks_0_0.", "lora_unet_conv_in.")] = value
    path = tmp_path / "diffusers-names.safetensors"
    save_file(renamed, str(path))
    ref, got = by_key(lora.read_lora("a", KOHYA, components)), by_key(lora.read_lora("a", path, components))
    assert got.keys() == ref.keys()
    assert all(np.array_equal(got[k].up, ref[k].up) for k in ref)


def write(tmp_path, tensors: dict, name="x.safetensors", metadata=None):
    path = tmp_path / name
    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def test_an_sd15_lora_is_refused_saying_its_widths_do_not_fit(components, tmp_path):
    """An SD 1.x LoRA: its cross-attention reads 768 wide text (SDXL 2048; tiny-pt 80) and names blocks SDXL
    lacks (down_blocks_0 has attention in SD 1.5)."""
    rng = np.random.default_rng(0)
    path = write(tmp_path, {
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight":
            rng.normal(size=(4, 768)),
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight": rng.normal(size=(32, 4)),
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": rng.normal(size=(4, 320, 1, 1)),
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": rng.normal(size=(320, 4, 1, 1)),
    }, "sd15.safetensors")
    with pytest.raises(lora.LoraError) as err:
        lora.read_lora("old", path, components)
    message = str(err.value)
    assert message.startswith(f"LoRA 'old' ({path}): 1 layer do not fit this model's shapes (first: "
                              "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k: down (4, 768) and "
                              "up (32, 4) cannot change a weight of shape (32, 80) (out, in)). It looks like an SD 1.x "
                              "LoRA (cross-attention width 768; SDXL's is 2048): it cannot apply to SDXL")
    assert message.endswith("; and 1 match no module") and "\n" not in message


def test_keys_that_match_no_module_are_named(components, tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"lora_unet_up_blocks_{i}_attentions_9_proj_in.lora_{r}.weight": rng.normal(size=(4, 4))
               for i in range(7) for r in ("down", "up")}
    path = write(tmp_path, tensors)
    with pytest.raises(lora.LoraError, match=r"7 of 7 LoRA layers match no module of this model \(first: "
                                             r"lora_unet_up_blocks_0_attentions_9_proj_in, "
                                             r"lora_unet_up_blocks_1_attentions_9_proj_in, .*, "
                                             r"lora_unet_up_blocks_4_attentions_9_proj_in\)\. "
                                             r"Is it a LoRA for this model\?$"):
        lora.read_lora("x", path, components)


@pytest.mark.parametrize("key, what", [
    ("lora_unet_conv_in.dora_scale", "DoRA (dora_scale)"),
    ("lora_unet_conv_in.hada_w1_a", "LyCORIS LoHa (hada_*)"),
    ("lora_unet_conv_in.lokr_w1", "LyCORIS LoKr (lokr_*)"),
    ("lora_unet_conv_in.diff_b", "full weight or bias deltas (diff / diff_b)"),
])
def test_unsupported_variants_are_refused_by_name(components, tmp_path, key, what):
    path = write(tmp_path, {**load_file(str(KOHYA)), key: np.ones((16,))})
    with pytest.raises(lora.LoraError, match=rf"^LoRA 'v' \(.*\): {re.escape(what)} is not supported \(key {key}\); "
                                             r"use a plain LoRA$"):
        lora.read_lora("v", path, components)


def test_foreign_keys_unpaired_layers_and_empty_files(components, tmp_path):
    with pytest.raises(lora.LoraError, match=r"2 keys of no LoRA format this server reads \(first: "
                                             r"model\.diffusion_model\.x, model\.diffusion_model\.y\)"):
        lora.read_lora("c", write(tmp_path, {"model.diffusion_model.x": np.ones(2),
                                             "model.diffusion_model.y": np.ones(2)}),
                       components)
    with pytest.raises(lora.LoraError, match=r"lora_unet_conv_in has no up weight$"):
        lora.read_lora("c", write(tmp_path, {"lora_unet_conv_in.lora_down.weight": np.ones((4, 4, 3, 3))}), components)
    with pytest.raises(lora.LoraError, match=r"no LoRA layers found"):
        lora.read_lora("c", write(tmp_path, {}), components)


@pytest.mark.parametrize("suffix", [".pt", ".ckpt", ".bin"])
def test_pickles_are_refused_unopened(components, tmp_path, suffix):
    path = tmp_path / f"evil{suffix}"
    path.write_bytes(b"not read")
    path.chmod(0)  # unreadable: opening it would fail differently
    with pytest.raises(lora.LoraError, match=rf"^{re.escape(str(path))}: a pickle \({re.escape(suffix)}\); "
                                             r"LoRA pickles are never opened because unpickling can run code"):
        lora.read_lora("e", path, components)


def test_a_truncated_file_is_one_line(components, tmp_path):
    data = KOHYA.read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(lora.LoraError, match=r"^LoRA 't': .*cut\.safetensors: truncated .*; download it again$"):
        lora.read_lora("t", path, components)
    assert issubclass(lora.LoraError, ModelLoadError)  # the start-up's one-line error path (exit 1)


KOHYA_Q = "lora_unet_input_blocks_8_1_transformer_blocks_1_attn2_to_q"


def poisoned(tmp_path, key: str, change, name="bad.safetensors"):
    """The kohya fixture with one tensor changed by ``change`` (written here, nothing else differs)."""
    tensors = load_file(str(KOHYA))
    tensors[key] = change(tensors[key].copy()).astype(np.float32)
    return write(tmp_path, tensors, name)


def put(value, at=(0,)):
    def change(tensor):
        tensor.reshape(-1)[list(at)] = value
        return tensor
    return change


@pytest.mark.parametrize("role, value, counts", [
    ("lora_down.weight", np.nan, "1 NaN and 0 infinite values"),
    ("lora_up.weight", np.inf, "0 NaN and 1 infinite values"),
    ("lora_up.weight", -np.inf, "0 NaN and 1 infinite values"),
    ("alpha", np.nan, "1 NaN and 0 infinite values of 1"),
])
def test_a_tensor_with_nan_or_inf_is_refused_naming_file_and_key(components, tmp_path, role, value, counts):
    """A damaged LoRA stops the start (LoraError is the start-up's one-line exit 1) instead of making every
    prompt that uses it fail with non-finite pixels."""
    key = f"{KOHYA_Q}.{role}"
    path = poisoned(tmp_path, key, put(value))
    with pytest.raises(lora.LoraError) as err:
        lora.read_lora("bad", path, components)
    size = load_file(str(KOHYA))[key].size
    assert str(err.value) == (f"LoRA 'bad' ({path}): tensor {key} has {counts} of {size}; the file is damaged "
                              "or was saved from a diverged training run").replace(" of 1 of 1;", " of 1;")


def test_a_nan_everywhere_peft_file_is_refused_at_its_first_tensor(components, tmp_path):
    tensors = {k: np.full_like(v, np.nan) for k, v in load_file(str(PEFT)).items()}
    path = write(tmp_path, tensors, "nan.safetensors")
    first = next(iter(lora._pairs("w", lora.read_safetensors_header(path), False).values()))["down"]
    with pytest.raises(lora.LoraError, match=rf"^LoRA 'n' \({re.escape(str(path))}\): tensor {re.escape(first)} has "
                                             rf"{tensors[first].size} NaN and 0 infinite values of "
                                             rf"{tensors[first].size};"):
        lora.read_lora("n", path, components)


@pytest.mark.parametrize("role, value, bound", [
    ("lora_up.weight", 1e30, "3.41e+29"),  # 1e30 * alpha / rank * the max |down| of its rank row
    ("lora_down.weight", 1e30, None),
    ("alpha", 1e30, None),
])
def test_a_huge_finite_tensor_is_refused_naming_the_layer(components, tmp_path, role, value, bound):
    """1e30 is finite in float32 but its delta overflows or swamps every weight: refused, naming the up key
    and the bound the reader computed (float64: no spurious inf)."""
    path = poisoned(tmp_path, f"{KOHYA_Q}.{role}", put(value))
    with pytest.raises(lora.LoraError) as err:
        lora.read_lora("big", path, components)
    message = str(err.value)
    assert message.startswith(f"LoRA 'big' ({path}): tensor {KOHYA_Q}.lora_up.weight (with its down weight and "
                              "scale) gives a delta that may reach ")
    assert message.endswith(" at weight 1; trained LoRAs stay far below 10000, so the file is damaged or was saved "
                            "from a diverged training run")
    reached = float(message.split("may reach ")[1].split(" ")[0])
    assert 1e20 < reached < 1e40
    if bound:
        file = load_file(str(path))
        up = file[f"{KOHYA_Q}.lora_up.weight"].astype(np.float64) * float(file[f"{KOHYA_Q}.alpha"]) / 4
        down = file[f"{KOHYA_Q}.lora_down.weight"].astype(np.float64)
        expected = np.max(np.abs(up) @ np.abs(down).max(axis=1))
        assert f"{expected:.3g}" == message.split("may reach ")[1].split(" ")[0] == bound


def test_the_magnitude_limit_sits_between_real_and_damaged_deltas(components, tmp_path):
    """The bound is MAX_DELTA = 1e4 on the delta at weight 1: the fixtures' and tiny-shapes' trained LCM-LoRA
    stay below 2, a layer scaled to a bound just under 1e4 is read, and just over is refused."""
    assert lora.MAX_DELTA == 1e4
    key = f"{KOHYA_Q}.lora_up.weight"
    file = load_file(str(KOHYA))
    up = file[key].astype(np.float64) * float(file[f"{KOHYA_Q}.alpha"]) / file[key].shape[1]
    down = file[f"{KOHYA_Q}.lora_down.weight"].astype(np.float64)
    bound = float(np.max(np.abs(up) @ np.abs(down).max(axis=1)))
    lora.read_lora("ok", poisoned(tmp_path, key, lambda t: t * (0.99e4 / bound), "ok.safetensors"), components)
    with pytest.raises(lora.LoraError, match=r"may reach 1\.01e\+04 at weight 1"):
        lora.read_lora("no", poisoned(tmp_path, key, lambda t: t * (1.01e4 / bound), "no.safetensors"), components)


def test_a_non_finite_scale_from_the_peft_header_is_refused(components, tmp_path):
    config = {"unet.lora_alpha": float("inf"), "unet.r": 4}
    path = write(tmp_path, load_file(str(PEFT)), "inf.safetensors",
                 metadata={"lora_adapter_metadata": json.dumps(config)})
    with pytest.raises(lora.LoraError, match=r"the lora_adapter_metadata header gives unet\..*\.lora_B\.weight a scale "
                                             r"of inf; a LoRA's scale must be a finite number$"):
        lora.read_lora("s", path, components)


def test_hash_is_a1111s_addnet_hash_or_its_stored_sshs_model_hash(tmp_path):
    """extensions-builtin/Lora/network.py: sshs_model_hash from the metadata, else sha256 of the bytes after the
    safetensors header (modules/hashes.py addnet_hash_safetensors); the infotext carries its first 12 hex."""
    data = KOHYA.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert lora.lora_hash(KOHYA) == hashlib.sha256(data[8 + length:]).hexdigest()
    stored = write(tmp_path, {"lora_unet_conv_in.lora_down.weight": np.ones((1, 1))},
                   metadata={"sshs_model_hash": "ab" * 32})
    assert lora.lora_hash(stored) == "ab" * 32


def test_sources_from_entries_and_a_folder(tmp_path):
    folder = tmp_path / "loras"
    folder.mkdir()
    for name in ("b.safetensors", "a.safetensors", "notes.txt", "c.ckpt"):
        (folder / name).write_bytes(b"")
    sources = lora.lora_sources(f"ink={KOHYA}:peft = {PEFT}", str(folder), ":")
    assert sources == {"ink": KOHYA, "peft": PEFT, "a": folder / "a.safetensors", "b": folder / "b.safetensors"}
    with pytest.raises(lora.LoraError, match=r"^--lora-dir '.*': two LoRAs named 'a' \(.*a\.safetensors and "
                                             r".*a\.safetensors\); each name once$"):
        lora.lora_sources(f"a={KOHYA}", str(folder), ":")
    with pytest.raises(lora.LoraError, match=r"two LoRAs named 'x'"):
        lora.lora_sources(f"x={KOHYA}:x={PEFT}", "", ":")
    with pytest.raises(lora.LoraError, match=r"expected NAME=PATH"):
        lora.lora_sources(str(KOHYA), "", ":")
    with pytest.raises(lora.LoraError, match=r"LoRA name 'a b' must be letters, digits"):
        lora.lora_sources(f"a b={KOHYA}", "", ":")
    with pytest.raises(lora.LoraError, match=r"--lora-dir '/nonexistent': not a folder"):
        lora.lora_sources("", "/nonexistent", ":")


def test_cli_repeats_lora_and_joins_with_pathsep():
    import os

    from sdxl_engine.config import EngineConfig
    from sdxl_engine.serving import cli

    args = cli.parse_args(["--lora", "a=/x/a.safetensors", "--lora", "b=/x/b.safetensors", "--lora-dir", "/d"])
    overrides = cli.engine_overrides(args)
    assert overrides["lora"] == os.pathsep.join(["a=/x/a.safetensors", "b=/x/b.safetensors"])
    config = EngineConfig.load(overrides, environ={})
    assert (config.lora, config.lora_dir) == (overrides["lora"], "/d")
    assert list(lora.lora_sources(config.lora, "", os.pathsep)) == ["a", "b"]


def test_pngs_keep_the_tags_and_carry_lora_hashes_as_a1111_writes_them(tmp_path):
    """A1111's Lora extension adds ``Lora hashes: "NAME: shorthash, ..."`` (quoted: the value holds ': ' and
    ', '), in the tags' order; the prompt keeps its tags. The expected text is written out here."""
    from PIL import Image

    from sdxl_engine.engine.contract import GenerateResult
    from sdxl_engine.engine.validation import GenerateRequest
    from sdxl_engine.service.delivery import deliver
    from sdxl_engine.service.images import parse_a1111_parameters
    from sdxl_engine.service.styles import NO_STYLE

    request = GenerateRequest("a cat <lora:ink:0.7>, <lora:peft>", "", 5, 5.0, 4, 64, 64, "Euler")
    result = GenerateResult(images=np.zeros((1, 64, 64, 3), np.uint8), seeds=[5], request=request,
                            timings={"latency": 0.1}, warnings=[], device_count=1, device_summary="1 × cpu",
                            model="tiny-pt", loras={"ink": "24ffad87cf5b", "peft": "8347dfde1941"})
    out = deliver(result, request.prompt, NO_STYLE, tmp_path)
    with Image.open(out.paths[0]) as image:
        text = image.text["parameters"]
    assert text == ('a cat <lora:ink:0.7>, <lora:peft>\nSteps: 4, Sampler: Euler, CFG scale: 5, Seed: 5, Size: 64x64, '
                    'Model: tiny-pt, Lora hashes: "ink: 24ffad87cf5b, peft: 8347dfde1941"')
    assert parse_a1111_parameters(text)["Lora hashes"] == "ink: 24ffad87cf5b, peft: 8347dfde1941"
    assert out.info["loras"] == {"ink": "24ffad87cf5b", "peft": "8347dfde1941"}


def test_a_model_folders_own_loras_come_last_and_yield_their_name(tmp_path):
    """A model folder's loras.json names LoRAs shipped with it; the deployment's --lora / --lora-dir
    take a name first, and a bad loras.json is refused in one line naming the file."""
    from sdxl_engine.checkpoint.loading import MODEL_LORAS_FILE, ModelLoadError, model_loras, read_model_loras

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "fast.safetensors").write_bytes(b"")
    (folder / MODEL_LORAS_FILE).write_text('{"_note": "shipped", "lcm": "fast.safetensors"}')
    shipped = read_model_loras(folder)
    assert shipped == {"lcm": folder / "fast.safetensors"} == model_loras(str(folder))
    assert lora.lora_sources(f"ink={KOHYA}", "", ":", shipped) == {"ink": KOHYA, "lcm": folder / "fast.safetensors"}
    assert lora.lora_sources(f"lcm={KOHYA}", "", ":", shipped) == {"lcm": KOHYA}  # the deployment's wins
    assert lora.available_names("", "", ":", shipped) == ["lcm"]
    assert read_model_loras(tmp_path) == {} and model_loras("tiny-random") == {}
    for bad in ('{"lcm": "../x.safetensors"}', '{"lcm": "missing.safetensors"}', '{"lcm": 3}'):
        (folder / MODEL_LORAS_FILE).write_text(bad)
        with pytest.raises(ModelLoadError, match=r"loras\.json: LoRA 'lcm': .* is not a file of "):
            read_model_loras(folder)
    (folder / MODEL_LORAS_FILE).write_text('["lcm"]')
    with pytest.raises(ModelLoadError, match=r"loras\.json: expected a JSON object"):
        read_model_loras(folder)


def test_tiny_shapes_ships_its_lcm_lora_in_the_peft_format():
    """The shipped LCM-LoRA: named "lcm" by tiny-shapes' loras.json, diffusers/PEFT keys and LoraConfig."""
    import json

    from safetensors import safe_open

    from sdxl_engine.checkpoint import builtin
    from sdxl_engine.checkpoint.loading import model_loras

    path = model_loras("tiny-shapes")["lcm"]
    assert path == builtin.TINY_SHAPES_DIR / "lcm-lora.safetensors"
    with safe_open(str(path), "np") as f:
        keys, config = list(f.keys()), json.loads(f.metadata()["lora_adapter_metadata"])
        rank = config["unet.r"]
        assert f.get_tensor("unet.down_blocks.1.attentions.0.proj_in.lora_A.weight").shape == (rank, 64)
        assert f.get_tensor("unet.down_blocks.1.resnets.0.conv1.lora_A.weight").shape == (rank, 32, 3, 3)
        assert f.get_tensor("unet.down_blocks.1.resnets.0.conv1.lora_B.weight").shape == (64, rank, 1, 1)
    assert all(k.startswith("unet.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert "unet.to_q" not in config and "to_q" in config["unet.target_modules"]
    record = json.loads(path.with_suffix(".json").read_text())
    assert record["steps_done"] > 0 and record["loss"] and record["train_s"] < 90 * 60
