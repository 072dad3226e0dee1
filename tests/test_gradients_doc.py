"""Every formula of docs/gradients.md, checked numerically.

Small float64 problems. Convolutions (sections 1 to 5): each formula is evaluated from this
file's own im2col / col2im (written here, independent of numbaconv's kernels and of its
reference backend) and compared with numbaconv's functions, and each gradient is checked to be
the gradient: for the loss ``L = <y, dy>`` the identity ``<dL/dp, v> = <y(p + v) - y(p), dy>``
holds exactly (y is linear in each operand), which is finite differences without their
rounding error.

Recurrent networks (section 7): the doc's cell equations and backpropagation through time,
written out step by step here, are compared with numbaconv's rnn_* functions on the cpu and
reference backends (outputs, every gradient, and the reserve's contents after the forward and
after the data gradient), and with central differences of this file's own forward.

The doc names the test checking each formula; ``test_the_doc_names_only_tests_that_exist``
keeps the two in step.
"""

import itertools
import math
import pathlib
import re

import numpy as np
import pytest

import numbaconv as nc
from numbaconv import _geometry
from numbaconv.problem import rnn_reserve_layout

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "gradients.md"


class Geometry:
    """A convolution problem in the doc's notation (channels-first, explicit padding)."""

    def __init__(self, name, N, C, K, S, R, stride, dilation, padding, groups=1):
        self.name, self.N, self.C, self.K, self.groups = name, N, C, K, groups
        self.S, self.R, self.s, self.d = tuple(S), tuple(R), tuple(stride), tuple(dilation)
        self.pad = tuple(tuple(p) for p in padding)  # ((before, after), ...) per dim
        self.eff = tuple(d * (r - 1) + 1 for r, d in zip(self.R, self.d))
        # The doc's output size: P = floor((S + b + a - eff) / s) + 1.
        self.P = tuple((S_ + b + a - e) // s + 1
                       for S_, (b, a), e, s in zip(self.S, self.pad, self.eff, self.s))
        self.x_shape = (N, C) + self.S
        self.w_shape = (K, C // groups) + self.R
        self.y_shape = (N, K) + self.P

    @property
    def kwargs(self):
        return dict(stride=self.s, dilation=self.d, padding=self.pad, groups=self.groups)

    def __repr__(self):
        return self.name


GEOMETRIES = [
    Geometry("1d_stride2", N=2, C=3, K=4, S=(11,), R=(3,), stride=(2,), dilation=(1,),
             padding=((1, 1),)),
    # The stride leaves the input's last position unread: the data gradient must be 0 there.
    Geometry("1d_stride_remainder_dilated", N=2, C=2, K=3, S=(10,), R=(3,), stride=(3,),
             dilation=(2,), padding=((2, 0),)),
    # Padding wider than the kernel: the data gradient's derived padding is negative (crop).
    Geometry("1d_padding_wider_than_kernel", N=1, C=2, K=2, S=(7,), R=(2,), stride=(1,),
             dilation=(1,), padding=((4, 3),)),
    Geometry("2d_grouped_asymmetric", N=2, C=4, K=6, S=(7, 6), R=(3, 2), stride=(2, 1),
             dilation=(1, 2), padding=((1, 0), (2, 1)), groups=2),
    Geometry("3d_small", N=1, C=2, K=2, S=(4, 5, 3), R=(2, 2, 1), stride=(1, 2, 1),
             dilation=(1, 1, 2), padding=((0, 1), (1, 1), (0, 0))),
]


@pytest.fixture(params=GEOMETRIES, ids=repr)
def g(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(20240607)


def _random(rng, shape):
    return rng.standard_normal(shape)


# --- this file's own im2col, col2im and plain correlation ----------------------------------

def im2col(x, R, stride, dilation, padding, P):
    """The doc's Xcol: shape (N, C * prod(R), prod(P)), rows ordered (c, r), columns p.

    ``Xcol[n, (c, r), p] = x[n, c, p*s - b + r*d]``, zero where that index is outside x.
    ``padding`` may be negative (cropping), which the doc's derived paddings need.
    """
    N, C = x.shape[:2]
    S = x.shape[2:]
    # Pad generously (and crop where negative) so every index the windows read exists.
    lo = [max(b, 0) for b, _ in padding]
    need = [(p - 1) * s + (r - 1) * d + 1 for p, s, r, d in zip(P, stride, R, dilation)]
    hi = [max(n_ - (S_ + b), 0) for n_, S_, (b, _) in zip(need, S, padding)]
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(lo, hi)))
    # Start of window 0 in xp: -b in x's indices, x's index 0 sits at lo in xp.
    start = [l_ - b for l_, (b, _) in zip(lo, padding)]
    rows = []
    for r in itertools.product(*(range(k) for k in R)):
        index = tuple(slice(st + ri * d, st + ri * d + (p - 1) * s + 1, s)
                      for st, ri, d, p, s in zip(start, r, dilation, P, stride))
        rows.append(xp[(slice(None), slice(None)) + index].reshape(N, C, -1))
    # (N, C, prod(R), prod(P)) -> rows (c, r)
    return np.stack(rows, axis=2).reshape(N, C * math.prod(R), math.prod(P))


def col2im(cols, C, S, R, stride, dilation, padding, P):
    """The adjoint of :func:`im2col`: add every column entry back where it was read from."""
    N = cols.shape[0]
    lo = [max(b, 0) for b, _ in padding]
    need = [(p - 1) * s + (r - 1) * d + 1 for p, s, r, d in zip(P, stride, R, dilation)]
    hi = [max(n_ - (S_ + b), 0) for n_, S_, (b, _) in zip(need, S, padding)]
    xp = np.zeros((N, C) + tuple(S_ + l_ + h for S_, l_, h in zip(S, lo, hi)))
    start = [l_ - b for l_, (b, _) in zip(lo, padding)]
    cols = cols.reshape((N, C, math.prod(R)) + tuple(P))
    for i, r in enumerate(itertools.product(*(range(k) for k in R))):
        index = tuple(slice(st + ri * d, st + ri * d + (p - 1) * s + 1, s)
                      for st, ri, d, p, s in zip(start, r, dilation, P, stride))
        xp[(slice(None), slice(None)) + index] += cols[:, :, i]
    return xp[(slice(None), slice(None)) + tuple(slice(l_, l_ + S_) for l_, S_ in zip(lo, S))]


def correlate(x, w, stride, dilation, padding, groups=1):
    """A plain grouped correlation through im2col: the doc's forward formula, no bias."""
    N, C = x.shape[:2]
    K, R = w.shape[0], w.shape[2:]
    P = tuple((S_ + b + a - (d * (r - 1) + 1)) // s + 1
              for S_, (b, a), r, d, s in zip(x.shape[2:], padding, R, dilation, stride))
    cols = im2col(x, R, stride, dilation, padding, P)
    cg, kg = C // groups, K // groups
    rows_per_group = cg * math.prod(R)
    y = np.empty((N, K, math.prod(P)))
    for grp in range(groups):
        w_mat = w[grp * kg:(grp + 1) * kg].reshape(kg, -1)
        y[:, grp * kg:(grp + 1) * kg] = np.einsum(
            "kj,njp->nkp", w_mat, cols[:, grp * rows_per_group:(grp + 1) * rows_per_group])
    return y.reshape((N, K) + P)


def dilate(a, factors):
    """Insert ``factor - 1`` zeros between neighbours along each spatial dim."""
    out = np.zeros(a.shape[:2] + tuple((n - 1) * f + 1 for n, f in zip(a.shape[2:], factors)))
    out[(slice(None), slice(None)) + tuple(slice(None, None, f) for f in factors)] = a
    return out


def flip(w):
    """Reverse the kernel along every spatial dim."""
    return w[(slice(None), slice(None)) + (slice(None, None, -1),) * (w.ndim - 2)]


def swap_channels(w, groups):
    """(K, C/G, *R) -> (C, K/G, *R): per group, the weight matrix transposed."""
    K, cg = w.shape[:2]
    kg = K // groups
    blocks = w.reshape((groups, kg, cg) + w.shape[2:])
    return np.swapaxes(blocks, 1, 2).reshape((groups * cg, kg) + w.shape[2:])


# --- section 1: the forward convolution as a matrix product --------------------------------

def test_output_size_formula(g):
    assert nc.conv_output_shape(g.x_shape, g.w_shape, **g.kwargs) == g.y_shape


def test_forward_is_weight_matrix_times_im2col(g, rng):
    x, w, b = _random(rng, g.x_shape), _random(rng, g.w_shape), _random(rng, g.K)
    cols = im2col(x, g.R, g.s, g.d, g.pad, g.P)
    cg, kg = g.C // g.groups, g.K // g.groups
    rows = cg * math.prod(g.R)
    y = np.concatenate([np.einsum("kj,njp->nkp", w[i * kg:(i + 1) * kg].reshape(kg, -1),
                                  cols[:, i * rows:(i + 1) * rows])
                        for i in range(g.groups)], axis=1) + b[:, None]
    np.testing.assert_allclose(y.reshape(g.y_shape), nc.conv(x, w, b, **g.kwargs),
                               rtol=1e-12, atol=1e-12)


# --- section 2: the weight gradient --------------------------------------------------------

def weight_gradient_by_im2col(x, dy, g):
    """The doc's dW = sum over n of dY[n] @ Xcol[n]^T, per group, shaped like w."""
    cols = im2col(x, g.R, g.s, g.d, g.pad, g.P)
    dY = dy.reshape(g.N, g.K, -1)
    kg, rows = g.K // g.groups, g.C // g.groups * math.prod(g.R)
    return np.concatenate([np.einsum("nkp,njp->kj", dY[:, i * kg:(i + 1) * kg],
                                     cols[:, i * rows:(i + 1) * rows])
                           for i in range(g.groups)]).reshape(g.w_shape)


def test_weight_gradient_is_dy_times_im2col_transposed(g, rng):
    x, dy = _random(rng, g.x_shape), _random(rng, g.y_shape)
    dw = weight_gradient_by_im2col(x, dy, g)
    np.testing.assert_allclose(dw, nc.conv_backward_weight(x, dy, g.w_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)
    # ... and it is dL/dw for L = <conv(x, w), dy>: <dw, v> = <conv(x, v), dy> for any v.
    v = _random(rng, g.w_shape)
    assert np.vdot(dw, v) == pytest.approx(np.vdot(correlate(x, v, g.s, g.d, g.pad,
                                                              g.groups), dy), rel=1e-12)


def test_weight_gradient_index_form():
    """dw[k, c, r] = sum over n, p of dy[n, k, p] * x[n, c, p*s - b + r*d], by plain loops."""
    g = GEOMETRIES[1]
    rng = np.random.default_rng(5)
    x, dy = _random(rng, g.x_shape), _random(rng, g.y_shape)
    (S,), (R,), (P,), (s,), (d,), ((b, _),) = g.S, g.R, g.P, g.s, g.d, g.pad
    dw = np.zeros(g.w_shape)
    for k, c, r, n, p in itertools.product(range(g.K), range(g.C), range(R), range(g.N),
                                           range(P)):
        i = p * s - b + r * d
        if 0 <= i < S:
            dw[k, c, r] += dy[n, k, p] * x[n, c, i]
    np.testing.assert_allclose(dw, nc.conv_backward_weight(x, dy, g.w_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)


def test_weight_gradient_as_convolution(g, rng):
    """x correlated with dy as the kernel: stride and dilation trade places."""
    x, dy = _random(rng, g.x_shape), _random(rng, g.y_shape)
    # Batch becomes the reduced channel axis, x's channels the batch, dy's channels the
    # output channels; padding after = (R-1)d + (P-1)s - b - S + 1 (negative crops).
    pads = tuple((b, (r - 1) * d + (p - 1) * s - b - S_ + 1)
                 for (b, _), r, d, p, s, S_ in zip(g.pad, g.R, g.d, g.P, g.s, g.S))
    cg, kg = g.C // g.groups, g.K // g.groups
    out = np.concatenate([  # per group: (C/G, K/G, *R)
        correlate(np.swapaxes(x[:, i * cg:(i + 1) * cg], 0, 1),
                  np.swapaxes(dy[:, i * kg:(i + 1) * kg], 0, 1),
                  stride=g.d, dilation=g.s, padding=pads)
        for i in range(g.groups)], axis=1)
    assert out.shape[2:] == g.R
    np.testing.assert_allclose(np.swapaxes(out, 0, 1),
                               nc.conv_backward_weight(x, dy, g.w_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)
    for dim, (b, after) in enumerate(pads):
        geo = _geometry.wgrad_as_conv(g.S[dim], g.P[dim], g.R[dim], g.s[dim], g.d[dim], b)
        assert geo.padding == (b, after) and (geo.stride, geo.dilation) == (g.d[dim], g.s[dim])


# --- section 3: the data gradient ----------------------------------------------------------

def test_data_gradient_is_col2im_of_w_transposed_times_dy(g, rng):
    w, dy = _random(rng, g.w_shape), _random(rng, g.y_shape)
    dY = dy.reshape(g.N, g.K, -1)
    kg = g.K // g.groups
    # dXcol[n] = W^T dY[n], per group; then col2im scatters it back onto x's grid.
    dcols = np.concatenate([np.einsum("kj,nkp->njp", w[i * kg:(i + 1) * kg].reshape(kg, -1),
                                      dY[:, i * kg:(i + 1) * kg])
                            for i in range(g.groups)], axis=1)
    dx = col2im(dcols, g.C, g.S, g.R, g.s, g.d, g.pad, g.P)
    np.testing.assert_allclose(dx, nc.conv_backward_data(dy, w, g.x_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)
    # ... and it is dL/dx for L = <conv(x, w), dy>: <dx, v> = <conv(v, w), dy>.
    v = _random(rng, g.x_shape)
    assert np.vdot(dx, v) == pytest.approx(
        np.vdot(correlate(v, w, g.s, g.d, g.pad, g.groups), dy), rel=1e-12)


def test_col2im_is_the_transpose_of_im2col(g, rng):
    """<im2col(x), c> = <x, col2im(c)>: what makes the data gradient a transposed map."""
    x = _random(rng, g.x_shape)
    cols = _random(rng, (g.N, g.C * math.prod(g.R), math.prod(g.P)))
    lhs = np.vdot(im2col(x, g.R, g.s, g.d, g.pad, g.P), cols)
    rhs = np.vdot(x, col2im(cols, g.C, g.S, g.R, g.s, g.d, g.pad, g.P))
    assert lhs == pytest.approx(rhs, rel=1e-12)


def derived_data_gradient_padding(g):
    """The doc's padding of the dilated dy: (eff-1-b, eff-1-a_read) per dim."""
    pads = []
    for S_, (b, _), e, p, s in zip(g.S, g.pad, g.eff, g.P, g.s):
        a_read = (p - 1) * s + e - b - S_  # the trailing pad the last window reads
        pads.append((e - 1 - b, e - 1 - a_read))
    return tuple(pads)


def test_data_gradient_as_convolution_with_input_dilation(g, rng):
    """Dilate dy by the stride, pad (or crop), correlate with the flipped, channel-swapped
    kernel at the original dilation and stride 1."""
    w, dy = _random(rng, g.w_shape), _random(rng, g.y_shape)
    pads = derived_data_gradient_padding(g)
    dx = correlate(dilate(dy, g.s), flip(swap_channels(w, g.groups)), stride=(1,) * len(g.S),
                   dilation=g.d, padding=pads, groups=g.groups)
    np.testing.assert_allclose(dx, nc.conv_backward_data(dy, w, g.x_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)
    for dim, pair in enumerate(pads):
        geo = _geometry.dgrad_as_conv(g.S[dim], g.P[dim], g.R[dim], g.s[dim], g.d[dim],
                                      g.pad[dim][0])
        assert geo.padding == pair and geo.input_dilation == g.s[dim] and geo.flip


def test_derived_padding_crops_and_zeroes_where_the_doc_says():
    crop = GEOMETRIES[2]          # padding before 4 > eff - 1 = 1
    assert derived_data_gradient_padding(crop)[0][0] < 0
    tail = GEOMETRIES[1]          # stride 3 leaves x's last position unread
    pads = derived_data_gradient_padding(tail)
    assert pads[0][1] > tail.eff[0] - 1
    rng = np.random.default_rng(3)
    dx = nc.conv_backward_data(_random(rng, tail.y_shape), _random(rng, tail.w_shape),
                               tail.x_shape, **tail.kwargs)
    assert np.all(dx[..., -1] == 0)


def test_stride_makes_the_input_size_ambiguous():
    """Several S give the same P; conv_backward_data needs input_shape to pick one."""
    w, dy = np.ones((1, 1, 3)), np.ones((1, 1, 4))
    sizes = [S for S in range(3, 20)
             if nc.conv_output_shape((1, 1, S), w.shape, stride=3) == (1, 1, 4)]
    assert sizes == [12, 13, 14]  # floor((S - 3) / 3) + 1 = 4
    for S in sizes:
        dx = nc.conv_backward_data(dy, w, (1, 1, S), stride=3)
        assert dx.shape == (1, 1, S) and np.all(dx[..., 12:] == 0)


# --- section 4: the bias gradient ----------------------------------------------------------

@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_bias_gradient_is_dy_summed_over_batch_and_positions(g, rng, layout):
    dy = _random(rng, g.y_shape)
    db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
    given = np.moveaxis(dy, 1, -1) if layout == "channels_last" else dy
    np.testing.assert_allclose(nc.conv_backward_bias(given, layout=layout), db, rtol=1e-12)
    # ... and it is dL/db: moving b by v moves y[n, k, p] by v[k] at every (n, p).
    v = _random(rng, g.K)
    shift = np.broadcast_to(v.reshape((1, -1) + (1,) * len(g.S)), g.y_shape)
    assert np.vdot(db, v) == pytest.approx(np.vdot(shift, dy), rel=1e-12)


# --- section 5: the transposed convolution and its backward --------------------------------

def transposed(g):
    """The transposed convolution paired with ``g``: input of shape y, output of shape x."""
    output_padding = tuple(S_ - ((p - 1) * s - b - a + e)
                           for S_, p, s, (b, a), e in zip(g.S, g.P, g.s, g.pad, g.eff))
    return dict(g.kwargs, output_padding=output_padding)


def _valid_output_padding(g):
    op = transposed(g)["output_padding"]
    return all(0 <= o < max(s, d) for o, s, d in zip(op, g.s, g.d))


def test_transposed_convolution_output_size(g):
    if not _valid_output_padding(g):
        pytest.skip("this size needs an output_padding PyTorch's rule does not allow")
    assert nc.conv_output_shape(g.y_shape, g.w_shape, transposed=True,
                                **transposed(g)) == g.x_shape


def test_transposed_convolution_is_the_data_gradient(g, rng):
    if not _valid_output_padding(g):
        pytest.skip("this size needs an output_padding PyTorch's rule does not allow")
    x_t, w = _random(rng, g.y_shape), _random(rng, g.w_shape)
    y_t = nc.conv_transpose(x_t, w, **transposed(g))
    np.testing.assert_allclose(y_t, nc.conv_backward_data(x_t, w, g.x_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)
    # The adjoint identity: <conv(u, w), x_t> = <u, conv_transpose(x_t, w)>.
    u = _random(rng, g.x_shape)
    assert np.vdot(correlate(u, w, g.s, g.d, g.pad, g.groups), x_t) == pytest.approx(
        np.vdot(u, y_t), rel=1e-12)


def test_transposed_convolution_backward(g, rng):
    """dx = conv(dy, w); dw = conv's weight gradient with input and output swapped;
    db = dy summed over everything but its channels."""
    if not _valid_output_padding(g):
        pytest.skip("this size needs an output_padding PyTorch's rule does not allow")
    x_t, w = _random(rng, g.y_shape), _random(rng, g.w_shape)
    dy_t = _random(rng, g.x_shape)
    dx, dw, db = nc.conv_transpose_backward(dy_t, x_t, w, **transposed(g))
    np.testing.assert_allclose(dx, correlate(dy_t, w, g.s, g.d, g.pad, g.groups),
                               rtol=1e-12, atol=1e-12)
    # Section 2's dW = sum_n dY Xcol^T with dy_t in the place of x and x_t in that of dy.
    np.testing.assert_allclose(dw, weight_gradient_by_im2col(dy_t, x_t, g), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(dw, nc.conv_backward_weight(dy_t, x_t, g.w_shape, **g.kwargs),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, dy_t.sum(axis=(0,) + tuple(range(2, dy_t.ndim))),
                               rtol=1e-12)
    # Each is the gradient of L = <conv_transpose(x_t, w), dy_t>.
    v_x, v_w = _random(rng, g.y_shape), _random(rng, g.w_shape)
    assert np.vdot(dx, v_x) == pytest.approx(
        np.vdot(nc.conv_transpose(v_x, w, **transposed(g)), dy_t), rel=1e-12)
    assert np.vdot(dw, v_w) == pytest.approx(
        np.vdot(nc.conv_transpose(x_t, v_w, **transposed(g)), dy_t), rel=1e-12)


# --- recurrent networks (section 7) --------------------------------------------------------
# The doc's equations for one layer and one direction, written out step by step in NumPy
# (independent of numbaconv's kernels and of its reference backend), compared with numbaconv's
# public rnn_* functions on every backend that runs them, and checked against finite
# differences of this file's own forward.

RNN_T, RNN_N, RNN_I, RNN_H, RNN_P = 4, 3, 3, 5, 2
GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


@pytest.fixture(params=["cpu", "reference"])
def rnn_backend(request):
    """Runs the test with only this backend (no fallback)."""
    with nc.use_backend(request.param):
        yield request.param


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def rnn_problem(mode, rng, proj_size=0, **cfg_kwargs):
    """A config, its flat float64 parameters, and x, h0, c0, dy, dhy, dcy of the doc."""
    cfg = nc.RNNConfig(mode, RNN_I, RNN_H, proj_size=proj_size, **cfg_kwargs)
    ld, out = cfg.num_layers * cfg.num_directions, cfg.out_size
    a = dict(params=rng.uniform(-0.6, 0.6, cfg.num_params),
             x=_random(rng, (RNN_T, RNN_N, RNN_I)),
             h0=0.5 * _random(rng, (ld, RNN_N, out)),
             c0=0.5 * _random(rng, (ld, RNN_N, RNN_H)) if mode == "lstm" else None,
             dy=_random(rng, (RNN_T, RNN_N, cfg.num_directions * out)),
             dhy=_random(rng, (ld, RNN_N, out)),
             dcy=_random(rng, (ld, RNN_N, RNN_H)) if mode == "lstm" else None)
    return cfg, a


def weights(cfg, params, layer=0, direction=0):
    suffix = f"_l{layer}" + ("_reverse" if direction else "")
    views = nc.rnn_param_views(cfg, params)
    return {key: views.get(key + suffix) for key in
            ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")}


def doc_forward(mode, x, h0, c0, w):
    """The doc's forward equations, one layer, one direction, steps in order.

    Returns y (T, N, P), hy, cy and per step what the backward reads (``acts``, the stored
    activations in the reserve's order; ``c``; ``c_prev``; ``h_prev``; ``m``)."""
    H = w["weight_hh"].shape[0] // GATES[mode]
    b_ih = w["bias_ih"] if w["bias_ih"] is not None else 0.0
    b_hh = w["bias_hh"] if w["bias_hh"] is not None else 0.0
    h, c, ys, steps = h0, c0, [], []
    for x_t in x:
        xg = x_t @ w["weight_ih"].T + b_ih          # the input path, x_t W_ih^T + b_ih
        hg = h @ w["weight_hh"].T + b_hh            # the hidden path, h_{t-1} W_hh^T + b_hh
        step = dict(h_prev=h, c_prev=c)
        if mode == "lstm":
            a = xg + hg
            i, f = sigmoid(a[:, :H]), sigmoid(a[:, H:2 * H])
            g, o = np.tanh(a[:, 2 * H:3 * H]), sigmoid(a[:, 3 * H:])
            c = f * c + i * g
            m = o * np.tanh(c)
            h = m @ w["weight_hr"].T if w["weight_hr"] is not None else m
            step.update(acts=np.concatenate([i, f, g, o], axis=1), c=c, m=m)
        elif mode == "gru":
            r = sigmoid(xg[:, :H] + hg[:, :H])
            z = sigmoid(xg[:, H:2 * H] + hg[:, H:2 * H])
            hn = hg[:, 2 * H:]                      # W_hn h + b_hn, before the reset gate
            n = np.tanh(xg[:, 2 * H:] + r * hn)
            h = (1 - z) * n + z * h
            step.update(acts=np.concatenate([r, z, n, hn], axis=1))
        else:
            a = xg + hg
            h = np.tanh(a) if mode == "rnn_tanh" else np.maximum(a, 0)
            step.update(acts=h)
        ys.append(h)
        steps.append(step)
    return np.stack(ys), h, c, steps


def doc_backward(mode, steps, x, dy, dhy, dcy, w):
    """The doc's BPTT: steps in reverse, then the weight gradients as sums over steps.

    Returns dx, dh0, dc0, the per-step gate gradients as the reserve stores them, the
    per-step gradient of h (``dh``, what the projection's dproj region holds) and a dict of
    parameter gradients by PyTorch's names (no layer suffix)."""
    H = w["weight_hh"].shape[0] // GATES[mode]
    w_ih, w_hh, w_hr = w["weight_ih"], w["weight_hh"], w["weight_hr"]
    T = len(steps)
    dx, stored, dhs = np.zeros_like(x), [None] * T, [None] * T
    dh, dc = dhy, dcy
    grads = {k: np.zeros_like(v) for k, v in w.items() if v is not None}
    for t in reversed(range(T)):
        s = steps[t]
        dh = dh + dy[t]                              # total gradient of h_t
        dhs[t] = dh
        if mode == "lstm":
            i, f, g, o = (s["acts"][:, k * H:(k + 1) * H] for k in range(4))
            dm = dh @ w_hr if w_hr is not None else dh
            tc = np.tanh(s["c"])
            dc = dc + dm * o * (1 - tc ** 2)
            da = np.concatenate([dc * g * i * (1 - i), dc * s["c_prev"] * f * (1 - f),
                                 dc * i * (1 - g ** 2), dm * tc * o * (1 - o)], axis=1)
            d_ih = d_hh = da
            dc = dc * f
            if w_hr is not None:
                grads["weight_hr"] += dh.T @ s["m"]
        elif mode == "gru":
            r, z, n, hn = (s["acts"][:, k * H:(k + 1) * H] for k in range(4))
            dn = dh * (1 - z) * (1 - n ** 2)         # gradient of n's pre-activation
            dz = dh * (s["h_prev"] - n) * z * (1 - z)
            dr = dn * hn * r * (1 - r)
            d_ih = np.concatenate([dr, dz, dn], axis=1)
            d_hh = np.concatenate([dr, dz, r * dn], axis=1)
            da = np.concatenate([d_hh, dn], axis=1)  # the reserve's order: hidden path first
        else:
            deriv = 1 - s["acts"] ** 2 if mode == "rnn_tanh" else (s["acts"] > 0)
            da = d_ih = d_hh = dh * deriv
        stored[t] = da
        dx[t] = d_ih @ w_ih
        grads["weight_ih"] += d_ih.T @ x[t]
        grads["weight_hh"] += d_hh.T @ s["h_prev"]
        if "bias_ih" in grads:
            grads["bias_ih"] += d_ih.sum(axis=0)
            grads["bias_hh"] += d_hh.sum(axis=0)
        dh = d_hh @ w_hh + (dh * z if mode == "gru" else 0)
    return dx, dh, dc, np.stack(stored), np.stack(dhs), grads


def numbaconv_step(cfg, a, dropout_seed=None):
    """One training step through the public functions, keeping snapshots of the reserve."""
    reserve = np.empty(nc.rnn_reserve_size(cfg, RNN_T, RNN_N))
    y, hy, cy, _ = nc.rnn_forward(cfg, a["x"], a["params"], a["h0"], a["c0"], training=True,
                                  reserve=reserve, dropout_seed=dropout_seed)
    after_forward = reserve.copy()
    dx, dh0, dc0 = nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["h0"],
                                        cx=a["c0"], dhy=a["dhy"], dcy=a["dcy"])
    after_data = reserve.copy()
    dparams = nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["h0"])
    return dict(y=y, hy=hy, cy=cy, dx=dx, dh0=dh0, dc0=dc0, dparams=dparams,
                after_forward=after_forward, after_data=after_data,
                layout=rnn_reserve_layout(cfg, RNN_T, RNN_N))


def directional_check(loss, arrays, grads, rng, h=1e-6):
    """<grad, v> against the central difference of ``loss`` along a random v, per array."""
    for array, grad in zip(arrays, grads):
        v = _random(rng, array.shape)
        array += h * v
        plus = loss()
        array -= 2 * h * v
        minus = loss()
        array += h * v
        assert (plus - minus) / (2 * h) == pytest.approx(np.vdot(grad, v), rel=1e-6,
                                                         abs=1e-9)


def check_one_layer(mode, rng, proj_size=0, bias=True):
    """The doc's forward and backward against numbaconv, and against finite differences."""
    cfg, a = rnn_problem(mode, rng, proj_size=proj_size, bias=bias)
    w = weights(cfg, a["params"])
    y, hy, cy, steps = doc_forward(mode, a["x"], a["h0"][0],
                                   a["c0"][0] if a["c0"] is not None else None, w)
    dx, dh0, dc0, stored, dhs, grads = doc_backward(
        mode, steps, a["x"], a["dy"], a["dhy"][0], a["dcy"][0] if a["dcy"] is not None
        else None, w)
    got = numbaconv_step(cfg, a)
    close = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["y"], y, **close)
    np.testing.assert_allclose(got["hy"][0], hy, **close)
    np.testing.assert_allclose(got["dx"], dx, **close)
    np.testing.assert_allclose(got["dh0"][0], dh0, **close)
    if mode == "lstm":
        np.testing.assert_allclose(got["cy"][0], cy, **close)
        np.testing.assert_allclose(got["dc0"][0], dc0, **close)
    # The reserve's gate region: activations after the forward, their pre-activation
    # gradients after rnn_backward_data.
    layout = got["layout"]
    np.testing.assert_allclose(layout.gates(got["after_forward"], 0, 0),
                               np.stack([s["acts"] for s in steps]), **close)
    np.testing.assert_allclose(layout.gates(got["after_data"], 0, 0), stored, **close)
    dviews = weights(cfg, got["dparams"])
    for name, grad in grads.items():
        np.testing.assert_allclose(dviews[name], grad, err_msg=name, **close)

    # ... and the doc's backward is the gradient of L = <y, dy> + <hy, dhy> (+ <cy, dcy>).
    h0, c0 = a["h0"][0], (a["c0"][0] if a["c0"] is not None else None)

    def loss():
        y_, hy_, cy_, _ = doc_forward(mode, a["x"], h0, c0, w)
        value = np.vdot(y_, a["dy"]) + np.vdot(hy_, a["dhy"][0])
        return value + (np.vdot(cy_, a["dcy"][0]) if mode == "lstm" else 0.0)

    arrays = [a["x"], h0] + ([c0] if mode == "lstm" else []) + list(w[k] for k in grads)
    checked = [dx, dh0] + ([dc0] if mode == "lstm" else []) + list(grads.values())
    directional_check(loss, arrays, checked, rng)
    return cfg, a, got, steps, stored, dhs, grads


@pytest.mark.parametrize("mode", ["rnn_tanh", "rnn_relu"])
def test_rnn_tanh_and_relu_gate_derivatives(mode, rnn_backend, rng):
    check_one_layer(mode, rng)


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_gate_derivatives(bias, rnn_backend, rng):
    _, _, got, _, _, _, grads = check_one_layer("lstm", rng, bias=bias)
    if bias:  # one pre-activation, two biases: equal gradients
        np.testing.assert_array_equal(grads["bias_ih"], grads["bias_hh"])


def test_lstm_projection_gradients(rnn_backend, rng):
    cfg, a, got, steps, _, dhs, grads = check_one_layer("lstm", rng,
                                                        proj_size=RNN_P)
    layout = got["layout"]
    # After rnn_backward_data: dproj holds dL/dh_t, and the cells region m_t = o * tanh(c_t),
    # the two factors of dW_hr = sum over t of dh_t^T m_t.
    np.testing.assert_allclose(layout.dproj(got["after_data"], 0, 0), dhs, rtol=1e-10,
                               atol=1e-12)
    np.testing.assert_allclose(layout.cells(got["after_data"], 0, 0),
                               np.stack([s["m"] for s in steps]), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layout.cells(got["after_forward"], 0, 0),
                               np.stack([s["c"] for s in steps]), rtol=1e-10, atol=1e-12)


def test_gru_gate_derivatives_and_bias_gradients(rnn_backend, rng):
    _, _, got, steps, stored, _, grads = check_one_layer("gru", rng)
    H = RNN_H
    # r and z: one pre-activation each, so equal bias gradients; n: b_in lies outside the
    # reset gate, b_hn inside, so b_hn's gradient is b_in's times r.
    np.testing.assert_allclose(grads["bias_ih"][:2 * H], grads["bias_hh"][:2 * H])
    dn = stored[:, :, 3 * H:]
    r = np.stack([s["acts"][:, :H] for s in steps])
    np.testing.assert_allclose(grads["bias_ih"][2 * H:], dn.sum(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(grads["bias_hh"][2 * H:], (r * dn).sum(axis=(0, 1)),
                               rtol=1e-12)
    assert np.abs(grads["bias_ih"][2 * H:] - grads["bias_hh"][2 * H:]).max() > 1e-3


def test_backward_data_overwrites_the_gate_activations(rng):
    cfg, a = rnn_problem("lstm", rng)
    reserve = np.empty(nc.rnn_reserve_size(cfg, RNN_T, RNN_N))
    y, _, _, _ = nc.rnn_forward(cfg, a["x"], a["params"], a["h0"], a["c0"], training=True,
                                reserve=reserve)
    layout = rnn_reserve_layout(cfg, RNN_T, RNN_N)
    acts = layout.gates(reserve, 0, 0).copy()  # i, f, o in (0, 1); g in (-1, 1)
    sigmoids = np.concatenate([acts[..., :2 * RNN_H], acts[..., 3 * RNN_H:]], axis=-1)
    assert 0 < sigmoids.min() and sigmoids.max() < 1 and np.abs(acts).max() < 1
    # The weight gradient needs the gate gradients, which do not exist yet.
    with pytest.raises(ValueError, match="rnn_backward_data to have run"):
        nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["h0"])
    nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["h0"], cx=a["c0"])
    assert not np.array_equal(layout.gates(reserve, 0, 0), acts)  # overwritten in place
    # The activations are gone, so a second data gradient cannot run on this reserve.
    with pytest.raises(ValueError, match="already ran"):
        nc.rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["h0"], cx=a["c0"])
    nc.rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["h0"])


@pytest.mark.parametrize("mode, proj_size", [("lstm", RNN_P), ("gru", 0), ("rnn_tanh", 0)])
def test_weight_gradients_are_one_product_over_all_steps(mode, proj_size, rnn_backend, rng):
    cfg, a = rnn_problem(mode, rng, proj_size=proj_size)
    got = numbaconv_step(cfg, a)
    layout, reserve = got["layout"], got["after_data"]
    rows, H, P = RNN_T * RNN_N, RNN_H, cfg.out_size
    # Stack the steps: every sum over t of (N, .)^T (N, .) products is one product over
    # T * N rows.
    DA = layout.gates(reserve, 0, 0).reshape(rows, -1)
    X = a["x"].reshape(rows, RNN_I)
    H_prev = np.concatenate([a["h0"], got["y"][:-1]]).reshape(rows, P)
    if mode == "gru":
        DA_ih, DA_hh = np.concatenate([DA[:, :2 * H], DA[:, 3 * H:]], axis=1), DA[:, :3 * H]
    else:
        DA_ih = DA_hh = DA
    dviews = weights(cfg, got["dparams"])
    close = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dviews["weight_ih"], DA_ih.T @ X, **close)
    np.testing.assert_allclose(dviews["weight_hh"], DA_hh.T @ H_prev, **close)
    np.testing.assert_allclose(dviews["bias_ih"], DA_ih.sum(axis=0), **close)
    np.testing.assert_allclose(dviews["bias_hh"], DA_hh.sum(axis=0), **close)
    if proj_size:
        DH = layout.dproj(reserve, 0, 0).reshape(rows, P)
        M = layout.cells(reserve, 0, 0).reshape(rows, H)
        np.testing.assert_allclose(dviews["weight_hr"], DH.T @ M, **close)
    # ... which is the sum of the per-step products.
    per_step = sum(DA_ih[t * RNN_N:(t + 1) * RNN_N].T @ X[t * RNN_N:(t + 1) * RNN_N]
                   for t in range(RNN_T))
    np.testing.assert_allclose(per_step, DA_ih.T @ X, **close)


def test_reserve_holds_what_the_backward_reads(rng):
    cfg, a = rnn_problem("lstm", rng, num_layers=2, dropout=0.5)
    got = numbaconv_step(cfg, a, dropout_seed=4)
    layout, reserve = got["layout"], got["after_forward"]
    assert layout.size == nc.rnn_reserve_size(cfg, RNN_T, RNN_N)
    # Layer 0 from x; layer 1 from layer 0's output times the dropout scales.
    masks = layout.masks(reserve, 1)
    assert set(np.unique(masks)) <= {0.0, 2.0}
    inp = a["x"]
    for layer in range(2):
        w = weights(cfg, a["params"], layer)
        y, _, _, steps = doc_forward("lstm", inp, a["h0"][layer], a["c0"][layer], w)
        np.testing.assert_allclose(layout.gates(reserve, layer, 0),
                                   np.stack([s["acts"] for s in steps]), rtol=1e-10)
        np.testing.assert_allclose(layout.cells(reserve, layer, 0),
                                   np.stack([s["c"] for s in steps]), rtol=1e-10)
        np.testing.assert_allclose(layout.outputs(reserve, layer), y, rtol=1e-10)
        inp = y * masks if layer == 0 else None
    np.testing.assert_allclose(layout.outputs(reserve, 1), got["y"], rtol=1e-12)
    assert layout.masks(reserve, 0) is None


def test_layers_and_directions_chain_one_layer_backward(rnn_backend, rng):
    """Two bidirectional layers with dropout between them, from the one-layer formulas:
    the reverse direction is the forward one on the time-reversed sequence; layer 1's dx,
    times the dropout scales, is layer 0's dy; each direction gets its half of dy."""
    cfg, a = rnn_problem("gru", rng, num_layers=2, bidirectional=True, dropout=0.5)
    got = numbaconv_step(cfg, a, dropout_seed=9)
    masks = got["layout"].masks(got["after_forward"], 1)
    P = cfg.out_size

    def run_layer(layer, inp):
        outs, saved = [], []
        for d in range(2):
            ld = 2 * layer + d
            seq = inp if d == 0 else inp[::-1]
            y, hy, _, steps = doc_forward("gru", seq, a["h0"][ld], None,
                                          weights(cfg, a["params"], layer, d))
            outs.append(y if d == 0 else y[::-1])
            saved.append((seq, steps))
        return np.concatenate(outs, axis=2), saved

    y0, saved0 = run_layer(0, a["x"])
    y1, saved1 = run_layer(1, y0 * masks)
    np.testing.assert_allclose(got["y"], y1, rtol=1e-10, atol=1e-12)

    def back_layer(layer, saved, dy):
        din, grads = 0, {}
        for d in range(2):
            ld = 2 * layer + d
            seq, steps = saved[d]
            dy_d = dy[:, :, d * P:(d + 1) * P]
            dx, dh0, _, _, _, g = doc_backward("gru", steps, seq, dy_d if d == 0 else
                                               dy_d[::-1], a["dhy"][ld], None,
                                               weights(cfg, a["params"], layer, d))
            np.testing.assert_allclose(got["dh0"][ld], dh0, rtol=1e-10, atol=1e-12)
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            grads.update({k + suffix: v for k, v in g.items()})
            din = din + (dx if d == 0 else dx[::-1])
        return din, grads

    d1, grads1 = back_layer(1, saved1, a["dy"])
    d0, grads0 = back_layer(0, saved0, d1 * masks)
    np.testing.assert_allclose(got["dx"], d0, rtol=1e-10, atol=1e-12)
    dviews = nc.rnn_param_views(cfg, got["dparams"])
    for name, grad in {**grads0, **grads1}.items():
        np.testing.assert_allclose(dviews[name], grad, rtol=1e-10, atol=1e-12, err_msg=name)


# --- the doc and this file -----------------------------------------------------------------

def test_the_doc_names_only_tests_that_exist():
    text = DOC.read_text(encoding="utf-8")
    named = set(re.findall(r"`(test_\w+)`", text))
    assert named, "docs/gradients.md names no test"
    missing = sorted(name for name in named if name not in globals())
    assert not missing, f"docs/gradients.md names tests that do not exist: {missing}"


def test_every_formula_test_is_named_in_the_doc():
    text = DOC.read_text(encoding="utf-8")
    tests = {name for name in globals() if name.startswith("test_")}
    unnamed = sorted(tests - set(re.findall(r"`(test_\w+)`", text))
                     - {"test_the_doc_names_only_tests_that_exist",
                        "test_every_formula_test_is_named_in_the_doc"})
    assert not unnamed, f"tests of docs/gradients.md the doc does not point to: {unnamed}"
