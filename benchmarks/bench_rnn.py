"""Recurrent networks: LSTM and GRU training steps (to come with the RNN functions).

This module is the place for the RNN benchmarks, in the style of ``bench_conv.py``: one
class per mode (``LSTMTrainingStep``, ``GRUTrainingStep``) with ``params`` over
``numbaconv.bench.RNN_SHAPES`` and the available CPU backends, operands and a preallocated
reserve built in ``setup`` (``NotImplementedError`` where a backend declines), and
``time_forward``, ``time_backward_data``, ``time_backward_weights``, ``time_training_step``
(the three in order, as a training loop runs them) and ``peakmem_training_step``.

It defines no benchmark until ``numbaconv.rnn_forward`` and its gradients are implemented
and ``RNN_SHAPES`` is filled in.
"""
