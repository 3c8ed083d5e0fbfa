"""Layout tags and their conversions."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the XLA backend needs jax")

from enginekit.backends.xla import layout


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("tag", [layout.NHWC, layout.HWIO])
def test_layouts_round_trip(rank, tag):
    x = np.arange(np.prod(range(2, rank + 2))).reshape(range(2, rank + 2))
    assert np.array_equal(layout.from_layout(layout.to_layout(x, tag), tag), x)


def test_nhwc_moves_channels_last_and_hwio_moves_kernel_space_first():
    assert layout.to_layout(np.zeros((1, 3, 5, 7)), layout.NHWC).shape == (1, 5, 7, 3)
    assert layout.to_layout(np.zeros((8, 3, 5, 7)), layout.HWIO).shape == (5, 7, 3, 8)


def test_onnx_axes_map_to_their_channels_last_position():
    assert [layout.nhwc_axis(a, 4) for a in (0, 1, 2, 3, -1)] == [0, 3, 1, 2, 2]


def test_pads_reorder_to_channels_last():
    pads = np.array([0, 1, 2, 3, 4, 5, 6, 7])
    args, _ = layout.remap_pad([np.zeros((1, 1, 1, 1)), pads], {}, 4)
    assert args[1].tolist() == [0, 2, 3, 1, 4, 6, 7, 5]


def test_reductions_with_keepdims_zero_do_not_follow_channels_last():
    assert layout.remap_reduce([np.zeros(1)], {"keepdims": 0, "axes": [1]}, 4) is None
    assert layout.remap_reduce([np.zeros(1)], {"axes": [2, 3]}, 4)[1]["axes"] == [1, 2]
