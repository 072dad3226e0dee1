"""Problem geometry as the kernels of both built-in backends see it: always three spatial
dimensions.

1D and 2D problems get leading singleton dimensions (size 1, kernel 1, stride 1, no padding),
so one set of 3D kernels serves every rank. Arrays are viewed (never copied) as 5D:
channels-first ``(N, C, S0, S1, S2)``, channels-last ``(N, S0, S1, S2, C)``.
No Numba here; the per-dimension arithmetic is :mod:`numbaconv._geometry`'s.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from ._geometry import dgrad_as_conv


class Geom(NamedTuple):
    n: int
    c: int
    k: int
    groups: int
    s: tuple        # input size, 3 dims
    r: tuple        # kernel size
    p: tuple        # output size
    stride: tuple
    dilation: tuple
    before: tuple   # zeros read before the input
    trailing: tuple  # zeros read after it (negative: input tail unread)
    channels_last: bool

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def kg(self) -> int:
        return self.k // self.groups

    @property
    def taps(self) -> int:
        return math.prod(self.r)

    @property
    def positions(self) -> int:
        """Output positions per image."""
        return math.prod(self.p)

    @property
    def pixels(self) -> int:
        """Input positions per image."""
        return math.prod(self.s)

    @property
    def pointwise(self) -> bool:
        """1x1 kernel, stride 1, no padding: the convolution is a matrix product over x."""
        return (self.r == (1, 1, 1) and self.stride == (1, 1, 1)
                and self.before == (0, 0, 0) and self.trailing == (0, 0, 0))

    @property
    def whole_input(self) -> bool:
        """The kernel covers the whole unpadded input once: a matrix product over images.

        Channels-last with groups orders a flattened image (r, g, c), not the (g, r, c) of
        the packed layout, so it is excluded there.
        """
        return (self.p == (1, 1, 1) and self.r == self.s and self.before == (0, 0, 0)
                and self.trailing == (0, 0, 0) and (self.groups == 1 or not self.channels_last))

    def x5(self, a: np.ndarray) -> np.ndarray:
        """x or dx as a 5D view."""
        if self.channels_last:
            return a.reshape((self.n,) + self.s + (self.c,))
        return a.reshape((self.n, self.c) + self.s)

    def y5(self, a: np.ndarray) -> np.ndarray:
        """y or dy as a 5D view."""
        if self.channels_last:
            return a.reshape((self.n,) + self.p + (self.k,))
        return a.reshape((self.n, self.k) + self.p)

    def strides_of(self, size: tuple, channels: int) -> tuple:
        """Element strides along (N, D, H, W, C) of a contiguous array of spatial ``size``
        and ``channels`` in this layout (x: ``s``, ``c``; y: ``p``, ``k``)."""
        d, h, w = size
        if self.channels_last:
            return (d * h * w * channels, h * w * channels, w * channels, channels, 1)
        return (channels * d * h * w, h * w, w, 1, d * h * w)

    def geometry_args(self) -> tuple:
        """The int tuples every packing kernel takes, as int64 arrays (no globals in kernels):
        made once per geometry and shared by every call, so kernels only read them."""
        return int64_arrays((self.s, self.r, self.p, self.stride, self.dilation, self.before))


@functools.lru_cache(maxsize=1024)
def int64_arrays(values: tuple) -> tuple:
    """Each tuple of ints in ``values`` as an int64 array, made once per ``values`` and
    shared by every caller: the kernels' geometry arguments, which they only read (building
    them took several microseconds a call)."""
    return tuple(np.array(v, dtype=np.int64) for v in values)


@functools.lru_cache(maxsize=1024)
def geom(problem) -> Geom:
    """The problem's geometry in three spatial dimensions (remembered per problem: the
    problem's derived sizes cost about 8 us a call to work out)."""
    pad = 3 - problem.ndim

    def three(values, fill):
        return (fill,) * pad + tuple(values)

    return Geom(problem.batch, problem.in_channels, problem.out_channels, problem.groups,
                three(problem.input_size, 1), three(problem.kernel_size, 1),
                three(problem.output_size, 1), three(problem.stride, 1),
                three(problem.dilation, 1), three(problem.padding_before, 0),
                three(problem.trailing_padding, 0), problem.channels_last)



@functools.lru_cache(maxsize=1024)
def data_gradient_as_forward(g: Geom) -> Geom:
    """The stride-1 data gradient as the geometry of a forward convolution over dy, with the
    flipped, transposed kernel (padding from :func:`._geometry.dgrad_as_conv`; remembered
    per geometry, like :func:`geom`)."""
    pads = [dgrad_as_conv(*dims, 1, d, b).padding
            for dims, d, b in zip(zip(g.s, g.p, g.r), g.dilation, g.before)]
    return g._replace(c=g.k, k=g.c, s=g.p, p=g.s, before=tuple(b for b, _ in pads),
                      trailing=tuple(a for _, a in pads))
