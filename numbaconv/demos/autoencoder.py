"""A convolutional autoencoder for handwritten digits, trained in NumPy on numbaconv's kernels.

The data: the 1,797 8x8 greyscale digits that scikit-learn ships (``load_digits``, no
download), scaled to [0, 1]; a fifth of them, chosen by the seed, is held out. The network
squeezes each 64-pixel image through a 32-number code and back::

    x (N, 1, 8, 8)
      -> Conv 1 -> 16, 3x3, stride 2, padding 1, ReLU                    (N, 16, 4, 4)   encoder,
      -> Conv 16 -> 8, 3x3, stride 2, padding 1, ReLU                    (N, 8, 2, 2)    weights w_f
      -> ConvTranspose 8 -> 16, 3x3, stride 2, padding 1,
         output_padding 1, ReLU                                          (N, 16, 4, 4)   decoder,
      -> ConvTranspose 16 -> 1, same geometry -> logits                  (N, 1, 8, 8)    weights w_b
      -> sigmoid: the reconstruction

with binary cross-entropy between reconstruction and image as the loss (the pixels are
intensities in [0, 1]), minimised by Adam.

The encoder's and decoder's weights are separate (untied), as in most hand-written
autoencoders, so each half has its own backward (see :mod:`numbaconv.nn`): the encoder's
weight gradient is the convolution's (``conv_backward_weight(x, dy)``), the decoder's is the
transposed convolution's, which is the convolution's weight gradient with input and output
swapped (``conv_backward_weight(dy, x)``), and the decoder passes the gradient back to the
code through a plain convolution. ``docs/gradients.md`` derives all three.

Run it with ``numbaconv demo autoencoder`` (``--epochs``, ``--seed``, ``--backend``,
``--output``); it needs scikit-learn (``pip install "numbaconv[demo]"``). Before training it
checks the whole model's gradients against finite differences in float64; after training it
saves a PNG of held-out digits above their reconstructions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..nn import Adam, Conv, ConvTranspose
from ._gradcheck import directional_gradient_error
from ._png import image_grid, write_png
from ._progress import ProgressBar

IMAGE_SIZE = 8
#: Channels of the two encoder layers; the decoder mirrors them.
CHANNELS = (16, 8)
BATCH_SIZE = 32
LEARNING_RATE = 0.01
DEFAULT_EPOCHS = 25
#: Fraction of the digits held out to measure the loss on images never trained on.
TEST_FRACTION = 0.2
DEFAULT_OUTPUT = "numbaconv-autoencoder.png"

#: A run has learned when the held-out loss fell by at least this fraction of its value
#: before training (an untrained decoder outputs about 0.5 everywhere: loss about 0.69;
#: the default run ends near 0.24, whose floor is the entropy of the grey pixels).
MIN_LOSS_FALL = 0.1

#: :func:`gradient_check` passes below this; correct gradients give about 1e-8 in float64,
#: a single wrong one order 1.
GRADIENT_TOLERANCE = 1e-5

#: The geometry every layer shares: each encoder layer halves the image, each decoder layer
#: doubles it back (output_padding 1 picks 2n, not 2n - 1, of the sizes a stride-2
#: convolution maps to n).
GEOMETRY = dict(stride=2, padding=1)


def load_digits_images(dtype=np.float32) -> tuple:
    """scikit-learn's handwritten digits as images in [0, 1].

    Returns
    -------
    images : ndarray, shape (1797, 1, 8, 8)
    labels : ndarray of int, shape (1797,)
        The digit each image shows (used only to pick examples for the picture).

    Raises
    ------
    ImportError
        scikit-learn is not installed; the message says how to install it.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError('the autoencoder demo needs scikit-learn: pip install '
                          '"numbaconv[demo]" (or pip install scikit-learn)') from exc
    digits = load_digits()
    # The pixel values are counts 0..16 (ink in a 4x4 block of the original 32x32 scan).
    images = (digits.images / 16.0).astype(dtype)[:, None]
    return images, digits.target.astype(np.int64)


def split(n: int, seed: int, test_fraction: float = TEST_FRACTION) -> tuple:
    """``(train_indices, test_indices)``: a seeded random split of ``range(n)``."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(n * test_fraction)))
    return order[n_test:], order[:n_test]


def sigmoid(z: np.ndarray) -> np.ndarray:
    # The tanh form never overflows, unlike 1 / (1 + exp(-z)) for very negative z.
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def bce_with_logits(logits: np.ndarray, target: np.ndarray) -> tuple:
    """Binary cross-entropy of ``sigmoid(logits)`` against ``target``, mean per pixel.

    Returns
    -------
    loss : float
    dlogits : ndarray, shape of logits
        dL/dlogits ``= (sigmoid(logits) - target) / logits.size``: the sigmoid's derivative
        cancels the logarithm's, which is why the loss is taken on the logits.
    """
    # log(1 + exp(-|z|)) plus max(z, 0) - z t is the loss in a form that never overflows.
    loss = float(np.mean(np.maximum(logits, 0) - logits * target
                         + np.log1p(np.exp(-np.abs(logits)))))
    dlogits = ((sigmoid(logits) - target) / logits.size).astype(logits.dtype)
    return loss, dlogits


class Autoencoder:
    """The network of the module docstring: two :class:`~numbaconv.nn.Conv` layers encode,
    two :class:`~numbaconv.nn.ConvTranspose` layers decode.

    Parameters
    ----------
    rng : numpy Generator or int
        Source (or seed) of the initial weights.
    channels : (int, int)
        Channels after the first and second encoder layer.
    dtype : float32 or float64
    """

    def __init__(self, rng, channels: tuple = CHANNELS, dtype=np.float32):
        rng = np.random.default_rng(rng)
        c1, c2 = channels
        options = dict(GEOMETRY, dtype=dtype, rng=rng)
        # Encoder: weights w_f, (out, in, 3, 3) as for any convolution.
        self.encode1 = Conv(1, c1, 3, **options)
        self.encode2 = Conv(c1, c2, 3, **options)
        # Decoder: weights w_b, (in, out, 3, 3) as for any transposed convolution.
        self.decode1 = ConvTranspose(c2, c1, 3, output_padding=1, **options)
        self.decode2 = ConvTranspose(c1, 1, 3, output_padding=1, **options)
        self.layers = (self.encode1, self.encode2, self.decode1, self.decode2)

    def params(self) -> list:
        return [p for layer in self.layers for p in layer.params()]

    def grads(self) -> list:
        """Gradients from the last :meth:`backward`, in the order of :meth:`params`."""
        return [g for layer in self.layers for g in layer.grads()]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Logits of the reconstruction, shape of ``x`` (N, 1, 8, 8)."""
        # Each ReLU keeps the mask of its positive inputs: its backward lets dy through there.
        z = self.encode1.forward(x)
        self._mask1 = z > 0
        z = self.encode2.forward(z * self._mask1)
        self._mask2 = z > 0
        z = self.decode1.forward(z * self._mask2)
        self._mask3 = z > 0
        return self.decode2.forward(z * self._mask3)

    def backward(self, dlogits: np.ndarray) -> None:
        """Fill every layer's ``dw`` and ``db`` from dL/dlogits (after :meth:`forward`)."""
        d = self.decode2.backward(dlogits)
        d = self.decode1.backward(d * self._mask3)
        d = self.encode2.backward(d * self._mask2)
        # Nothing needs dL/dx of the images, so the first layer skips its data gradient.
        self.encode1.backward(d * self._mask1, need_dx=False)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """The code of each image, shape (N, channels[1], 2, 2)."""
        return np.maximum(self.encode2.forward(np.maximum(self.encode1.forward(x), 0)), 0)

    def reconstruct(self, x: np.ndarray) -> np.ndarray:
        """Reconstructions in [0, 1], shape of ``x``."""
        return sigmoid(self.forward(x))


def gradient_check(seed: int = 0, batch: int = 8, h: float = 1e-6,
                   images: Optional[np.ndarray] = None) -> float:
    """Worst relative disagreement of the model's gradients with finite differences.

    A float64 model on ``batch`` digits; see
    :func:`~numbaconv.demos._gradcheck.directional_gradient_error`.

    Parameters
    ----------
    seed : int
    batch : int
        Images in the loss.
    h : float
        Finite-difference step.
    images : ndarray, optional
        Images to use (default: the first ``batch`` digits).

    Returns
    -------
    float
        About 1e-8 or less when the backward pass is right.
    """
    if images is None:
        images = load_digits_images(np.float64)[0]
    x = np.asarray(images[:batch], np.float64)
    rng = np.random.default_rng(seed)
    model = Autoencoder(rng, dtype=np.float64)
    _, dlogits = bce_with_logits(model.forward(x), x)
    model.backward(dlogits)
    return directional_gradient_error(lambda: bce_with_logits(model.forward(x), x)[0],
                                      model.params(), model.grads(), rng, h)


def mean_loss(model: Autoencoder, images: np.ndarray, batch: int = 512) -> float:
    """Mean per-pixel loss of ``model`` on ``images``, in batches (no gradients)."""
    total = 0.0
    for start in range(0, len(images), batch):
        x = images[start:start + batch]
        total += bce_with_logits(model.forward(x), x)[0] * len(x)
    return total / len(images)


@dataclass
class AutoencoderResult:
    """What :func:`train` reports.

    Attributes
    ----------
    history : list of dict
        Per epoch: ``epoch``, ``loss`` (mean training loss over the epoch), ``test_loss``
        (held-out, after the epoch) and ``seconds``.
    initial_test_loss : float
        Held-out loss before training.
    test_loss : float
        Held-out loss after the last epoch.
    learned : bool
        ``test_loss <= (1 - MIN_LOSS_FALL) * initial_test_loss``.
    seconds : float
        Wall time of training, evaluation included.
    model : Autoencoder
    test_images, test_labels : ndarray
        The held-out digits.
    """

    history: list
    initial_test_loss: float
    test_loss: float
    learned: bool
    seconds: float
    model: Autoencoder
    test_images: np.ndarray
    test_labels: np.ndarray


def train(epochs: int = DEFAULT_EPOCHS, seed: int = 0, *, batch_size: int = BATCH_SIZE,
          lr: float = LEARNING_RATE, max_steps: Optional[int] = None,
          data: Optional[tuple] = None, log: Optional[Callable[[str], None]] = print,
          progress: Optional[bool] = None) -> AutoencoderResult:
    """Train the autoencoder on the digits, logging the loss per epoch.

    Parameters
    ----------
    epochs : int
        Passes over the training digits.
    seed : int
        Seeds the split, the initial weights and the shuffling: a run is reproducible.
    batch_size : int
    lr : float
        Adam's step size.
    max_steps : int, optional
        Stop each epoch after this many batches (quick smoke runs).
    data : (images, labels), optional
        Instead of :func:`load_digits_images` (images ``(n, 1, 8, 8)`` in [0, 1]).
    log : callable or None
        Receives one line per epoch.
    progress : bool, optional
        Draw a progress bar on stderr; default: when stderr is a terminal.

    Returns
    -------
    AutoencoderResult
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs: expected an int >= 1, got {epochs!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    start = time.perf_counter()
    images, labels = load_digits_images() if data is None else data
    train_idx, test_idx = split(len(images), seed)
    x_train, x_test = images[train_idx], images[test_idx]
    rng = np.random.default_rng(seed)
    model = Autoencoder(rng, dtype=images.dtype)
    optimiser = Adam(model.params(), lr=lr)
    initial = mean_loss(model, x_test)
    if log is not None:
        log(f"epoch {0:3d}/{epochs}  test loss {initial:.4f}  (before training)")
    steps = -(-len(x_train) // batch_size)
    if max_steps is not None:
        steps = min(steps, max_steps)
    history = []
    with ProgressBar(epochs * steps, enabled=progress) as bar:
        for epoch in range(1, epochs + 1):
            epoch_start = time.perf_counter()
            order = rng.permutation(len(x_train))
            losses = []
            for step in range(steps):
                x = x_train[order[step * batch_size:(step + 1) * batch_size]]
                loss, dlogits = bce_with_logits(model.forward(x), x)
                model.backward(dlogits)
                optimiser.step(model.grads())
                losses.append(loss)
                bar.update(status=f"epoch {epoch}  loss {loss:.4f}")
            record = dict(epoch=epoch, loss=float(np.mean(losses)),
                          test_loss=mean_loss(model, x_test),
                          seconds=time.perf_counter() - epoch_start)
            history.append(record)
            if log is not None:
                bar.close()  # the epoch line must not land on top of the bar
                log(f"epoch {epoch:3d}/{epochs}  loss {record['loss']:.4f}  "
                    f"test loss {record['test_loss']:.4f}  ({record['seconds']:.2f} s)")
    final = history[-1]["test_loss"]
    return AutoencoderResult(history, initial, final, final <= (1 - MIN_LOSS_FALL) * initial,
                             time.perf_counter() - start, model, x_test, labels[test_idx])


def save_reconstructions(path, model: Autoencoder, images: np.ndarray, labels: np.ndarray,
                         per_digit: int = 2) -> np.ndarray:
    """Save a PNG of digits (one of each, 0 to 9, per row) above their reconstructions.

    Parameters
    ----------
    path : str or path-like
    model : Autoencoder
    images : ndarray, shape (n, 1, 8, 8)
        Digits to pick from (the held-out ones, to show generalisation).
    labels : ndarray of int, shape (n,)
    per_digit : int
        Pairs of rows (originals, reconstructions).

    Returns
    -------
    ndarray of uint8
        The picture written.
    """
    chosen = []
    for k in range(per_digit):
        for digit in range(10):
            candidates = np.flatnonzero(labels == digit)
            # A small set may lack a digit or have too few of one: repeat rather than fail.
            chosen.append(candidates[k % len(candidates)] if len(candidates) else 0)
    originals = images[chosen, 0]
    reconstructions = model.reconstruct(images[chosen])[:, 0]
    rows = []
    for k in range(per_digit):
        rows += [originals[k * 10:(k + 1) * 10], reconstructions[k * 10:(k + 1) * 10]]
    picture = image_grid(np.concatenate(rows), 10, scale=5,
                         row_gaps=tuple(range(1, 2 * per_digit - 1, 2)))
    write_png(path, picture)
    return picture


def run_demo(*, epochs: Optional[int] = None, seed: int = 0,
             output: Optional[str] = DEFAULT_OUTPUT,
             log: Callable[[str], None] = print, max_steps: Optional[int] = None,
             progress: Optional[bool] = None) -> int:
    """The ``numbaconv demo autoencoder`` command: check gradients, train, save the picture.

    Parameters
    ----------
    epochs : int, optional
        Default :data:`DEFAULT_EPOCHS`.
    seed : int
    output : str or None
        Where to save the PNG; None saves none.
    log : callable
        Receives every line of the report.
    max_steps : int, optional
        Batches per epoch at most (quick smoke runs).
    progress : bool, optional
        As for :func:`train`.

    Returns
    -------
    int
        0 when the gradients check out and the held-out loss fell by :data:`MIN_LOSS_FALL`
        or more; 1 otherwise.
    """
    import numbaconv

    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    images, labels = load_digits_images()
    c1, c2 = CHANNELS
    probe = (np.zeros((BATCH_SIZE, 1, IMAGE_SIZE, IMAGE_SIZE), np.float32),
             np.zeros((BATCH_SIZE, c1, IMAGE_SIZE // 2, IMAGE_SIZE // 2), np.float32),
             (c1, 1, 3, 3))
    choice = numbaconv.explain("conv_backward_weight", *probe, **GEOMETRY)
    log(f"convolutional autoencoder on scikit-learn's handwritten digits: {len(images)} "
        f"images, {IMAGE_SIZE}x{IMAGE_SIZE}, {TEST_FRACTION:.0%} held out")
    log(f"model: conv 1->{c1}->{c2} (stride 2) to a {c2 * (IMAGE_SIZE // 4) ** 2}-number "
        f"code, transposed conv {c2}->{c1}->1 back; binary cross-entropy; Adam; "
        f"{epochs} epoch(s); seed {seed}")
    log(f"convolutions run on backend {choice.backend!r}")
    error = gradient_check(seed, images=images)
    verdict = "ok" if error < GRADIENT_TOLERANCE else "FAILED"
    log(f"gradient check (float64, finite differences): worst relative error {error:.1e}, "
        f"{verdict}")
    result = train(epochs, seed, data=(images, labels), log=log, max_steps=max_steps,
                   progress=progress)
    fall = 1 - result.test_loss / result.initial_test_loss
    log(f"held-out loss {result.initial_test_loss:.4f} -> {result.test_loss:.4f} "
        f"({fall:.0%} lower) after {epochs} epoch(s) in {result.seconds:.1f} s")
    if output is not None:
        save_reconstructions(output, result.model, result.test_images, result.test_labels)
        log(f"saved {output}: held-out digits 0-9, each row above its reconstructions")
    if verdict != "ok":
        log("FAILED: the model's gradients disagree with finite differences")
        return 1
    if not result.learned:
        log(f"FAILED: the held-out loss fell by less than {MIN_LOSS_FALL:.0%} "
            f"(more --epochs may help)")
        return 1
    return 0
