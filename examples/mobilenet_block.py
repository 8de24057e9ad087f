"""MobileNetV2 inverted-residual blocks from torch, compiled through opsdk, with symbolic batch.

Two blocks of MobileNetV2's second stage: a stride-2 block (24 -> 32 channels, no residual)
then a stride-1 block with the residual add. Each block is 1x1 expand conv (x6) + BN +
ReLU6, 3x3 depthwise conv + BN + ReLU6, 1x1 project conv + BN. torch.export with a dynamic
batch dim -> ``opsdk.frontend.from_torch`` -> ``opsdk.transform.FuseIntoOps`` (every BN folded
into its conv) -> ``opsdk.compile``; one executable runs every batch size.

    python examples/mobilenet_block.py                 # x86 + arm, default sizes
    python examples/mobilenet_block.py --bench         # + latency vs TVM default
    python examples/mobilenet_block.py --small         # the sizes the tests use
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import run_example

#: The benchmark size (``opsdk bench --examples``, this script's defaults).
DEFAULT_ARGS = {"cin": 24, "cout": 32, "size": 56, "batch": 1}
#: Exported with a symbolic batch dim (one executable for every batch size).
DYNAMIC_BATCH = True


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand (1x1), depthwise (3x3), project (1x1), residual if it fits."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 6) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileNetStage(nn.Module):
    """A stride-2 block followed by a stride-1 residual block."""

    def __init__(self, cin: int = 24, cout: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(InvertedResidual(cin, cout, 2), InvertedResidual(cout, cout, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build_model(
    cin: int = 16, cout: int = 16, size: int = 16, batch: int = 2, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The stage with random weights and BN statistics, and an input: ``(model, (x,))``."""
    torch.manual_seed(seed)
    model = MobileNetStage(cin, cout).eval()
    with torch.no_grad():  # BN statistics as after training, not the identity defaults
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
                m.running_mean.normal_(0.0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(batch, cin, size, size),)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cin", type=int, default=DEFAULT_ARGS["cin"])
    p.add_argument("--cout", type=int, default=DEFAULT_ARGS["cout"])
    p.add_argument("--size", type=int, default=DEFAULT_ARGS["size"])
    p.add_argument("--batch", type=int, default=DEFAULT_ARGS["batch"])
    p.add_argument("--small", action="store_true", help="16 -> 16 channels, 16x16, batch 2")
    p.add_argument("--no-arm", action="store_true", help="skip the aarch64 cross-compile")
    p.add_argument("--bench", action="store_true", help="time opsdk vs TVM's default pipeline")
    p.add_argument("--repeats", type=int, default=11)
    a = p.parse_args(argv)
    if a.small:
        a.cin, a.cout, a.size, a.batch = 16, 16, 16, 2
    model, args = build_model(a.cin, a.cout, a.size, a.batch)
    name = f"mobilenet stage cin={a.cin} cout={a.cout} size={a.size} batch={a.batch} (symbolic)"
    return run_example(
        name, model, args, arm_target=not a.no_arm, do_bench=a.bench, repeats=a.repeats,
        dynamic_batch=True,
    )


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["x86"]["ok"] else 1)
