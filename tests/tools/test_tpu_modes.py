"""tools/tpu_modes.py's parts that run off the chip: the FLOP count of a ControlNet unit's step, and a random
ControlNet written once per DIR (a full-size one takes minutes on the chip)."""

import json

import pytest

from tools.tpu_modes import controlnet_flops, write_controlnet, write_ip_adapter

pytestmark = pytest.mark.slow  # a chip tool's parts (about 30 s of lowering and writing): not the quick subset's


def test_a_controlnet_units_step_counts_the_unet_and_the_controlnet():
    r = controlnet_flops("tiny-shapes", 64)
    assert r["unet_cfg_step_tflop"] > 0 and r["controlnet_cfg_step_tflop"] > 0
    # the ControlNet copies the UNet's down and mid blocks: less than the whole UNet, more than nothing
    assert r["controlnet_cfg_step_tflop"] < r["unet_cfg_step_tflop"]
    assert abs(r["step_with_unit_over_without"]
               - (r["unet_cfg_step_tflop"] + r["controlnet_cfg_step_tflop"]) / r["unet_cfg_step_tflop"]) < 1e-9
    # twice the pixels per side: four times the FLOPs of either call (convolutions and projections dominate)
    big = controlnet_flops("tiny-shapes", 128)
    assert 3.5 < big["controlnet_cfg_step_tflop"] / r["controlnet_cfg_step_tflop"] < 4.6
    # a union unit: the ControlNet's call and its token transformer, so a little more than a plain unit's; an
    # IP-Adapter unit: the UNet's own call with 16 more keys in each cross-attention, so a little more than none
    assert r["controlnet_cfg_step_tflop"] < r["union_cfg_step_tflop"] < 1.2 * r["controlnet_cfg_step_tflop"]
    assert r["step_with_union_unit_over_without"] > r["step_with_unit_over_without"]
    assert 1.0 < r["step_with_ip_adapter_unit_over_without"] < 1.1
    assert r["unet_with_ip_adapter_cfg_step_tflop"] / r["unet_cfg_step_tflop"] == pytest.approx(
        r["step_with_ip_adapter_unit_over_without"])


def test_a_controlnet_written_before_is_reused_and_a_changed_config_rewritten(tmp_path):
    folder = write_controlnet(tmp_path / "cn", "tiny-shapes")
    weights = folder / "diffusion_pytorch_model.safetensors"
    first = weights.stat().st_mtime_ns
    assert write_controlnet(tmp_path / "cn", "tiny-shapes") == folder and weights.stat().st_mtime_ns == first
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layers_per_block": 99}))
    write_controlnet(tmp_path / "cn", "tiny-shapes")
    assert json.loads((folder / "config.json").read_text()) == config and weights.stat().st_mtime_ns != first


def test_an_ip_adapter_written_before_is_reused(tmp_path):
    file = write_ip_adapter(tmp_path / "ip", "tiny-shapes")
    encoder = tmp_path / "ip" / "image_encoder" / "model.safetensors"
    first = (file.stat().st_mtime_ns, encoder.stat().st_mtime_ns)
    assert write_ip_adapter(tmp_path / "ip", "tiny-shapes") == file
    assert (file.stat().st_mtime_ns, encoder.stat().st_mtime_ns) == first
    (tmp_path / "ip" / "written.json").unlink()  # a write cut short leaves no record: the next run writes again
    write_ip_adapter(tmp_path / "ip", "tiny-shapes")
    assert file.stat().st_mtime_ns != first[0] and (tmp_path / "ip" / "written.json").exists()
