"""ATen lowerings on edge shapes, through `opweave.compile`, against eager."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import opweave
from opweave.frontends import torch_dynamo
from opweave.frontends.program import OpweaveFallbackWarning


class _SoftmaxOfScalar(torch.nn.Module):
    def __init__(self, fn, dim):
        super().__init__()
        self.fn, self.dim = fn, dim

    def forward(self, x):
        return self.fn(x * 2, self.dim) + 1


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax])
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_of_a_0d_tensor(fn, dim):
    """Used to crash compilation with ZeroDivisionError (dim % rank, rank 0)."""
    model = _SoftmaxOfScalar(fn, dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (torch.tensor(3.0),))
    for value in (3.0, -7.5, float("inf"), float("nan")):
        x = torch.tensor(value)
        got = compiled(x)
        assert got.shape == ()
        torch.testing.assert_close(got, model(x), equal_nan=True)


class _Pick(torch.nn.Module):
    def forward(self, x, idx):
        return x[idx] * 2


def test_negative_indices_count_from_the_end():
    """x[idx] accepts negative indices; index_select does not (found by opweave fuzz in
    the gradient of an index_put, which indexes the incoming gradient)."""
    x, idx = torch.randn(4, 2, 3), torch.tensor([0, -4, 3, -1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(_Pick(), (x, idx))
    torch.testing.assert_close(compiled(x, idx), _Pick()(x, idx))
    other = torch.tensor([-2, 1, -3, 2])
    torch.testing.assert_close(compiled(x, other), _Pick()(x, other))


class _Scatter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(4, 2, 3))

    def forward(self, idx, v):
        return self.x.index_put((idx,), v, accumulate=True).square().sum()


def test_the_gradient_of_an_index_put_with_negative_indices():
    model, idx, v = _Scatter(), torch.tensor([0, -4]), torch.tensor(2.24)
    step = opweave.compile(model, (idx, v), train=True)
    step(idx, v).backward()
    got = model.x.grad.clone()
    model.x.grad = None
    model(idx, v).backward()
    torch.testing.assert_close(got, model.x.grad)


class _Split(torch.nn.Module):
    def __init__(self, sizes, dim):
        super().__init__()
        self.sizes, self.dim = sizes, dim

    def forward(self, x):
        parts = torch.split(x * 2, self.sizes, dim=self.dim)
        return tuple(p + i for i, p in enumerate(parts))


@pytest.mark.parametrize("shape, sizes, dim", [((3, 12), [4, 4, 4], -1), ((3, 5), [2, 1], 0)])
def test_split_with_sizes_runs_in_opweave(shape, sizes, dim):
    """GPT-2 splits its fused QKV projection so; it used to run in eager."""
    model, x = _Split(sizes, dim), torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (x,))
    for got, want in zip(compiled(x), model(x), strict=True):
        torch.testing.assert_close(got, want)


class _CastsAndRepeats(torch.nn.Module):
    """`.to()` calls (torch.export asserts their source's metadata) and `repeat`, both of
    which ran in eager (DeBERTa-v2, RoBERTa and MPNet of the zoo use them)."""

    def __init__(self, repeats):
        super().__init__()
        self.repeats = repeats

    def forward(self, x, ids):
        return x.float() * 2 + ids.to(torch.float32), (x + 1).repeat(*self.repeats)


@pytest.mark.parametrize("repeats", [(2, 1, 3), (1, 1, 1), (2, 3, 1, 2), (1, 4, 1, 1, 1)])
def test_casts_and_repeat_lower_without_fallback(repeats):
    model = _CastsAndRepeats(repeats)
    x, ids = torch.randn(1, 3, 4), torch.arange(12).reshape(1, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (x, ids))
    assert not compiled.coverage.fallback
    x, ids = torch.randn(1, 3, 4), torch.randint(-5, 5, (1, 3, 4))
    for got, expected in zip(compiled(x, ids), model(x, ids)):
        torch.testing.assert_close(got, expected)


class _PositionIds(torch.nn.Module):
    """RoBERTa's position ids: a running count of the non-padding tokens (cumsum ran in
    eager in twelve zoo transformers)."""

    def forward(self, ids, x):
        mask = ids.ne(1).int()
        positions = torch.cumsum(mask, dim=1).type_as(mask) * mask + 1
        return positions, x.cumsum(-1), x.cumsum(0, dtype=torch.float64)


def test_cumsum_lowers_without_fallback():
    model = _PositionIds()
    ids, x = torch.tensor([[0, 5, 1, 1, 7, 3]]), torch.randn(3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (ids, x))
    assert not compiled.coverage.fallback
    ids, x = torch.tensor([[1, 1, 4, 1, 2, 2]]), torch.randn(3, 5)
    for got, expected in zip(compiled(ids, x), model(ids, x)):
        torch.testing.assert_close(got, expected)


class _MultiIndex(torch.nn.Module):
    """Several index tensors at adjacent dims, broadcast together (transformers' causal
    masks read padding_mask[batch_idx, kv_idx]; ran in eager in seven zoo decoders)."""

    def forward(self, x, rows, cols):
        b = torch.arange(x.shape[0])[:, None, None]
        return x[b, rows, cols], x[:, rows[0], cols[0]], x[1][rows[0], cols[0]]


def test_multi_tensor_index_lowers_without_fallback():
    model = _MultiIndex()
    x = torch.randn(2, 5, 7, 3)
    rows, cols = torch.randint(-5, 5, (1, 4, 1)), torch.randint(-7, 7, (1, 1, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (x, rows, cols))
    assert not compiled.coverage.fallback
    x = torch.randn(2, 5, 7, 3)
    rows, cols = torch.randint(-5, 5, (1, 4, 1)), torch.randint(-7, 7, (1, 1, 6))
    for got, expected in zip(compiled(x, rows, cols), model(x, rows, cols)):
        torch.testing.assert_close(got, expected)


class _CnnOps(torch.nn.Module):
    """Ops the zoo's CNNs ran in eager: ReLU6 (hardtanh), padding="valid" (one padding
    value for two dims), tiled average pooling, adaptive average pooling that tiles or
    repeats a 1x1 input, and constant padding (TF "same" padding, Swin's window pad)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding="valid")

    def forward(self, x):
        y = torch.nn.functional.relu6(self.conv(x) * 4)  # [1, 4, 6, 6]
        pooled = torch.nn.functional.avg_pool2d(y, 2)
        tiles = torch.nn.functional.adaptive_avg_pool2d(y, 3)
        single = torch.nn.functional.adaptive_avg_pool2d(y, 1)
        spread = torch.nn.functional.adaptive_avg_pool2d(single, (2, 3))
        padded = torch.nn.functional.pad(y, (1, 2, 0, 1), value=0.5)
        cropped = torch.nn.functional.pad(y, (-1, 2, 1, -2))
        whole = torch.nn.functional.avg_pool2d(y, 8, ceil_mode=True)  # EfficientNet's pooler
        return pooled, tiles, single, spread, padded, cropped, whole


def test_cnn_ops_lower_without_fallback():
    model = _CnnOps().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (torch.randn(1, 3, 8, 8),))
    assert not compiled.coverage.fallback
    x = torch.randn(1, 3, 8, 8)
    for got, expected in zip(compiled(x), model(x)):
        torch.testing.assert_close(got, expected)


class _Norms(torch.nn.Module):
    """Group norm (wav2vec 2.0's feature extractor) and the 2-norm of weight normalization
    (its positional conv) ran in eager."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 6)
        self.plain = torch.nn.GroupNorm(3, 6, affine=False)

    def forward(self, x):
        flat = x.flatten(2)
        return (self.norm(x) * 2, self.plain(flat), torch.linalg.vector_norm(x, dim=(0, 2)),
                x.norm(dim=-1, keepdim=True), torch.linalg.vector_norm(x))


def test_group_norm_and_vector_norm_lower_without_fallback():
    model = _Norms().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2)
        model.norm.bias.uniform_(-1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (torch.randn(2, 6, 3, 5),))
    assert not compiled.coverage.fallback
    x = torch.randn(2, 6, 3, 5) * 3 + 1
    for got, expected in zip(compiled(x), model(x)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class _ShiftRight(torch.nn.Module):
    """BART's shift_tokens_right: slice assignments into a new tensor (slice_scatter and
    copy after functionalization) ran in eager."""

    def forward(self, ids, x):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        y = torch.zeros(3, 8)
        y[1:-2] = x[:, :8]
        y[:, -3:] = 1.5
        return shifted.masked_fill(shifted == -100, 1), y


def test_slice_assignment_lowers_without_fallback():
    model = _ShiftRight()
    ids, x = torch.randint(0, 50, (2, 7)), torch.randn(1, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (ids, x))
    assert not compiled.coverage.fallback
    ids, x = torch.randint(0, 50, (2, 7)), torch.randn(1, 9)
    for got, expected in zip(compiled(ids, x), model(ids, x)):
        torch.testing.assert_close(got, expected)


class _Roll(torch.nn.Module):
    """Swin's shifted windows: torch.roll, whose decomposition computes indices by fmod."""

    def forward(self, x, idx):
        return torch.roll(x, shifts=(-2, 3), dims=(1, 2)) * 2, torch.fmod(idx, 3), idx.fmod(idx + 5)


def test_integer_fmod_and_roll_lower_without_fallback():
    x, idx = torch.randn(1, 7, 5, 4), torch.tensor([-7, -3, 0, 2, 5, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(_Roll(), (x, idx))
    for got, want in zip(compiled(x, idx), _Roll()(x, idx)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Fmod(torch.nn.Module):
    def __init__(self, divisor):
        super().__init__()
        self.divisor = divisor

    def forward(self, a, b):
        return torch.fmod(a, b), torch.fmod(a, self.divisor), a.fmod(-1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8])
@pytest.mark.parametrize("divisor", [3, -3, -1])
def test_integer_fmod_matches_torch_at_the_edges(dtype, divisor):
    """Negative operands, small types (a Python divisor is cast as torch casts it), and
    INT_MIN % -1, which a plain truncating division would trap on."""
    info = torch.iinfo(dtype)
    a = torch.tensor([info.min, info.min + 1, -7, -1, 0, 1, 7, info.max], dtype=dtype)
    b = torch.tensor([-1, 3, -2, -1, 5, 2, -3, -1], dtype=dtype) if dtype.is_signed else \
        torch.tensor([1, 3, 2, 1, 5, 2, 3, 1], dtype=dtype)
    model = _Fmod(divisor)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (a, b))
    for got, want in zip(compiled(a, b), model(a, b)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _FloatFmod(torch.nn.Module):
    def forward(self, x):
        return torch.fmod(x, 0.3) + 1


def test_floating_point_fmod_stays_in_eager_with_its_reason():
    x = torch.randn(8) * 10
    with pytest.warns(OpweaveFallbackWarning, match="fmod of floating-point values"):
        compiled = opweave.compile(_FloatFmod(), (x,))
    torch.testing.assert_close(compiled(x), _FloatFmod()(x), rtol=0, atol=0)


class _Pool1d(torch.nn.Module):
    """Swin's pooler: adaptive_avg_pool1d decomposes into a mean and an as_strided."""

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool1d(x.transpose(1, 2), 1).flatten(1) * 3


class _Strided(torch.nn.Module):
    def forward(self, x):
        return torch.as_strided(x + 1, (3, 2), (1, 3)) * 2  # a transposing view


def test_an_as_strided_that_is_a_reshape_lowers_and_others_stay_in_eager():
    x = torch.randn(2, 5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(_Pool1d(), (x,))
    torch.testing.assert_close(compiled(x), _Pool1d()(x))
    y = torch.randn(2, 3)
    with pytest.warns(OpweaveFallbackWarning, match="as_strided to a non-contiguous view"):
        strided = opweave.compile(_Strided(), (y,))
    torch.testing.assert_close(strided(y), _Strided()(y))


class _Attention(torch.nn.Module):
    """Causal attention with fewer queries than keys (torch aligns the mask top-left),
    an additive mask, and a projection to train."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, q, k, v, bias):
        causal = F.scaled_dot_product_attention(self.proj(q), k, v, is_causal=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return causal + masked


def _attention_inputs():
    torch.manual_seed(0)
    return (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
            torch.randn(1, 1, 3, 5))


def test_inference_attention_runs_fused():
    model, inputs = _Attention().eval(), _attention_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, inputs)
    assert sum(g.op_counts().get("attention", 0) for g in compiled.graphs) == 2
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))


def test_training_attention_runs_fused_and_matches_eager_gradients():
    """The forward keeps the logsumexp (`attention_lse`) and the backward is torch's fused
    kernel (`attention_backward`), the causal mask aligned as torch's (top-left when
    queries < keys) and the additive one broadcast."""
    model, inputs = _Attention(), _attention_inputs()
    loss = _SumLoss(model)
    step = opweave.compile(loss, inputs, train=True)
    (graph,) = step.programs[True].compiled_graphs
    counts = graph.graph.op_counts()
    assert counts.get("attention_backward") == 1, counts  # the other one's inputs need none
    got = step(*inputs)
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = loss(*inputs)
    expected.backward()
    torch.testing.assert_close(got, expected)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


class _SumLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return (self.model(*inputs) ** 2).sum()


class _Decoder(torch.nn.Module):
    """What decoders (U-Net, feature pyramids, segmentation heads) run: transposed
    convolutions (2-d with output padding, 1-d) and upsampling, nearest and bilinear, by
    a factor or to a size; they ran in eager."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.up1d = torch.nn.ConvTranspose1d(4, 2, 4, stride=3, groups=2)

    def forward(self, x):
        y = self.up(x)  # [N, 3, 12, 12]
        nearest = F.interpolate(x, scale_factor=2, mode="nearest")
        sized = F.interpolate(y, size=(7, 9), mode="nearest")
        smooth = F.interpolate(x, scale_factor=1.5, mode="bilinear")
        corners = F.interpolate(y, size=(20, 17), mode="bilinear", align_corners=True)
        wave = self.up1d(x.flatten(2))
        return (y * nearest[:, :3].tanh()).sum() + sized.square().sum() + \
            smooth.sin().sum() + corners.square().sum() + wave.square().sum()


def test_decoder_ops_lower_without_fallback():
    model, x = _Decoder().eval(), torch.randn(2, 4, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (x,))
    counts = compiled.graphs[0].op_counts()
    assert counts["conv_transpose"] == 2 and counts["upsample_bilinear2d"] == 2, counts
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def _train_like_eager(model, reference, x, path):
    """One step through opweave (`path`: the joint graph or torch.compile) without a
    fallback, against eager: the loss and every gradient."""
    reference.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        step = opweave.compile(model, (x,), train=True) if path == "joint" else \
            torch.compile(model, backend="opweave")
        got = step(x)
        got.backward()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(got, expected)
    for g, e in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(g.grad, e.grad, rtol=1e-4, atol=1e-4)
    return step


@pytest.mark.parametrize("path", ["joint", "dynamo"])
def test_decoder_ops_train_without_fallback(path):
    """Tracing through autograd, torch decomposes upsampling into index reads whatever the
    decomposition table says (`ops_kept_whole` keeps them whole): the graph holds
    torch's upsampling backwards, not scatter-adds."""
    before = torch_dynamo.compiled_graphs.mark()
    step = _train_like_eager(_Decoder(), _Decoder(), torch.randn(2, 4, 6, 6), path)
    programs = [step.programs[True]] if path == "joint" else \
        torch_dynamo.compiled_graphs.since(before)
    graphs = [g for p in programs for g in p.graphs]
    counts = sum((Counter(g.op_counts()) for g in graphs), Counter())
    # (the two upsamplings of the input, which needs no gradient, have no backward)
    assert counts["upsample_bilinear2d_backward"] == 1, counts
    assert counts["upsample_nearest2d_backward"] == 1 and "index_put" not in counts, counts


class _Pick2d(torch.nn.Module):
    """A read at a row and a column index per output (`x[:, :, rows, cols]`): its
    gradient scatter-adds with two index tensors (index_put with two indices)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(1, 3, 1, 1))
        self.rows, self.cols = torch.tensor([[0], [3], [3]]), torch.tensor([[1, -1, 2, 2]])

    def forward(self, x):
        return ((x * self.scale)[:, :, self.rows, self.cols] ** 2).sum()


@pytest.mark.parametrize("path", ["joint", "dynamo"])
def test_a_read_at_two_index_tensors_trains_without_fallback(path):
    x = torch.randn(2, 3, 5, 6, requires_grad=False)
    _train_like_eager(_Pick2d(), _Pick2d(), x, path)
