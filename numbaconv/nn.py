"""Layers with hand-written backward passes on numbaconv's kernels, and Adam.

``Conv`` and ``ConvTranspose`` are the two halves of a convolutional network written without
autograd: ``forward(x)`` computes the output and remembers ``x`` (the weight gradient needs
it); ``backward(dy)`` takes dL/d(output), stores dL/dw and dL/db in ``dw`` and ``db`` and
returns dL/dx. Each backward is spelled out as the plain numbaconv calls it amounts to, so the
file doubles as a worked example of ``docs/gradients.md``:

- ``Conv``, ``y = conv(x, w)``: ``dx = conv_backward_data(dy, w, x.shape)`` and
  ``dw = conv_backward_weight(x, dy, w.shape)``.
- ``ConvTranspose``, ``y = conv_transpose(x, w)``: ``dx = conv(dy, w)``, the forward
  convolution, and ``dw = conv_backward_weight(dy, x, w.shape)``, the convolution's weight
  gradient with input and output swapped;

and ``db = conv_backward_bias(dy)`` for both. A layer's geometry keywords (``stride``,
``padding``, ``dilation``, ``groups``, ``layout``) mean what they mean in :func:`numbaconv.conv`
and :func:`numbaconv.conv_transpose`.

``LSTM`` is the recurrent counterpart, on the three calls of a cuDNN-style training step:
``forward(x, h0, c0)`` runs ``rnn_forward(training=True)`` into a reserve the layer owns and
reuses; ``backward(dy, dhy, dcy)`` runs ``rnn_backward_data`` (dx, dh0, dc0: backpropagation
through time) and then ``rnn_backward_weights`` into the layer's ``dw``, in that order, since
the first overwrites the reserve's gate activations with the gate gradients the second reads.

To use this in your own project, copy the file and replace the relative imports below by
``from numbaconv import ...``: it depends on nothing else.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from .conv import (conv, conv_backward_bias, conv_backward_data, conv_backward_weight,
                   conv_transpose)
from .rnn import (RNNConfig, rnn_backward_data, rnn_backward_weights, rnn_forward,
                  rnn_param_views, rnn_reserve_size)

__all__ = ["Conv", "ConvTranspose", "LSTM", "Adam"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _per_dim(name: str, value, ndim: int, minimum: int = 1) -> tuple:
    """An int, or a tuple of ``ndim`` ints, each ``>= minimum``, as a tuple."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * ndim
    if len(values) != ndim or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= minimum
            for v in values):
        raise ValueError(f"{name}: expected an int >= {minimum} or {ndim} of them, got "
                         f"{value!r}")
    return tuple(int(v) for v in values)


def _kernel_shape(kernel_size, ndim: int) -> tuple:
    """``kernel_size`` (an int, repeated ``ndim`` times, or a tuple) as a tuple of ints."""
    if isinstance(kernel_size, (tuple, list)):
        if not 1 <= len(kernel_size) <= 3:
            raise ValueError(f"kernel_size: expected 1 to 3 sizes (1, 2 or 3 spatial dims), "
                             f"got {tuple(kernel_size)!r}")
        return tuple(_positive_int("kernel_size", k) for k in kernel_size)
    if ndim not in (1, 2, 3):
        raise ValueError(f"ndim: expected 1, 2 or 3, got {ndim!r}")
    return (_positive_int("kernel_size", kernel_size),) * ndim


class _ConvLayer:
    """What Conv and ConvTranspose share: parameters, their gradients and the geometry."""

    def __init__(self, in_channels, out_channels, kernel_size, *, stride, padding, dilation,
                 groups, bias, layout, ndim, dtype, rng, transposed):
        in_channels = _positive_int("in_channels", in_channels)
        out_channels = _positive_int("out_channels", out_channels)
        groups = _positive_int("groups", groups)
        for name, channels in (("in_channels", in_channels), ("out_channels", out_channels)):
            if channels % groups:
                raise ValueError(f"{name}: expected a multiple of groups={groups}, got "
                                 f"{channels}")
        kernel = _kernel_shape(kernel_size, ndim)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
        rng = np.random.default_rng(rng)
        # PyTorch's default initialisation (kaiming_uniform with a = sqrt(5)), so a model
        # ported from PyTorch starts from the same distribution: U(-1/sqrt(fan), 1/sqrt(fan))
        # with fan = weight.shape[1] * prod(kernel), for weights and bias alike.
        if transposed:
            shape = (in_channels, out_channels // groups) + kernel
        else:
            shape = (out_channels, in_channels // groups) + kernel
        bound = 1.0 / math.sqrt(shape[1] * math.prod(kernel))
        self.w = rng.uniform(-bound, bound, shape).astype(dtype)
        self.b = rng.uniform(-bound, bound, out_channels).astype(dtype) if bias else None
        self.dw = np.zeros_like(self.w)
        self.db = None if self.b is None else np.zeros_like(self.b)
        self.geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                             layout=layout)
        self.x: Optional[np.ndarray] = None

    def params(self) -> list:
        """The parameter arrays, ``[w, b]`` (or ``[w]`` without bias); updated in place."""
        return [self.w] if self.b is None else [self.w, self.b]

    def grads(self) -> list:
        """Their gradients from the last :meth:`backward`, in the order of :meth:`params`."""
        return [self.dw] if self.db is None else [self.dw, self.db]

    def _input(self) -> np.ndarray:
        if self.x is None:
            raise RuntimeError(f"{type(self).__name__}.backward: call forward first (the "
                               f"weight gradient needs the forward's input)")
        return self.x

    def _store_bias_gradient(self, dy, accumulate: bool) -> None:
        if self.db is not None:
            # db[k] = sum of dy over the batch and every output position.
            conv_backward_bias(dy, layout=self.geometry["layout"], out=self.db,
                               accumulate=accumulate)


class Conv(_ConvLayer):
    """Convolution layer, ``y = conv(x, w) + b`` (PyTorch's ``nn.Conv{1,2,3}d``).

    Parameters
    ----------
    in_channels, out_channels : int
        C and K; both multiples of ``groups``.
    kernel_size : int or tuple of int
        An int means the same size along ``ndim`` spatial dims; a tuple sets ``ndim``.
    stride, padding, dilation, groups, layout
        As in :func:`numbaconv.conv`.
    bias : bool
        Whether the layer has a bias ``b`` of shape ``(K,)``.
    ndim : int
        Spatial dims when ``kernel_size`` is an int.
    dtype : float32 or float64
    rng : numpy Generator or int, optional
        Source (or seed) of the initial weights.

    Attributes
    ----------
    w : ndarray, shape (K, C // groups, *R)
    b : ndarray, shape (K,), or None
    dw, db : ndarray
        Gradients of w and b from the last :meth:`backward`.
    x : ndarray or None
        The input of the last :meth:`forward`.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, *, stride=1,
                 padding=0, dilation=1, groups: int = 1, bias: bool = True,
                 layout: str = "channels_first", ndim: int = 2, dtype=np.float32, rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride,
                         padding=padding, dilation=dilation, groups=groups, bias=bias,
                         layout=layout, ndim=ndim, dtype=dtype, rng=rng, transposed=False)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """``y = conv(x, w) + b``; remembers ``x`` for :meth:`backward`.

        Parameters
        ----------
        x : ndarray, shape (N, C, *S) or (N, *S, C)

        Returns
        -------
        y : ndarray, shape (N, K, *P) or (N, *P, K)
        """
        self.x = x
        return conv(x, self.w, self.b, **self.geometry)

    def backward(self, dy: np.ndarray, *, need_dx: bool = True,
                 accumulate: bool = False) -> Optional[np.ndarray]:
        """Store dL/dw and dL/db in ``dw`` and ``db``; return dL/dx.

        Parameters
        ----------
        dy : ndarray, shape of y
            dL/dy.
        need_dx : bool
            False skips the data gradient (a first layer's input needs none) and returns None.
        accumulate : bool
            Add into ``dw`` and ``db`` instead of overwriting them (micro-batches).

        Returns
        -------
        dx : ndarray, shape of x, or None
        """
        x = self._input()
        # dw = dy times the im2col matrix of x, transposed (docs/gradients.md).
        conv_backward_weight(x, dy, self.w.shape, **self.geometry, out=self.dw,
                             accumulate=accumulate)
        self._store_bias_gradient(dy, accumulate)
        if not need_dx:
            return None
        # dx = the transposed convolution of dy: W^T dy scattered back onto the input grid.
        return conv_backward_data(dy, self.w, x.shape, **self.geometry)


class ConvTranspose(_ConvLayer):
    """Transposed convolution layer, ``y = conv_transpose(x, w) + b``
    (PyTorch's ``nn.ConvTranspose{1,2,3}d``): the adjoint of a convolution, an upsampler.

    Parameters
    ----------
    in_channels, out_channels : int
        C_in (channels of x) and C_out (channels of y); both multiples of ``groups``.
    kernel_size : int or tuple of int
        As for :class:`Conv`.
    stride, padding, dilation, groups, layout
        As in :func:`numbaconv.conv_transpose`: the geometry of the forward convolution this
        layer is the adjoint of.
    output_padding : int or tuple of int
        Extra size after the output, each smaller than ``stride``. (PyTorch also allows up to
        ``dilation - 1``; this layer's backward, a plain convolution of dy, does not, so use
        :func:`numbaconv.conv_transpose_backward` for that case.)
    bias, ndim, dtype, rng
        As for :class:`Conv`.

    Attributes
    ----------
    w : ndarray, shape (C_in, C_out // groups, *R)
    b : ndarray, shape (C_out,), or None
    dw, db, x
        As for :class:`Conv`.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, *, stride=1,
                 padding=0, output_padding=0, dilation=1, groups: int = 1, bias: bool = True,
                 layout: str = "channels_first", ndim: int = 2, dtype=np.float32, rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride,
                         padding=padding, dilation=dilation, groups=groups, bias=bias,
                         layout=layout, ndim=ndim, dtype=dtype, rng=rng, transposed=True)
        spatial = self.w.ndim - 2
        strides = _per_dim("stride", stride, spatial)
        extras = _per_dim("output_padding", output_padding, spatial, minimum=0)
        if any(e >= s for e, s in zip(extras, strides)):
            raise ValueError(f"output_padding: expected each < stride {strides}, got "
                             f"{extras}")
        self.output_padding = output_padding

    def forward(self, x: np.ndarray) -> np.ndarray:
        """``y = conv_transpose(x, w) + b``; remembers ``x`` for :meth:`backward`.

        Parameters
        ----------
        x : ndarray, shape (N, C_in, *S_in) or (N, *S_in, C_in)

        Returns
        -------
        y : ndarray, shape (N, C_out, *S_out) or (N, *S_out, C_out)
        """
        self.x = x
        return conv_transpose(x, self.w, self.b, output_padding=self.output_padding,
                              **self.geometry)

    def backward(self, dy: np.ndarray, *, need_dx: bool = True,
                 accumulate: bool = False) -> Optional[np.ndarray]:
        """Store dL/dw and dL/db in ``dw`` and ``db``; return dL/dx.

        Parameters
        ----------
        dy : ndarray, shape of y
        need_dx, accumulate : bool
            As for :meth:`Conv.backward`.

        Returns
        -------
        dx : ndarray, shape of x, or None
        """
        x = self._input()
        # y = conv_transpose(x, w) is conv's data gradient with x in the place of dy, so
        # dw is conv's weight gradient with input and output swapped: dy (the size of a
        # convolution's input) plays x, and x (the size of its output) plays dy.
        conv_backward_weight(dy, x, self.w.shape, **self.geometry, out=self.dw,
                             accumulate=accumulate)
        self._store_bias_gradient(dy, accumulate)
        if not need_dx:
            return None
        # The adjoint of the adjoint is the convolution itself.
        return conv(dy, self.w, **self.geometry)


class LSTM:
    """Long short-term memory layer(s), PyTorch's ``nn.LSTM`` (time-major by default).

    Each step of each layer, from the input ``x_t`` and the previous states ``h``, ``c``::

        i, f, g, o = split4(W_ih x_t + b_ih + W_hh h + b_hh)
        c = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h = sigmoid(o) * tanh(c)            (then h = W_hr h with proj_size)

    All parameters live in one flat vector ``w`` in PyTorch's order; ``views`` names its
    pieces (``"weight_ih_l0"``, ``"bias_hh_l0"``, ...), and writing a view writes ``w``, so a
    PyTorch state dict loads with ``layer.views[name][...] = tensor.numpy()``.

    Parameters
    ----------
    input_size, hidden_size : int
    num_layers : int
        Stacked layers; layer l > 0 reads layer l - 1's output.
    bias : bool
        Whether each layer has ``bias_ih`` and ``bias_hh``.
    proj_size : int
        0, or the size (< hidden_size) each layer projects its hidden state to.
    bidirectional, batch_first, dropout
        As in :class:`numbaconv.RNNConfig` (dropout between layers, in training only).
    dtype : float32 or float64
    rng : numpy Generator or int, optional
        Source (or seed) of the initial weights, uniform in +-1/sqrt(hidden_size) like
        PyTorch's.

    Attributes
    ----------
    config : RNNConfig
    w : ndarray, shape (config.num_params,)
        The parameters, updated in place by an optimiser.
    dw : ndarray, shape of w
        Their gradient from the last :meth:`backward`.
    views : dict of str to ndarray
        PyTorch-named views into ``w``.
    reserve : ndarray or None
        What the training forward keeps for the backward (gate activations, cell states,
        layer outputs); allocated by the first :meth:`forward`, reused by later ones and
        grown only when a longer sequence or a larger batch needs more.
    """

    def __init__(self, input_size: int, hidden_size: int, *, num_layers: int = 1,
                 bias: bool = True, proj_size: int = 0, bidirectional: bool = False,
                 batch_first: bool = False, dropout: float = 0.0, dtype=np.float32,
                 rng=None):
        self.config = RNNConfig("lstm", input_size, hidden_size, num_layers=num_layers,
                                bias=bias, proj_size=proj_size, bidirectional=bidirectional,
                                batch_first=batch_first, dropout=dropout)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
        rng = np.random.default_rng(rng)
        bound = 1.0 / math.sqrt(hidden_size)  # as numbaconv.rnn_init_params and PyTorch
        self.w = rng.uniform(-bound, bound, self.config.num_params).astype(dtype)
        self.dw = np.zeros_like(self.w)
        self.views = rnn_param_views(self.config, self.w)
        self.reserve: Optional[np.ndarray] = None
        self._saved: Optional[tuple] = None  # (x, h0, c0, y) of the last training forward

    def params(self) -> list:
        """``[w]``, the flat parameter vector; updated in place."""
        return [self.w]

    def grads(self) -> list:
        """``[dw]``, from the last :meth:`backward`."""
        return [self.dw]

    def forward(self, x: np.ndarray, h0: Optional[np.ndarray] = None,
                c0: Optional[np.ndarray] = None, *, training: bool = True,
                dropout_seed: Optional[int] = None) -> tuple:
        """Run the layers over a batch of sequences.

        Parameters
        ----------
        x : ndarray, shape (T, N, input_size), or (N, T, input_size) with batch_first
        h0 : ndarray, shape (num_layers * D, N, out_size), optional
            Initial hidden states (zeros when None); D = 2 if bidirectional, out_size =
            proj_size or hidden_size. To carry state across truncated-BPTT windows, pass the
            previous window's ``hy``: gradients stop there (the backward returns dh0 but
            nothing pushes it further back).
        c0 : ndarray, shape (num_layers * D, N, hidden_size), optional
            Initial cell states (zeros when None).
        training : bool
            Fill the reserve for :meth:`backward` (and apply dropout); False only predicts.
        dropout_seed : int, optional
            Seed of the dropout masks (see :func:`numbaconv.rnn_forward`).

        Returns
        -------
        y : ndarray, shape (T, N, D * out_size) (batch-first with batch_first)
            The last layer's hidden state at every step.
        hy : ndarray, shape of h0
            Every layer's hidden state after the last step.
        cy : ndarray, shape of c0
            Every layer's cell state after the last step.
        """
        if not training:
            self._saved = None  # a later backward must not read an older forward's reserve
            y, hy, cy, _ = rnn_forward(self.config, x, self.w, h0, c0)
            return y, hy, cy
        t, n = x.shape[:2][::-1] if self.config.batch_first else x.shape[:2]
        needed = rnn_reserve_size(self.config, t, n)
        if self.reserve is None or self.reserve.size < needed or self.reserve.dtype != x.dtype:
            self.reserve = np.empty(needed, x.dtype)
        y, hy, cy, _ = rnn_forward(self.config, x, self.w, h0, c0, training=True,
                                   dropout_seed=dropout_seed, reserve=self.reserve)
        self._saved = (x, h0, c0, y)
        return y, hy, cy

    def backward(self, dy: np.ndarray, dhy: Optional[np.ndarray] = None,
                 dcy: Optional[np.ndarray] = None, *, accumulate: bool = False) -> tuple:
        """Backpropagate through time: store dL/dw in ``dw``; return dL/dx, dL/dh0, dL/dc0.

        Once per training :meth:`forward`.

        Parameters
        ----------
        dy : ndarray, shape of y
            dL/dy.
        dhy, dcy : ndarray, shapes of hy and cy, optional
            dL/dhy and dL/dcy (zeros when None): the gradient flowing back from whatever read
            the final states.
        accumulate : bool
            Add into ``dw`` instead of overwriting it (micro-batches).

        Returns
        -------
        dx : ndarray, shape of x
        dh0 : ndarray, shape (num_layers * D, N, out_size)
        dc0 : ndarray, shape (num_layers * D, N, hidden_size)
        """
        if self._saved is None:
            raise RuntimeError("LSTM.backward: call forward (with training=True) first; each "
                               "training forward allows one backward")
        x, h0, c0, y = self._saved
        self._saved = None
        # Data first: it walks the steps backwards (the recurrence) and leaves every step's
        # gate gradients in the reserve, in the place of the activations it no longer needs.
        dx, dh0, dc0 = rnn_backward_data(self.config, y, dy, self.w, self.reserve, hx=h0,
                                         cx=c0, dhy=dhy, dcy=dcy)
        # Then the weights: no recurrence left, so dW_ih = sum over t of dgates_t^T x_t (and
        # the like) is one large matrix product over all steps at once.
        rnn_backward_weights(self.config, x, self.w, self.reserve, hx=h0, out=self.dw,
                             accumulate=accumulate)
        return dx, dh0, dc0


class Adam:
    """Adam (Kingma and Ba, 2015), updating a list of arrays in place.

    Parameters
    ----------
    params : sequence of ndarray
        Updated in place by :meth:`step`.
    lr : float
        Step size.
    betas : (float, float)
        Decay rates of the first and second moment estimates.
    eps : float
        Added to the root of the second moment.
    """

    def __init__(self, params: Sequence[np.ndarray], lr: float = 0.001, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        if not lr > 0:
            raise ValueError(f"lr: expected a positive step size, got {lr!r}")
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.t = 0

    def step(self, grads: Sequence[np.ndarray]) -> None:
        """Move every parameter against its gradient (same order as ``params``)."""
        if len(grads) != len(self.params):
            raise ValueError(f"grads: expected {len(self.params)} arrays, one per parameter, "
                             f"got {len(grads)}")
        self.t += 1
        b1, b2 = self.betas
        # Bias corrections folded into the step size, as in the paper's final algorithm.
        lr = self.lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= (lr * m / (np.sqrt(v) + self.eps)).astype(p.dtype)
