"""numbaconv: Numba-accelerated backward-pass kernels for NumPy codebases.

Importing numbaconv compiles nothing and touches no GPU: backends are discovered on the first
call that needs one, and kernels compile on first use.
"""

from .conv import (conv, conv_backward, conv_backward_bias, conv_backward_data,
                   conv_backward_weight, conv_output_shape, conv_transpose,
                   conv_transpose_backward, explain)
from ._warmup import warmup
from .dispatch import (BackendInfo, Choice, NoBackendError, backends, register_backend,
                       reload_backends, set_autotune, unregister_backend, use_backend)
from .problem import BiasProblem, ConvProblem, RNNProblem
from .rnn import (RNNConfig, rnn_backward_data, rnn_backward_weights, rnn_forward,
                  rnn_init_params, rnn_param_views, rnn_reserve_size)

__version__ = "0.1.0"

__all__ = [
    "conv", "conv_backward", "conv_backward_bias", "conv_backward_data",
    "conv_backward_weight", "conv_output_shape", "conv_transpose", "conv_transpose_backward",
    "explain", "backends", "use_backend", "set_autotune", "register_backend",
    "unregister_backend", "reload_backends", "BackendInfo", "Choice", "NoBackendError",
    "ConvProblem", "BiasProblem", "RNNProblem", "RNNConfig", "rnn_init_params",
    "rnn_param_views", "rnn_reserve_size", "rnn_forward", "rnn_backward_data",
    "rnn_backward_weights", "warmup", "__version__",
]
