"""CPU forward convolution: backend entry -> driver per algorithm -> kernels.

Algorithms: ``gemm`` (the convolution is a matrix product over x itself: 1x1 kernels with
stride 1 and no padding, or kernels as large as the unpadded input), ``im2col`` (pack windows,
then one BLAS product per tile; any problem), ``implicit`` (stride 1, one group: the
micro-kernel reads the windows in a padded copy of x's rows, see ``_implicit``),
``winograd`` (2D 3x3, stride 1, one group: Winograd F(2x2, 3x3), see ``_winograd``) and
``direct`` (Numba loops for grouped convolutions with few channels per group, where GEMM
wastes work).
"""

from __future__ import annotations

import numpy as np

from . import _direct, _gemm, _implicit, _winograd
from ._im2col import add_row_scalars, add_row_vector
from ._layout import Geom, geom


def run(problem, operands, out, algorithm):
    x, w, bias = operands
    g = geom(problem)
    y = out if out is not None else np.empty(problem.y_shape, problem.dtype)
    if algorithm == "gemm":
        _gemm_forward(g, x, w, y)
    elif algorithm == "im2col":
        im2col_forward(g, x, w, y)
    elif algorithm == "direct":
        _direct.forward(g, x, w, y)
    elif algorithm == "implicit":
        if g.stride != (1, 1, 1) or g.g != 1:
            raise ValueError("algorithm: 'implicit' needs stride 1 and one group")
        _implicit.forward(g, x, _gemm.weight_cl(g, w)[0].T, y, False)
    elif algorithm == "winograd":
        _winograd.require(g)
        if not _winograd.forward(g, x, _winograd.transformed_weights(g, w, False), y):
            im2col_forward(g, x, w, y)          # a value not finite: see _winograd
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a forward algorithm")
    if bias is not None:
        add_channel_vector(g, y, bias, problem.channels_last)
    return y


#: Outputs of at least this many values get their bias in a Numba pass shared among the
#: tile workers; smaller ones from NumPy (no kernel to compile, no workers to wake).
#: NumPy's broadcast add, on one thread, was a quarter of a 1x1 forward: channels-last 64 ->
#: 256 channels at 56x56, N = 8 (y 25.7 MB), 7.8 ms with the bias against 5.7 without
#: (Zen 4, 2 cores). A parallel Numba region instead (its OpenMP threads) made the next
#: BLAS-based call slower wherever those threads spin (PyTorch's OpenMP loaded first):
#: hence the tile workers, which the products use anyway.
PARALLEL_BIAS_FROM = 2**16


def add_channel_vector(g: Geom, a: np.ndarray, v: np.ndarray, channels_last: bool) -> None:
    """a += v along the channel axis (bias); a C-contiguous (the backend's outputs are)."""
    channels = v.shape[0]
    if a.size < PARALLEL_BIAS_FROM:
        if channels_last:
            a.reshape(-1, channels)[...] += v
        else:
            a.reshape(a.shape[0], channels, -1)[...] += v[:, None]
        return
    # Channels-last rows are pixels (+= v); channels-first rows are planes (+= v[plane % K]).
    rows, kernel = ((a.reshape(-1, channels), add_row_vector) if channels_last else
                    (a.reshape(a.shape[0] * channels, -1), add_row_scalars))

    def add(span, pick):
        pick(kernel)(rows[span[0]:span[1]], v, span[0])

    _gemm.run_tiles(add, _gemm.worker_ranges(rows.shape[0]))


def _gemm_forward(g: Geom, x, w, y) -> None:
    if g.pointwise and not g.channels_last:
        # y[n] (G, Kg, S) = W (G, Kg, Cg) @ x[n] (G, Cg, S), per image.
        _gemm.matmul(_gemm.weight_cf(g, w), x.reshape(g.n, g.g, g.cg, g.positions),
                     y.reshape(g.n, g.g, g.kg, g.positions))
    elif _gemm.rows_in_place(g):
        # x's rows read in place; w^T (C, K) copied (small next to x).
        _gemm.rows_matmul(x.reshape(-1, g.c), np.ascontiguousarray(w.reshape(g.k, g.c).T),
                          y.reshape(-1, g.k))
    elif g.pointwise:
        # Every position of every image is a row: one product per group.
        _gemm.grouped_matmul(x.reshape(-1, g.g, g.cg),
                             _gemm.weight_cf(g, w).transpose(0, 2, 1),
                             y.reshape(-1, g.g, g.kg))
    elif g.whole_input:
        # Every image is a row of (G, features): features in w's own order, (c, t) when
        # channels-first, (t, c) channels-last (then G == 1).
        wmat = _gemm.weight_cl(g, w) if g.channels_last else _gemm.weight_cf(g, w)
        _gemm.grouped_matmul(x.reshape(g.n, g.g, -1), wmat.transpose(0, 2, 1),
                             y.reshape(g.n, g.g, g.kg))
    else:
        raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")


def im2col_forward(g: Geom, x, w, y, wmat=None) -> None:
    """y = conv(x, w) by packed tiles; ``wmat``, when given, is w already in the layout of
    the product (see below), and w is not read."""
    args = g.geometry_args()
    x5 = g.x5(x)
    per_position = _gemm.packed_bytes_per_position(g, x.itemsize)
    tiles = list(_gemm.tiles(g, per_position, _gemm.largest_operand(x, y)))
    if not g.channels_last:
        if wmat is None:
            wmat = _gemm.weight_cf(g, w)                  # (G, Kg, Cg * taps)

        def tile(job, pick):
            n0, nb, q0, q1 = job
            one_product = _gemm.batch_columns(g, nb)
            col = _gemm.packed_cf(g, x5, args, job, pick, one_product)
            if one_product:
                # One product for the tile, then y's tile copied out image by image.
                prod = _gemm.workspace((g.g, g.kg, col.shape[-1]), x.dtype, "rows")
                np.matmul(wmat, col, out=prod)
                y.reshape(g.n, g.k, -1)[n0:n0 + nb] = \
                    prod.reshape(g.k, nb, -1).transpose(1, 0, 2)
            else:
                np.matmul(wmat, col, out=_gemm.output_columns(g, y, n0, nb, q0, q1))
    else:
        if wmat is None:
            wmat = _gemm.weight_cl(g, w).transpose(0, 2, 1)  # (G, taps * Cg, Kg)

        def tile(job, pick):
            n0, nb, q0, q1 = job
            _gemm.grouped_matmul(_gemm.packed_cl(g, x5, args, job, pick), wmat,
                                 _gemm.output_rows(g, y, n0, nb, q0, q1))
    _gemm.run_tiles(tile, tiles)
