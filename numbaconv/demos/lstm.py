"""A character-level LSTM language model, trained in NumPy on numbaconv's recurrent kernels.

The data: the Zen of Python (``import this``), 856 characters that ship with every Python,
read without printing them (``codecs.decode(this.s, "rot13")``). The model reads the text one
character at a time and predicts the next one::

    x_t one-hot (T, N, V)                           V = the text's distinct characters (45)
      -> LSTM V -> H                  (T, N, H)      numbaconv.nn.LSTM: rnn_forward and the
                                                     two rnn_backward_* calls
      -> linear H -> V, + bias        (T, N, V)      logits, NumPy
      -> softmax cross-entropy with the next character

A one-hot input times ``weight_ih`` is an embedding lookup (column ``k`` of ``weight_ih`` is
character ``k``'s embedding), so no separate embedding layer is needed.

Training is truncated backpropagation through time: the text, read cyclically, is split into
N streams starting at evenly spaced places (shifted at random each epoch), and every step
takes the next window of T characters of each stream. The LSTM's final states of a window are
the initial states of the next (the streams continue), but the gradient stops at the window's
start: ``dh0`` and ``dc0`` are dropped. Every step is one training forward into the layer's
preallocated reserve, then ``rnn_backward_data``, then ``rnn_backward_weights(out=...)`` into
the layer's gradient; no reserve-sized array is allocated after the first step.

Run it with ``numbaconv demo lstm`` (``--epochs``, ``--seed``, ``--backend``). Before training
it checks the whole model's gradients against finite differences in float64 on a small copy;
it prints the loss per epoch and, at the end, lines the model writes after a few primes.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..nn import LSTM, Adam
from ._gradcheck import directional_gradient_error
from ._progress import ProgressBar

HIDDEN_SIZE = 128
#: Parallel streams (the batch) and characters per BPTT window.
STREAMS = 16
WINDOW = 32
LEARNING_RATE = 0.01
DEFAULT_EPOCHS = 20
#: Gradients are scaled down to at most this global norm (the usual guard against the rare
#: exploding step of recurrent networks).
CLIP_NORM = 5.0

#: A run has learned when the loss on the whole text fell by at least this fraction of its
#: value before training (about ln 45 = 3.8 nats: a uniform guess).
MIN_LOSS_FALL = 0.25

#: :func:`gradient_check` passes below this; correct gradients give about 1e-8 in float64,
#: a single wrong one order 1.
GRADIENT_TOLERANCE = 1e-5


def zen_of_python() -> str:
    """The Zen of Python, from the standard library's ``this`` module, without printing it."""
    if "this" not in sys.modules:
        with contextlib.redirect_stdout(io.StringIO()):  # importing it prints the poem
            import this  # noqa: F401
    return codecs.decode(sys.modules["this"].s, "rot13")


class Vocabulary:
    """The characters of a text, each with an index."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {ch: k for k, ch in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[ch] for ch in text], np.int64)

    def decode(self, indices) -> str:
        return "".join(self.chars[k] for k in indices)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Along the last axis."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple:
    """Mean softmax cross-entropy over every position.

    Parameters
    ----------
    logits : ndarray, shape (..., V)
    targets : ndarray of int, shape (...)

    Returns
    -------
    loss : float
        In nats per character.
    dlogits : ndarray, shape of logits
        dL/dlogits ``= (softmax(logits) - onehot(targets)) / targets.size``.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    rows = np.arange(len(flat))
    shifted = flat - flat.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    loss = float(np.mean(log_z - shifted[rows, targets.ravel()]))
    dlogits = np.exp(shifted - log_z[:, None])
    dlogits[rows, targets.ravel()] -= 1
    dlogits /= len(flat)
    return loss, dlogits.reshape(logits.shape).astype(logits.dtype, copy=False)


class CharLSTM:
    """The model of the module docstring: :class:`~numbaconv.nn.LSTM` and a linear output.

    Parameters
    ----------
    vocab_size : int
        V, the size of the one-hot inputs and of the logits.
    hidden_size : int
    rng : numpy Generator or int
        Source (or seed) of the initial weights.
    dtype : float32 or float64
    """

    def __init__(self, vocab_size: int, hidden_size: int = HIDDEN_SIZE, rng=None,
                 dtype=np.float32):
        rng = np.random.default_rng(rng)
        self.lstm = LSTM(vocab_size, hidden_size, dtype=dtype, rng=rng)
        bound = 1.0 / np.sqrt(hidden_size)  # PyTorch's nn.Linear initialisation
        self.w_out = rng.uniform(-bound, bound, (vocab_size, hidden_size)).astype(dtype)
        self.b_out = rng.uniform(-bound, bound, vocab_size).astype(dtype)
        self.dw_out = np.zeros_like(self.w_out)
        self.db_out = np.zeros_like(self.b_out)
        self._onehot = np.eye(vocab_size, dtype=dtype)
        self._h: Optional[np.ndarray] = None

    @property
    def vocab_size(self) -> int:
        return self.w_out.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w_out.shape[1]

    def params(self) -> list:
        return self.lstm.params() + [self.w_out, self.b_out]

    def grads(self) -> list:
        """Gradients from the last :meth:`backward`, in the order of :meth:`params`."""
        return self.lstm.grads() + [self.dw_out, self.db_out]

    def zero_state(self, streams: int) -> tuple:
        """``(h, c)`` of zeros for ``streams`` sequences, shapes (1, N, H)."""
        shape = (1, streams, self.hidden_size)
        return np.zeros(shape, self.w_out.dtype), np.zeros(shape, self.w_out.dtype)

    def forward(self, chars: np.ndarray, state: tuple, *, training: bool = True) -> tuple:
        """Logits of the next character after each of ``chars``.

        Parameters
        ----------
        chars : ndarray of int, shape (T, N)
        state : (h0, c0), each of shape (1, N, H)
            The LSTM's initial states (:meth:`zero_state`, or the last window's final ones).
        training : bool
            Keep what :meth:`backward` needs.

        Returns
        -------
        logits : ndarray, shape (T, N, V)
        state : (hy, cy)
            The final states, to start the next window from.
        """
        x = self._onehot[chars]
        h, hy, cy = self.lstm.forward(x, *state, training=training)
        self._h = h if training else None
        return h @ self.w_out.T + self.b_out, (hy, cy)

    def backward(self, dlogits: np.ndarray) -> None:
        """Fill every gradient from dL/dlogits (after a training :meth:`forward`).

        The window's final states feed only the next window, whose gradient does not come
        back (truncated BPTT), so the LSTM gets no dL/dhy or dL/dcy, and its dL/dh0, dL/dc0
        are dropped.
        """
        rows = dlogits.reshape(-1, self.vocab_size)
        h = self._h.reshape(-1, self.hidden_size)
        np.matmul(rows.T, h, out=self.dw_out)         # dW_out = sum over (t, n) of dz h^T
        np.sum(rows, axis=0, out=self.db_out)
        dh = dlogits @ self.w_out                      # (T, N, H): dL/dy of the LSTM
        self.lstm.backward(dh)

    def sample(self, rng: np.random.Generator, prime: np.ndarray, length: int,
               temperature: float = 1.0, stop: Optional[int] = None) -> list:
        """Characters drawn one at a time, each fed back as the next input.

        Parameters
        ----------
        rng : numpy Generator
        prime : ndarray of int, shape (k,)
            Characters read first (their predictions are not drawn from).
        length : int
            At most this many characters are drawn.
        temperature : float
            Divides the logits: below 1 favours the likeliest characters.
        stop : int, optional
            Stop after drawing this character.

        Returns
        -------
        list of int
        """
        logits, state = self.forward(prime[:, None], self.zero_state(1), training=False)
        drawn = []
        for _ in range(length):
            p = softmax(logits[-1, 0].astype(np.float64) / temperature)
            char = int(rng.choice(len(p), p=p))
            drawn.append(char)
            if char == stop:
                break
            logits, state = self.forward(np.array([[char]]), state, training=False)
        return drawn


def clip_gradients(grads: list, max_norm: float) -> float:
    """Scale ``grads`` in place to a global norm of at most ``max_norm``; return the norm
    before scaling."""
    norm = float(np.sqrt(sum(float(np.vdot(g, g)) for g in grads)))
    if norm > max_norm:
        for g in grads:
            g *= max_norm / norm
    return norm


def text_loss(model: CharLSTM, data: np.ndarray) -> float:
    """Mean loss predicting each character of ``data`` from the ones before it, reading the
    whole text as one sequence from zero states (no gradients)."""
    logits, _ = model.forward(data[:-1, None], model.zero_state(1), training=False)
    return cross_entropy(logits, data[1:, None])[0]


def windows(data: np.ndarray, streams: int, window: int, offset: int) -> tuple:
    """One epoch's BPTT windows: ``(inputs, targets)``, each (steps, window, streams).

    Stream ``k`` reads ``data`` cyclically from ``offset + k * len(data) // streams`` on, so
    window ``s + 1`` of a stream continues where window ``s`` stopped; ``steps`` windows
    cover about the whole text once per stream.
    """
    steps = max(1, len(data) // window)
    starts = offset + np.arange(streams) * (len(data) // streams)
    positions = starts[None, :] + np.arange(steps * window)[:, None]  # (steps * window, N)
    inputs = data[positions % len(data)]
    targets = data[(positions + 1) % len(data)]
    return (inputs.reshape(steps, window, streams), targets.reshape(steps, window, streams))


def gradient_check(seed: int = 0, hidden_size: int = 6, window: int = 5, streams: int = 3,
                   h: float = 1e-6, text: Optional[str] = None) -> float:
    """Worst relative disagreement of the model's gradients with finite differences.

    A float64 copy of the model with a small hidden size, on two consecutive windows of the
    text: the first gives the carried (non-zero) states, the loss is the second's; see
    :func:`~numbaconv.demos._gradcheck.directional_gradient_error`.

    Returns
    -------
    float
        About 1e-8 or less when the backward pass is right.
    """
    text = zen_of_python() if text is None else text
    vocab = Vocabulary(text)
    data = vocab.encode(text)
    inputs, targets = windows(data, streams, window, offset=0)
    rng = np.random.default_rng(seed)
    model = CharLSTM(len(vocab), hidden_size, rng, dtype=np.float64)
    _, state = model.forward(inputs[0], model.zero_state(streams), training=False)

    def loss():
        return cross_entropy(model.forward(inputs[1], state, training=False)[0],
                             targets[1])[0]

    _, dlogits = cross_entropy(model.forward(inputs[1], state)[0], targets[1])
    model.backward(dlogits)
    return directional_gradient_error(loss, model.params(), model.grads(), rng, h)


@dataclass
class LSTMResult:
    """What :func:`train` reports.

    Attributes
    ----------
    history : list of dict
        Per epoch: ``epoch``, ``loss`` (mean training loss over the epoch's windows),
        ``text_loss`` (on the whole text, after the epoch) and ``seconds``.
    initial_loss : float
        Loss on the whole text before training.
    final_loss : float
        Loss on the whole text after the last epoch.
    learned : bool
        ``final_loss <= (1 - MIN_LOSS_FALL) * initial_loss``.
    seconds : float
    model : CharLSTM
    vocab : Vocabulary
    """

    history: list
    initial_loss: float
    final_loss: float
    learned: bool
    seconds: float
    model: CharLSTM
    vocab: Vocabulary


def train(epochs: int = DEFAULT_EPOCHS, seed: int = 0, *, hidden_size: int = HIDDEN_SIZE,
          streams: int = STREAMS, window: int = WINDOW, lr: float = LEARNING_RATE,
          max_steps: Optional[int] = None, text: Optional[str] = None,
          log: Optional[Callable[[str], None]] = print,
          progress: Optional[bool] = None) -> LSTMResult:
    """Train the character model with truncated BPTT, logging the loss per epoch.

    Parameters
    ----------
    epochs : int
        Passes over the text (each stream reads it about once per epoch).
    seed : int
        Seeds the weights and the streams' offsets: a run is reproducible.
    hidden_size, streams, window : int
        H, the batch N and the BPTT window T.
    lr : float
        Adam's step size.
    max_steps : int, optional
        Stop each epoch after this many windows (quick smoke runs).
    text : str, optional
        Instead of the Zen of Python.
    log : callable or None
        Receives one line per epoch.
    progress : bool, optional
        Draw a progress bar on stderr; default: when stderr is a terminal.

    Returns
    -------
    LSTMResult
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs: expected an int >= 1, got {epochs!r}")
    start = time.perf_counter()
    text = zen_of_python() if text is None else text
    vocab = Vocabulary(text)
    data = vocab.encode(text)
    rng = np.random.default_rng(seed)
    model = CharLSTM(len(vocab), hidden_size, rng)
    optimiser = Adam(model.params(), lr=lr)
    initial = text_loss(model, data)
    if log is not None:
        log(f"epoch {0:3d}/{epochs}  text loss {initial:.4f}  (before training)")
    steps = len(data) // window
    if max_steps is not None:
        steps = min(steps, max_steps)
    history = []
    with ProgressBar(epochs * steps, enabled=progress) as bar:
        for epoch in range(1, epochs + 1):
            epoch_start = time.perf_counter()
            inputs, targets = windows(data, streams, window, int(rng.integers(len(data))))
            state = model.zero_state(streams)
            losses = []
            for step in range(steps):
                # The previous window's final states, as plain arrays: nothing here links
                # them to the graph of that window, so gradients stop at the window's start.
                logits, state = model.forward(inputs[step], state)
                loss, dlogits = cross_entropy(logits, targets[step])
                model.backward(dlogits)
                clip_gradients(model.grads(), CLIP_NORM)
                optimiser.step(model.grads())
                losses.append(loss)
                bar.update(status=f"epoch {epoch}  loss {loss:.4f}")
            record = dict(epoch=epoch, loss=float(np.mean(losses)),
                          text_loss=text_loss(model, data),
                          seconds=time.perf_counter() - epoch_start)
            history.append(record)
            if log is not None:
                bar.close()  # the epoch line must not land on top of the bar
                log(f"epoch {epoch:3d}/{epochs}  loss {record['loss']:.4f}  "
                    f"text loss {record['text_loss']:.4f}  ({record['seconds']:.2f} s)")
    final = history[-1]["text_loss"]
    return LSTMResult(history, initial, final, final <= (1 - MIN_LOSS_FALL) * initial,
                      time.perf_counter() - start, model, vocab)


#: What the demo's samples start from: openings of lines of the text ("Although" opens three
#: lines, so the model has to pick a continuation), each read after a newline, as in the text.
PRIMES = ("Beautiful", "Errors", "Although")


def sample_line(model: CharLSTM, vocab: Vocabulary, rng: np.random.Generator, prime: str,
                temperature: float = 0.5, max_length: int = 80) -> str:
    """The rest of the line the model writes after ``prime`` (read from zero states).

    Raises
    ------
    ValueError
        ``prime`` has a character the text lacks.
    """
    unknown = sorted(set(prime) - set(vocab.chars))
    if unknown:
        raise ValueError(f"prime: expected characters of the text, got {prime!r} with "
                         f"{''.join(unknown)!r}")
    drawn = model.sample(rng, vocab.encode(prime), max_length, temperature,
                         stop=vocab.index.get("\n"))
    return vocab.decode(drawn).rstrip("\n")


def loss_change(initial: float, final: float) -> str:
    """How the loss moved, in words that stay informative near zero: ``"38% lower"``, and
    once it fell below a tenth of the start, the factor (``"400x lower"`` where a
    percentage would round to 100%)."""
    if not (math.isfinite(initial) and math.isfinite(final)) or initial <= 0 or final < 0:
        return f"from {initial:.4g} to {final:.4g}"
    if final > initial:
        return f"{final / initial - 1:.0%} higher"
    if final == 0:
        return "down to zero"
    if final <= initial / 10:
        ratio = initial / final
        return f"{ratio:.0f}x lower" if ratio >= 100 else f"{ratio:.1f}x lower"
    return f"{1 - final / initial:.0%} lower"


def one_blas_thread():
    """``(context manager, note)``: limits BLAS to one thread while in the context, through
    threadpoolctl when it is installed (else changes nothing); ``note`` says which.

    The demo's products are small (per step of the recurrence, 16 x 128 times 128 x 512), so
    a second BLAS thread gains nothing; but on a machine whose other cores are busy,
    OpenBLAS's threads wait on each other at each of the thousands of such products an epoch
    makes (measured on 2 shared cores: 0.1 s an epoch on one thread, up to 15 s on two).
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext(), ("BLAS threads left as they are (pip install "
                                          "threadpoolctl to run the small products on one)")
    return threadpool_limits(1, user_api="blas"), "BLAS limited to one thread (small products)"


def run_demo(*, epochs: Optional[int] = None, seed: int = 0,
             log: Callable[[str], None] = print, max_steps: Optional[int] = None,
             progress: Optional[bool] = None) -> int:
    """The ``numbaconv demo lstm`` command: check gradients, train, sample.

    Parameters
    ----------
    epochs : int, optional
        Default :data:`DEFAULT_EPOCHS`.
    seed : int
    log : callable
        Receives every line of the report.
    max_steps : int, optional
        Windows per epoch at most (quick smoke runs).
    progress : bool, optional
        As for :func:`train`.

    Returns
    -------
    int
        0 when the gradients check out and the loss on the text fell by
        :data:`MIN_LOSS_FALL` or more; 1 otherwise.
    """
    import numbaconv

    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    text = zen_of_python()
    vocab = Vocabulary(text)
    probe = LSTM(len(vocab), HIDDEN_SIZE)
    choice = numbaconv.explain(
        "rnn_forward", probe.config, np.zeros((WINDOW, STREAMS, len(vocab)), np.float32),
        probe.w, training=True)
    log(f"character-level LSTM on the Zen of Python: {len(text)} characters, "
        f"{len(vocab)} distinct")
    log(f"model: one-hot {len(vocab)} -> LSTM {HIDDEN_SIZE} -> linear {len(vocab)}, softmax "
        f"cross-entropy; truncated BPTT over {WINDOW}-character windows of {STREAMS} "
        f"streams, states carried; Adam; {epochs} epoch(s); seed {seed}")
    blas_limit, blas_note = one_blas_thread()
    log(f"recurrent ops run on backend {choice.backend!r}; {blas_note}")
    with blas_limit:
        error = gradient_check(seed, text=text)
        verdict = "ok" if error < GRADIENT_TOLERANCE else "FAILED"
        log(f"gradient check (float64, finite differences): worst relative error "
            f"{error:.1e}, {verdict}")
        result = train(epochs, seed, text=text, log=log, max_steps=max_steps,
                       progress=progress)
        log(f"text loss {result.initial_loss:.4f} -> {result.final_loss:.4f} nats per "
            f"character ({loss_change(result.initial_loss, result.final_loss)}) after "
            f"{epochs} epoch(s) in {result.seconds:.1f} s")
        rng = np.random.default_rng(seed)
        for prime in PRIMES:
            line = sample_line(result.model, vocab, rng, "\n" + prime)
            log(f"sample (temperature 0.5), primed with {prime!r}: {prime}{line}")
    if verdict != "ok":
        log("FAILED: the model's gradients disagree with finite differences")
        return 1
    if not result.learned:
        log(f"FAILED: the loss fell by less than {MIN_LOSS_FALL:.0%} (more --epochs may help)")
        return 1
    return 0
