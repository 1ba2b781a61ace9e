"""layers.attention: jax.nn.dot_product_attention's arithmetic, without the transposing copy of its scores.

The engine's attention (UNet self- and cross-attention, CLIP's causal self-attention) is two einsums and a float32
softmax. It replaced ``jax.nn.dot_product_attention``, whose XLA path vmaps over query groups: on XLA:CPU that gave
every (q_len, kv_len) probability matrix an extra axis and a transposing copy, a third of a 256² request
(docs/benchmarks.md, "Against the blog's own pipeline"). Checked here: the values against JAX's own function on
fixed non-square inputs (causal and not, float32 and bfloat16), and the compiled program's copies.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdxl_engine.models import layers
from sdxl_engine.models.layers import (
    attention,
    flash_attention_tpu,
    flash_block,
    flash_fits,
    resolve_attention,
    rows_fit,
    softmax_attention_tpu,
)

B, T, S, HEADS, HEAD_DIM = 2, 24, 40, 3, 8


def inputs(t: int, s: int, dtype):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((B, n, HEADS * HEAD_DIM)).astype(np.float32) for n in (t, s, s))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def reference(q, k, v, is_causal: bool):
    split = lambda x: x.reshape(x.shape[0], x.shape[1], HEADS, HEAD_DIM)  # noqa: E731
    out = jax.nn.dot_product_attention(split(q), split(k), split(v), is_causal=is_causal, implementation="xla")
    return out.reshape(q.shape)


@pytest.mark.parametrize("t, s, is_causal", [(T, S, False), (S, S, True), (T, T, True)])
def test_equals_jax_dot_product_attention_in_float32(t, s, is_causal):
    q, k, v = inputs(t, s, jnp.float32)
    ours, theirs = jax.jit(attention, static_argnums=3, static_argnames="is_causal")(q, k, v, HEADS,
                                                                                        is_causal=is_causal), \
        reference(q, k, v, is_causal)
    assert ours.shape == (B, t, HEADS * HEAD_DIM) and ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=2e-6)


def test_causal_rows_see_only_earlier_positions():
    """Changing the last key/value moves only the last query's row with is_causal (and every row without)."""
    q, k, v = inputs(T, T, jnp.float32)
    k2, v2 = k.at[:, -1].add(1.0), v.at[:, -1].add(1.0)
    moved = np.abs(np.asarray(attention(q, k2, v2, HEADS, is_causal=True) - attention(q, k, v, HEADS,
                                                                                        is_causal=True)))
    assert moved[:, :-1].max() == 0 and moved[:, -1].max() > 1e-3
    assert np.abs(np.asarray(attention(q, k2, v2, HEADS) - attention(q, k, v, HEADS)))[:, :-1].max() > 1e-3


def test_bfloat16_keeps_float32_scores_and_returns_bfloat16():
    q, k, v = inputs(T, S, jnp.bfloat16)
    ours = attention(q, k, v, HEADS)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(reference(q, k, v, False), np.float32),
                               rtol=0, atol=2e-2)


def test_an_unknown_implementation_is_refused_by_name():
    q, k, v = inputs(T, S, jnp.float32)
    with pytest.raises(ValueError, match="'flash' is not one of auto, xla, cudnn, pallas_tpu, pallas_tpu_rows"):
        attention(q, k, v, HEADS, implementation="flash")


def test_no_copy_of_the_scores_in_the_compiled_program():
    """The cause of the 256² slowdown, checked in the optimized HLO: no copy or transpose as large as the
    (batch, heads, q_len, kv_len) scores (element count), while the two products are there."""
    q, k, v = inputs(T, S, jnp.float32)
    text = jax.jit(lambda q, k, v: attention(q, k, v, HEADS)).lower(q, k, v).compile().as_text()
    scores = B * HEADS * T * S
    big = []
    for line in text.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\{[\d,]*\} (copy|transpose)\(", line)
        if match and np.prod([int(n) for n in match[1].split(",") if n]) >= scores:
            big.append(line.strip()[:160])
    assert not big, big
    assert len(re.findall(r" dot\(", text)) >= 2


# ---- the Pallas TPU flash kernel beside the XLA path (rule 33) ----------------------------------------------------
def test_auto_is_xla_off_a_tpu_and_a_pallas_kernel_on_one_where_it_fits(monkeypatch):
    assert resolve_attention(None, 4096, 4096, heads=10, head_dim=64) == "xla"  # these tests run on CPU devices
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
    # SDXL's self-attentions at 1024² (10 heads over 4096 tokens, 20 over 1024): the whole-row kernel
    assert resolve_attention(None, 4096, 4096, heads=10, head_dim=64) == "pallas_tpu_rows"
    assert resolve_attention("auto", 1024, 1024, heads=20, head_dim=64) == "pallas_tpu_rows"
    assert resolve_attention(None, 16384, 16384, heads=10, head_dim=64) == "pallas_tpu"  # 2048²: rows too long
    assert resolve_attention(None, 4096, 4096, heads=5, head_dim=64) == "pallas_tpu"  # heads do not pair up
    assert resolve_attention(None, 4096, 4096, heads=8, head_dim=40) == "pallas_tpu"  # not 64-wide
    assert resolve_attention(None, 4096, 4096) == "pallas_tpu"
    assert resolve_attention("auto", 1024, 1024) == "pallas_tpu"
    assert resolve_attention(None, 4096, 77) == "xla"  # cross-attention over the prompt's 77 tokens
    assert resolve_attention(None, 4032, 4032) == "xla"  # a 72 x 56 latent: no tile divides 4032
    assert resolve_attention(None, 256, 256, is_causal=True) == "xla"  # CLIP's causal attention
    assert resolve_attention("xla", 4096, 4096) == "xla"  # a name is obeyed


def test_flash_tiles_are_the_largest_that_divide():
    assert [flash_block(n) for n in (4096, 1024, 768, 384, 77, 4032)] == [512, 512, 256, 128, None, None]
    assert flash_fits(1024, 1024) and not flash_fits(1024, 77)
    q, k, v = inputs(T, S, jnp.float32)
    with pytest.raises(ValueError, match="q_len 24, kv_len 40"):
        flash_attention_tpu(q, k, v, HEADS)


@pytest.mark.parametrize("t, s, dtype, atol", [(256, 384, jnp.float32, 2e-5), (128, 128, jnp.bfloat16, 2e-2)])
def test_flash_kernel_in_interpret_mode_equals_the_xla_path(t, s, dtype, atol):
    """The kernel the TPU runs, interpreted on the CPU, against the XLA path on the same non-square inputs: the
    same attention to float32 rounding (bfloat16: its rounding)."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip("this JAX has no TPU interpret mode for Pallas kernels")
    q, k, v = inputs(t, s, dtype)
    with pltpu.force_tpu_interpret_mode():
        ours = attention(q, k, v, HEADS, implementation="pallas_tpu")
    assert ours.shape == (B, t, HEADS * HEAD_DIM) and ours.dtype == dtype
    xla = attention(q, k, v, HEADS, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(xla, np.float32), rtol=0, atol=atol)
    moved = attention(q, k, v.at[:, -1].add(10.0), HEADS, implementation="xla")  # the check can fail
    assert np.abs(np.asarray(moved, np.float32) - np.asarray(ours, np.float32)).max() > 10 * atol


# ---- the whole-row TPU kernel (rule 33: checked against the XLA path in interpret mode) ---------------------------
def test_the_whole_row_kernel_takes_sdxl_self_attention_and_refuses_the_rest():
    assert rows_fit(4096, 4096, 10, 64) and rows_fit(1024, 1024, 20, 64) and rows_fit(3072, 3072, 10, 64)
    assert not rows_fit(4096, 77, 10, 64)  # cross-attention: not 128-lane keys
    assert not rows_fit(8192, 8192, 10, 64) and not rows_fit(4096, 4096, 5, 64) and not rows_fit(4096, 4096, 8, 40)
    q = jnp.zeros((1, 256, 128), jnp.float32)
    with pytest.raises(ValueError, match="block_q 512 to divide q_len 256"):
        softmax_attention_tpu(q, q, q, 2, block_q=512)
    with pytest.raises(ValueError, match="pairs of 64-wide heads; got 1 x 128"):
        softmax_attention_tpu(q, q, q, 1, block_q=128)
    with pytest.raises(ValueError, match="not causal"):
        attention(q, q, q, 2, is_causal=True, implementation="pallas_tpu_rows")
    q72 = jnp.zeros((1, 72, 128), jnp.float32)  # no query block divides 72 tokens: the kernel says so
    with pytest.raises(ValueError, match="block_q 512 to divide q_len 72"):
        attention(q72, q72, q72, 2, implementation="pallas_tpu_rows")
    q = jnp.zeros((1, 256, 384), jnp.float32)  # 6 heads of 64
    with pytest.raises(ValueError, match="row_sum 'gpu' is not 'vpu' or 'mxu'"):
        softmax_attention_tpu(q, q, q, 6, block_q=128, row_sum="gpu")
    with pytest.raises(ValueError, match="heads_per_step 4 must be even and divide the 6 heads"):
        softmax_attention_tpu(q, q, q, 6, block_q=128, heads_per_step=4)


@pytest.mark.parametrize("layout, t, s, dtype, atol, row_sum, per_step", [
    ("packed", 256, 384, jnp.float32, 2e-5, "vpu", 2),
    ("packed", 128, 256, jnp.bfloat16, 2e-2, "vpu", 2),
    ("heads_first", 256, 384, jnp.float32, 2e-5, "vpu", 2),
    ("packed", 256, 384, jnp.float32, 2e-5, "mxu", 2),  # the row sums from the matrix unit
    ("packed", 256, 384, jnp.float32, 2e-5, "vpu", 4),  # 4 heads (two pairs) a grid step
    ("packed", 128, 256, jnp.bfloat16, 2e-2, "mxu", 4),  # what "auto" runs on a TPU where the heads divide by 4
])
def test_whole_row_kernel_in_interpret_mode_equals_the_xla_path(layout, t, s, dtype, atol, row_sum, per_step):
    """The kernel "auto" picks on a TPU for SDXL's self-attention, interpreted on the CPU, against the XLA path on
    non-square inputs with SDXL's 64-wide heads (4 heads: two packed pairs, two query blocks), each way of summing
    a row and each number of heads a grid step."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip("this JAX has no TPU interpret mode for Pallas kernels")
    heads, rng = 4, np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((2, n, heads * 64)), dtype) for n in (t, s, s))
    with pltpu.force_tpu_interpret_mode():
        ours = softmax_attention_tpu(q, k, v, heads, block_q=t // 2, layout=layout, row_sum=row_sum,
                                     heads_per_step=per_step)
    assert ours.shape == q.shape and ours.dtype == dtype
    xla = attention(q, k, v, heads, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(xla, np.float32), rtol=0, atol=atol)
    swapped = attention(q, k, v.at[..., :64].set(v[..., 64:128]), heads, implementation="xla")  # heads kept apart
    assert np.abs(np.asarray(swapped, np.float32) - np.asarray(ours, np.float32)).max() > 10 * atol
