"""A small convolutional network trained end to end in NumPy on numbaconv's gradients.

The task: tell apart images of a horizontal, a vertical and a diagonal bar (either diagonal)
drawn at random positions and lengths on a noisy 16x16 canvas. The network::

    x (N, 1, 16, 16)
      -> conv 3x3, 1 -> 8 channels, padding 1, + bias -> ReLU         (N, 8, 16, 16)
      -> conv 3x3, 8 -> 8 channels, stride 2, padding 1, + bias -> ReLU (N, 8, 8, 8)
      -> global average pool                                           (N, 8)
      -> linear 8 -> 3 + bias -> softmax cross-entropy

Both convolutions run forward through :func:`numbaconv.conv` and backward through
:func:`numbaconv.conv_backward` (dx, dw, db; the first layer skips dx, which nothing needs).
Everything else is a few lines of NumPy (Adam is :class:`numbaconv.nn.Adam`). Orientation
cannot be read off any single pixel and the pooling throws position away, so only the
convolutions can solve it.

Training well is weak evidence of correct gradients (a network learns something even with
some wrong ones), so before training :func:`gradient_check` compares the whole network's
gradients with finite differences in float64; the test suite checks each op in depth.

Run it with ``numbaconv demo cnn`` (``--epochs``, ``--seed``, ``--backend``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..conv import conv, conv_backward
from ..nn import Adam
from ._gradcheck import directional_gradient_error

CLASSES = ("horizontal", "vertical", "diagonal")
DEFAULT_EPOCHS = 8
IMAGE_SIZE = 16
CHANNELS = 8
BATCH_SIZE = 32

#: A run counts as having learned when its test accuracy reaches this (chance is 1/3).
PASS_ACCURACY = 0.6

#: :func:`gradient_check` passes below this; correct gradients give about 1e-8 in float64,
#: a single wrong one order 1.
GRADIENT_TOLERANCE = 1e-5


def make_bars(n: int, seed: int, size: int = IMAGE_SIZE, noise: float = 0.3,
              dtype=np.float32) -> tuple:
    """Noisy images of one bar each, with balanced labels.

    Parameters
    ----------
    n : int
        Number of images.
    seed : int
        Seed of everything random: positions, lengths, noise, order.
    size : int
        Height and width.
    noise : float
        Standard deviation of the Gaussian background noise (the bar has intensity 1).
    dtype : dtype

    Returns
    -------
    images : ndarray, shape (n, 1, size, size)
    labels : ndarray of int, shape (n,)
        Index into :data:`CLASSES`.
    """
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, noise, size=(n, 1, size, size))
    labels = np.arange(n) % len(CLASSES)
    rng.shuffle(labels)
    for i, label in enumerate(labels):
        length = int(rng.integers(size // 2, size - 2))
        # Start anywhere the whole bar fits, so position says nothing about the class.
        r0 = int(rng.integers(0, size - (length if label != 0 else 0)))
        c0 = int(rng.integers(0, size - (length if label != 1 else 0)))
        steps = np.arange(length)
        if label == 0:
            rows, cols = np.full(length, r0), c0 + steps
        elif label == 1:
            rows, cols = r0 + steps, np.full(length, c0)
        elif rng.random() < 0.5:
            rows, cols = r0 + steps, c0 + steps
        else:
            rows, cols = r0 + steps, c0 + length - 1 - steps
        images[i, 0, rows, cols] += 1.0
    return images.astype(dtype), labels


@dataclass
class Model:
    """Parameters of the network in the module docstring.

    Convolution weights are ``(K, C, 3, 3)`` with biases ``(K,)``; the classifier is ``w3``
    ``(channels, classes)`` and ``b3`` ``(classes,)``.
    """

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    w3: np.ndarray
    b3: np.ndarray

    NAMES = ("w1", "b1", "w2", "b2", "w3", "b3")

    @classmethod
    def init(cls, rng, channels: int = CHANNELS, classes: int = len(CLASSES), dtype=np.float32):
        """He-initialised weights (suited to ReLU), zero biases."""
        def he(shape, fan_in):
            return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(dtype)
        return cls(he((channels, 1, 3, 3), 9), np.zeros(channels, dtype),
                   he((channels, channels, 3, 3), 9 * channels), np.zeros(channels, dtype),
                   he((channels, classes), channels), np.zeros(classes, dtype))

    def params(self) -> list:
        return [getattr(self, name) for name in self.NAMES]

    def forward(self, x: np.ndarray) -> tuple:
        """Logits ``(N, classes)`` and what the backward pass needs."""
        z1 = conv(x, self.w1, self.b1, padding=1)
        a1 = np.maximum(z1, 0)
        z2 = conv(a1, self.w2, self.b2, stride=2, padding=1)
        a2 = np.maximum(z2, 0)
        pooled = a2.mean(axis=(2, 3))
        logits = pooled @ self.w3 + self.b3
        return logits, (x, z1, a1, z2, a2, pooled)

    def backward(self, dlogits: np.ndarray, cache: tuple) -> list:
        """Gradients of the loss, in :attr:`NAMES` order, given dL/dlogits."""
        x, z1, a1, z2, a2, pooled = cache
        dw3 = pooled.T @ dlogits
        db3 = dlogits.sum(axis=0)
        dpooled = dlogits @ self.w3.T
        # The mean over H*W positions hands each of them an equal share of the gradient.
        da2 = np.broadcast_to(dpooled[:, :, None, None] / (a2.shape[2] * a2.shape[3]),
                              a2.shape)
        dz2 = np.where(z2 > 0, da2, 0).astype(x.dtype)
        da1, dw2, db2 = conv_backward(dz2, a1, self.w2, stride=2, padding=1)
        dz1 = np.where(z1 > 0, da1, 0).astype(x.dtype)
        _, dw1, db1 = conv_backward(dz1, x, self.w1, padding=1, needs=(False, True, True))
        return [dw1, db1, dw2, db2, dw3, db3]


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple:
    """Mean loss and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp never overflows
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    n = len(labels)
    loss = -float(log_probs[np.arange(n), labels].mean())
    dlogits = np.exp(log_probs)
    dlogits[np.arange(n), labels] -= 1.0
    return loss, (dlogits / n).astype(logits.dtype)


def gradient_check(seed: int = 0, batch: int = 8, h: float = 1e-6) -> float:
    """Worst relative disagreement of the network's gradients with finite differences.

    A float64 network on ``batch`` images; see
    :func:`~numbaconv.demos._gradcheck.directional_gradient_error`.

    Parameters
    ----------
    seed : int
    batch : int
        Images in the loss.
    h : float
        Finite-difference step.

    Returns
    -------
    float
        ``max |numeric - analytic| / max(|analytic|, 1e-6)`` over the parameters.
    """
    rng = np.random.default_rng(seed)
    images, labels = make_bars(batch, seed, dtype=np.float64)
    model = Model.init(rng, dtype=np.float64)

    def loss() -> float:
        return softmax_cross_entropy(model.forward(images)[0], labels)[0]

    logits, cache = model.forward(images)
    grads = model.backward(softmax_cross_entropy(logits, labels)[1], cache)
    return directional_gradient_error(loss, model.params(), grads, rng, h)


def accuracy(model: Model, images: np.ndarray, labels: np.ndarray, batch: int = 256) -> float:
    correct = 0
    for start in range(0, len(labels), batch):
        logits, _ = model.forward(images[start:start + batch])
        correct += int((logits.argmax(axis=1) == labels[start:start + batch]).sum())
    return correct / len(labels)


@dataclass
class DemoResult:
    """What :func:`train` reports.

    Attributes
    ----------
    history : list of dict
        Per epoch: ``epoch``, ``loss`` (mean training loss), ``train_accuracy``,
        ``test_accuracy`` and ``seconds``.
    test_accuracy : float
        After the last epoch.
    chance : float
        Accuracy of guessing.
    learned : bool
        ``test_accuracy >= PASS_ACCURACY``.
    seconds : float
        Wall time of the whole run, data generation included.
    """

    history: list
    test_accuracy: float
    chance: float
    learned: bool
    seconds: float


def train(epochs: int = DEFAULT_EPOCHS, seed: int = 0, *, train_size: int = 1536,
          test_size: int = 512, batch_size: int = BATCH_SIZE, lr: float = 0.01,
          log: Optional[Callable[[str], None]] = print) -> DemoResult:
    """Train the network on the bars task and report per-epoch loss and accuracy.

    Parameters
    ----------
    epochs : int
        Passes over the training set.
    seed : int
        Seeds the data, the initial weights and the shuffling: a run is reproducible.
    train_size, test_size : int
        Images in each set (the test set uses its own seed and is never trained on).
    batch_size : int
    lr : float
        Adam's step size.
    log : callable or None
        Receives one line per epoch.

    Returns
    -------
    DemoResult
    """
    if epochs < 1:
        raise ValueError(f"epochs: expected an int >= 1, got {epochs}")
    start = time.perf_counter()
    x_train, y_train = make_bars(train_size, seed)
    x_test, y_test = make_bars(test_size, seed + 1_000_003)
    rng = np.random.default_rng(seed)
    model = Model.init(rng)
    optimiser = Adam(model.params(), lr=lr)
    history = []
    for epoch in range(1, epochs + 1):
        epoch_start = time.perf_counter()
        order = rng.permutation(train_size)
        losses, correct = [], 0
        for first in range(0, train_size, batch_size):
            idx = order[first:first + batch_size]
            logits, cache = model.forward(x_train[idx])
            loss, dlogits = softmax_cross_entropy(logits, y_train[idx])
            optimiser.step(model.backward(dlogits, cache))
            losses.append(loss * len(idx))
            correct += int((logits.argmax(axis=1) == y_train[idx]).sum())
        record = dict(epoch=epoch, loss=sum(losses) / train_size,
                      train_accuracy=correct / train_size,
                      test_accuracy=accuracy(model, x_test, y_test),
                      seconds=time.perf_counter() - epoch_start)
        history.append(record)
        if log is not None:
            log(f"epoch {epoch:3d}/{epochs}  loss {record['loss']:.4f}  "
                f"train accuracy {record['train_accuracy']:.3f}  "
                f"test accuracy {record['test_accuracy']:.3f}  ({record['seconds']:.2f} s)")
    final = history[-1]["test_accuracy"]
    return DemoResult(history, final, 1.0 / len(CLASSES), final >= PASS_ACCURACY,
                      time.perf_counter() - start)


def run_demo(*, epochs: Optional[int] = None, seed: int = 0,
             log: Callable[[str], None] = print) -> int:
    """The ``numbaconv demo cnn`` command: check gradients, train, judge the accuracy.

    Parameters
    ----------
    epochs : int, optional
        Default :data:`DEFAULT_EPOCHS`.
    seed : int
    log : callable
        Receives every line of the report.

    Returns
    -------
    int
        0 when the gradients check out and the test accuracy reaches
        :data:`PASS_ACCURACY`; 1 otherwise.
    """
    import numbaconv

    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    # The first layer's weight gradient, to ask the dispatcher which backend runs it.
    probe = (np.zeros((BATCH_SIZE, 1, IMAGE_SIZE, IMAGE_SIZE), np.float32),
             np.zeros((BATCH_SIZE, CHANNELS, IMAGE_SIZE, IMAGE_SIZE), np.float32),
             (CHANNELS, 1, 3, 3))
    choice = numbaconv.explain("conv_backward_weight", *probe, padding=1)
    log(f"bars task ({', '.join(CLASSES)}), {IMAGE_SIZE}x{IMAGE_SIZE} images; conv 1->8, "
        f"conv 8->8 stride 2, global average pool, linear 8->3; Adam; seed {seed}")
    log(f"convolutions run on backend {choice.backend!r}")
    error = gradient_check(seed)
    verdict = "ok" if error < GRADIENT_TOLERANCE else "FAILED"
    log(f"gradient check (float64, finite differences): worst relative error {error:.1e}, "
        f"{verdict}")
    result = train(epochs, seed, log=log)
    log(f"final test accuracy: {result.test_accuracy:.3f} (chance {result.chance:.3f}, "
        f"pass mark {PASS_ACCURACY}) after {epochs} epoch(s) in {result.seconds:.1f} s")
    if verdict != "ok":
        log("FAILED: the network's gradients disagree with finite differences")
        return 1
    if not result.learned:
        log("FAILED: the network did not learn (more --epochs may help)")
        return 1
    return 0
