"""Sampling ops: GridSample (nearest, linear, cubic; zeros, border, reflection padding; any
number of spatial dims) and AffineGrid, the grid it is usually fed.

One function per op, inputs positional, attributes as keywords with the spec's defaults.
GridSample is one gather per interpolation tap (2 or 4 per spatial dim) weighted and summed,
which XLA fuses; the coordinate rules follow the spec's reference step by step.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import OpError, ints, to_jax

#: Opset 16's names for the modes opset 20 renamed.
_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic"}
_CUBIC_ALPHA = -0.75


def _reflect(x: Any, lo: float, hi: float) -> Any:
    """``x`` reflected off the borders ``lo`` and ``hi`` until it lies between them."""
    span = hi - lo
    if span <= 0:
        return jnp.full_like(x, lo)
    below, above = lo - x, x - hi
    n_below = jnp.floor(below / span)
    n_above = jnp.floor(above / span)
    r_below = below - n_below * span
    r_above = above - n_above * span
    from_below = jnp.where(n_below % 2 == 0, lo + r_below, hi - r_below)
    from_above = jnp.where(n_above % 2 == 0, hi - r_above, lo + r_above)
    return jnp.where(x < lo, from_below, jnp.where(x > hi, from_above, x))


def _cubic(t: Any) -> list[Any]:
    a = _CUBIC_ALPHA
    return [
        ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
        ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
    ]


def _taps(x: Any, mode: str) -> list[tuple[Any, Any]]:
    """(integer position, weight) of every tap along one dim for coordinates ``x``."""
    if mode == "nearest":
        return [(x, jnp.ones_like(x))]
    base = jnp.floor(x)
    t = x - base
    if mode == "linear":
        return [(base, 1 - t), (base + 1, t)]
    return [(base + k - 1, w) for k, w in enumerate(_cubic(t))]


def GridSample(
    X: Any, grid: Any, align_corners: int = 0, mode: str = "linear", padding_mode: str = "zeros"
) -> Any:
    kind = "nearest" if mode == "nearest" else _MODES.get(mode)
    if kind is None:
        raise OpError(f"GridSample mode {mode!r}: expected linear, nearest or cubic")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise OpError(
            f"GridSample padding_mode {padding_mode!r}: expected zeros, border or reflection"
        )
    x = to_jax(X)
    g = to_jax(grid).astype(jnp.float32)
    sizes = [int(d) for d in x.shape[2:]]
    rank = len(sizes)
    n = x.shape[0]
    out_dims = tuple(g.shape[1:-1])
    # Column k of the grid addresses spatial dim rank-1-k (x is the innermost dim).
    taps_per_dim = []
    bounds = []
    for i, size in enumerate(sizes):
        c = g[..., rank - 1 - i]
        pos = (c + 1) / 2 * (size - 1) if align_corners else ((c + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        if kind == "nearest":
            pos = jnp.round(pos)  # half to even, as the reference's np.rint
        if padding_mode == "border":
            pos = jnp.where((pos < lo) | (pos > hi), jnp.clip(pos, 0, size - 1), pos)
        elif padding_mode == "reflection":
            pos = _reflect(pos, lo, hi)
        taps_per_dim.append(_taps(pos, kind))
        bounds.append((lo, hi))
    data = jnp.moveaxis(x, 1, -1)  # [N, *S, C]: one gather picks every channel
    batch = jnp.reshape(jnp.arange(n), (n,) + (1,) * len(out_dims))
    total = jnp.zeros((n, *out_dims, x.shape[1]), jnp.float32)
    for combo in itertools.product(*taps_per_dim):
        index = [batch]
        weight: Any = 1.0
        valid: Any = True
        for (pos, w), size, (lo, hi) in zip(combo, sizes, bounds):
            if padding_mode == "reflection":
                pos = jnp.trunc(_reflect(pos, lo, hi))
            i = pos.astype(jnp.int32)
            if padding_mode == "zeros":
                valid = valid & (i >= 0) & (i < size)
            index.append(jnp.clip(i, 0, size - 1))
            weight = weight * w
        picked = data[tuple(index)].astype(jnp.float32)
        contribution = picked * jnp.where(valid, weight, 0.0)[..., None]
        total = total + contribution
    return jnp.moveaxis(total.astype(x.dtype), -1, 1)


def AffineGrid(theta: Any, size: Any, align_corners: int = 0) -> Any:
    dims = ints(size, "AffineGrid's size")
    if len(dims) not in (4, 5):
        raise OpError(f"AffineGrid size {dims}: expected [N, C, H, W] or [N, C, D, H, W]")
    spatial = dims[2:]
    t = to_jax(theta)
    axes = []
    for d in reversed(spatial):  # x (the innermost dim) first, as the grid's columns
        if align_corners:
            step = np.linspace(-1.0, 1.0, d) if d > 1 else np.zeros(1)
        else:
            step = (np.arange(d) * 2.0 + 1.0) / d - 1.0
        axes.append(step)
    mesh = np.meshgrid(*axes[::-1], indexing="ij")  # each [*spatial]
    points = np.stack([m for m in mesh[::-1]] + [np.ones_like(mesh[0])], axis=-1)
    base = jnp.asarray(points.reshape(-1, len(spatial) + 1), t.dtype)
    out = jnp.einsum("pk,njk->npj", base, t)
    return jnp.reshape(out, (dims[0], *spatial, len(spatial)))


def _bilinear_zero_padded(data: Any, y: Any, x: Any, lead: tuple[Any, ...]) -> Any:
    """``data`` [..., H, W, C] sampled at pixel coordinates (y, x); corners outside the image
    count as zero. ``lead`` are the index arrays of the leading axes."""
    h, w = data.shape[-3], data.shape[-2]
    y0, x0 = jnp.floor(y), jnp.floor(x)
    total: Any = 0
    for dy in (0, 1):
        for dx in (0, 1):
            yy, xx = y0 + dy, x0 + dx
            weight = (1 - jnp.abs(y - yy)) * (1 - jnp.abs(x - xx))
            inside = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
            yi = jnp.clip(yy, 0, h - 1).astype(jnp.int32)
            xi = jnp.clip(xx, 0, w - 1).astype(jnp.int32)
            picked = data[(*lead, yi, xi)]
            total = total + picked * jnp.where(inside, weight, 0)[..., None]
    return total


def DeformConv(
    X: Any,
    W: Any,
    offset: Any,
    B: Any = None,
    mask: Any = None,
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    offset_group: int = 1,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> Any:
    """2-D deformable convolution: every kernel tap reads the input at its own learned offset
    (bilinear, zero outside), scaled by ``mask``, then one grouped contraction with ``W``."""
    x, w, off = to_jax(X), to_jax(W), to_jax(offset)
    if x.ndim != 4:
        raise OpError(f"DeformConv supports 2-D images ([N, C, H, W]), got rank {x.ndim}")
    n, c = x.shape[0], x.shape[1]
    kh, kw = kernel_shape or w.shape[2:]
    dh, dw = dilations or [1, 1]
    sh, sw = strides or [1, 1]
    top, left = (pads or [0, 0, 0, 0])[:2]
    oh, ow = off.shape[2], off.shape[3]
    og = offset_group
    off = jnp.reshape(off, (n, og, kh, kw, 2, oh, ow)).astype(jnp.float32)
    # Undeformed tap positions, [kH, 1, oH, 1] and [1, kW, 1, oW]; offsets [N, og, kH, kW, oH, oW].
    base_y = (np.arange(kh) * dh)[:, None, None, None] + (np.arange(oh) * sh - top)[:, None]
    base_x = (np.arange(kw) * dw)[:, None, None] + (np.arange(ow) * sw - left)[None, :]
    y = base_y + off[:, :, :, :, 0]
    xs = base_x + off[:, :, :, :, 1]
    data = jnp.moveaxis(jnp.reshape(x, (n, og, c // og, *x.shape[2:])), 2, -1)
    lead = (
        jnp.reshape(jnp.arange(n), (n, 1, 1, 1, 1, 1)),
        jnp.reshape(jnp.arange(og), (1, og, 1, 1, 1, 1)),
    )
    cols = _bilinear_zero_padded(data.astype(jnp.float32), y, xs, lead)  # [..., Cg]
    if mask is not None:
        cols = cols * jnp.reshape(to_jax(mask), (n, og, kh, kw, oh, ow))[..., None]
    cols = jnp.moveaxis(cols, -1, 2)  # [N, og, Cg, kH, kW, oH, oW]
    cols = jnp.reshape(cols, (n, group, c // group, kh, kw, oh, ow))
    kernel = jnp.reshape(w, (group, w.shape[0] // group, c // group, kh, kw))
    out = jnp.einsum("ngckhab,gockh->ngoab", cols, kernel.astype(jnp.float32), precision="highest")
    out = jnp.reshape(out, (n, w.shape[0], oh, ow))
    if B is not None:
        out = out + to_jax(B).astype(jnp.float32)[None, :, None, None]
    return out.astype(x.dtype)
