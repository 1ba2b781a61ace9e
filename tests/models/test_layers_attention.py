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

from sdxl_engine.models.layers import attention

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
    with pytest.raises(ValueError, match="'flash' is not one of None, 'xla', 'cudnn'"):
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
