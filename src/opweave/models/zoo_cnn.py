"""Classic CNNs written from their papers in plain torch (torchvision does not import here).

`width` scales every channel count, so one definition gives the small test variant and
the paper's size (width 1 at 224x224).
"""
from __future__ import annotations

import networkx as nx
import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def _conv_bn_rect(cin: int, cout: int, kernel, stride=1, padding=0) -> nn.Sequential:
    """conv(bias=False) + BatchNorm + ReLU with any kernel, stride and padding (ints or
    (h, w) pairs: the (1, 7) and (7, 1) convs of Inception-v3 with padding (0, 3), (3, 0))."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class VGG11(nn.Module):
    """VGG configuration A (Simonyan & Zisserman, 2014): 8 convs, 5 max pools, 3 FC layers."""

    def __init__(self, width: float = 1.0, classes: int = 1000, fc: int = 4096):
        super().__init__()
        layers, cin = [], 3
        for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                cout = max(8, int(v * width))
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]
                cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(cin * 49, fc), nn.ReLU(inplace=True),
                                        nn.Dropout(), nn.Linear(fc, fc), nn.ReLU(inplace=True),
                                        nn.Dropout(), nn.Linear(fc, classes))

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x):
        s = F.relu(self.squeeze(x))
        return torch.cat([F.relu(self.expand1(s)), F.relu(self.expand3(s))], 1)


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1 (Iandola et al., 2016): fire modules, a conv classifier, global pool."""

    def __init__(self, width: float = 1.0, classes: int = 1000):
        super().__init__()
        c = lambda v: max(4, int(v * width))  # noqa: E731
        fires = [(64, 16, 64), (128, 16, 64), "M", (128, 32, 128), (256, 32, 128), "M",
                 (256, 48, 192), (384, 48, 192), (384, 64, 256), (512, 64, 256)]
        layers = [nn.Conv2d(3, c(64), 3, stride=2), nn.ReLU(inplace=True),
                  nn.MaxPool2d(3, 2, ceil_mode=True)]
        for f in fires:
            if f == "M":
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            else:
                cin, sq, ex = f
                layers.append(Fire(c(cin), c(sq), c(ex)))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(c(512), classes, 1),
                                        nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        return self.classifier(self.features(x)).flatten(1)


class Inception(nn.Module):
    """GoogLeNet's inception block: 1x1, 1x1->3x3, 1x1->3x3->3x3 (the v2 factorized 5x5)
    and pool->1x1 branches, concatenated."""

    def __init__(self, cin: int, b1: int, b3r: int, b3: int, b5r: int, b5: int, bp: int):
        super().__init__()
        self.b1 = _conv_bn(cin, b1, 1)
        self.b3 = nn.Sequential(_conv_bn(cin, b3r, 1), _conv_bn(b3r, b3, 3))
        self.b5 = nn.Sequential(_conv_bn(cin, b5r, 1), _conv_bn(b5r, b5, 3), _conv_bn(b5, b5, 3))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), _conv_bn(cin, bp, 1))
        self.out_channels = b1 + b3 + b5 + bp

    def forward(self, x):
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)


class InceptionNet(nn.Module):
    """A GoogLeNet-style stem and the first four inception blocks (3a, 3b, 4a, 4b)."""

    def __init__(self, width: float = 1.0, classes: int = 1000):
        super().__init__()
        c = lambda v: max(4, int(v * width))  # noqa: E731
        self.stem = nn.Sequential(_conv_bn(3, c(64), 7, 2), nn.MaxPool2d(3, 2, 1),
                                  _conv_bn(c(64), c(192), 3), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], c(192)
        for i, spec in enumerate([(64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64),
                                  (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64)]):
            if i == 2:
                blocks.append(nn.MaxPool2d(3, 2, 1))
            block = Inception(cin, *map(c, spec))
            blocks.append(block)
            cin = block.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
                                  nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                  nn.BatchNorm2d(4 * growth), nn.ReLU(inplace=True),
                                  nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False))

    def forward(self, x):
        return torch.cat([x, self.body(x)], 1)


class DenseNet(nn.Module):
    """DenseNet-BC (Huang et al., 2017): dense blocks of bottleneck layers joined by
    transitions that halve the channels and the resolution. Default: DenseNet-121."""

    def __init__(self, blocks=(6, 12, 24, 16), growth: int = 32, stem: int = 64,
                 classes: int = 1000):
        super().__init__()
        layers = [nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem),
                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = stem
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(DenseLayer(cin, growth))
                cin += growth
            if i < len(blocks) - 1:
                layers += [nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
                           nn.Conv2d(cin, cin // 2, 1, bias=False), nn.AvgPool2d(2)]
                cin //= 2
        layers += [nn.BatchNorm2d(cin), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


# --- Inception-v3 (Szegedy et al., "Rethinking the Inception Architecture", 2016) -----

class InceptionA(nn.Module):
    """The 35x35 module (figure 5): 1x1 | 1x1->5x5 | 1x1->3x3->3x3 | avgpool->1x1.

    The second branch keeps a single 5x5 conv (as the common implementation does) rather
    than the figure's two stacked 3x3s; the third branch is the factorized one."""

    def __init__(self, cin: int, c1: int, c5r: int, c5: int, c3r: int, c3: int, cp: int):
        super().__init__()
        self.b1 = _conv_bn_rect(cin, c1, 1)
        self.b5 = nn.Sequential(_conv_bn_rect(cin, c5r, 1), _conv_bn_rect(c5r, c5, 5, 1, 2))
        self.b3 = nn.Sequential(_conv_bn_rect(cin, c3r, 1), _conv_bn_rect(c3r, c3, 3, 1, 1),
                                _conv_bn_rect(c3, c3, 3, 1, 1))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv_bn_rect(cin, cp, 1))
        self.out_channels = c1 + c5 + c3 + cp

    def forward(self, x):
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(x)], 1)


class ReductionA(nn.Module):
    """Grid reduction 35x35 -> 17x17 (figure 10): 3x3/2 | 1x1->3x3->3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c3: int, cdr: int, cd: int):
        super().__init__()
        self.b3 = _conv_bn_rect(cin, c3, 3, 2)
        self.bd = nn.Sequential(_conv_bn_rect(cin, cdr, 1), _conv_bn_rect(cdr, cd, 3, 1, 1),
                                _conv_bn_rect(cd, cd, 3, 2))
        self.bp = nn.MaxPool2d(3, 2)
        self.out_channels = c3 + cd + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.bd(x), self.bp(x)], 1)


class InceptionB(nn.Module):
    """The 17x17 module (figure 6, n = 7): 1x1 | 1x1->1x7->7x1 |
    1x1->7x1->1x7->7x1->1x7 | avgpool->1x1."""

    def __init__(self, cin: int, c1: int, c7: int, cp: int):
        super().__init__()
        row = lambda a, b: _conv_bn_rect(a, b, (1, 7), 1, (0, 3))  # noqa: E731
        col = lambda a, b: _conv_bn_rect(a, b, (7, 1), 1, (3, 0))  # noqa: E731
        self.b1 = _conv_bn_rect(cin, c1, 1)
        self.b7 = nn.Sequential(_conv_bn_rect(cin, c7, 1), row(c7, c7), col(c7, c1))
        self.b77 = nn.Sequential(_conv_bn_rect(cin, c7, 1), col(c7, c7), row(c7, c7),
                                 col(c7, c7), row(c7, c1))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv_bn_rect(cin, cp, 1))
        self.out_channels = 3 * c1 + cp

    def forward(self, x):
        return torch.cat([self.b1(x), self.b7(x), self.b77(x), self.bp(x)], 1)


class ReductionB(nn.Module):
    """Grid reduction 17x17 -> 8x8 (figure 10 with the 17x17 module's factorized 7x7):
    1x1->3x3/2 | 1x1->1x7->7x1->3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c3r: int, c3: int, c7: int):
        super().__init__()
        self.b3 = nn.Sequential(_conv_bn_rect(cin, c3r, 1), _conv_bn_rect(c3r, c3, 3, 2))
        self.b7 = nn.Sequential(_conv_bn_rect(cin, c7, 1),
                                _conv_bn_rect(c7, c7, (1, 7), 1, (0, 3)),
                                _conv_bn_rect(c7, c7, (7, 1), 1, (3, 0)),
                                _conv_bn_rect(c7, c7, 3, 2))
        self.bp = nn.MaxPool2d(3, 2)
        self.out_channels = c3 + c7 + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), self.bp(x)], 1)


class InceptionC(nn.Module):
    """The 8x8 module (figure 7): the last conv of the 3x3 branches is split into a 1x3
    and a 3x1 side by side, their outputs concatenated (the expanded filter bank):
    1x1 | 1x1->(1x3, 3x1) | 1x1->3x3->(1x3, 3x1) | avgpool->1x1."""

    def __init__(self, cin: int, c1: int, c3: int, cdr: int, cp: int):
        super().__init__()
        self.b1 = _conv_bn_rect(cin, c1, 1)
        self.b3 = _conv_bn_rect(cin, c3, 1)
        self.b3_row = _conv_bn_rect(c3, c3, (1, 3), 1, (0, 1))
        self.b3_col = _conv_bn_rect(c3, c3, (3, 1), 1, (1, 0))
        self.bd = nn.Sequential(_conv_bn_rect(cin, cdr, 1), _conv_bn_rect(cdr, c3, 3, 1, 1))
        self.bd_row = _conv_bn_rect(c3, c3, (1, 3), 1, (0, 1))
        self.bd_col = _conv_bn_rect(c3, c3, (3, 1), 1, (1, 0))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv_bn_rect(cin, cp, 1))
        self.out_channels = c1 + 4 * c3 + cp

    def forward(self, x):
        b3, bd = self.b3(x), self.bd(x)
        return torch.cat([self.b1(x), self.b3_row(b3), self.b3_col(b3),
                          self.bd_row(bd), self.bd_col(bd), self.bp(x)], 1)


class InceptionV3(nn.Module):
    """Inception-v3 without the auxiliary classifier: the stem, 3 x InceptionA (35x35),
    a grid reduction, 4 x InceptionB (17x17), a grid reduction, 2 x InceptionC (8x8),
    global average pool and FC (dropout omitted: the zoo runs in eval mode). Every conv is
    conv + BN + ReLU. 299x299 inputs at the paper's size; 75x75 is the smallest input that
    keeps every grid valid (the 8x8 grid becomes 1x1). ~23.8M parameters at width 1."""

    def __init__(self, width: float = 1.0, classes: int = 1000):
        super().__init__()
        c = lambda v: max(4, int(v * width))  # noqa: E731
        self.stem = nn.Sequential(
            _conv_bn_rect(3, c(32), 3, 2), _conv_bn_rect(c(32), c(32), 3),
            _conv_bn_rect(c(32), c(64), 3, 1, 1), nn.MaxPool2d(3, 2),
            _conv_bn_rect(c(64), c(80), 1), _conv_bn_rect(c(80), c(192), 3), nn.MaxPool2d(3, 2))
        blocks, cin = [], c(192)

        def add(block):
            nonlocal cin
            blocks.append(block)
            cin = block.out_channels

        for cp in (32, 64, 64):
            add(InceptionA(cin, c(64), c(48), c(64), c(64), c(96), c(cp)))
        add(ReductionA(cin, c(384), c(64), c(96)))
        for c7 in (128, 160, 160, 192):
            add(InceptionB(cin, c(192), c(c7), c(192)))
        add(ReductionB(cin, c(192), c(320), c(192)))
        for _ in range(2):
            add(InceptionC(cin, c(320), c(384), c(448), c(192)))
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


# --- RandWire (Xie et al., "Exploring Randomly Wired Neural Networks", ICCV 2019) -----

class SepConvBN(nn.Module):
    """A node's transformation: ReLU -> 3x3 separable conv (depthwise 3x3, pointwise 1x1)
    -> BN."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.bn(self.pointwise(self.depthwise(F.relu(x))))


class RandomStage(nn.Module):
    """One randomly wired stage: a WS(k, p) graph of `nodes` nodes from networkx (a fixed
    seed), made a DAG by orienting every edge from the lower to the higher index. A node
    sums its inputs weighted by sigmoid(w) (one learnable w per edge), then runs
    ReLU-sepconv-BN. The input nodes (no predecessors) read the stage input with stride 2
    (the stage's downsampling); the output nodes (no successors) are averaged."""

    def __init__(self, cin: int, cout: int, nodes: int, k: int = 4, p: float = 0.75,
                 seed: int = 0):
        super().__init__()
        graph = nx.connected_watts_strogatz_graph(nodes, k, p, seed=seed)
        preds = [sorted(j for j in graph.neighbors(i) if j < i) for i in range(nodes)]
        self.preds = preds
        self.outputs = [i for i in range(nodes) if all(j < i for j in graph.neighbors(i))]
        self.ops = nn.ModuleList(SepConvBN(cout, cout) if preds[i] else SepConvBN(cin, cout, 2)
                                 for i in range(nodes))
        # the aggregation weights of the nodes that have predecessors (sigmoid(0) = 0.5)
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(len(preds[i])))
                                        for i in range(nodes) if preds[i])

    def forward(self, x):
        results, weights = [], iter(self.weights)
        for i, op in enumerate(self.ops):
            if self.preds[i]:
                w = torch.sigmoid(next(weights))
                agg = w[0] * results[self.preds[i][0]]
                for t, j in enumerate(self.preds[i][1:], 1):
                    agg = agg + w[t] * results[j]
                results.append(op(agg))
            else:
                results.append(op(x))
        out = results[self.outputs[0]]
        for i in self.outputs[1:]:
            out = out + results[i]
        return out / len(self.outputs)


class RandWire(nn.Module):
    """RandWire-WS, the paper's small regime: conv1 3x3/2 (C/2) + BN, conv2 a single
    ReLU-3x3/2 conv (C)-BN (as in the paper's small regime table), then random stages
    conv3, conv4, conv5 of `nodes` nodes each with C, 2C, 4C channels (each halving the
    resolution), a 1x1 conv to 1280 channels + BN + ReLU, global average pool and FC.
    Stage s's graph is WS(k, p) with seed s, so the model is deterministic. The paper's
    small regime: C = 78, N = 32, WS(4, 0.75), 224x224 inputs, ~5.6M parameters."""

    def __init__(self, channels: int = 78, nodes: int = 32, classes: int = 1000, k: int = 4,
                 p: float = 0.75, head: int = 1280):
        super().__init__()
        c = channels
        self.conv1 = nn.Sequential(nn.Conv2d(3, c // 2, 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(c // 2))
        self.conv2 = nn.Sequential(nn.ReLU(), nn.Conv2d(c // 2, c, 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(c))
        self.conv3 = RandomStage(c, c, nodes, k, p, seed=3)
        self.conv4 = RandomStage(c, 2 * c, nodes, k, p, seed=4)
        self.conv5 = RandomStage(2 * c, 4 * c, nodes, k, p, seed=5)
        self.head = nn.Sequential(nn.Conv2d(4 * c, head, 1, bias=False), nn.BatchNorm2d(head),
                                  nn.ReLU(inplace=True))
        self.fc = nn.Linear(head, classes)

    def forward(self, x):
        x = self.conv5(self.conv4(self.conv3(self.conv2(self.conv1(x)))))
        return self.fc(F.adaptive_avg_pool2d(self.head(x), 1).flatten(1))


class UNet(nn.Module):
    """U-Net (Ronneberger, Fischer & Brox, 2015): a contracting path of two 3x3 convs and a
    2x2 max pool per level, an expanding path of a 2x2 up-convolution (transposed, stride
    2), a concatenation with the contracting path's features and two 3x3 convs per level,
    then a 1x1 conv to the classes. As it is commonly run today: padded convs (the output
    has the input's size, no cropping) with batch norm after each."""

    def __init__(self, width: float = 1.0, classes: int = 2, levels: int = 4):
        super().__init__()
        chans = [max(8, int(64 * width * 2 ** i)) for i in range(levels + 1)]

        def double(cin, cout):
            return nn.Sequential(_conv_bn(cin, cout, 3), _conv_bn(cout, cout, 3))
        self.down = nn.ModuleList([double(3, chans[0])] +
                                  [double(chans[i], chans[i + 1]) for i in range(levels)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2)
                                 for i in reversed(range(levels))])
        self.merge = nn.ModuleList([double(2 * chans[i], chans[i])
                                    for i in reversed(range(levels))])
        self.head = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1])):
            x = merge(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


def build(name: str, small: bool):
    """(module in eval mode, inputs, notes) for a classic CNN of the zoo."""
    side = 32 if small else 224
    if name == "vgg11":
        module = VGG11(0.125, 10, 64) if small else VGG11()
    elif name == "squeezenet":
        side = 64 if small else 224
        module = SqueezeNet(0.125, 10) if small else SqueezeNet()
    elif name == "inception":
        side = 64 if small else 224
        module = InceptionNet(0.125, 10) if small else InceptionNet()
    elif name == "densenet":
        module = DenseNet((2, 2), 8, 16, 10) if small else DenseNet()
    elif name == "inception3":
        side = 75 if small else 299
        module = InceptionV3(0.125, 10) if small else InceptionV3()
    elif name == "randwire":
        side = 64 if small else 224
        module = RandWire(16, 8, 10) if small else RandWire()
    elif name == "unet":
        side = 64 if small else 256
        module = UNet(0.125, 2, 3) if small else UNet()
    else:
        raise KeyError(name)
    return module.eval(), (torch.randn(1, 3, side, side),), f"{side}px"


NAMES = ("vgg11", "squeezenet", "inception", "densenet", "inception3", "randwire", "unet")
