"""Random networks of the benchmark models' blocks, compiled in one precision and checked
against float64: the precision modes' fuzzer (`opweave fuzz --blocks`).

The op-graph fuzzer draws graphs op by op, small and in float32. The precision modes act
on structure such graphs seldom have: convolutions chained through norms, activations and
pooling, bottlenecks whose residual is summed in place, attention and MLP blocks, and
values read both by a graph output and by a bf16 or int8 step (which must then stay
float32 for the output). Each seed here draws such a network (`draw`): convolutional
(conv + batch norm + activation, depthwise, strided, bottlenecks with a projected or
identity shortcut, branches concatenated, TensorFlow's "SAME" padding before a stride-2
convolution, MobileViT's patches unfolded and folded around a linear layer, pooling,
pointwise activations) or a sequence model (pre- or post-norm attention with Q, K and V
in one product or three, with or without a mask; MLPs; plain linear layers), with some
intermediate results taken as outputs too.

`check` compiles it with `opweave.compile` in one precision and compares five calls (the
Python steps, the native plan's recording, its check against them, and its replay) with
the network run in float64, by the relative L2 difference of each output, within
`TOLERANCES`; it also checks that no call changed an input, nor the results a call before
it returned. With `random_forms`, every
measured choice among a group's library forms is drawn at random instead (seeded): each
form then meets the shapes, not only the ones that measure fastest here, and nothing is
recorded in the tuning database. A part that falls back to eager is not judged here (the
op-graph fuzzer judges fallbacks); its results are, like every other part's.
"""
from __future__ import annotations

import random
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..bench.harness import LOW_PRECISION_REL_L2

# the relative L2 difference from float64 each precision may have, per output: bf16 and
# int8 as the bench holds them; float32 and bf16x3 (as accurate as float32) far below
# bf16's, above float32's rounding through a few layers
TOLERANCES = {"fp32": 1e-4, "bf16x3": 1e-4, "bf16": LOW_PRECISION_REL_L2["bf16"],
              "int8": LOW_PRECISION_REL_L2["int8"], "int8-dynamic": LOW_PRECISION_REL_L2["int8"]}
CALLS = 5  # the native plan records at the 2nd call, is checked at the 3rd, replays after

ACTIVATIONS = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu, "hardswish": F.hardswish,
               "relu6": F.relu6, "none": lambda x: x}


class ConvNet(nn.Module):
    """A chain of convolutional blocks drawn from `rng` over a [1, C, S, S] image."""

    def __init__(self, rng: random.Random):
        super().__init__()
        c = self.channels = rng.choice([3, 8, 16])
        self.size = rng.choice([8, 12, 15, 20])
        self.blocks, self.kinds = nn.ModuleList(), []
        for _ in range(rng.randint(2, 6)):
            kind = rng.choice(["conv", "conv", "bottleneck", "bottleneck", "pool", "cat",
                               "pointwise", "same-padding", "patches"])
            arg, block = rng.choice(["relu", "silu"]), nn.ModuleList()
            if kind == "conv":
                out, k = rng.choice([8, 16, 32]), rng.choice([1, 3, 5])
                stride = rng.choice([1, 1, 2])
                groups = c if out % c == 0 and rng.random() < 0.3 else 1  # depthwise-like
                block.append(nn.Conv2d(c, out, k, stride, k // 2, groups=groups,
                                       bias=rng.random() < 0.5))
                block.append(nn.BatchNorm2d(out) if rng.random() < 0.6 else nn.Identity())
                arg, c = rng.choice(sorted(ACTIVATIONS)), out
            elif kind == "bottleneck":
                mid, out = rng.choice([8, 16]), rng.choice([c, c, 16, 32])
                stride = rng.choice([1, 1, 2])
                identity = (stride, out) == (1, c)
                shortcut = nn.Identity() if identity else nn.Conv2d(c, out, 1, stride)
                block.extend([nn.Conv2d(c, mid, 1), nn.Conv2d(mid, mid, 3, stride, 1),
                              nn.Conv2d(mid, out, 1), shortcut])
                c = out
            elif kind == "cat":
                out = rng.choice([8, 16])
                block.extend([nn.Conv2d(c, out, 1), nn.Conv2d(c, out, 3, 1, 1)])
                c = 2 * out
            elif kind == "same-padding":  # TensorFlow's "SAME" at stride 2: one more after
                out = rng.choice([8, 16])
                block.append(nn.Conv2d(c, out, 3, 2, 0))
                c = out
            elif kind == "patches":  # MobileViT's unfold, a linear layer, fold
                block.append(nn.Linear(c, c))
            elif kind == "pool":
                arg = rng.choice(["max", "avg"])
            else:
                arg = rng.choice(["silu", "hardswish", "affine"])
            self.blocks.append(block)
            self.kinds.append((kind, arg))
        self.taps = {i for i in range(len(self.kinds)) if rng.random() < 0.3}
        self.head = nn.Linear(c, rng.choice([5, 10])) if rng.random() < 0.7 else None
        for norm in (m for m in self.modules() if isinstance(m, nn.BatchNorm2d)):
            norm.running_mean.uniform_(-0.2, 0.2)
            norm.running_var.uniform_(0.5, 1.5)
            norm.weight.data.uniform_(0.5, 1.5)
            norm.bias.data.uniform_(-0.2, 0.2)

    def example(self) -> list[torch.Tensor]:
        return [torch.randn(1, self.channels, self.size, self.size)]

    def forward(self, x):
        outputs = []
        for i, ((kind, arg), block) in enumerate(zip(self.kinds, self.blocks)):
            if kind == "conv":
                x = ACTIVATIONS[arg](block[1](block[0](x)))
            elif kind == "bottleneck":
                act = ACTIVATIONS[arg]
                x = act(block[2](act(block[1](act(block[0](x))))) + block[3](x))
            elif kind == "cat":
                x = F.relu(torch.cat([block[0](x), block[1](x)], 1))
            elif kind == "same-padding":
                small = min(x.shape[-2:]) < 2  # (too small for the kernel: both sides then)
                x = F.relu(block[0](F.pad(x, (1, 1, 1, 1) if small else (0, 1, 0, 1))))
            elif kind == "patches":
                x = self._through_patches(x, block[0])
            elif kind == "pool":
                if min(x.shape[-2:]) >= 2:
                    x = F.max_pool2d(x, 2) if arg == "max" else F.avg_pool2d(x, 2)
            else:
                x = x * 0.5 + 0.1 if arg == "affine" else ACTIVATIONS[arg](x)
            if i in self.taps:
                outputs.append(x)
        outputs.append(x if self.head is None else self.head(x.mean((2, 3))))
        return tuple(outputs)

    @staticmethod
    def _through_patches(x, linear):
        """`linear` over the channels of 2x2 patches, unfolded and folded back as
        MobileViT does (reshape, permute, reshape: the view-chains pass's pattern)."""
        n, c, h, w = x.shape
        if h % 2 or w % 2:
            return x
        p = x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 2, 4, 1)
        p = linear(p.reshape(n, 4, h * w // 4, c))
        return p.reshape(n, 2, 2, h // 2, w // 2, c).permute(0, 5, 3, 1, 4, 2).reshape(n, c, h, w)


class SeqNet(nn.Module):
    """Transformer-like blocks drawn from `rng` over a [1, T, D] sequence, with an
    additive attention mask as a second input where `masked`."""

    def __init__(self, rng: random.Random):
        super().__init__()
        d = self.width = rng.choice([16, 32, 64])
        self.length = rng.choice([4, 9, 16])
        self.heads = rng.choice([1, 2, 4])
        self.masked = rng.random() < 0.4
        self.blocks, self.kinds = nn.ModuleList(), []
        for _ in range(rng.randint(1, 3)):
            kind = rng.choice(["attention", "mlp", "linear"])
            if kind == "attention":  # Q, K and V in one product, or three the rewrite merges
                qkv = [nn.Linear(d, 3 * d)] if rng.random() < 0.5 else \
                    [nn.Linear(d, d) for _ in range(3)]
                block = [nn.Linear(d, d), nn.LayerNorm(d), *qkv]
            elif kind == "mlp":
                block = [nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)]
            else:
                block = [nn.Linear(d, d)]
            self.blocks.append(nn.ModuleList(block))
            self.kinds.append((kind, rng.choice(["gelu", "relu", "none"]), rng.random() < 0.5))
        self.taps = {i for i in range(len(self.kinds)) if rng.random() < 0.3}

    def example(self) -> list[torch.Tensor]:
        x = torch.randn(1, self.length, self.width)
        if not self.masked:
            return [x]
        mask = torch.zeros(1, 1, self.length, self.length)
        mask[..., -1] = float("-inf")  # every row keeps the others
        return [x, mask]

    def forward(self, x, mask=None):
        outputs, (t, d, h) = [], (self.length, self.width, self.heads)
        heads = lambda v: v.view(1, t, h, d // h).transpose(1, 2)  # noqa: E731
        for i, ((kind, act, pre_norm), block) in enumerate(zip(self.kinds, self.blocks)):
            if kind == "linear":
                x = ACTIVATIONS[act](block[0](x))
            else:
                norm = block[1] if kind == "attention" else block[2]
                y = norm(x) if pre_norm else x
                if kind == "attention":
                    q, k, v = block[2](y).split(d, -1) if len(block) == 3 else \
                        (block[2](y), block[3](y), block[4](y))
                    a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
                    x = x + block[0](a.transpose(1, 2).reshape(1, t, d))
                else:
                    x = x + block[1](ACTIVATIONS[act](block[0](y)))
                if not pre_norm:
                    x = norm(x)
            if i in self.taps:
                outputs.append(x)
        outputs.append(x)
        return tuple(outputs)


def draw(seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
    """The network of `seed` (in eval mode, its weights drawn from the seed) and inputs."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = (ConvNet(rng) if rng.random() < 0.6 else SeqNet(rng)).eval()
    return model, model.example()


@contextmanager
def random_forms(seed: int):
    """Within it, every choice among a group's library forms is drawn at random instead of
    measured or recalled, and nothing is recorded. The draw is seeded by `seed` and the
    group's key, not taken from one stream: a compile that asks about fewer groups (their
    times known from an earlier one in the process) draws the same forms for the rest."""
    from unittest import mock

    from ..codegen import choice

    def choose(key, candidates, inputs, rounds=7, work=0.0):
        rng = random.Random(f"{seed}:{key!r}")
        return rng.choice(sorted(candidates)), 1e-4  # (a time: cost estimates read it)
    with mock.patch.object(choice, "choose", choose):
        yield


def check(seed: int, precision: str, forms_at_random: bool = False) -> list[str]:
    """What is wrong with network `seed` compiled in `precision` (empty: nothing)."""
    import opweave

    if precision not in TOLERANCES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(TOLERANCES)}")
    model, inputs = draw(seed)
    before = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = model.double()(*[t.double() for t in inputs])
        model.float()
        with random_forms(seed) if forms_at_random else nullcontext():
            compiled = opweave.compile(model, inputs, precision=precision, name=f"blocks{seed}")
            calls, as_returned = [], []
            for _ in range(CALLS):
                calls.append(compiled(*inputs))
                as_returned.append([y.clone() for y in calls[-1]])
            # a call on other values must leave the results returned before it alone
            compiled(*[t * 2 if t.is_floating_point() else t for t in inputs])
    problems = [f"input {k} was changed" for k, (t, b) in enumerate(zip(inputs, before))
                if not torch.equal(t, b)]
    problems += [f"call {call}, output {k} changed at a later call"
                 for call, (outputs, copies) in enumerate(zip(calls, as_returned), 1)
                 for k, (y, copy) in enumerate(zip(outputs, copies))
                 if not torch.equal(y.nan_to_num(), copy.nan_to_num())]
    for call, outputs in enumerate(calls, 1):
        if len(outputs) != len(expected):
            problems.append(f"call {call}: {len(outputs)} outputs, expected {len(expected)}")
            continue
        for k, (got, want) in enumerate(zip(outputs, expected)):
            if got.shape != want.shape or got.dtype != torch.float32:
                problems.append(f"call {call}, output {k}: {got.dtype}{list(got.shape)}, "
                                f"expected float32{list(want.shape)}")
                continue
            error = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            if not error <= TOLERANCES[precision]:  # NaN fails too
                problems.append(f"call {call}, output {k}: relative L2 difference {error:.3g} "
                                f"(allowed {TOLERANCES[precision]:g})")
    return problems


def run(seeds, precision: str, forms_at_random: bool = False, log=print) -> int:
    """Check each seed's network; log each failure (a raise counts) and return how many."""
    failed = 0
    for seed in seeds:
        try:
            problems = check(seed, precision, forms_at_random)
        except Exception as error:  # noqa: BLE001  (a crash is a finding, reported as one)
            problems = [f"raised {type(error).__name__}: {str(error).strip()[:300]}"]
        if problems:
            failed += 1
            log(f"seed {seed} ({precision}{', forms at random' if forms_at_random else ''}): "
                + "; ".join(problems[:4]))
    return failed
