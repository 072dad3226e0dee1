"""cpu ``rnn_forward``: the input projections of all steps as one BLAS product per layer and
direction (written straight into the reserve's gate region), then the recurrence in chains
of batch rows (:func:`batch_chains`), each stepping on one core: per step the recurrent
product on weights packed once per call (:class:`._microkernel.RowPanels`) and one fused
Numba kernel for the gates and the state update (docs/cpu-algorithms.md, "Recurrent
networks")."""

from __future__ import annotations

import numpy as np

from ..problem import layer_params
from . import _tiles
from . import _rnn_cells as cells_k
from . import _rnn_chains as chains_k
from ._microkernel import (RowPanels, columns_product, load_columns, panel_rows,
                           state_columns, vector_lanes)


def lengths_or_full(lengths, seq_len, batch):
    return lengths if lengths is not None else np.full(batch, seq_len, np.int64)


def steps(seq_len, direction):
    """Time steps in processing order."""
    return range(seq_len) if direction == 0 else range(seq_len - 1, -1, -1)


def each_step(order):
    """The time steps of ``order``; a chain on a tile worker stops between two of them once
    its call is interrupted (Ctrl-C: see _tiles.stop_if_interrupted)."""
    for t in order:
        _tiles.stop_if_interrupted()
        yield t


def combined_bias(b_ih, b_hh, size, dtype):
    if b_ih is None:
        return np.zeros(size, dtype)
    return b_ih + b_hh


#: At most this many chains per direction (the most cores a recurrence can keep busy).
CHAIN_PARTS = 8
#: At least this many chains in all (directions times chains per direction) where the
#: batch has the rows: a single chain steps with a barrier among the threads at every step,
#: several step on their own cores without one.
CHAIN_MIN_PARTS = 2


def chain_rows(dtype) -> int:
    """Batch rows per chain: the columns of one micro-kernel tile (NR), so that a chain's
    product wastes no column of its tiles (:class:`RowPanels` pads to whole tiles)."""
    return RowPanels.tile_columns(dtype)


def batch_chains(batch: int, dtype, directions: int = 1) -> list:
    """[(start, stop), ...]: the batch rows cut into chains, fixed by the shape.

    The rows of a recurrence are independent of one another (each row's state depends on
    its own past only), so each chain runs every step of its rows on one core, with no
    barrier between the cores: its own recurrent product and its own gate kernel. A chain
    per :func:`chain_rows` rows, at most CHAIN_PARTS, and enough that the ``directions``
    make CHAIN_MIN_PARTS chains in all (fewer rows than a tile's columns then); the cut does
    not depend on the thread count, nor then do the bits."""
    least = min(-(-CHAIN_MIN_PARTS // directions), batch)
    parts = max(-(-batch // chain_rows(dtype)), least)
    return _tiles.fixed_ranges(batch, min(CHAIN_PARTS, parts))


def share_chains(chains) -> bool:
    """Whether the chains are shared out among the tile workers (else they run one after
    another, each step's work parallel in itself): whenever there are several."""
    return len(chains) > 1


def run_recurrences(chains, recurrence, batch, gate_width):
    """``recurrence(direction, rows, kernels, products)`` for each chain (direction, rows).

    Shared chains (:func:`share_chains`) run on the tile workers, each on one thread
    (serial kernels, products on the calling thread: :class:`OneThread`). Otherwise each
    chain runs here, with the step kernels parallel where a step is large enough and each
    step's products shared out (:class:`Shared`). Which of the two runs depends on the
    shape alone, and so do the bits."""
    if share_chains(chains):
        serial = cells_k.kernels(False)
        _tiles.run_tiles(lambda chain, pick: recurrence(*chain, serial, OneThread), chains)
    else:
        for chain in chains:
            recurrence(*chain, cells_k.kernels_for(batch, gate_width), Shared)


def weights_as_columns(chain_rows: int, dtype) -> bool:
    """Whether :class:`StepWeights` packs the weights as the micro-kernel's NR side: where
    that pads a chain of ``chain_rows`` rows to no more rows (whole tiles of
    :func:`._microkernel.panel_rows` each) than the MR side would (whole NR columns). On
    a tie too: the product then lands as (rows, gates), and the step kernels read each
    row's gates from one run of memory rather than one value a column."""
    nr = RowPanels.tile_columns(dtype)
    return padded_rows(chain_rows, dtype) <= -(-chain_rows // nr) * nr


def padded_rows(rows: int, dtype) -> int:
    """A chain's states in whole tiles of :func:`._microkernel.panel_rows` rows."""
    height = panel_rows(rows, dtype)
    return -(-rows // height) * height


class StepWeights:
    """A layer and direction's recurrent weights W (G x K), packed once per call for the
    chains' per-step products ``W @ states.T`` (:meth:`chain`).

    The micro-kernel computes tiles of NR columns and at most MR rows: with the weights as
    its MR side (:meth:`RowPanels.multiply`) a chain's states are padded to whole NR
    columns, with the weights as its NR side (:func:`._microkernel.columns_product`) to
    whole tiles of :func:`._microkernel.panel_rows` rows (16 rows: two 8-row tiles).
    Packed the way that pads the widest of ``chains`` less (:func:`weights_as_columns`; on
    AVX-512's 32-column tiles, chains of 10, 16 or 32 rows: the weights as NR side; on
    AVX2's 16-column tiles, a chain of 16 rows: as MR side)."""

    def __init__(self, w, chains):
        widest = max(stop - start for _, (start, stop) in chains)
        self.by_columns = weights_as_columns(widest, w.dtype)
        self.packed = RowPanels(w, height=RowPanels.tile_columns(w.dtype)
                                if self.by_columns else None)

    def chain(self, rows: int) -> "ChainProduct":
        return ChainProduct(self, rows)


class ChainProduct:
    """One chain's product ``result = W @ states.T`` (G, rows), a view into its buffer:
    :meth:`load` the step's states (rows, K), then :meth:`multiply`. Either way the states
    are transposed into a columns buffer: with the weights as the NR side, the
    micro-kernel reads them there in tiles of :attr:`height` rows
    (:func:`._microkernel.columns_product`); with the weights as the MR side, they are its
    NR-wide right operand (:meth:`RowPanels.multiply`)."""

    def __init__(self, weights: StepWeights, rows: int):
        packed = self.packed = weights.packed
        dtype = packed.dtype
        self.by_columns = weights.by_columns
        self.rows = rows
        if self.by_columns:
            #: Rows of the micro-kernel's tiles: the states' :func:`panel_rows`, or MR.
            self.height = panel_rows(rows, dtype)
            self.states = state_columns(rows, packed.depth, dtype)
            self.out = np.zeros((-(-rows // self.height) * self.height,
                                 packed.count * packed.height), dtype)
            self.result = self.out[:rows, :packed.rows].T
        else:
            self.height = packed.mr
            self.states = packed.columns(rows)
            self.out = np.zeros((packed.count * packed.mr, self.states.shape[1]), dtype)
            self.result = self.out[:packed.rows, :rows]

    def load(self, states):
        if self.by_columns:
            load_columns(states, self.states)
        else:
            self.packed.load(states, self.states)

    def multiply(self, products):
        """The product, run as ``products`` runs it (:class:`OneThread`, :class:`Shared`)."""
        products.recurrent(self)

    def run_steps(self, kernel, order, *operands):
        """The steps ``order`` by the chain loop ``kernel`` of :mod:`._rnn_chains`, compiled
        for this product's tiles, in blocks (:func:`._rnn_chains.blocks`), the chain
        stopping between two once its call is interrupted: ``kernel(block, <the product's
        arguments>, *operands)``, the product's arguments being by_columns, the states'
        columns buffer, the weights' panels, out, the tiles' height and count (with the
        weights as the NR side), MR, NR and the vector lanes."""
        packed = self.packed
        drive = chains_k.driver(kernel, self.height, packed.mr)
        product = (self.by_columns, self.states, packed.panels, self.out, self.height,
                   -(-self.rows // self.height), packed.mr, packed.nr,
                   vector_lanes(packed.dtype))
        for block in chains_k.blocks(order):
            _tiles.stop_if_interrupted()
            drive(block, *product, *operands)

    def multiply_panels(self, start: int, stop: int):
        """The part of the product that the weights' panels ``start .. stop`` make: the
        same bits whichever panels share a call."""
        if self.by_columns:
            columns_product(self.states, self.rows, self.packed, self.out, start, stop)
        else:
            self.packed.multiply(self.states, self.out, start, stop)


class OneThread:
    """A chain's products on a tile worker: on the calling thread, BLAS on one thread."""

    @staticmethod
    def dense(a, b, out):
        """out = a @ b (NumPy)."""
        np.matmul(a, b, out=out)

    @staticmethod
    def recurrent(step: ChainProduct):
        step.multiply_panels(0, step.packed.count)


class Shared:
    """A single chain's products shared out among the tile workers: BLAS in slices fixed by
    the shape (:func:`_tiles.matmul`); the packed weights' panels in any runs (a panel's
    values do not depend on the others)."""

    @staticmethod
    def dense(a, b, out):
        _tiles.matmul(a, b, out, fixed=True)

    @staticmethod
    def recurrent(step: ChainProduct):
        share = step.out.size * step.packed.depth > _tiles.SHARED_PRODUCT_ABOVE
        spans = _tiles.worker_ranges(step.packed.count, share)
        if len(spans) == 1:
            step.multiply_panels(*spans[0])
        else:
            _tiles.run_tiles(lambda span, pick: step.multiply_panels(*span), spans)


# One BLAS thread, products over all steps cut into slices fixed by the shape: the parameter
# gradients' bits then do not depend on the thread count (see _tiles.blas_single_threaded).
@_tiles.on_one_blas_thread
def run(problem, operands, out, algorithm):
    x, params, hx, cx, lengths, reserve = operands
    cfg = problem.config
    t_len, n = problem.seq_len, problem.batch
    d_num, p, hs = cfg.num_directions, cfg.out_size, cfg.hidden_size
    dtype = problem.numpy_dtype
    mode, training = cfg.mode, problem.training
    gh = cfg.gates * hs
    gw = 4 * hs if mode == "gru" else gh
    lens = lengths_or_full(lengths, t_len, n)
    layout = problem.reserve_layout if training else None
    hy = np.empty_like(hx)
    cy = np.empty_like(cx) if mode == "lstm" else None
    scratch = None if training else np.empty((d_num, t_len, n, gw), dtype)
    zeros = np.zeros(gh, dtype)
    one = dtype.type(1)  # keeps float32 kernels in float32
    chains = [(d, rows) for d in range(d_num) for rows in batch_chains(n, dtype, d_num)]
    inp = x
    for layer in range(cfg.num_layers):
        if training:
            inp = layout.layer_input(reserve, layer, x)  # with its dropout masks applied
            out_l = layout.outputs(reserve, layer)
        else:
            out_l = np.empty((t_len, n, d_num * p), dtype)
        gates_of = [layout.gates(reserve, layer, d) if training else scratch[d]
                    for d in range(d_num)]
        panels = []
        for d in range(d_num):
            w_ih, w_hh = layer_params(cfg, params, layer, d)[:2]
            _tiles.matmul(inp.reshape(t_len * n, -1), w_ih.T,
                          gates_of[d].reshape(t_len * n, gw)[:, :gh], fixed=True)
            panels.append(StepWeights(w_hh, chains))

        def recurrence(d, rows, k, products, layer=layer, out_l=out_l, gates_of=gates_of,
                       panels=panels):
            _, w_hh, b_ih, b_hh, w_hr = layer_params(cfg, params, layer, d)
            ld = layer * d_num + d
            sl = slice(*rows)
            m_rows = rows[1] - rows[0]
            gates = gates_of[d][:, sl]
            y_d = out_l[:, sl, d * p:(d + 1) * p]
            lens_c = lens[sl]
            h = hx[ld, sl].copy()
            step = panels[d].chain(m_rows)  # W_hh @ h.T: see _rnn_cells on why transposed
            hg = step.result
            work = np.empty((m_rows, (5 if mode == "lstm" else 4) * hs), dtype)
            if mode == "lstm":
                c = cx[ld, sl].copy()
                bias = combined_bias(b_ih, b_hh, gh, dtype)
                cells = layout.cells(reserve, layer, d)[:, sl] if training else None
                m = np.empty((m_rows, hs), dtype) if cfg.proj_size else None
                hp = np.empty((m_rows, p), dtype) if cfg.proj_size else None
                hout = m if cfg.proj_size else h
                flat = chains_k.by_steps(gates) if products is OneThread else None
                kept = chains_k.by_steps(cells) if training else (c.reshape(-1), 0)
                if flat and kept and not cfg.proj_size:
                    step.run_steps(chains_k.lstm_forward_chain, steps(t_len, d), *flat, hg,
                                   bias, c, h, y_d, *kept, lens_c, training, work)
                else:
                    for t in each_step(steps(t_len, d)):
                        step.load(h)
                        step.multiply(products)
                        k.lstm_forward_step(gates[t], hg, bias, c, hout, y_d[t],
                                            cells[t] if training else c, lens_c, t,
                                            training, not cfg.proj_size, work)
                        if cfg.proj_size:
                            products.dense(m, w_hr.T, hp)
                            k.commit_projection(hp, h, y_d[t], lens_c, t)
                cy[ld, sl] = c
            elif mode == "gru":
                bi = zeros if b_ih is None else b_ih
                bh = zeros if b_hh is None else b_hh
                flat = chains_k.by_steps(gates) if products is OneThread else None
                if flat:
                    step.run_steps(chains_k.gru_forward_chain, steps(t_len, d), *flat, hg, bi,
                                   bh, h, y_d, lens_c, training, one, work)
                else:
                    for t in each_step(steps(t_len, d)):
                        step.load(h)
                        step.multiply(products)
                        k.gru_forward_step(gates[t], hg, bi, bh, h, y_d[t], lens_c, t,
                                           training, one, work)
            else:
                bias = combined_bias(b_ih, b_hh, gh, dtype)
                relu = mode == "rnn_relu"
                flat = chains_k.by_steps(gates) if products is OneThread else None
                if flat:
                    step.run_steps(chains_k.rnn_forward_chain, steps(t_len, d), *flat, hg,
                                   bias, h, y_d, lens_c, training, relu)
                else:
                    for t in each_step(steps(t_len, d)):
                        step.load(h)
                        step.multiply(products)
                        k.rnn_forward_step(gates[t], hg, bias, h, y_d[t], lens_c, t,
                                           training, relu)
            hy[ld, sl] = h

        run_recurrences(chains, recurrence, n, gw)
        inp = out_l
    # In training the last layer's output lives in the reserve; the caller gets its own copy.
    y = inp.copy() if training else inp
    return y, hy, cy
