"""Recurrent-network problem descriptions (RNN tanh/relu, LSTM with projection, GRU): the
configuration, the flat parameter layout, the reserve layout every backend shares, the
normalised problems backends receive and the validating builders of the three recurrent ops.

Re-exported by :mod:`numbaconv.problem`, where plugins and backends import them from.
"""

from __future__ import annotations

import functools
import math
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

from ._checks import check_operands, check_out, inspect_array


#: RNN modes and the number of gate blocks each computes per step.
RNN_MODES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


def _positive_int(value, name: str, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _flag_value(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class RNNConfig:
    """A recurrent network's architecture, as PyTorch's ``nn.RNN``/``nn.LSTM``/``nn.GRU``.

    Parameters
    ----------
    mode : str
        ``"rnn_tanh"``, ``"rnn_relu"``, ``"lstm"`` or ``"gru"``.
    input_size, hidden_size : int
        Features of x and of the hidden state (the cell state, for an LSTM).
    num_layers : int
        Stacked layers; layer l > 0 reads layer l - 1's output.
    bidirectional : bool
        A second direction per layer reading the sequence backwards; outputs are
        concatenated along the feature axis (forward first).
    bias : bool
        Whether each layer has ``bias_ih`` and ``bias_hh``.
    dropout : float
        In [0, 1): inverted dropout on the inputs of layers 1 .. num_layers - 1, in training
        only.
    proj_size : int
        LSTM only: 0, or the size (< hidden_size) of the projected hidden state
        ``h = weight_hr @ (o * tanh(c))``.
    batch_first : bool
        x, y, dy and dx are ``(N, T, features)`` instead of ``(T, N, features)``; states are
        always ``(num_layers * num_directions, N, size)``.

    Equations, gate order and parameter shapes are PyTorch's (GRU applies the reset gate
    after the hidden product, so its ``n`` slices of ``bias_ih`` and ``bias_hh`` differ).
    """

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int = 1
    bidirectional: bool = False
    bias: bool = True
    dropout: float = 0.0
    proj_size: int = 0
    batch_first: bool = False

    def __post_init__(self):
        if not isinstance(self.mode, str) or self.mode not in RNN_MODES:
            raise ValueError(f"mode: expected one of {sorted(RNN_MODES)}, got {self.mode!r}")
        set_ = functools.partial(object.__setattr__, self)
        set_("input_size", _positive_int(self.input_size, "input_size"))
        set_("hidden_size", _positive_int(self.hidden_size, "hidden_size"))
        set_("num_layers", _positive_int(self.num_layers, "num_layers"))
        set_("bidirectional", _flag_value(self.bidirectional, "bidirectional"))
        set_("bias", _flag_value(self.bias, "bias"))
        set_("batch_first", _flag_value(self.batch_first, "batch_first"))
        set_("proj_size", _positive_int(self.proj_size, "proj_size", 0))
        if isinstance(self.dropout, (bool, np.bool_)) or \
                not isinstance(self.dropout, (int, float, np.integer, np.floating)):
            raise TypeError(f"dropout: expected a float in [0, 1), got {self.dropout!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {self.dropout!r}")
        set_("dropout", float(self.dropout))
        if self.proj_size:
            if self.mode != "lstm":
                raise ValueError(f"proj_size: expected 0 for mode {self.mode!r} (projections "
                                 f"are LSTM only), got {self.proj_size}")
            if self.proj_size >= self.hidden_size:
                raise ValueError(f"proj_size: expected a value < hidden_size "
                                 f"({self.hidden_size}), got {self.proj_size}")

    @property
    def num_directions(self) -> int:
        """2 if bidirectional, else 1."""
        return 2 if self.bidirectional else 1

    @property
    def out_size(self) -> int:
        """Features of each direction's output and hidden state: proj_size or hidden_size."""
        return self.proj_size or self.hidden_size

    @property
    def gates(self) -> int:
        """Gate blocks per step: 1 (RNN), 4 (LSTM: i, f, g, o) or 3 (GRU: r, z, n)."""
        return RNN_MODES[self.mode]

    def layer_input_size(self, layer: int) -> int:
        """Features read by ``layer``: input_size for layer 0, else D * out_size."""
        return self.input_size if layer == 0 else self.num_directions * self.out_size

    @functools.cached_property
    def param_layout(self) -> tuple:
        """``(name, offset, shape)`` of every parameter in the flat vector, in order.

        The order is PyTorch's ``_flat_weights_names``: for each layer, for each direction,
        ``weight_ih``, ``weight_hh``, ``bias_ih`` and ``bias_hh`` (with bias), ``weight_hr``
        (with proj_size); names carry ``_l{layer}`` and ``_reverse`` for direction 1.
        """
        entries, offset = [], 0
        gh = self.gates * self.hidden_size
        for layer in range(self.num_layers):
            for direction in range(self.num_directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                shapes = [("weight_ih", (gh, self.layer_input_size(layer))),
                          ("weight_hh", (gh, self.out_size))]
                if self.bias:
                    shapes += [("bias_ih", (gh,)), ("bias_hh", (gh,))]
                if self.proj_size:
                    shapes.append(("weight_hr", (self.proj_size, self.hidden_size)))
                for name, shape in shapes:
                    entries.append((name + suffix, offset, shape))
                    offset += math.prod(shape)
        return tuple(entries)

    @property
    def num_params(self) -> int:
        """Length of the flat parameter vector."""
        _, offset, shape = self.param_layout[-1]
        return offset + math.prod(shape)

    def key(self) -> str:
        return (f"{self.mode}:I{self.input_size}:H{self.hidden_size}:L{self.num_layers}"
                f":D{self.num_directions}:bias{int(self.bias)}:p{self.dropout:g}"
                f":proj{self.proj_size}")


def rnn_param_views(config: RNNConfig, flat) -> dict:
    """PyTorch-named views into the flat parameter vector (writing a view writes ``flat``).

    Parameters
    ----------
    config : RNNConfig
    flat : 1-D array of ``config.num_params`` elements (NumPy or CUDA)

    Returns
    -------
    dict
        ``{"weight_ih_l0": (G*H, input_size) view, "weight_hh_l0": (G*H, out_size), "bias_ih_l0":
        (G*H,), "bias_hh_l0": (G*H,), "weight_hr_l0": (proj_size, H), ...}`` in the flat
        order, ``_reverse`` names for the second direction.
    """
    if not isinstance(config, RNNConfig):
        raise TypeError(f"config: expected an RNNConfig, got {type(config).__name__}")
    info = inspect_array("flat", flat)
    if len(info.shape) != 1 or info.shape[0] != config.num_params:
        raise ValueError(f"flat: expected a 1-D array of {config.num_params} elements "
                         f"(config.num_params), got shape {info.shape}")
    return {name: flat[offset:offset + math.prod(shape)].reshape(shape)
            for name, offset, shape in config.param_layout}


def layer_params(config: RNNConfig, flat, layer: int, direction: int) -> tuple:
    """``(weight_ih, weight_hh, bias_ih or None, bias_hh or None, weight_hr or None)`` views of
    one layer and direction, for backends."""
    per = 2 + 2 * config.bias + (1 if config.proj_size else 0)
    entries = config.param_layout[(layer * config.num_directions + direction) * per:][:per]
    views = [flat[o:o + math.prod(s)].reshape(s) for _, o, s in entries]
    w_ih, w_hh = views[0], views[1]
    b_ih, b_hh = (views[2], views[3]) if config.bias else (None, None)
    w_hr = views[-1] if config.proj_size else None
    return w_ih, w_hh, b_ih, b_hh, w_hr


#: Marks a reserve written by a training forward (header slot 0); below 2048, so that
#: float16 holds it exactly, like every header value.
RESERVE_MAGIC = 1737.0
#: Reserve states (header slot 1): after the training forward, after rnn_backward_data.
RESERVE_FORWARD, RESERVE_BACKWARD_DATA = 1.0, 2.0
RESERVE_HEADER = 16
_ALIGN = 16  # elements: 64 bytes in float32, so every region starts on a cache line


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class RNNReserveLayout:
    """Where everything lives in a training forward's reserve (a 1-D array of the dtype).

    With T steps, N sequences, D directions, H = hidden_size, P = out_size, G = gates and
    Gw = G * H (``4H`` for the GRU, which also keeps its hidden-path ``n`` product), the
    regions, in order, each starting at a multiple of 16 elements:

    ============  =============================  ===========================================
    region        shape, per layer (x direction)  contents
    ============  =============================  ===========================================
    header        16                              magic, state, then T, N, a config tag and
                                                  a lengths tag as base-1024 digits, three
                                                  each (exact in float16 too)
    gates[l, d]   (T, N, Gw)                      forward: activations (RNN: h; LSTM: i, f,
                                                  g, o; GRU: r, z, n, W_hn h + b_hn); after
                                                  rnn_backward_data: the gradients of the
                                                  pre-activations (GRU: dr, dz, then r * dn
                                                  for the hidden path, dn for the input path)
    cells[l, d]   (T, N, H), LSTM only            forward: cell state after each step; after
                                                  rnn_backward_data with projection:
                                                  o * tanh(c), the projection's input
    dproj[l, d]   (T, N, P), LSTM with proj only  after rnn_backward_data: gradient of h
    outputs[l]    (T, N, D * P)                   the layer's output (the last layer's is y)
    masks[l]      (T, N, D * P), l >= 1, only     dropout scale (0 or 1 / (1 - p)) applied to
                  with dropout > 0                layer l's input
    ============  =============================  ===========================================

    Past a sequence's end, gates and dproj hold zeros and cells the carried state. Size:
    ``16 + sum of the aligned region sizes`` elements (:func:`numbaconv.rnn_reserve_size`).
    """

    config: RNNConfig
    seq_len: int
    batch: int

    @functools.cached_property
    def _regions(self) -> dict:
        cfg, t, n = self.config, self.seq_len, self.batch
        d, h, p = cfg.num_directions, cfg.hidden_size, cfg.out_size
        gw = (4 if cfg.mode == "gru" else cfg.gates) * h
        regions, offset = {}, RESERVE_HEADER

        def add(key, shape):
            nonlocal offset
            regions[key] = (offset, shape)
            offset += _aligned(math.prod(shape))

        for layer in range(cfg.num_layers):
            for direction in range(d):
                add(("gates", layer, direction), (t, n, gw))
                if cfg.mode == "lstm":
                    add(("cells", layer, direction), (t, n, h))
                if cfg.proj_size:
                    add(("dproj", layer, direction), (t, n, p))
            add(("outputs", layer), (t, n, d * p))
            if layer > 0 and cfg.dropout > 0:
                add(("masks", layer), (t, n, d * p))
        regions["size"] = offset
        return regions

    @property
    def size(self) -> int:
        """Elements the reserve must have."""
        return self._regions["size"]

    def _view(self, reserve, key):
        offset, shape = self._regions[key]
        return reserve[offset:offset + math.prod(shape)].reshape(shape)

    def gates(self, reserve, layer: int, direction: int):
        return self._view(reserve, ("gates", layer, direction))

    def cells(self, reserve, layer: int, direction: int):
        return self._view(reserve, ("cells", layer, direction))

    def dproj(self, reserve, layer: int, direction: int):
        return self._view(reserve, ("dproj", layer, direction))

    def outputs(self, reserve, layer: int):
        return self._view(reserve, ("outputs", layer))

    def masks(self, reserve, layer: int):
        """Layer ``layer``'s input dropout scales, or None without dropout."""
        key = ("masks", layer)
        return self._view(reserve, key) if key in self._regions else None

    def header(self, reserve):
        return reserve[:RESERVE_HEADER]

    def layer_input(self, reserve, layer: int, x):
        """What ``layer`` read in the training forward: x for layer 0, else the previous
        layer's outputs times this layer's dropout masks (a new array when masked)."""
        if layer == 0:
            return x
        inp = self.outputs(reserve, layer - 1)
        masks = self.masks(reserve, layer)
        return inp if masks is None else inp * masks

    def previous_states(self, reserve, layer: int, direction: int, h0, lengths):
        """The hidden state each step of (layer, direction) read, as a new (T, N, P) array:
        the previous step's output in processing order, or ``h0`` at a sequence's first
        step (t = 0 forwards; t = T - 1, or length - 1, backwards). CPU arrays only."""
        p = self.config.out_size
        outputs = self.outputs(reserve, layer)[:, :, direction * p:(direction + 1) * p]
        prev = shifted_in_time(outputs, h0, direction)
        if direction == 1 and lengths is not None:
            prev[lengths - 1, np.arange(len(lengths))] = h0
        return prev


def shifted_in_time(values, first, direction: int):
    """A new (T, ...) array holding, at each step, ``values`` at the step processed just
    before it (t - 1 forwards, t + 1 backwards), and ``first`` at the first step processed."""
    prev = np.empty(values.shape, values.dtype)
    if direction == 0:
        prev[0] = first
        prev[1:] = values[:-1]
    else:
        prev[-1] = first
        prev[:-1] = values[1:]
    return prev


@functools.lru_cache(maxsize=64)
def rnn_reserve_layout(config: RNNConfig, seq_len: int, batch: int) -> RNNReserveLayout:
    """The (cached) :class:`RNNReserveLayout` of a configuration and sequence shape."""
    return RNNReserveLayout(config, seq_len, batch)


@dataclass(frozen=True)
class RNNProblem:
    """One recurrent op, normalised: what the dispatcher and backends see.

    Backends always get time-major arrays (batch_first is undone by the public functions),
    C-contiguous and of ``dtype``; missing initial states and state gradients arrive as
    zeros. Operands of :meth:`Backend.run`, by op:

    ``rnn_forward``
        ``(x (T, N, I), params, hx, cx or None, lengths or None, reserve or None)`` ->
        ``(y, hy, cy or None)``; with ``training`` the reserve (laid out as
        :class:`RNNReserveLayout`, dropout masks already filled in) must be written.
    ``rnn_backward_data``
        ``(y, dy, params, reserve, hx, cx or None, dhy, dcy or None, lengths or None)`` ->
        ``(dx, dhx, dcx or None)``; overwrites the reserve's gates with their gradients.
    ``rnn_backward_weights``
        ``(x, params, reserve, hx, lengths or None)`` -> dparams (flat; honour ``out`` and
        ``accumulate``).

    ``lengths`` is an int64 array of N values in 1..T, or None when every sequence is T long.

    Attributes
    ----------
    op : str
    config : RNNConfig
    seq_len, batch : int
        T and N.
    dtype, device : str
    training : bool
        ``rnn_forward`` only: fill the reserve.
    variable_lengths : bool
        Whether ``lengths`` is given (some sequence is shorter than T).
    accumulate : bool
        ``rnn_backward_weights`` only: add into ``out``.
    """

    op: str
    config: RNNConfig
    seq_len: int
    batch: int
    dtype: str = "float32"
    device: str = "cpu"
    training: bool = False
    variable_lengths: bool = False
    accumulate: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def reserve_layout(self) -> RNNReserveLayout:
        return rnn_reserve_layout(self.config, self.seq_len, self.batch)

    @property
    def flops(self) -> int:
        """Floating-point operations of the op's matrix products (2 per multiply-add)."""
        cfg = self.config
        gh, p = cfg.gates * cfg.hidden_size, cfg.out_size
        per_step = 0
        for layer in range(cfg.num_layers):
            per_step += cfg.num_directions * gh * (cfg.layer_input_size(layer) + p)
            if cfg.proj_size:
                per_step += cfg.num_directions * p * cfg.hidden_size
        return 2 * self.seq_len * self.batch * per_step

    def key(self) -> str:
        return (f"{self.op}:{self.config.key()}:T{self.seq_len}:N{self.batch}:{self.dtype}"
                f":{self.device}:train{int(self.training)}:var{int(self.variable_lengths)}"
                f":acc{int(self.accumulate)}")


# --- recurrent validation ------------------------------------------------------------------

def check_config(config) -> RNNConfig:
    if not isinstance(config, RNNConfig):
        raise TypeError(f"config: expected an RNNConfig, got {type(config).__name__}")
    return config


def _sequence(name: str, value, config: RNNConfig, features: int):
    """(info, T, N) of a (T, N, features) array, or (N, T, features) with batch_first."""
    info = inspect_array(name, value)
    order = "(N, T, features)" if config.batch_first else "(T, N, features)"
    if len(info.shape) != 3:
        raise ValueError(f"{name}: expected 3 dimensions {order}, got shape {info.shape}")
    t, n = info.shape[:2][::-1] if config.batch_first else info.shape[:2]
    if t < 1 or n < 1:
        raise ValueError(f"{name}: expected a non-empty sequence {order}, got shape "
                         f"{info.shape}")
    if info.shape[2] != features:
        raise ValueError(f"{name}: expected {features} features in the last dimension, got "
                         f"shape {info.shape}")
    return info, t, n


def _state(name: str, value, shape: tuple, infos: list, allowed: bool = True,
           why: str = ""):
    if value is None:
        return
    if not allowed:
        raise ValueError(f"{name}: expected None {why}, got an array")
    info = inspect_array(name, value)
    if info.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (num_layers * num_directions, N, "
                         f"size), got {info.shape}")
    infos.append(info)


def check_seq_lengths(seq_lengths, seq_len: int, batch: int):
    """int64 array of N lengths in 1..T, or None when absent or all equal to T."""
    if seq_lengths is None:
        return None
    try:
        lengths = np.asarray(seq_lengths)
    except Exception as exc:  # e.g. a ragged list
        raise TypeError(f"seq_lengths: expected N ints, got {seq_lengths!r}") from exc
    if lengths.dtype == bool or not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"seq_lengths: expected integers, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"seq_lengths: expected {batch} lengths (one per sequence), got "
                         f"shape {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > seq_len:
        raise ValueError(f"seq_lengths: expected every length in 1..{seq_len} (T), got "
                         f"values from {lengths.min()} to {lengths.max()}")
    if (lengths == seq_len).all():
        return None
    return np.ascontiguousarray(lengths, dtype=np.int64)


def _config_tag(config: RNNConfig) -> float:
    return float(zlib.crc32(config.key().encode()) % (1 << 23))


def lengths_tag(lengths) -> float:
    """A small exact-in-float32 fingerprint of the lengths (0 when all are T)."""
    if lengths is None:
        return 0.0
    return float(zlib.crc32(lengths.tobytes()) % (1 << 23) + 1)


def _digits(value) -> list:
    """``value`` (below 2**30) as three base-1024 digits, most significant first: integers
    below 2048 are exact in float16, whose integers stop being exact at 2048."""
    value = int(value)
    return [float(value >> 20), float(value >> 10 & 1023), float(value & 1023)]


def _from_digits(digits) -> int:
    return (int(digits[0]) << 20) + (int(digits[1]) << 10) + int(digits[2])


def reserve_header(config, seq_len, batch, lengths, state) -> list:
    """The header a training forward writes: magic, state, then T, N, the config tag and
    the lengths tag as three digits each (slots 2-4, 5-7, 8-10, 11-13)."""
    return [RESERVE_MAGIC, state, *_digits(seq_len), *_digits(batch),
            *_digits(_config_tag(config)), *_digits(lengths_tag(lengths))]


#: The header numbaconv last wrote to each device reserve, per array object ({id: (weak
#: reference, data pointer, header)}): a check reads it instead of the device's copy,
#: whose transfer would wait for all the device's work queued before it.
_DEVICE_HEADERS: dict = {}


def _data_pointer(a):
    cai = getattr(a, "__cuda_array_interface__", None)   # None for simulator arrays
    return None if cai is None else cai["data"][0]


def _forget_header(key, ref) -> None:
    found = _DEVICE_HEADERS.get(key)
    if found is not None and found[0] is ref:
        del _DEVICE_HEADERS[key]


def _noted_header(reserve):
    """The header noted for this array object over the memory it holds now, or None."""
    found = _DEVICE_HEADERS.get(id(reserve))
    if found is not None and found[0]() is reserve and found[1] == _data_pointer(reserve):
        return found[2]
    return None


def record_header(reserve, start: int, values, dtype) -> None:
    """Note that ``values`` were written to slots ``start:`` of a device reserve's header
    (by a kernel queued after everything that used the reserve before). Only a whole
    header starts a record, for arrays that take weak references; a record is dropped with
    its array, or when the array's data moved."""
    header = _noted_header(reserve)
    if header is None:
        key = id(reserve)
        _DEVICE_HEADERS.pop(key, None)
        if start != 0 or len(values) != RESERVE_HEADER:
            return
        try:
            ref = weakref.ref(reserve, functools.partial(_forget_header, key))
        except TypeError:
            return
        header = np.zeros(RESERVE_HEADER, dtype)
        _DEVICE_HEADERS[key] = (ref, _data_pointer(reserve), header)
    header[start:start + len(values)] = values


def _device_header(reserve):
    """The header of a device reserve: as numbaconv last wrote it to this array object,
    or read from the device (a synchronous copy) for an array it has not written."""
    header = _noted_header(reserve)
    return reserve[:RESERVE_HEADER].copy_to_host() if header is None else header.copy()


def check_reserve(reserve, config, seq_len, batch, dtype, device, *, state=None,
                  lengths=None, inputs=()):
    """A reserve large enough (and, for backward, filled by a matching training forward in
    the expected ``state``). A device reserve's header is the one numbaconv last wrote to
    that array object where it wrote one (:func:`record_header`: no transfer), else read
    from the device."""
    needed = rnn_reserve_layout(config, seq_len, batch).size
    if reserve is None:
        raise ValueError("reserve: expected the reserve of a training forward "
                         "(rnn_forward(..., training=True)), got None")
    info = inspect_array("reserve", reserve)
    if info.device != device:
        raise ValueError(f"reserve: expected an array on {device}, got one on {info.device}")
    if info.dtype != dtype:
        raise TypeError(f"reserve: expected dtype {dtype} like x, got {info.dtype}")
    if len(info.shape) != 1 or info.shape[0] < needed:
        raise ValueError(f"reserve: expected a 1-D array of at least {needed} elements "
                         f"(rnn_reserve_size(config, {seq_len}, {batch})), got shape "
                         f"{info.shape}")
    if device == "cpu":
        if not reserve.flags.writeable or not reserve.flags.c_contiguous:
            raise ValueError("reserve: expected a writable, contiguous array")
        for arr in inputs:
            if isinstance(arr, np.ndarray) and np.may_share_memory(reserve, arr):
                raise ValueError("reserve: expected memory separate from the other "
                                 "arrays, got one that overlaps an input")
    if state is None:
        return
    head = np.asarray(reserve[:RESERVE_HEADER]) if device == "cpu" else \
        _device_header(reserve)
    expected = reserve_header(config, seq_len, batch, lengths, state)
    if head[0] != RESERVE_MAGIC or head[1] not in (RESERVE_FORWARD, RESERVE_BACKWARD_DATA):
        raise ValueError("reserve: expected the reserve of a training forward "
                         "(rnn_forward(..., training=True)), got an array it did not fill")
    same = [bool(np.all(head[a:a + 3] == expected[a:a + 3])) for a in (2, 5, 8, 11)]
    if not all(same[:3]):
        other = "" if same[2] else ", another config"
        raise ValueError(f"reserve: filled by a training forward of another problem (T="
                         f"{_from_digits(head[2:5])}, N={_from_digits(head[5:8])}{other}), "
                         f"expected T={seq_len}, N={batch} and this config")
    if not same[3]:
        raise ValueError("seq_lengths: expected the lengths the training forward used, got "
                         "different ones")
    if head[1] != state:
        if state == RESERVE_FORWARD:
            raise ValueError("reserve: rnn_backward_data already ran on this reserve (it "
                             "overwrites the gate activations with their gradients, as "
                             "cuDNN does); run a new training forward")
        raise ValueError("reserve: expected rnn_backward_data to have run on this reserve "
                         "first (it writes the gate gradients rnn_backward_weights reads)")


def rnn_forward_problem(config, x, params, hx=None, cx=None, *, seq_lengths=None,
                        training=False, dropout_seed=None, reserve=None):
    """Validate :func:`numbaconv.rnn_forward`; returns ``(problem, lengths)``."""
    config = check_config(config)
    xinfo, t, n = _sequence("x", x, config, config.input_size)
    infos = [xinfo, _params_info(params, config)]
    ld = config.num_layers * config.num_directions
    _state("hx", hx, (ld, n, config.out_size), infos)
    _state("cx", cx, (ld, n, config.hidden_size), infos, config.mode == "lstm",
           f"for mode {config.mode!r} (cell states are LSTM only)")
    device, dtype = check_operands(*infos)
    training = _flag_value(training, "training")
    if dropout_seed is not None and (not isinstance(dropout_seed, (int, np.integer))
                                     or isinstance(dropout_seed, bool) or dropout_seed < 0):
        raise TypeError(f"dropout_seed: expected None or a non-negative int, got "
                        f"{dropout_seed!r}")
    lengths = check_seq_lengths(seq_lengths, t, n)
    if reserve is not None:
        if not training:
            raise ValueError("reserve: expected None with training=False (only the training "
                             "forward fills a reserve), got an array")
        check_reserve(reserve, config, t, n, dtype, device, inputs=(x, params, hx, cx))
    return RNNProblem("rnn_forward", config, t, n, dtype, device, training,
                      lengths is not None), lengths


def _params_info(params, config):
    info = inspect_array("params", params)
    if info.shape != (config.num_params,):
        raise ValueError(f"params: expected a 1-D array of {config.num_params} elements "
                         f"(config.num_params), got shape {info.shape}")
    return info


def rnn_backward_data_problem(config, y, dy, params, reserve, *, hx=None, cx=None, dhy=None,
                              dcy=None, seq_lengths=None):
    """Validate :func:`numbaconv.rnn_backward_data`; returns ``(problem, lengths)``."""
    config = check_config(config)
    features = config.num_directions * config.out_size
    yinfo, t, n = _sequence("y", y, config, features)
    dyinfo = inspect_array("dy", dy)
    if dyinfo.shape != yinfo.shape:
        raise ValueError(f"dy: expected y's shape {yinfo.shape}, got {dyinfo.shape}")
    infos = [yinfo, dyinfo, _params_info(params, config)]
    ld = config.num_layers * config.num_directions
    lstm = config.mode == "lstm"
    why = f"for mode {config.mode!r} (cell states are LSTM only)"
    _state("hx", hx, (ld, n, config.out_size), infos)
    _state("cx", cx, (ld, n, config.hidden_size), infos, lstm, why)
    _state("dhy", dhy, (ld, n, config.out_size), infos)
    _state("dcy", dcy, (ld, n, config.hidden_size), infos, lstm, why)
    device, dtype = check_operands(*infos)
    lengths = check_seq_lengths(seq_lengths, t, n)
    check_reserve(reserve, config, t, n, dtype, device, state=RESERVE_FORWARD,
                  lengths=lengths, inputs=(y, dy, params, hx, cx, dhy, dcy))
    return RNNProblem("rnn_backward_data", config, t, n, dtype, device, True,
                      lengths is not None), lengths


def rnn_backward_weights_problem(config, x, params, reserve, *, hx=None, seq_lengths=None,
                                 out=None, accumulate=False):
    """Validate :func:`numbaconv.rnn_backward_weights`; returns ``(problem, lengths)``."""
    config = check_config(config)
    xinfo, t, n = _sequence("x", x, config, config.input_size)
    infos = [xinfo, _params_info(params, config)]
    ld = config.num_layers * config.num_directions
    _state("hx", hx, (ld, n, config.out_size), infos)
    device, dtype = check_operands(*infos)
    lengths = check_seq_lengths(seq_lengths, t, n)
    check_reserve(reserve, config, t, n, dtype, device, state=RESERVE_BACKWARD_DATA,
                  lengths=lengths, inputs=(x, params, hx))
    check_out(out, (config.num_params,), device, dtype, accumulate, (x, params, hx, reserve))
    return RNNProblem("rnn_backward_weights", config, t, n, dtype, device, True,
                      lengths is not None, bool(accumulate)), lengths
