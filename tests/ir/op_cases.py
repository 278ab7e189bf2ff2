"""Generated cases for every IR op: inputs, attributes, and what eager PyTorch computes.

Each entry of `CASES` maps an op name to a hypothesis strategy drawing `Case`s. The eager
side uses torch's public API (or autograd for backward ops), not the registry's reference
implementation, so the test checks the IR op, its rules and the executor against PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

FLOATS = [torch.float32, torch.float64]
NUMERIC = [torch.float32, torch.float64, torch.int64, torch.int32]


@dataclass
class Case:
    inputs: list[torch.Tensor]
    attrs: dict
    eager: Callable[..., object]  # eager(*inputs) -> tensor or tuple of tensors
    constants: dict | None = None
    # assert_close's rtol and atol where float32 rounding of a long sum needs more than the
    # default (1e-5, 1e-6): say why where a case sets it
    tolerance: dict | None = None

    def __repr__(self):
        shapes = [f"{tuple(t.shape)}:{t.dtype}" for t in self.inputs]
        return f"Case({shapes}, {self.attrs})"


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


def tensor(shape, dtype, low=-3.0, high=3.0):
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, dtype=torch.float64) * (high - low) + low).to(dtype)
    return torch.randint(int(low), int(high) + 1, shape, dtype=dtype)


@st.composite
def unary(draw, fn, dtypes=FLOATS, low=-3.0, high=3.0):
    dtype = draw(st.sampled_from(dtypes))
    return Case([tensor(draw(shapes), dtype, low, high)], {}, fn)


@st.composite
def binary(draw, fn, dtypes=NUMERIC, low=-3.0, high=3.0, same_dtype=False):
    (sa, sb), _ = draw(mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=3))
    da = draw(st.sampled_from(dtypes))
    db = da if same_dtype else draw(st.sampled_from(dtypes))
    if draw(st.booleans()):  # a 0-d operand, as scalars lower to
        sb = ()
    return Case([tensor(sa, da, low, high), tensor(sb, db, low, high)], {}, fn)


@st.composite
def div_case(draw):
    case = draw(binary(None, dtypes=FLOATS + [torch.int64], low=1, high=5))
    rounding = draw(st.sampled_from(["none", "floor", "trunc"]))
    if draw(st.booleans()):
        case.inputs[0] = -case.inputs[0]
    case.attrs = {"rounding": rounding}
    case.eager = lambda a, b: torch.div(a, b, rounding_mode=None if rounding == "none" else rounding)
    return case


@st.composite
def where_case(draw):
    (sc, sa, sb), _ = draw(mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3))
    da, db = draw(st.sampled_from(NUMERIC)), draw(st.sampled_from(NUMERIC))
    return Case([tensor(sc, torch.bool), tensor(sa, da), tensor(sb, db)], {}, torch.where)


@st.composite
def reduce_case(draw, op, dtypes):
    shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple))
    dims = draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=len(shape),
                         unique_by=lambda d: d % len(shape)))
    keepdim = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    x = tensor(shape, dtype)
    if op == "amax" or op == "amin":  # reductions without identity need non-empty dims
        x = tensor(tuple(max(s, 1) for s in shape), dtype)
    eager = {
        "sum": lambda t: t.sum(dims, keepdim=keepdim),
        "mean": lambda t: t.mean(dims, keepdim=keepdim),
        "amax": lambda t: t.amax(dims, keepdim=keepdim),
        "amin": lambda t: t.amin(dims, keepdim=keepdim),
        "any": lambda t: _any(t, dims, keepdim),
    }[op]
    return Case([x], {"dims": dims, "keepdim": keepdim}, eager)


def _any(t, dims, keepdim):
    return torch.any(t, dim=tuple(dims), keepdim=keepdim)


@st.composite
def softmax_case(draw, fn):
    shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    x = tensor(shape, draw(st.sampled_from(FLOATS)), -20, 20)
    return Case([x], {"dim": dim}, lambda t: fn(t, dim))


@st.composite
def cumsum_case(draw):
    shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    x = tensor(shape, draw(st.sampled_from(NUMERIC + [torch.bool])))
    return Case([x], {"dim": dim}, lambda t: torch.cumsum(t, dim))


@st.composite
def layer_norm_case(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple))
    k = draw(st.integers(1, len(shape)))
    normalized = list(shape[len(shape) - k:])
    dtype = draw(st.sampled_from(FLOATS))
    x, w, b = tensor(shape, dtype), tensor(normalized, dtype), tensor(normalized, dtype)
    eps = draw(st.sampled_from([1e-5, 1e-12]))

    def eager(x, w, b):
        y = F.layer_norm(x, normalized, w, b, eps)
        dims = list(range(len(shape) - k, len(shape)))
        mean = x.mean(dims, keepdim=True)
        rstd = (x.var(dims, unbiased=False, keepdim=True) + eps).rsqrt()
        return y, mean, rstd
    return Case([x, w, b], {"normalized_shape": normalized, "eps": eps}, eager)


@st.composite
def batch_norm_case(draw):
    shape = draw(st.lists(st.integers(1, 3), min_size=2, max_size=4).map(tuple))
    c = shape[1]
    dtype = draw(st.sampled_from(FLOATS))
    x = tensor(shape, dtype)
    w, b, m = tensor((c,), dtype), tensor((c,), dtype), tensor((c,), dtype)
    v = tensor((c,), dtype, 0.1, 2.0)
    return Case([x, w, b, m, v], {"eps": 1e-5},
                lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, training=False, eps=1e-5))


def _bn_stats(x):
    dims = [d for d in range(x.dim()) if d != 1]
    view = [1, -1] + [1] * (x.dim() - 2)
    mean = x.mean(dims)
    var = x.var(dims, unbiased=False)
    return dims, view, mean, var


@st.composite
def batch_norm_train_case(draw):
    shape = draw(st.lists(st.integers(2, 3), min_size=2, max_size=4).map(tuple))
    c = shape[1]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    x = tensor(shape, dtype)
    w, b, rm = tensor((c,), dtype), tensor((c,), dtype), tensor((c,), dtype)
    rv = tensor((c,), dtype, 0.1, 2.0)
    momentum, eps = 0.1, 1e-5

    def eager(x, w, b, rm, rv):
        dims, view, mean, var = _bn_stats(x)
        invstd = (var + eps).rsqrt()
        out = (x - mean.reshape(view)) * invstd.reshape(view) * w.reshape(view) + b.reshape(view)
        n = x.numel() // c
        return (out, mean, invstd, (1 - momentum) * rm + momentum * mean,
                (1 - momentum) * rv + momentum * var * n / (n - 1))
    return Case([x, w, b, rm, rv], {"momentum": momentum, "eps": eps}, eager)


@st.composite
def batch_norm_backward_case(draw):
    shape = draw(st.lists(st.integers(2, 3), min_size=2, max_size=4).map(tuple))
    c = shape[1]
    x, grad, w = tensor(shape, torch.float64), tensor(shape, torch.float64), tensor((c,), torch.float64)
    eps = 1e-5
    _, _, mean, var = _bn_stats(x)
    invstd = (var + eps).rsqrt()

    def eager(grad, x, w, mean, invstd):  # autograd through training-mode batch norm
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        b = torch.zeros_like(w, requires_grad=True)
        out = F.batch_norm(x, None, None, w, b, training=True, eps=eps)
        return torch.autograd.grad(out, (x, w, b), grad)
    return Case([grad, x, w, mean, invstd], {"eps": eps}, eager)


@st.composite
def index_add_zeros_case(draw):
    rows = draw(st.integers(1, 5))
    n = draw(st.integers(0, 6))
    index = torch.randint(0, rows, (n,))
    values = tensor((n,) + tuple(draw(st.lists(st.integers(1, 3), max_size=2))), torch.float32)
    return Case([index, values], {"rows": rows},
                lambda i, v: torch.zeros((rows,) + tuple(v.shape[1:])).index_add(0, i, v))


@st.composite
def reshape_case(draw):
    shape = draw(shapes)
    x = tensor(shape, draw(st.sampled_from(NUMERIC)))
    target = list(draw(st.permutations(list(shape)))) if shape else []
    if draw(st.booleans()) and len(target) >= 2:
        target = [target[0] * target[1]] + target[2:]
    if draw(st.booleans()):
        target = target + [1]
    return Case([x], {"shape": target}, lambda t: t.reshape(target))


@st.composite
def permute_case(draw):
    shape = draw(shapes)
    dims = list(draw(st.permutations(list(range(len(shape))))))
    return Case([tensor(shape, torch.float32)], {"dims": dims}, lambda t: t.permute(dims))


@st.composite
def expand_case(draw):
    target = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    k = draw(st.integers(0, len(target)))
    shape = [1 if draw(st.booleans()) else d for d in target[len(target) - k:]]
    return Case([tensor(shape, torch.float32)], {"shape": target}, lambda t: t.expand(target))


@st.composite
def slice_case(draw):
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple))
    dim = draw(st.integers(0, len(shape) - 1))
    start = draw(st.integers(-6, 6))
    end = draw(st.one_of(st.integers(-6, 6), st.just(2**63 - 1)))
    step = draw(st.integers(1, 3))
    return Case([tensor(shape, torch.float32)], {"dim": dim, "start": start, "end": end, "step": step},
                lambda t: torch.ops.aten.slice.Tensor(t, dim, start, end, step).clone())


@st.composite
def cat_case(draw):
    shape = draw(nonempty_shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    n = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(NUMERIC))
    parts = []
    for _ in range(n):
        s = list(shape)
        s[dim] = draw(st.integers(0, 3))
        parts.append(tensor(s, dtype))
    return Case(parts, {"dim": dim}, lambda *xs: torch.cat(xs, dim))


@st.composite
def matmul_case(draw):
    (ba, bb), _ = draw(mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3))
    m, k, n = (draw(st.integers(0, 5)) for _ in range(3))
    dtype = draw(st.sampled_from(FLOATS))
    a, b = tensor(ba + (m, k), dtype), tensor(bb + (k, n), dtype)
    return Case([a, b], {}, torch.matmul)


@st.composite
def conv_params(draw):
    spatial = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(spatial)]
    dilation = [draw(st.integers(1, 2)) for _ in range(spatial)]
    padding = [draw(st.integers(0, 1)) for _ in range(spatial)]
    stride = [draw(st.integers(1, 2)) for _ in range(spatial)]
    size = [dilation[i] * (kernel[i] - 1) + 1 + draw(st.integers(0, 3)) for i in range(spatial)]
    x = tensor([draw(st.integers(1, 2)), cin] + size, torch.float64)
    w = tensor([cout, cin // groups] + kernel, torch.float64)
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    return x, w, attrs


def _conv_fn(attrs, dims):
    fn = F.conv1d if dims == 1 else F.conv2d
    return lambda x, w, b=None: fn(x, w, b, attrs["stride"], attrs["padding"], attrs["dilation"],
                                   attrs["groups"])


@st.composite
def conv_case(draw):
    x, w, attrs = draw(conv_params())
    inputs = [x, w] + ([tensor([w.shape[0]], x.dtype)] if draw(st.booleans()) else [])
    return Case(inputs, attrs, _conv_fn(attrs, x.dim() - 2))


def _backward_case(draw, x, w, attrs, conv, out_channels: int) -> Case:
    """The gradients `output_mask` selects of `conv(x, w, bias)` (a bias of zeros)."""
    grad = tensor(conv(x, w).shape, x.dtype)
    mask = draw(st.sampled_from([[1, 1, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0]]))

    def eager(grad, x, w):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        b = torch.zeros(out_channels, dtype=x.dtype, requires_grad=True)
        grads = torch.autograd.grad(conv(xr, wr, b), (xr, wr, b), grad)
        return tuple(g for g, m in zip(grads, mask) if m)
    return Case([grad, x, w], {**attrs, "output_mask": mask}, eager)


@st.composite
def conv_backward_case(draw):
    x, w, attrs = draw(conv_params())
    return _backward_case(draw, x, w, attrs, _conv_fn(attrs, x.dim() - 2), w.shape[0])


@st.composite
def conv_transpose_params(draw):
    spatial = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(spatial)]
    stride = [draw(st.integers(1, 3)) for _ in range(spatial)]
    dilation = [draw(st.integers(1, 2)) for _ in range(spatial)]
    padding = [draw(st.integers(0, (dilation[i] * (kernel[i] - 1)) // 2)) for i in range(spatial)]
    output_padding = [draw(st.integers(0, max(stride[i], dilation[i]) - 1))
                      for i in range(spatial)]
    x = tensor([draw(st.integers(1, 2)), cin] + [draw(st.integers(1, 4)) for _ in range(spatial)],
               torch.float64)
    w = tensor([cin, cout // groups] + kernel, torch.float64)
    attrs = {"stride": stride, "padding": padding, "output_padding": output_padding,
             "dilation": dilation, "groups": groups}
    return x, w, attrs


def _conv_transpose_fn(attrs, dims):
    fn = F.conv_transpose1d if dims == 1 else F.conv_transpose2d
    return lambda x, w, b=None: fn(x, w, b, attrs["stride"], attrs["padding"],
                                   attrs["output_padding"], attrs["groups"], attrs["dilation"])


@st.composite
def conv_transpose_case(draw):
    x, w, attrs = draw(conv_transpose_params())
    cout = w.shape[1] * attrs["groups"]
    inputs = [x, w] + ([tensor([cout], x.dtype)] if draw(st.booleans()) else [])
    return Case(inputs, attrs, _conv_transpose_fn(attrs, x.dim() - 2))


@st.composite
def conv_transpose_backward_case(draw):
    x, w, attrs = draw(conv_transpose_params())
    return _backward_case(draw, x, w, attrs, _conv_transpose_fn(attrs, x.dim() - 2),
                          w.shape[1] * attrs["groups"])


@st.composite
def upsample_params(draw, bilinear: bool):
    """A size or whole or fractional factors (torch's `interpolate` arguments) and the
    IR attributes they lower to."""
    x = tensor([draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5)),
                draw(st.integers(1, 5))], torch.float64)
    kwargs = {"mode": "bilinear" if bilinear else "nearest"}
    if bilinear:
        kwargs["align_corners"] = draw(st.booleans())
    if draw(st.booleans()):
        size = [draw(st.integers(1, 9)), draw(st.integers(1, 9))]
        kwargs["size"] = size
        scales = [None, None]
    else:
        scales = [draw(st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0, 3.0])) for _ in range(2)]
        size = [int(n * s) for n, s in zip(x.shape[2:], scales)]
        if min(size) < 1:
            scales, size = [2.0, 2.0], [n * 2 for n in x.shape[2:]]
        kwargs["scale_factor"] = scales
    attrs = {"size": size, "scales_h": scales[0], "scales_w": scales[1]}
    if bilinear:
        attrs["align_corners"] = kwargs["align_corners"]
        if kwargs["align_corners"]:  # torch's kernel ignores the factors then
            attrs["scales_h"] = attrs["scales_w"] = None
    return x, attrs, lambda t: F.interpolate(t, **kwargs)


@st.composite
def upsample_case(draw, bilinear: bool):
    x, attrs, fn = draw(upsample_params(bilinear))
    return Case([x], attrs, fn)


@st.composite
def upsample_backward_case(draw, bilinear: bool):
    x, attrs, fn = draw(upsample_params(bilinear))
    grad = tensor(fn(x).shape, x.dtype)

    def eager(grad):
        xr = x.clone().requires_grad_()
        return torch.autograd.grad(fn(xr), xr, grad)[0]
    return Case([grad], {**attrs, "input_size": list(x.shape)}, eager)


@st.composite
def sparse_mm_case(draw):
    rows, cols, n = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(0, 4))
    dense = (torch.rand(rows, cols) < 0.4).float() * torch.randn(rows, cols)
    sparse = dense.to_sparse().coalesce()
    other = tensor((cols, n), torch.float32)
    return Case([sparse.indices(), sparse.values(), other], {"rows": rows, "cols": cols},
                lambda i, v, d: dense @ d)


@st.composite
def attention_case(draw):
    """Fused attention against its math form: causal (top-left, as torch aligns it) and a
    bool (keep) or additive mask; key 0 is always kept, so no row is wholly masked. Empty
    heads and lengths too (torch's fused kernel dies of SIGFPE on them)."""
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    length, source = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    dim = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(FLOATS))
    q, k, v = (tensor(s, dtype) for s in ((batch, heads, length, dim), (batch, heads, source, dim),
                                          (batch, heads, source, dim)))
    attrs = {"scale": draw(st.floats(-1.0, 1.0)), "causal": draw(st.booleans())}
    mask_kind = draw(st.sampled_from(["none", "bool", "additive"]))
    mask_shape = draw(st.sampled_from([(batch, heads, length, source), (1, 1, length, source),
                                       (batch, 1, 1, source), (source,)]))
    inputs = [q, k, v]
    if mask_kind == "bool":
        keep = torch.rand(mask_shape) < 0.6
        if source:
            keep[..., 0] = True
        inputs.append(keep)
    elif mask_kind == "additive":
        inputs.append(tensor(mask_shape, dtype))

    def eager(q, k, v, mask=None):
        return torch.softmax(_masked_scores(q, k, mask, attrs), -1) @ v
    return Case(inputs, attrs, eager)


def _masked_scores(q, k, mask, attrs):
    """scale * q k^T with the causal (top-left) and the bool (keep) or additive mask."""
    scores = (q @ k.transpose(-1, -2)) * attrs["scale"]
    if attrs["causal"]:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    return scores


@st.composite
def attention_lse_case(draw):
    """The same draws, and the logsumexp of each row of the masked, scaled scores."""
    case = draw(attention_case())

    def eager(q, k, v, mask=None):
        scores = _masked_scores(q, k, mask, case.attrs)
        return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    return Case(case.inputs, case.attrs, eager)


@st.composite
def attention_backward_case(draw):
    """The same draws with a drawn output gradient: the fused backward's query, key and
    value gradients against autograd through the math form (its output and logsumexp
    the operands, as the forward gave them)."""
    case = draw(attention_case())
    q, k, v, *mask = case.inputs

    def forward(q, k, v):
        scores = _masked_scores(q, k, mask[0] if mask else None, case.attrs)
        return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    out, lse = forward(q, k, v)
    grad = tensor(tuple(out.shape), out.dtype)

    def eager(grad, q, k, v, out, lse, mask=None):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(forward(*leaves)[0], leaves, grad, allow_unused=True)
    # each gradient sums products of terms up to about 10 in size, which cancel; float32
    # rounds them at about 1e-6, and the fused kernel sums in another order than autograd
    # (an order that differs between CPUs: 1.35e-6 apart on a Xeon with AMX)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if q.dtype == torch.float32 else None
    return Case([grad, q, k, v, out, lse, *mask], case.attrs, eager, tolerance=tolerance)


@st.composite
def pool_params(draw):
    kernel = [draw(st.integers(1, 3)) for _ in range(2)]
    stride = [draw(st.integers(1, 3)) for _ in range(2)]
    padding = [draw(st.integers(0, k // 2)) for k in kernel]
    dilation = [draw(st.integers(1, 2)) for _ in range(2)]
    ceil_mode = draw(st.booleans())
    size = [dilation[i] * (kernel[i] - 1) + 1 + draw(st.integers(0, 4)) for i in range(2)]
    x = tensor([draw(st.integers(1, 2)), draw(st.integers(1, 3))] + size, torch.float64)
    return x, {"kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation,
               "ceil_mode": ceil_mode}


@st.composite
def max_pool_case(draw):
    x, attrs = draw(pool_params())
    with_indices = draw(st.booleans())

    def eager(x):
        out = F.max_pool2d(x, attrs["kernel"], attrs["stride"], attrs["padding"], attrs["dilation"],
                           ceil_mode=attrs["ceil_mode"], return_indices=with_indices)
        return out
    return Case([x], {**attrs, "with_indices": with_indices}, eager)


def _avg_params(draw):
    x, attrs = draw(pool_params())
    del attrs["dilation"]
    attrs["count_include_pad"] = draw(st.booleans())
    return x, attrs


def _avg_pool(attrs):
    return lambda t: F.avg_pool2d(t, attrs["kernel"], attrs["stride"], attrs["padding"],
                                  ceil_mode=attrs["ceil_mode"],
                                  count_include_pad=attrs["count_include_pad"])


@st.composite
def avg_pool_case(draw):
    x, attrs = _avg_params(draw)
    return Case([x], attrs, _avg_pool(attrs))


@st.composite
def avg_pool_backward_case(draw):
    x, attrs = _avg_params(draw)
    pool = _avg_pool(attrs)
    grad = tensor(pool(x).shape, x.dtype)

    def eager(grad, x):
        xr = x.clone().requires_grad_()
        return torch.autograd.grad(pool(xr), xr, grad)[0]
    return Case([grad, x], attrs, eager)


@st.composite
def max_pool_backward_case(draw):
    x, attrs = draw(pool_params())
    pool = lambda t: F.max_pool2d(t, attrs["kernel"], attrs["stride"], attrs["padding"],  # noqa: E731
                                  attrs["dilation"], ceil_mode=attrs["ceil_mode"], return_indices=True)
    out, indices = pool(x)
    grad = tensor(out.shape, x.dtype)

    def eager(grad, x, indices):
        xr = x.clone().requires_grad_()
        return torch.autograd.grad(pool(xr)[0], xr, grad)[0]
    return Case([grad, x, indices], attrs, eager)


@st.composite
def adaptive_case(draw):
    x = tensor([1, draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))],
               torch.float64)
    size = [draw(st.integers(1, 4)), draw(st.integers(1, 4))]
    with_indices = draw(st.booleans())
    return Case([x], {"output_size": size, "with_indices": with_indices},
                lambda t: F.adaptive_max_pool2d(t, size, return_indices=with_indices))


@st.composite
def adaptive_backward_case(draw):
    x = tensor([1, draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))],
               torch.float64)
    size = [draw(st.integers(1, 4)), draw(st.integers(1, 4))]
    out, indices = F.adaptive_max_pool2d(x, size, return_indices=True)
    grad = tensor(out.shape, x.dtype)

    def eager(grad, x, indices):
        xr = x.clone().requires_grad_()
        return torch.autograd.grad(F.adaptive_max_pool2d(xr, size), xr, grad)[0]
    return Case([grad, x, indices], {}, eager)


@st.composite
def dropout_case(draw):
    x = tensor(draw(shapes), draw(st.sampled_from(FLOATS)))
    p = draw(st.sampled_from([0.0, 1.0]))  # the deterministic ends; the middle is tested apart
    return Case([x], {"p": p}, lambda t: (t * (1.0 if p == 0 else 0.0), torch.full_like(t, p == 0, dtype=torch.bool)))


@st.composite
def index_select_case(draw):
    shape = draw(nonempty_shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    index = torch.randint(0, shape[dim], (draw(st.integers(0, 5)),))
    return Case([tensor(shape, torch.float32), index], {"dim": dim},
                lambda x, i: x.index_select(dim, i))


@st.composite
def gather_case(draw):
    shape = draw(nonempty_shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    index_shape = [draw(st.integers(0, s)) for s in shape]
    index_shape[dim] = draw(st.integers(0, 4))
    index = torch.randint(0, shape[dim], index_shape)
    return Case([tensor(shape, torch.float32), index], {"dim": dim},
                lambda x, i: torch.gather(x, dim, i))


@st.composite
def scatter_case(draw):
    shape = draw(nonempty_shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    index_shape = [draw(st.integers(0, s)) for s in shape]
    # each line along dim is a permutation: unique targets, so write order cannot matter
    index = torch.rand(shape).argsort(dim)[tuple(slice(0, s) for s in index_shape)].contiguous()
    src = tensor(index_shape, torch.float32)
    return Case([tensor(shape, torch.float32), index, src], {"dim": dim},
                lambda x, i, s: x.scatter(dim, i, s))


@st.composite
def index_put_case(draw):
    shape = draw(nonempty_shapes)
    accumulate = draw(st.booleans())
    n = draw(st.integers(0, shape[0]))
    index = torch.randint(0, shape[0], (n,)) if accumulate else torch.randperm(shape[0])[:n]
    values = tensor((n,) + shape[1:], torch.float64)
    return Case([tensor(shape, torch.float64), index, values], {"accumulate": accumulate},
                lambda x, i, v: x.index_put((i,), v, accumulate))


@st.composite
def full_case(draw):
    shape = list(draw(shapes))
    dtype = draw(st.sampled_from(NUMERIC + [torch.bool]))
    value = draw(st.sampled_from([0, 1, 2.5, -1, True]))
    value = bool(value) if dtype == torch.bool else (value if dtype.is_floating_point else int(value))
    return Case([], {"shape": shape, "value": value, "dtype": dtype},
                lambda: torch.full(shape, value, dtype=dtype))


@st.composite
def arange_case(draw):
    start, end = draw(st.integers(-5, 5)), draw(st.integers(-5, 10))
    step = draw(st.sampled_from([1, 2, 3, -1, 0.5]))
    if (end - start) * step < 0:
        start, end = end, start
    dtype = torch.float32 if isinstance(step, float) else draw(st.sampled_from([torch.int64, torch.float32]))
    return Case([], {"start": start, "end": end, "step": step, "dtype": dtype},
                lambda: torch.arange(start, end, step, dtype=dtype))


@st.composite
def constant_case(draw):
    data = tensor(draw(shapes), draw(st.sampled_from(NUMERIC)))
    return Case([], {"name": "c", "shape": list(data.shape), "dtype": data.dtype}, lambda: data,
                constants={"c": data})


@st.composite
def clamp_case(draw):
    lo = draw(st.one_of(st.none(), st.floats(-2, 0, width=32)))
    hi = draw(st.one_of(st.none(), st.floats(0, 2, width=32))) if lo is not None else draw(
        st.floats(0, 2, width=32))
    x = tensor(draw(shapes), draw(st.sampled_from(FLOATS)))
    return Case([x], {"min": lo, "max": hi}, lambda t: torch.clamp(t, lo, hi))


@st.composite
def cast_case(draw):
    src = draw(st.sampled_from(NUMERIC + [torch.bool]))
    dst = draw(st.sampled_from(NUMERIC + [torch.bool, torch.float16, torch.bfloat16]))
    return Case([tensor(draw(shapes), src)], {"dtype": dst}, lambda t: t.to(dst))


@st.composite
def gelu_case(draw):
    approximate = draw(st.sampled_from(["none", "tanh"]))
    x = tensor(draw(shapes), draw(st.sampled_from(FLOATS)))
    return Case([x], {"approximate": approximate}, lambda t: F.gelu(t, approximate=approximate))


CASES = {
    "neg": unary(torch.neg, NUMERIC), "abs": unary(torch.abs, NUMERIC),
    "relu": unary(torch.relu, NUMERIC), "exp": unary(torch.exp, FLOATS + [torch.int64]),
    "log": unary(torch.log, FLOATS, 0.01, 5), "log1p": unary(torch.log1p, FLOATS, -0.9, 5),
    "sqrt": unary(torch.sqrt, FLOATS, 0.0, 5), "rsqrt": unary(torch.rsqrt, FLOATS, 0.01, 5),
    "reciprocal": unary(torch.reciprocal, FLOATS, 0.1, 5), "sigmoid": unary(torch.sigmoid),
    "tanh": unary(torch.tanh), "erf": unary(torch.erf), "sin": unary(torch.sin),
    "cos": unary(torch.cos), "sign": unary(torch.sign, NUMERIC),
    "ceil": unary(torch.ceil, NUMERIC), "floor": unary(torch.floor, NUMERIC),
    "logical_not": unary(torch.logical_not, [torch.bool, torch.float32]),
    "gelu": gelu_case(), "clamp": clamp_case(), "cast": cast_case(),
    "add": binary(torch.add), "sub": binary(torch.sub), "mul": binary(torch.mul),
    "pow": binary(torch.pow, FLOATS, 0.1, 3), "maximum": binary(torch.maximum),
    "minimum": binary(torch.minimum), "div": div_case(),
    "eq": binary(torch.eq), "ne": binary(torch.ne), "lt": binary(torch.lt), "le": binary(torch.le),
    "gt": binary(torch.gt), "ge": binary(torch.ge),
    "logical_and": binary(torch.logical_and, [torch.bool]),
    "logical_or": binary(torch.logical_or, [torch.bool]),
    "where": where_case(),
    "sum": reduce_case("sum", NUMERIC), "mean": reduce_case("mean", FLOATS),
    "amax": reduce_case("amax", NUMERIC), "amin": reduce_case("amin", NUMERIC),
    "any": reduce_case("any", [torch.bool, torch.float32]),
    "cumsum": cumsum_case(),
    "softmax": softmax_case(torch.softmax), "log_softmax": softmax_case(torch.log_softmax),
    "layer_norm": layer_norm_case(), "batch_norm": batch_norm_case(),
    "reshape": reshape_case(), "permute": permute_case(), "expand": expand_case(),
    "slice": slice_case(), "cat": cat_case(),
    "matmul": matmul_case(), "conv": conv_case(), "conv_backward": conv_backward_case(),
    "conv_transpose": conv_transpose_case(),
    "conv_transpose_backward": conv_transpose_backward_case(),
    "upsample_nearest2d": upsample_case(False),
    "upsample_nearest2d_backward": upsample_backward_case(False),
    "upsample_bilinear2d": upsample_case(True),
    "upsample_bilinear2d_backward": upsample_backward_case(True),
    "sparse_mm": sparse_mm_case(), "attention": attention_case(),
    "attention_lse": attention_lse_case(), "attention_backward": attention_backward_case(),
    "max_pool2d": max_pool_case(), "max_pool2d_backward": max_pool_backward_case(),
    "avg_pool2d": avg_pool_case(), "avg_pool2d_backward": avg_pool_backward_case(),
    "adaptive_max_pool2d": adaptive_case(), "adaptive_max_pool2d_backward": adaptive_backward_case(),
    "dropout": dropout_case(),
    "index_select": index_select_case(), "gather": gather_case(), "scatter": scatter_case(),
    "index_put": index_put_case(), "index_add_zeros": index_add_zeros_case(),
    "batch_norm_train": batch_norm_train_case(), "batch_norm_backward": batch_norm_backward_case(),
    "full": full_case(), "arange": arange_case(), "constant": constant_case(),
}
