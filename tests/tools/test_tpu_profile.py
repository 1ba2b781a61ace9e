"""tools/tpu_profile.py's reading of a chip's trace and HLO, on instruction texts a TPU v5e trace wrote (shortened),
and its side-by-side feed-forward comparison on CPU."""

import numpy as np
import pytest

from tools.tpu_profile import compare_images, conv_rates, ff_rates, hlo_products, main, op_class, op_flops

CONV = ("%convolution_add_fusion.444 = bf16[8,64,64,1280]{3,0,2,1:T(8,128)(2,1)} fusion(bf16[8,64,64,1280]"
        "{3,0,2,1:T(8,128)(2,1)} %bitcast.6194, bf16[3,3,1280,1280]{3,2,1,0:T(8,128)(2,1)S(1)} %custom-call.187, "
        "bf16[1280]{0:T(1024)(128)(2,1)S(1)} %copy-done.1121), kind=kOutput, calls=%fused_computation.5301.clone.1")
# a 3 x 3 convolution with GroupNorm's statistics fused into its output: a tuple type, the weight 960 -> 320
CONV_STATS = ("%convert_reduce_fusion.762 = (f32[8,320]{1,0:T(8,128)S(1)}, f32[8,320]{1,0:T(8,128)S(1)}, "
              "bf16[8,128,128,320]{3,0,2,1:T(8,128)(2,1)}) fusion(bf16[8,320]{1,0:T(8,128)(2,1)S(1)} "
              "%convolution_add_fusion.455, bf16[3,3,960,320]{2,3,1,0:T(8,128)(2,1)S(1)} %copy-done.670), "
              "kind=kOutput, calls=%fused_computation.821.clone.1")
ATTENTION = ("%body.628 = bf16[8,4096,640]{2,1,0:T(8,128)(2,1)} custom-call(bf16[8,4096,640]{2,1,0:T(8,128)(2,1)} "
             "%convolution_multiply_fusion.278, bf16[8,4096,640]{2,1,0:T(8,128)(2,1)} %fusion.14766, "
             "bf16[8,4096,640]{2,1,0:T(8,128)(2,1)} %fusion.14767), custom_call_target=\"tpu_custom_call\"")
PRODUCT = ("%fusion.14776 = bf16[8,4096,640]{1,2,0:T(8,128)(2,1)} fusion(bf16[8,4096,5120]{2,1,0:T(8,128)(2,1)} "
           "%convolution_add_fusion.452, bf16[640,2560]{1,0:T(8,128)(2,1)S(1)} %custom-call.649), kind=kOutput, "
           "calls=%fused_computation.4665.clone.1")
LOOP = "%while.5 = (s32[]{:T(128)}, f32[4,4,128,128]{3,2,1,0:T(8,128)}) while(%tuple.1), condition=%c, body=%b"


def test_ops_are_classed_by_what_their_instruction_computes():
    assert op_class(CONV) == op_class(CONV_STATS) == "3x3 convolution (+ what XLA fused in)"
    assert op_class(ATTENTION) == "attention kernel (Pallas)"
    assert op_class(PRODUCT) == "matrix product (+ fused)"
    assert op_class(LOOP) == "container"  # its events hold its body's: never counted as a leaf
    assert op_class("%copy.12 = bf16[8,640]{1,0} copy(bf16[8,640]{0,1} %x)") == "data movement"
    assert op_class("%fusion.9 = bf16[8,640]{1,0} fusion(bf16[8,640]{1,0} %x), kind=kLoop, calls=%f") == "elementwise"
    assert op_class("ynn_fusion.16") == "other (ynn_fusion)"  # XLA:CPU names kernels only


def test_flops_of_convolutions_and_attention_kernels_from_their_shapes():
    assert op_flops(CONV) == 2 * 8 * 64 * 64 * 1280 * 1280 * 9
    assert op_flops(CONV_STATS) == 2 * 8 * 128 * 128 * 960 * 320 * 9  # the tuple's [N, H, W, Cout] member
    assert op_flops(ATTENTION) == 4 * 8 * 4096 * 4096 * 640  # q k^T and p v over 4096 keys
    assert op_flops(PRODUCT) == 0.0  # a product's contraction is in its fused computation: hlo_products


HLO = """HloModule m

%fused_computation.4665.clone.1 (param_0: bf16[8,4096,2560], param_1: bf16[640,2560,1]) -> bf16[8,4096,640] {
  %param_0 = bf16[8,4096,2560]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = bf16[640,2560,1]{1,0,2:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = bf16[8,4096,640]{2,1,0:T(8,128)(2,1)} convolution(%param_0, %param_1), window={size=1}, \
dim_labels=0bf_oi0->0bf, metadata={op_name="jit(advance)/while/body/dot_general"}
}

%fused_computation.7 (param_0: bf16[8,77,10,64], param_1: bf16[8,4096,10,64]) -> f32[8,10,4096,77] {
  %param_0 = bf16[8,77,10,64]{3,2,1,0} parameter(0)
  %param_1 = bf16[8,4096,10,64]{3,2,1,0} parameter(1)
  ROOT %convolution-base-dilated.560 = f32[8,10,4096,77]{2,3,1,0:T(8,128)} convolution(%param_1, %param_0), \
window={size=8x10 stride=7x9 lhs_dilate=8x10}, dim_labels=0b1f_0o1i->01bf
}

%fused_computation.9 (param_0: bf16[8,64,64,640], param_1: bf16[3,3,640,640]) -> bf16[8,64,64,640] {
  %param_0 = bf16[8,64,64,640]{3,0,2,1} parameter(0)
  %param_1 = bf16[3,3,640,640]{3,2,1,0} parameter(1)
  ROOT %convolution.2 = bf16[8,64,64,640]{3,0,2,1} convolution(%param_0, %param_1), window={size=3x3 pad=1_1x1_1}, \
dim_labels=b01f_01io->b01f
}
""".replace("\\\n", "")


def test_products_count_their_contraction_once_per_output_and_a_window_only_when_real():
    found = hlo_products(HLO)
    assert found["fused_computation.4665.clone.1"] == (2.0 * 8 * 4096 * 640 * 2560, "[8, 4096, 640] x 2560")
    # a batched product (cross-attention's q k^T: batch 8 and 10 heads written as a dilated window): one tap
    assert found["fused_computation.7"][0] == 2.0 * 8 * 10 * 4096 * 77 * 64
    assert found["fused_computation.9"][0] == 2.0 * 8 * 64 * 64 * 640 * 640 * 9  # a 3 x 3 window: nine taps


@pytest.mark.slow  # compiles the feed-forward three ways at two sizes (about 30 s on CPU)
def test_the_feed_forwards_ways_compute_the_same_values():
    rows = ff_rates(rows=1, scale=64)
    assert {(r["tokens"], r["mode"]) for r in rows} == {(t, m) for t in (64, 16) for m in (
        "fused", "split", "split-erf", "split-tanh", "split-sigmoid")}
    # on XLA:CPU each output is the same dot product either way (tools/tpu_profile.ff_rates, models/unet.GEGLU);
    # erf's GELU differs from erfc's by a bfloat16 rounding, which ten chained random blocks make as large as the
    # values (its values: tests/models/test_models.py's GEGLU test)
    assert all(r["max_abs_diff_vs_fused"] == 0.0 and r["tflop_s"] > 0 for r in rows if r["mode"] in ("fused",
                                                                                                       "split"))
    # one block: the other formulas are a bfloat16 rounding or two from the exact GELU's block, not more
    for r in rows:
        assert r["one_block_max_abs_diff_vs_split"] <= 0.02 * r["one_block_max_abs"], r
    assert max(r["one_block_max_abs_diff_vs_split"] for r in rows if r["mode"] == "split-tanh") > 0


def test_compare_images_counts_the_pixels_both_runs_made(tmp_path, capsys):
    """--compare: two runs' seed-0 images (a 4-image run against a 1-image one compares the first image only)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    x = np.full((4, 2, 3, 3), 100, np.uint8)
    y = x[:1].copy()
    y[0, 0, 0] = [94, 100, 110]  # -6 and +10 on two of 18 values
    np.save(a / "images-seed0.npy", x)
    np.save(b / "images-seed0.npy", y)
    found = compare_images(a, b)
    assert (found["shape"], found["max_abs"], found["share_over_8"]) == ([1, 2, 3, 3], 10, 1 / 18)
    assert found["mean_abs"] == pytest.approx(16 / 18)
    assert main(["--out", str(b), "--compare", str(a)]) == 0
    assert '"max_abs": 10' in capsys.readouterr().out


def test_an_unknown_geglu_mode_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--geglu", "split-gelu", "--no-engine", "--ff"])
    assert "--geglu: one of split, fused, split-erf, split-tanh, split-sigmoid" in capsys.readouterr().err
    assert not (tmp_path / "tpu_profile.json").exists()


def test_an_unknown_conv_mode_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--conv", "pallas", "--no-engine", "--ff"])
    assert "--conv: one of auto, xla, strips" in capsys.readouterr().err
    assert not (tmp_path / "tpu_profile.json").exists()


def test_the_convolutions_ways_compute_the_same_values_side_by_side(monkeypatch):
    from sdxl_engine.models import layers

    ran = []  # (strips, side) of each trace that took strips
    monkeypatch.setattr(layers, "conv_strips", lambda x, w, n, run=layers.conv_strips: ran.append((n, x.shape[1])) or
                        run(x, w, n))
    found = conv_rates(rows=2, strips=(4, 2), rounds=1, shapes=((16, 64, 32), (8, 32, 64)))
    assert [(r["side"], r["in"], r["out"], r["mode"]) for r in found] == [
        (16, 64, 32, "xla"), (16, 64, 32, "strips4"), (16, 64, 32, "strips2"),
        (8, 32, 64, "xla"), (8, 32, 64, "strips4"), (8, 32, 64, "strips2")]
    assert all(r["ms"] > 0 and r["tflop_s"] > 0 for r in found)
    assert [r["vs_xla"] for r in found if r["mode"] == "xla"] == [1.0, 1.0]
    # bfloat16 in and out: the strips sum each pixel's products as one convolution does, up to its rounding
    assert all(r["max_abs_diff_vs_xla"] <= 0.0625 for r in found)
    assert ran == [(4, 16), (2, 16), (4, 8), (2, 8)]  # each strips mode ran as its count says
    assert (layers.CONV_MODE, layers.CONV_STRIPS) == ("auto", 4)  # put back as shipped
