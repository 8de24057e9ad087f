"""A small convolutional network from torch, compiled through opsdk.

Conv-BatchNorm-ReLU blocks, a GroupNorm, a conv with bias followed by BatchNorm, global
average pooling and a linear head. torch.export -> ``opsdk.frontend.from_torch`` (GroupNorm
becomes ``opsdk.group_norm``) -> ``opsdk.transform.FuseIntoOps`` (each inference BatchNorm is
folded into its convolution's weights and bias at compile time) -> ``opsdk.compile`` for x86
and aarch64; results against torch eager.

    python examples/conv_net.py                 # x86 + arm, default sizes
    python examples/conv_net.py --bench         # + opsdk vs TVM default latency
    python examples/conv_net.py --small         # the sizes the tests use
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
DEFAULT_ARGS = {"channels": 32, "size": 56, "batch": 1}


def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


class ConvNet(nn.Module):
    """conv-bn-relu, GroupNorm, conv-bn-relu, conv(+bias)-bn, pool, linear."""

    def __init__(self, channels: int, groups: int = 4, classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            *_conv_bn_relu(3, c),
            nn.GroupNorm(groups, c),
            *_conv_bn_relu(c, 2 * c),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1),
            nn.BatchNorm2d(2 * c),
        )
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def build_model(
    channels: int = 8, size: int = 16, batch: int = 2, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The network with random weights and BN statistics, and an input: ``(model, (x,))``."""
    torch.manual_seed(seed)
    model = ConvNet(channels).eval()
    with torch.no_grad():  # BN statistics as after training, not the identity defaults
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(batch, 3, size, size),)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--channels", type=int, default=DEFAULT_ARGS["channels"])
    p.add_argument("--size", type=int, default=DEFAULT_ARGS["size"])
    p.add_argument("--batch", type=int, default=DEFAULT_ARGS["batch"])
    p.add_argument("--small", action="store_true", help="8 channels, 16x16, batch 2")
    p.add_argument("--no-arm", action="store_true", help="skip the aarch64 cross-compile")
    p.add_argument("--bench", action="store_true", help="time opsdk vs TVM's default pipeline")
    p.add_argument("--repeats", type=int, default=11)
    a = p.parse_args(argv)
    if a.small:
        a.channels, a.size, a.batch = 8, 16, 2
    model, args = build_model(a.channels, a.size, a.batch)
    name = f"conv net channels={a.channels} size={a.size} batch={a.batch}"
    return run_example(
        name, model, args, arm_target=not a.no_arm, do_bench=a.bench, repeats=a.repeats
    )


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["x86"]["ok"] else 1)
