"""Building blocks in Flax NNX with PyTorch's parameter names and layouts.

Parameters carry PyTorch's names: the module path joined by dots *is* the checkpoint key
(``down_blocks.1.attentions.0.proj_in.weight``), and norms have ``weight`` and ``bias``.
``Linear.weight`` keeps PyTorch's (out_features, in_features) layout (the matmul contracts its
``in`` axis; no copy). ``Conv2d.weight`` alone is stored channels-last, (kh, kw, in, out)
(HWIO): the one rule the loader applies to PyTorch files is to transpose 4-D tensors from
(out, in, kh, kw). XLA's CPU convolution inside a ``fori_loop`` is far slower with OIHW
kernels (docs/benchmarks.md, "Figures behind choices in the code"), and HWIO is what XLA prefers on
TPU and GPU too.

Activations are channels-last inside the models (batch, height, width, channels).

Compute runs in the parameters' dtype (bfloat16 on accelerators); normalisation statistics and
softmax are computed in float32 and cast back, as PyTorch's autocast does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class Linear(nnx.Module):
    """``torch.nn.Linear``: y = x W^T + b with ``weight`` (out, in) and ``bias`` (out,).

    Initialised as Flax's Dense (LeCun normal weights, zero bias); checkpoints overwrite it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), 1 / math.sqrt(in_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., in) -> (..., out), in the weight's dtype."""
        w = self.weight[...]
        y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())))
        return y if self.bias is None else y + self.bias[...]


class Conv2d(nnx.Module):
    """``torch.nn.Conv2d`` on channels-last input: ``weight`` (kh, kw, in, out) (HWIO), ``bias`` (out,).

    ``padding`` is symmetric (PyTorch's int padding); ``pad_bottom_right`` instead pads one
    row and column after the image only, as diffusers' Downsample2D with ``padding=0`` does.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, pad_bottom_right: bool = False, *, rngs: nnx.Rngs):
        fan_in = in_channels * kernel_size * kernel_size
        self.weight = nnx.Param(_normal(rngs, (kernel_size, kernel_size, in_channels, out_channels),
                                        1 / math.sqrt(fan_in)))
        self.bias = nnx.Param(jnp.zeros((out_channels,), jnp.float32)) if bias else None
        self.stride = stride
        self.padding = ((0, 1), (0, 1)) if pad_bottom_right else ((padding, padding), (padding, padding))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (batch, height, width, in) -> (batch, height', width', out); :func:`conv_mode` says how it runs."""
        w = self.weight[...]
        x = x.astype(w.dtype)
        mode = conv_mode(x.shape, w.shape, self.stride, self.padding)
        if mode == "strips":
            y = conv_strips(x, w, conv_strip_count(x.shape, w.shape, self.stride, self.padding))
        elif mode == "dot":  # a 1x1 convolution is a product over the channels
            y = jax.lax.dot_general(x, w[0, 0], (((3,), (0,)), ((), ())))
        else:
            y = jax.lax.conv_general_dilated(x, w, (self.stride, self.stride), self.padding,
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y if self.bias is None else y + self.bias[...]


# How a 3x3 convolution with stride 1 and padding 1 (every UNet and VAE one but the downsamplers) runs (rule 33: a
# faster way is a choice beside the portable path, chosen in one place). "xla": one convolution over the batch.
# "strips": the image cut into CONV_STRIPS horizontal strips, each with its row of neighbours above and below, stacked
# on the batch axis and convolved without padding (:func:`conv_strips`): the same products, on CONV_STRIPS times the
# batch. On a TPU, XLA rewrites a convolution whose batch is small (2 rows: one image and its CFG twin) into its
# space-to-batch layouts, whose copies and pads (and the GroupNorm before it, computed in them) took a sixth of a
# one-image request's time on a v5e; on a batch of 8 it does not. "auto" (the default), on a TPU only: for exactly 2
# rows, CONV_STRIPS_TALL strips at the heights of CONV_STRIPS_TALL_HEIGHTS (the UNet's 64² and 128² latent levels
# at 1024², any channels), else CONV_STRIPS strips for at most CONV_STRIPS_MAX_ROWS rows with at least
# CONV_STRIPS_MIN_CHANNELS channels in and out (the 32² level: 0.77-0.79x the time of "xla" per convolution); and a
# 1x1 convolution of exactly 2 rows as one product over the channels ("dot"). One image took 2.070 s with "xla",
# 2.015 with 4 strips for wide convolutions, 1.891 with all of this; the VAE (1 row) was slower in strips and as
# products, so it keeps "xla" (docs/benchmarks.md, "Strips at every latent level"). "xla" everywhere else, which the
# CPU tests check to their tolerances. Inside the program's shard_map the rows are one device's: 2 on each chip of a
# v5e-4 serving 4 images, as on one chip serving 1.
CONV_MODES = ("auto", "xla", "strips")
CONV_MODE = "auto"
CONV_STRIPS = 4
CONV_STRIPS_MAX_ROWS = 2
CONV_STRIPS_MIN_CHANNELS = 640
CONV_STRIPS_TALL = 8  # auto's count for 2 rows of CONV_STRIPS_TALL_HEIGHTS rows of latents, any channels
CONV_STRIPS_TALL_HEIGHTS = (64, 128)  # the range measured: the UNet's 64² and 128² levels at 1024²


def conv_strip_count(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int,
                     padding: tuple[tuple[int, int], tuple[int, int]]) -> int:
    """How many strips :class:`Conv2d` cuts input ``x_shape`` (batch, height, width, in) into for weight ``w_shape``
    (kh, kw, in, out): 0 for XLA's one convolution (:data:`CONV_MODE`, "auto" resolved for the backend the program
    traces for). Only a 3x3 convolution with stride 1 and padding 1 over a height the count divides (in strips of at
    least 2 rows) takes strips: "strips" takes :data:`CONV_STRIPS`; "auto" on a TPU takes :data:`CONV_STRIPS_TALL`
    for exactly 2 rows :data:`CONV_STRIPS_TALL_HEIGHTS` high (both included), else :data:`CONV_STRIPS` for at most
    :data:`CONV_STRIPS_MAX_ROWS` rows with at least :data:`CONV_STRIPS_MIN_CHANNELS` channels in and out.

    Raises ValueError for a :data:`CONV_MODE` not in :data:`CONV_MODES`."""
    if CONV_MODE not in CONV_MODES:
        raise ValueError(f"conv mode {CONV_MODE!r} is not one of {', '.join(CONV_MODES)}")
    if CONV_MODE == "xla" or not (tuple(w_shape[:2]) == (3, 3) and stride == 1 and tuple(padding) == ((1, 1), (1, 1))):
        return 0

    def divides(count: int) -> bool:
        return x_shape[1] % count == 0 and x_shape[1] > count

    if CONV_MODE == "auto":
        if jax.default_backend() != "tpu":
            return 0
        if (x_shape[0] == 2 and CONV_STRIPS_TALL_HEIGHTS[0] <= x_shape[1] <= CONV_STRIPS_TALL_HEIGHTS[1]
                and divides(CONV_STRIPS_TALL)):
            return CONV_STRIPS_TALL
        if not (x_shape[0] <= CONV_STRIPS_MAX_ROWS and min(w_shape[2], w_shape[3]) >= CONV_STRIPS_MIN_CHANNELS):
            return 0
    return CONV_STRIPS if divides(CONV_STRIPS) else 0


def conv_mode(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int,
              padding: tuple[tuple[int, int], tuple[int, int]]) -> str:
    """How :class:`Conv2d` runs: "strips" where :func:`conv_strip_count` gives strips; "dot" for a 1x1 convolution
    (stride 1, no padding) of exactly 2 rows when "auto" traces for a TPU (one product over the channels: XLA's
    convolution of 2 rows took its space-to-batch layouts there; the VAE's of 1 row ran slower as products); else
    "xla".

    Raises ValueError for a :data:`CONV_MODE` not in :data:`CONV_MODES`."""
    if conv_strip_count(x_shape, w_shape, stride, padding):
        return "strips"
    one_by_one = tuple(w_shape[:2]) == (1, 1) and stride == 1 and tuple(padding) == ((0, 0), (0, 0))
    if CONV_MODE == "auto" and one_by_one and x_shape[0] == 2 and jax.default_backend() == "tpu":
        return "dot"
    return "xla"


def conv_strips(x: jax.Array, w: jax.Array, strips: int) -> jax.Array:
    """A 3x3 convolution, stride 1, zero padding 1, as one unpadded convolution over ``strips`` horizontal strips of
    the image stacked on the batch axis, each strip with the row above and below it (zeros at the image's edges).

    Args:
        x: (batch, height, width, in), height divisible by ``strips``; w: (3, 3, in, out) (HWIO), x's dtype.
    Returns:
        (batch, height, width, out) in x's dtype: ``lax.conv_general_dilated`` with padding ((1, 1), (1, 1)): the
        same products per output pixel (each output row's 3 x 3 x in window lies in one strip), summed as XLA's
        convolution of that batch sums them (on a TPU, bfloat16 outputs within a rounding step of the padded one's).
    Raises:
        ValueError: height not divisible by ``strips``.
    """
    n, h, wd, c = x.shape
    if h % strips:
        raise ValueError(f"conv_strips: {strips} strips do not divide height {h}")
    rows = h // strips
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    stacked = jnp.stack([padded[:, i * rows:(i + 1) * rows + 2] for i in range(strips)], axis=1)
    y = jax.lax.conv_general_dilated(stacked.reshape(n * strips, rows + 2, wd + 2, c), w, (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y.reshape(n, h, wd, w.shape[-1])  # (n, strips, rows, ...) is the image's rows in order


class GroupNorm(nnx.Module):
    """``torch.nn.GroupNorm`` over the last (channel) axis of channels-last input.

    Statistics in float32 (mean and biased variance over the spatial axes and the channels of a
    group, the variance as E[x^2] - E[x]^2 in one pass, as Flax computes it: a tenth fewer bytes
    moved by the tiny model's program than two passes), then ``weight`` and ``bias`` per channel;
    the output has the input's dtype.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, *, rngs: nnx.Rngs | None = None):
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: {num_channels} channels do not split into {num_groups} groups")
        self.num_groups = num_groups
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((num_channels,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((num_channels,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (batch, ..., channels) -> same shape and dtype."""
        shape = x.shape
        grouped = x.astype(jnp.float32).reshape(shape[0], -1, self.num_groups, shape[-1] // self.num_groups)
        mean = grouped.mean(axis=(1, 3), keepdims=True)
        var = jnp.maximum(jnp.square(grouped).mean(axis=(1, 3), keepdims=True) - jnp.square(mean), 0.0)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``torch.nn.LayerNorm`` over the last axis: float32 statistics, ``weight`` and ``bias``."""

    def __init__(self, dim: int, eps: float = 1e-5, *, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., dim) -> same shape and dtype."""
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.maximum(jnp.square(x32).mean(-1, keepdims=True) - jnp.square(mean), 0.0)  # one pass, as GroupNorm
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Embedding(nnx.Module):
    """``torch.nn.Embedding``: ``weight`` (num_embeddings, dim), looked up by integer ids."""

    def __init__(self, num_embeddings: int, dim: int, std: float = 1.0, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (num_embeddings, dim), std))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids (...) int -> (..., dim) in the weight's dtype."""
        return jnp.take(self.weight[...], ids, axis=0)


# Attention kernels by name (rule 33: a fast kernel is a choice beside the portable path, chosen in one place).
# "auto" picks per backend at trace time: on a TPU the whole-row Pallas kernel where it applies (:func:`rows_fit`:
# SDXL's self-attentions up to 4096 tokens), else the Pallas flash kernel where its tiles fit (:func:`flash_fits`),
# else the XLA path, which every backend compiles and the CPU tests check.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas_tpu", "pallas_tpu_rows")
FLASH_BLOCKS = (512, 256, 128)  # the Pallas flash kernel's q/kv tiles, largest first (512 ran fastest on a v5e)


def flash_block(length: int) -> int | None:
    """The largest of :data:`FLASH_BLOCKS` that divides ``length`` (tokens), or None: the kernel tiles the
    sequences without padding, so a length none divides (a latent of 72 x 56) runs on the XLA path."""
    return next((b for b in FLASH_BLOCKS if length % b == 0), None)


def flash_fits(q_len: int, kv_len: int) -> bool:
    """Whether the Pallas TPU flash kernel takes these lengths: both tile (:func:`flash_block`). Cross-attention
    over 77 text tokens does not, and there the (q_len, 77) scores are small anyway."""
    return flash_block(q_len) is not None and flash_block(kv_len) is not None


def rows_fit(q_len: int, kv_len: int, heads: int, head_dim: int) -> bool:
    """Whether the whole-row kernel (:func:`softmax_attention_tpu`, packed layout) takes this attention: a tile of
    :data:`FLASH_BLOCKS` divides q_len, kv_len is a multiple of 128 up to :data:`SOFTMAX_MAX_KV`, and the heads
    pair up as 64-wide halves of 128 lanes (every SDXL UNet, refiner and ControlNet attention has head_dim 64)."""
    return (flash_block(q_len) is not None and kv_len % 128 == 0 and kv_len <= SOFTMAX_MAX_KV and heads % 2 == 0
            and head_dim == 64)


def resolve_attention(implementation: str | None, q_len: int, kv_len: int, is_causal: bool = False,
                      heads: int = 1, head_dim: int = 0) -> str:
    """The implementation that runs: ``implementation`` as named, or for None/"auto" on a TPU backend (and not
    causal: CLIP's 77 tokens take the XLA path) ``pallas_tpu_rows`` where :func:`rows_fit`, else ``pallas_tpu``
    where :func:`flash_fits`, else ``xla``; ``xla`` on every other backend.

    Raises ValueError for a name not in :data:`ATTENTION_IMPLEMENTATIONS`."""
    if implementation not in (None, *ATTENTION_IMPLEMENTATIONS):
        raise ValueError(f"attention implementation {implementation!r} is not one of "
                         f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
    if implementation in (None, "auto"):
        if jax.default_backend() != "tpu" or is_causal:
            return "xla"
        if rows_fit(q_len, kv_len, heads, head_dim):
            return "pallas_tpu_rows"
        return "pallas_tpu" if flash_fits(q_len, kv_len) else "xla"
    return implementation


def attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int, *, is_causal: bool = False,
              implementation: str | None = None) -> jax.Array:
    """Multi-head scaled dot-product attention (Vaswani et al. 2017): softmax(q k^T / sqrt(head_dim)) v per head.

    Args:
        q: (batch, q_len, heads * head_dim); k, v: (batch, kv_len, heads * head_dim), one dtype.
        heads: number of heads; the scale is head_dim ** -0.5.
        is_causal: mask future positions (CLIP's text encoder).
        implementation: one of :data:`ATTENTION_IMPLEMENTATIONS` (:func:`resolve_attention`): None or "auto"
            chooses by backend; "xla": the two einsums below, which XLA compiles on every backend; "cudnn":
            ``jax.nn.dot_product_attention``'s cuDNN kernel (GPU, float16/bfloat16); "pallas_tpu": JAX's Pallas
            flash attention kernel for TPU (``jax.experimental.pallas.ops.tpu.flash_attention``; Dao et al. 2022),
            which never holds the (q_len, kv_len) scores in memory; "pallas_tpu_rows": this module's whole-row
            TPU kernel (:func:`softmax_attention_tpu`), which holds a query block's score rows on chip.
    Returns:
        (batch, q_len, heads * head_dim) in q's dtype; the scores and the softmax in float32 (the flash kernel
        keeps its running maximum and sum in float32 too).

    Raises:
        ValueError: an unknown implementation; "pallas_tpu" for lengths its tiles do not divide (flash_fits);
            "pallas_tpu_rows" for what :func:`softmax_attention_tpu` refuses, or causal.

    The XLA arithmetic is ``jax.nn.dot_product_attention``'s XLA path (``_dot_product_attention_core``: float32
    logits, masked with -0.7 x float32's max, softmax in float32, cast to v's dtype before the second
    product), written without its grouped-query ``vmap``: on XLA:CPU that ``vmap`` put an extra axis on the
    scores, and a transposing copy of every (q_len, kv_len) probability matrix per head went with it, which
    took a third of a 256² request's time (docs/benchmarks.md, "Against the blog's own pipeline"). On a TPU
    that path writes and reads every float32 score matrix in HBM (at 1024² a self-attention over 4096 tokens
    holds 10 x 4096² of them per image): the Pallas kernels are chosen there (docs/benchmarks.md, "On a TPU v5e
    chip": the whole-row kernel ran SDXL's self-attentions in 0.58-0.71x the flash kernel's time).
    """
    b, t, d = q.shape
    implementation = resolve_attention(implementation, t, k.shape[1], is_causal, heads, d // heads)

    def split(x):  # (b, len, heads, head_dim)
        return x.reshape(x.shape[0], x.shape[1], heads, d // heads)

    if implementation == "cudnn":
        out = jax.nn.dot_product_attention(split(q), split(k), split(v), is_causal=is_causal,
                                           implementation="cudnn")
        return out.reshape(b, t, d)
    if implementation == "pallas_tpu":
        return flash_attention_tpu(q, k, v, heads, is_causal=is_causal)
    if implementation == "pallas_tpu_rows":
        if is_causal:
            raise ValueError("pallas_tpu_rows attention is not causal; causal attention takes xla or pallas_tpu")
        # the largest block that divides q_len; none (asked by name): the kernel's own refusal names the length
        return softmax_attention_tpu(q, k, v, heads, block_q=next((n for n in SOFTMAX_BLOCKS if t % n == 0),
                                                                  SOFTMAX_BLOCK_Q))
    logits = jnp.einsum("btnh,bsnh->bnts", split(q), split(k), preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / math.sqrt(d // heads))
    if is_causal:
        s = k.shape[1]
        causal = jnp.tril(jnp.ones((t, s), bool))
        logits = jnp.where(causal, logits, jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max)))
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bnts,bsnh->btnh", probs, split(v))
    return out.reshape(b, t, d)


def flash_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, heads: int, *, is_causal: bool = False) -> jax.Array:
    """:func:`attention` through JAX's Pallas TPU flash attention kernel: same arguments and result.

    The kernel takes (batch, heads, len, head_dim); tiles of :func:`flash_block` tokens, 512 where the length
    allows (on a v5e twice as fast as 256-token tiles: docs/benchmarks.md, "On a TPU v5e chip"). On a CPU it
    runs only under ``pltpu.force_tpu_interpret_mode()`` (the tests' check against the XLA path).

    Raises ValueError when a length has no tile (:func:`flash_fits`)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    b, t, d = q.shape
    s, hd = k.shape[1], d // heads
    bq, bk = flash_block(t), flash_block(s)
    if bq is None or bk is None:
        raise ValueError(f"pallas_tpu attention needs lengths that {FLASH_BLOCKS} tokens divide; "
                         f"got q_len {t}, kv_len {s}")

    def heads_first(x):  # (b, heads, len, head_dim)
        return x.reshape(x.shape[0], x.shape[1], heads, hd).transpose(0, 2, 1, 3)

    blocks = pallas_flash.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1)
    out = pallas_flash.flash_attention(heads_first(q), heads_first(k), heads_first(v), causal=is_causal,
                                       sm_scale=1.0 / math.sqrt(hd), block_sizes=blocks)
    return out.transpose(0, 2, 1, 3).reshape(b, t, d).astype(q.dtype)


SOFTMAX_MAX_KV = 4096  # the whole-row kernel holds (block_q, kv_len) float32 scores in VMEM: up to SDXL's 64² latent
SOFTMAX_BLOCK_Q = 512  # query rows per grid step
# How the packed kernel takes each row's sum of probabilities: "vpu" (a float32 sum over the keys' lanes on the
# vector unit) or "mxu" (a column of ones beside the head's 64 values in the p·v product, whose output fills only
# 64 of the matrix unit's 128 lanes anyway, so the sum costs no product time and no lane reduction; the pair's two
# outputs are then stored as one 128-lane block instead of two half-width ones). SOFTMAX_HEADS_PER_STEP: 64-wide
# heads per grid step (2: 128 lanes; 4: 256), where the heads divide by it.
SOFTMAX_ROW_SUM = "mxu"
SOFTMAX_HEADS_PER_STEP = 4
SOFTMAX_BLOCKS = (1024, 512, 256, 128)  # query rows per grid step in "auto": the largest that divides q_len


def softmax_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, heads: int, *, block_q: int = SOFTMAX_BLOCK_Q,
                          layout: str = "packed", row_sum: str | None = None,
                          heads_per_step: int | None = None) -> jax.Array:
    """:func:`attention` (not causal) through a Pallas TPU kernel that holds a query block's whole score rows.

    The flash kernel (:func:`flash_attention_tpu`) walks the keys in tiles with a running maximum and sum (Dao et al.
    2022), for sequences whose scores do not fit on chip. SDXL's self-attention has at most 4096 keys
    (:data:`SOFTMAX_MAX_KV`), whose (block_q, 4096) float32 scores fit in a TPU core's VMEM, so one grid step takes
    whole rows: softmax(q k^T) v with the softmax's maximum and sum once per row, no rescaling of a running output,
    and an eighth of the flash kernel's grid steps. The scale head_dim ** -0.5 multiplies q before the kernel (a power
    of two for head_dim 64, so exact in bfloat16). ``layout`` "packed" reads q, k and v as they are, (batch, len,
    heads * head_dim), ``heads_per_step`` heads (a multiple of 128 lanes) per grid step, so no transposes surround
    the kernel; "heads_first" transposes to (batch, heads, len, head_dim) as the flash kernel does.

    Args:
        q: (batch, q_len, heads * head_dim); k, v: (batch, kv_len, heads * head_dim), one dtype (bfloat16 on a TPU).
        heads: number of heads. block_q: query rows per grid step, dividing q_len.
        row_sum: "vpu" or "mxu" (:data:`SOFTMAX_ROW_SUM`, its default): where the packed kernel sums each row's
            probabilities. heads_per_step: the packed kernel's heads per grid step (:data:`SOFTMAX_HEADS_PER_STEP`,
            its default, where it divides ``heads``; else 2).
    Returns:
        (batch, q_len, heads * head_dim) in q's dtype; scores, maximum and sum in float32, the probabilities cast to
        v's dtype before the second product (as :func:`attention`'s XLA path). With row_sum "mxu" the sum is of
        those cast probabilities (accumulated in float32), so each output row is a weighted mean of v whose
        weights sum to 1.
    Raises:
        ValueError: block_q does not divide q_len, kv_len over :data:`SOFTMAX_MAX_KV`, "packed" with an odd
        number of heads or head_dim other than 64, an odd heads_per_step or one that does not divide heads, or an
        unknown row_sum.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, t, d = q.shape
    s, hd = k.shape[1], d // heads
    if t % block_q or s > SOFTMAX_MAX_KV:
        raise ValueError(f"softmax attention needs block_q {block_q} to divide q_len {t} and kv_len {s} <= "
                         f"{SOFTMAX_MAX_KV}")
    row_sum = row_sum or SOFTMAX_ROW_SUM
    if row_sum not in ("vpu", "mxu"):
        raise ValueError(f"row_sum {row_sum!r} is not 'vpu' or 'mxu'")
    q = q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype)
    trans_b = (((1,), (1,)), ((), ()))

    def probabilities(qh, kh):  # (block_q, hd), (s, hd) -> (block_q, s) float32, unnormalised
        scores = jax.lax.dot_general(qh, kh, trans_b, preferred_element_type=jnp.float32)
        return jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))

    def one_head(qh, kh, vh):  # (block_q, hd), (s, hd), (s, hd) -> (block_q, hd) float32
        probs = probabilities(qh, kh)
        total = jnp.sum(probs, axis=1, keepdims=True)
        return jnp.dot(probs.astype(vh.dtype), vh, preferred_element_type=jnp.float32) / total

    def head_pair(q2, k2, v2):  # (block_q, 128), (s, 128), (s, 128) -> (block_q, 128) float32: two heads
        # Head 0 multiplies its probabilities by [v0 | 1], head 1 by [1 | v1]: one product each gives the head's
        # output in its own 64 lanes and its row sum in the other 64.
        first = jax.lax.broadcasted_iota(jnp.int32, (1, 2 * hd), 1) < hd
        one = jnp.ones((), v2.dtype)
        out0 = jnp.dot(probabilities(q2[:, :hd], k2[:, :hd]).astype(v2.dtype), jnp.where(first, v2, one),
                       preferred_element_type=jnp.float32)  # [p0 v0 | sum0]
        out1 = jnp.dot(probabilities(q2[:, hd:], k2[:, hd:]).astype(v2.dtype), jnp.where(first, one, v2),
                       preferred_element_type=jnp.float32)  # [sum1 | p1 v1]
        # rolling 128 lanes by 64 swaps the halves (either direction)
        total = jnp.where(first, pltpu.roll(out0, hd, 1), pltpu.roll(out1, hd, 1))  # [sum0 | sum1]
        return jnp.where(first, out0, out1) / total

    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"),
                                  vmem_limit_bytes=64 * 1024 * 1024)
    if layout == "packed":
        if heads % 2 or hd != 64:
            raise ValueError(f"packed softmax attention takes pairs of 64-wide heads; got {heads} x {hd}")
        if heads_per_step is None:
            heads_per_step = SOFTMAX_HEADS_PER_STEP if heads % SOFTMAX_HEADS_PER_STEP == 0 else 2
        if heads_per_step % 2 or heads % heads_per_step:
            raise ValueError(f"heads_per_step {heads_per_step} must be even and divide the {heads} heads")
        lanes = heads_per_step * hd

        def packed_kernel(q_ref, k_ref, v_ref, o_ref):
            for p in range(heads_per_step // 2):  # 128 lanes: two heads
                pair = slice(2 * p * hd, 2 * (p + 1) * hd)
                if row_sum == "mxu":
                    o_ref[0, :, pair] = head_pair(q_ref[0, :, pair], k_ref[0, :, pair],
                                                  v_ref[0, :, pair]).astype(o_ref.dtype)
                    continue
                for h in range(2 * p, 2 * p + 2):
                    one = slice(h * hd, (h + 1) * hd)
                    o_ref[0, :, one] = one_head(q_ref[0, :, one], k_ref[0, :, one],
                                                v_ref[0, :, one]).astype(o_ref.dtype)

        rows = pl.BlockSpec((1, block_q, lanes), lambda i, g, j: (i, j, g))
        whole = pl.BlockSpec((1, s, lanes), lambda i, g, j: (i, 0, g))
        return pl.pallas_call(packed_kernel, grid=(b, heads // heads_per_step, t // block_q),
                              in_specs=[rows, whole, whole], out_specs=rows,
                              out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), compiler_params=params)(q, k, v)

    def heads_first(x):  # (b, heads, len, head_dim)
        return x.reshape(x.shape[0], x.shape[1], heads, hd).transpose(0, 2, 1, 3)

    def kernel(q_ref, k_ref, v_ref, o_ref):
        o_ref[0, 0] = one_head(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]).astype(o_ref.dtype)

    rows = pl.BlockSpec((1, 1, block_q, hd), lambda i, h, j: (i, h, j, 0))
    whole = pl.BlockSpec((1, 1, s, hd), lambda i, h, j: (i, h, 0, 0))
    out = pl.pallas_call(kernel, grid=(b, heads, t // block_q), in_specs=[rows, whole, whole], out_specs=rows,
                         out_shape=jax.ShapeDtypeStruct((b, heads, t, hd), q.dtype),
                         compiler_params=params)(heads_first(q), heads_first(k), heads_first(v))
    return out.transpose(0, 2, 1, 3).reshape(b, t, d)


def timestep_embedding(timesteps: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float,
                       max_period: int = 10000) -> jax.Array:
    """Sinusoidal embedding of (fractional) timesteps, diffusers' ``get_timestep_embedding``.

    Args:
        timesteps: (n,) any numeric dtype.
        dim: embedding width; odd widths get one zero column, as diffusers pads.
    Returns:
        (n, dim) float32: [sin, cos] of t * exp(-log(max_period) * i / (dim / 2 - freq_shift)),
        or [cos, sin] with ``flip_sin_to_cos`` (Ho et al. 2020; Vaswani et al. 2017).
    """
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    emb = timesteps.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    emb = jnp.concatenate([jnp.cos(emb), jnp.sin(emb)] if flip_sin_to_cos else [jnp.sin(emb), jnp.cos(emb)], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # torch's default (erf) GELU
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's (Radford et al. 2021)
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
}


def activation(name: str):
    """The activation function a config names (``silu``, ``gelu``, ``quick_gelu``...). Raises ValueError."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})") from None
