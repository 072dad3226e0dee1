"""PyTorch as an independent oracle: forward through F.conv*d, gradients through autograd.

Padding is resolved here from the user's form with its own few lines (TensorFlow's SAME rule
written out again on purpose, not imported from numbaconv), asymmetric padding through F.pad.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

torch.set_num_threads(1)


def _tuple(v, nd):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def resolve_padding(padding, sizes, kernel, stride, dilation):
    """(before, after) per dim, independently of numbaconv._geometry."""
    nd = len(kernel)
    if isinstance(padding, str):
        if padding.lower() == "valid":
            return [(0, 0)] * nd
        pairs = []
        for i in range(nd):
            eff = (kernel[i] - 1) * dilation[i] + 1
            out = (sizes[i] + stride[i] - 1) // stride[i]
            total = max(0, (out - 1) * stride[i] + eff - sizes[i])
            pairs.append((total // 2, total - total // 2))
        return pairs
    return [tuple(p) if isinstance(p, (tuple, list)) else (p, p) for p in _tuple(padding, nd)]


def _cf(a, layout):
    return np.moveaxis(a, -1, 1) if layout == "channels_last" else a


def _phys(t, layout):
    a = t.detach().numpy()
    return np.ascontiguousarray(np.moveaxis(a, 1, -1) if layout == "channels_last" else a)


def _conv_fn(nd):
    return {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]


def _convT_fn(nd):
    return {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]


def _torch_pad(pairs):
    flat = []
    for before, after in reversed(pairs):
        flat += [before, after]
    return flat


def conv_and_grads(case, layout, a):
    """(y, dx, dw, db) of the forward conv of a case, by PyTorch autograd."""
    nd = len(case.w_shape) - 2
    stride = _tuple(case.stride, nd)
    dilation = _tuple(case.dilation, nd)
    x = torch.tensor(np.ascontiguousarray(_cf(a["x"], layout)), requires_grad=True)
    w = torch.tensor(a["w"], requires_grad=True)
    b = torch.tensor(a["bias"], requires_grad=True)
    pairs = resolve_padding(case.padding, x.shape[2:], case.w_shape[2:], stride, dilation)
    y = _conv_fn(nd)(F.pad(x, _torch_pad(pairs)), w, b, stride=stride, padding=0,
                     dilation=dilation, groups=case.groups)
    y.backward(torch.tensor(np.ascontiguousarray(_cf(a["dy"], layout))))
    return (_phys(y, layout), _phys(x.grad, layout), w.grad.numpy(), b.grad.numpy())


def conv_transpose_and_grads(case, layout, a):
    """(y, dx, dw, db) of the transposed conv of a case, by PyTorch autograd.

    PyTorch pads symmetrically; asymmetric padding is applied by cropping the padding-free
    result (and zero-extending where output_padding exceeds the after-padding).
    """
    nd = len(case.w_shape) - 2
    stride = _tuple(case.stride, nd)
    dilation = _tuple(case.dilation, nd)
    opad = _tuple(case.output_padding, nd)
    x = torch.tensor(np.ascontiguousarray(_cf(a["xt"], layout)), requires_grad=True)
    w = torch.tensor(a["w"], requires_grad=True)
    b = torch.tensor(a["bias_t"], requires_grad=True)
    sizes_in = x.shape[2:]
    kernel = case.w_shape[2:]
    if isinstance(case.padding, str) and case.padding.lower() == "same":
        out_sizes = [sizes_in[i] * stride[i] for i in range(nd)]
        pairs = resolve_padding("same", out_sizes, kernel, stride, dilation)
    else:
        pairs = resolve_padding(case.padding, None, kernel, stride, dilation)
    if all(b == e for b, e in pairs):  # PyTorch's own padding and output_padding
        y = _convT_fn(nd)(x, w, b, stride=stride, padding=[p for p, _ in pairs],
                          output_padding=opad, groups=case.groups, dilation=dilation)
        y.backward(torch.tensor(np.ascontiguousarray(_cf(a["dyt"], layout))))
        return (_phys(y, layout), _phys(x.grad, layout), w.grad.numpy(), b.grad.numpy())
    full = _convT_fn(nd)(x, w, None, stride=stride, padding=0, groups=case.groups,
                         dilation=dilation)
    out_sizes = [(sizes_in[i] - 1) * stride[i] - pairs[i][0] - pairs[i][1]
                 + (kernel[i] - 1) * dilation[i] + 1 + opad[i] for i in range(nd)]
    extend = [max(0, pairs[i][0] + out_sizes[i] - full.shape[2 + i]) for i in range(nd)]
    full = F.pad(full, _torch_pad([(0, e) for e in extend]))
    index = (slice(None), slice(None)) + tuple(
        slice(pairs[i][0], pairs[i][0] + out_sizes[i]) for i in range(nd))
    y = full[index] + b.reshape((1, -1) + (1,) * nd)
    y.backward(torch.tensor(np.ascontiguousarray(_cf(a["dyt"], layout))))
    return (_phys(y, layout), _phys(x.grad, layout), w.grad.numpy(), b.grad.numpy())
