"""CPU data gradient (and transposed convolution): entry -> driver per algorithm -> kernels.

``im2col`` here is its mirror image: one BLAS product per tile gives the packed gradient of
every window (``W^T @ dy``), which col2im adds back into dx; ``gemm`` writes the product
straight into dx when the packing would be the identity; ``implicit`` and ``winograd`` (and
``im2col`` with stride 1) compute the stride-1 data gradient as the forward convolution of
dy with the flipped, transposed kernel.
"""

from __future__ import annotations

import functools

import numpy as np

from .._geometry import dgrad_as_conv
from . import _direct, _gemm, _implicit, _winograd
from ._im2col import col2im_cf, col2im_cl, zero_rows
from ._layout import Geom, geom
from .conv import im2col_forward, add_channel_vector


def run(problem, operands, out, algorithm):
    dy, w = operands
    g = geom(problem)
    dx = out if out is not None else np.empty(problem.x_shape, problem.dtype)
    data_gradient(g, dy, w, dx, problem.accumulate and out is not None, algorithm)
    return dx


def run_transpose(problem, operands, out, algorithm):
    """conv_transpose: the data gradient of the forward geometry, plus bias over C."""
    x, w, bias = operands
    g = geom(problem)
    y = out if out is not None else np.empty(problem.x_shape, problem.dtype)
    data_gradient(g, x, w, y, False, algorithm)
    if bias is not None:
        add_channel_vector(g, y, bias, problem.channels_last)
    return y


def data_gradient(g: Geom, dy, w, dx, accumulate: bool, algorithm: str) -> None:
    if algorithm == "gemm":
        _gemm_dgrad(g, dy, w, dx, accumulate)
        return
    if algorithm == "im2col":
        if g.stride == (1, 1, 1) and not accumulate and _direct.finite(w):
            # A forward convolution of dy with the flipped, transposed kernel: dx is written
            # once, with no zeroing and no col2im read-modify-write of every window. It
            # multiplies the weights by dy's padding, which the reference never does: a
            # non-finite weight would give NaN where the reference has a number.
            im2col_forward(_stride1_as_forward(g), dy, None, dx, _flipped_matrix(g, w))
            return
        _im2col_dgrad(g, dy, w, dx, accumulate)
    elif algorithm == "direct":
        _direct.data_gradient(g, dy, w, dx, accumulate)
    elif algorithm == "implicit":
        if g.g != 1 or (g.stride != (1, 1, 1) and not g.channels_last):
            raise ValueError("algorithm: 'implicit' needs one group, and channels-last with a "
                             "stride")
        if not _direct.finite(w):                  # see im2col above
            _im2col_dgrad(g, dy, w, dx, accumulate)
        elif g.stride != (1, 1, 1):
            # By stride phases, dy read in place: dy's zero columns multiply the weights too.
            _implicit.strided_data_gradient(g, dy, w, dx, accumulate)
        else:
            _implicit.forward(_stride1_as_forward(g), dy, _flipped_matrix(g, w, True)[0], dx,
                              accumulate)
    elif algorithm == "winograd":
        _winograd.require(g)
        forward = _stride1_as_forward(g)
        # With accumulate, or where a value is not finite (see _winograd), col2im.
        if accumulate or not _winograd.forward(
                forward, dy, _winograd.transformed_weights(forward, w, True), dx):
            _im2col_dgrad(g, dy, w, dx, accumulate)
    else:
        raise ValueError(f"algorithm: {algorithm!r} is not a data-gradient algorithm")


@functools.lru_cache(maxsize=1024)
def _stride1_as_forward(g: Geom) -> Geom:
    """The stride-1 data gradient as the geometry of a forward convolution over dy
    (remembered per geometry, like :func:`._layout.geom`)."""
    pads = [dgrad_as_conv(*dims, 1, d, b).padding
            for dims, d, b in zip(zip(g.s, g.p, g.r), g.dilation, g.before)]
    return g._replace(c=g.k, k=g.c, s=g.p, p=g.s, before=tuple(b for b, _ in pads),
                      trailing=tuple(a for _, a in pads))


def _flipped_matrix(g: Geom, w: np.ndarray, channels_last=None) -> np.ndarray:
    """The weight matrix of that convolution, whose kernel is w with each group's (Kg, Cg)
    block transposed and every tap flipped, in one copy: channels-first (G, Cg, Kg * taps),
    channels-last (G, taps * Kg, Cg), as :func:`.conv.im2col_forward` multiplies them (and
    :func:`._implicit.forward`, with ``channels_last`` True, in either layout)."""
    flipped = w.reshape((g.g, g.kg, g.cg, g.taps))[..., ::-1]
    if g.channels_last if channels_last is None else channels_last:
        return _gemm.relayout(flipped.transpose(0, 3, 1, 2), 2).reshape(g.g, -1, g.cg)
    return _gemm.relayout(flipped.transpose(0, 2, 1, 3), 1).reshape(g.g, g.cg, -1)


def _gemm_dgrad(g: Geom, dy, w, dx, accumulate: bool) -> None:
    target = np.empty_like(dx) if accumulate else dx
    if g.pointwise and not g.channels_last:
        _gemm.matmul(_gemm.weight_cf(g, w).transpose(0, 2, 1),
                     dy.reshape(g.n, g.g, g.kg, g.positions),
                     target.reshape(g.n, g.g, g.cg, g.positions))
    elif _gemm.rows_in_place(g):
        _gemm.rows_matmul(dy.reshape(-1, g.k), w.reshape(g.k, g.c), target.reshape(-1, g.c))
    elif g.pointwise:
        _gemm.grouped_matmul(dy.reshape(-1, g.g, g.kg), _gemm.weight_cf(g, w),
                             target.reshape(-1, g.g, g.cg))
    elif g.whole_input:
        wmat = _gemm.weight_cl(g, w) if g.channels_last else _gemm.weight_cf(g, w)
        _gemm.grouped_matmul(dy.reshape(g.n, g.g, g.kg), wmat, target.reshape(g.n, g.g, -1))
    else:
        raise ValueError("algorithm: 'gemm' needs a 1x1 or whole-input kernel")
    if accumulate:
        dx += target


def _im2col_dgrad(g: Geom, dy, w, dx, accumulate: bool) -> None:
    args = g.geometry_args()
    dx5 = g.x5(dx)
    images = dx.reshape(g.n, -1)
    per_position = _gemm.packed_bytes_per_position(g, dx.itemsize)
    # col2im adds each tile into the input rows its windows read, which neighbouring row
    # tiles of one image share: a job is one run of whole images, or all tiles of one image.
    jobs = []
    for tile in _gemm.tiles(g, per_position, _gemm.largest_operand(dx, dy)):
        if jobs and jobs[-1][-1][0] == tile[0]:
            jobs[-1].append(tile)
        else:
            jobs.append([tile])

    def clear(job, pick):
        # Each job zeroes its own images, on its worker: a parallel kernel launched from
        # this thread before the jobs would leave an OpenMP thread spinning while they run
        # (see numbaconv.config on OMP_WAIT_POLICY and runtimes loaded before numbaconv).
        if not accumulate:
            n0 = job[0][0]
            pick(zero_rows)(images[n0:n0 + job[0][1]])

    if not g.channels_last:
        wmat = _gemm.weight_cf(g, w).transpose(0, 2, 1)       # (G, Cg * taps, Kg)

        def image_tiles(job, pick):
            clear(job, pick)
            for n0, nb, q0, q1 in job:
                dcol = _gemm.workspace((nb, g.g, g.cg * g.taps, _gemm.positions_in(q0, q1, g)),
                                       dx.dtype)
                np.matmul(wmat, _gemm.output_columns(g, dy, n0, nb, q0, q1), out=dcol)
                pick(col2im_cf)(dcol.reshape(nb, g.c * g.taps, -1), dx5, n0, q0, q1, *args)
    else:
        wmat = _gemm.weight_cl(g, w)                          # (G, Kg, taps * Cg)

        def image_tiles(job, pick):
            clear(job, pick)
            for n0, nb, q0, q1 in job:
                m = nb * _gemm.positions_in(q0, q1, g)
                dcol = _gemm.workspace((m, g.g, g.taps * g.cg), dx.dtype)
                _gemm.grouped_matmul(_gemm.output_rows(g, dy, n0, nb, q0, q1), wmat, dcol)
                pick(col2im_cl)(dcol.reshape(m, g.g, g.taps, g.cg), dx5, n0, q0, q1, g.g,
                                *args)
    _gemm.run_tiles(image_tiles, jobs)
