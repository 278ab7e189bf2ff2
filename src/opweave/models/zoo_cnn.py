"""Classic CNNs written from their papers in plain torch (torchvision does not import here).

`width` scales every channel count, so one definition gives the small test variant and
the paper's size (width 1 at 224x224).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False),
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
    else:
        raise KeyError(name)
    return module.eval(), (torch.randn(1, 3, side, side),), f"{side}px"


NAMES = ("vgg11", "squeezenet", "inception", "densenet")
