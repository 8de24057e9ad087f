"""A transformer encoder block from torch, compiled through opsdk.

Pre-norm block: ``x + Attention(LayerNorm(x))`` then ``x + MLP(LayerNorm(x))`` with a GELU
MLP. torch.export -> ``opsdk.frontend.from_torch`` (LayerNorm, softmax, GELU become opsdk
ops) -> ``opsdk.transform.FuseIntoOps`` (the MLP's bias add + GELU becomes
``opsdk.bias_gelu``) -> ``opsdk.compile`` for x86 and aarch64; results against torch eager.

    python examples/transformer_block.py                 # x86 + arm, default sizes
    python examples/transformer_block.py --bench         # + opsdk vs TVM default latency
    python examples/transformer_block.py --small         # the sizes the tests use

``opsdk drift examples/transformer_block.py`` reports fused-vs-unfused drift per site
(``build_model`` is the entry point it calls).
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
DEFAULT_ARGS = {"dim": 256, "heads": 4, "seq": 128, "batch": 1}


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: multi-head self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // h) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def build_model(
    dim: int = 64, heads: int = 4, seq: int = 16, batch: int = 2, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The block with random weights and an input: ``(model, (x,))``."""
    torch.manual_seed(seed)
    model = EncoderBlock(dim, heads).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters
        for ln in (model.ln1, model.ln2):
            ln.weight.normal_(1.0, 0.2)
            ln.bias.normal_(0.0, 0.2)
    return model, (torch.randn(batch, seq, dim),)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=DEFAULT_ARGS["dim"])
    p.add_argument("--heads", type=int, default=DEFAULT_ARGS["heads"])
    p.add_argument("--seq", type=int, default=DEFAULT_ARGS["seq"])
    p.add_argument("--batch", type=int, default=DEFAULT_ARGS["batch"])
    p.add_argument("--small", action="store_true", help="dim 64, seq 16, batch 2")
    p.add_argument("--no-arm", action="store_true", help="skip the aarch64 cross-compile")
    p.add_argument("--bench", action="store_true", help="time opsdk vs TVM's default pipeline")
    p.add_argument("--repeats", type=int, default=11)
    a = p.parse_args(argv)
    if a.small:
        a.dim, a.heads, a.seq, a.batch = 64, 4, 16, 2
    model, args = build_model(a.dim, a.heads, a.seq, a.batch)
    name = f"transformer block dim={a.dim} heads={a.heads} seq={a.seq} batch={a.batch}"
    return run_example(
        name, model, args, arm_target=not a.no_arm, do_bench=a.bench, repeats=a.repeats
    )


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["x86"]["ok"] else 1)
