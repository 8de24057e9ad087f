"""Hand-written zoo networks (torch only): a YOLOv8-style detector and a UNet.

Written from the published architectures, sized by arguments, with random weights: what the
zoo needs when no package ships the model without a download.
"""

from __future__ import annotations

from typing import Any

__all__ = ["unet", "yolov8"]


def _nn() -> Any:
    import torch.nn as nn  # heavy: torch

    return nn


def _conv(c1: int, c2: int, k: int = 1, s: int = 1) -> Any:
    """YOLOv8's ``Conv``: conv (no bias) -> batch norm -> SiLU."""
    nn = _nn()
    return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2, bias=False), nn.BatchNorm2d(c2),
                         nn.SiLU())


def _random_bn(model: Any) -> Any:
    """Batch-norm statistics that are not the identity (a fresh one folds to a no-op)."""
    import torch  # heavy: torch

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model


def _yolo_classes() -> dict[str, type]:
    import torch  # heavy: torch
    import torch.nn as nn  # heavy: torch

    class Bottleneck(nn.Module):
        def __init__(self, c: int, shortcut: bool) -> None:
            super().__init__()
            self.cv1, self.cv2, self.add = _conv(c, c, 3), _conv(c, c, 3), shortcut

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):
        """Split in two halves, chain ``n`` bottlenecks on one, concat every stage."""

        def __init__(self, c1: int, c2: int, n: int, shortcut: bool) -> None:
            super().__init__()
            self.c = c2 // 2
            self.cv1 = _conv(c1, 2 * self.c, 1)
            self.cv2 = _conv((2 + n) * self.c, c2, 1)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

        def forward(self, x):
            y = list(self.cv1(x).chunk(2, 1))
            for m in self.m:
                y.append(m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        """Three chained 5x5 max pools, concatenated with their input."""

        def __init__(self, c1: int, c2: int) -> None:
            super().__init__()
            self.cv1, self.cv2 = _conv(c1, c1 // 2, 1), _conv(2 * c1, c2, 1)
            self.m = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            y = [self.cv1(x)]
            for _ in range(3):
                y.append(self.m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class Detect(nn.Module):
        """Anchor-free head: per level a box branch (4 x ``reg_max`` bins, decoded by the
        distribution focal loss' expectation, DFL) and a class branch; boxes in pixels."""

        def __init__(self, nc: int, ch: tuple[int, ...], size: int, strides: tuple[int, ...],
                     reg_max: int = 16) -> None:
            super().__init__()
            self.nc, self.reg_max = nc, reg_max
            c2, c3 = max(16, ch[0] // 4, 4 * reg_max), max(ch[0], min(nc, 100))
            self.cv2 = nn.ModuleList(nn.Sequential(_conv(c, c2, 3), _conv(c2, c2, 3),
                                                   nn.Conv2d(c2, 4 * reg_max, 1)) for c in ch)
            self.cv3 = nn.ModuleList(nn.Sequential(_conv(c, c3, 3), _conv(c3, c3, 3),
                                                   nn.Conv2d(c3, nc, 1)) for c in ch)
            self.dfl = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
            self.dfl.weight.data[:] = torch.arange(reg_max, dtype=torch.float32).view(
                1, reg_max, 1, 1)
            anchors, stride = [], []
            for s in strides:  # cell centres, fixed by the input size
                n = size // s
                r = torch.arange(n, dtype=torch.float32) + 0.5
                yy, xx = torch.meshgrid(r, r, indexing="ij")
                anchors.append(torch.stack((xx, yy), -1).view(-1, 2))
                stride.append(torch.full((n * n, 1), float(s)))
            self.register_buffer("anchors", torch.cat(anchors).transpose(0, 1).unsqueeze(0))
            self.register_buffer("strides", torch.cat(stride).transpose(0, 1).unsqueeze(0))

        def forward(self, xs):
            b = xs[0].shape[0]
            y = torch.cat([torch.cat((self.cv2[i](x), self.cv3[i](x)), 1).flatten(2)
                           for i, x in enumerate(xs)], 2)
            box, cls = y.split((4 * self.reg_max, self.nc), 1)
            a = box.shape[-1]
            prob = box.view(b, 4, self.reg_max, a).transpose(2, 1).softmax(1)
            dist = self.dfl(prob).view(b, 4, a)
            lt, rb = dist.chunk(2, 1)
            x1y1, x2y2 = self.anchors - lt, self.anchors + rb
            xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * self.strides
            return torch.cat((xywh, cls.sigmoid()), 1)

    class YOLOv8(nn.Module):
        def __init__(self, width: int, depth: int, size: int, nc: int) -> None:
            super().__init__()
            w = [width * 2**i for i in range(5)]  # yolov8n: 16 32 64 128 256
            d = [depth, 2 * depth, 2 * depth, depth]
            self.stem = nn.Sequential(_conv(3, w[0], 3, 2), _conv(w[0], w[1], 3, 2),
                                      C2f(w[1], w[1], d[0], True))
            self.p3 = nn.Sequential(_conv(w[1], w[2], 3, 2), C2f(w[2], w[2], d[1], True))
            self.p4 = nn.Sequential(_conv(w[2], w[3], 3, 2), C2f(w[3], w[3], d[2], True))
            self.p5 = nn.Sequential(_conv(w[3], w[4], 3, 2), C2f(w[4], w[4], d[3], True),
                                    SPPF(w[4], w[4]))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.h4 = C2f(w[4] + w[3], w[3], depth, False)
            self.h3 = C2f(w[3] + w[2], w[2], depth, False)
            self.d3 = _conv(w[2], w[2], 3, 2)
            self.n4 = C2f(w[2] + w[3], w[3], depth, False)
            self.d4 = _conv(w[3], w[3], 3, 2)
            self.n5 = C2f(w[3] + w[4], w[4], depth, False)
            self.detect = Detect(nc, (w[2], w[3], w[4]), size, (8, 16, 32))

        def forward(self, x):
            p3 = self.p3(self.stem(x))
            p4 = self.p4(p3)
            p5 = self.p5(p4)
            h4 = self.h4(torch.cat((self.up(p5), p4), 1))
            o3 = self.h3(torch.cat((self.up(h4), p3), 1))
            o4 = self.n4(torch.cat((self.d3(o3), h4), 1))
            o5 = self.n5(torch.cat((self.d4(o4), p5), 1))
            return self.detect([o3, o4, o5])

    return {"YOLOv8": YOLOv8}


def yolov8(width: int = 16, depth: int = 1, size: int = 320, classes: int = 80,
           seed: int = 0) -> tuple[Any, tuple]:
    """A YOLOv8-style detector (Conv-BN-SiLU, C2f, SPPF, upsample + concat, DFL head) and a
    ``(1, 3, size, size)`` input; ``width=16, depth=1`` is yolov8n's size (3.2 M parameters).

    Returns the eval-mode module and its example arguments; the output is
    ``(1, 4 + classes, anchors)`` (box centre/size in pixels, class scores).

    Examples
    --------
    >>> from opsdk.bench._zoonets import yolov8
    >>> model, (x,) = yolov8(width=4, size=64, classes=3)
    >>> tuple(model(x).shape)
    (1, 7, 84)
    """
    import torch  # heavy: torch

    if size % 32:
        raise ValueError(f"yolov8: size must be a multiple of 32 (the deepest stride), got {size}")
    torch.manual_seed(seed)
    model = _random_bn(_yolo_classes()["YOLOv8"](width, depth, size, classes).eval())
    return model, (torch.randn(1, 3, size, size),)


def unet(base: int = 16, depth: int = 4, size: int = 256, classes: int = 2,
         up: str = "transpose", seed: int = 0) -> tuple[Any, tuple]:
    """A UNet (two conv-BN-ReLU per level, max-pool down, 2x up, skip concat) of ``depth``
    down steps from ``base`` channels, and a ``(1, 3, size, size)`` input.

    ``up``: ``"transpose"`` (a 2x2 stride-2 transposed conv, as the paper) or ``"nearest"``
    (nearest-neighbour upsampling then a 1x1 conv).

    Examples
    --------
    >>> from opsdk.bench._zoonets import unet
    >>> model, (x,) = unet(base=4, depth=2, size=32)
    >>> tuple(model(x).shape)
    (1, 2, 32, 32)
    """
    import torch  # heavy: torch
    import torch.nn as nn  # heavy: torch

    if up not in ("transpose", "nearest"):
        raise ValueError(f"unet: up must be 'transpose' or 'nearest', got {up!r}")
    if size % 2**depth:
        raise ValueError(f"unet: size must be a multiple of 2**depth = {2**depth}, got {size}")

    def double(c1: int, c2: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c1, c2, 3, padding=1, bias=False), nn.BatchNorm2d(c2), nn.ReLU(),
            nn.Conv2d(c2, c2, 3, padding=1, bias=False), nn.BatchNorm2d(c2), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            ch = [base * 2**i for i in range(depth + 1)]
            self.inc = double(3, ch[0])
            self.down = nn.ModuleList(double(ch[i], ch[i + 1]) for i in range(depth))
            self.ups = nn.ModuleList(
                nn.ConvTranspose2d(ch[i + 1], ch[i], 2, 2) if up == "transpose" else
                nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                              nn.Conv2d(ch[i + 1], ch[i], 1))
                for i in reversed(range(depth)))
            self.dec = nn.ModuleList(double(2 * ch[i], ch[i]) for i in reversed(range(depth)))
            self.pool = nn.MaxPool2d(2)
            self.out = nn.Conv2d(ch[0], classes, 1)

        def forward(self, x):
            skips = [self.inc(x)]
            for d in self.down:
                skips.append(d(self.pool(skips[-1])))
            y = skips.pop()
            for up, dec in zip(self.ups, self.dec):
                y = dec(torch.cat((up(y), skips.pop()), 1))
            return self.out(y)

    torch.manual_seed(seed)
    return _random_bn(UNet().eval()), (torch.randn(1, 3, size, size),)
