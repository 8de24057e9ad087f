"""The model zoo of ``opsdk bench --zoo``: public architectures with random weights, no
downloads.

timm and transformers models (the ``zoo`` extra) are built from their configurations with
``pretrained=False``; the YOLOv8-style detector and the UNet are written by hand in torch
(:mod:`opsdk.bench._zoonets`). Every entry builds ``(eval-mode torch module, example args)``
with a fixed seed, so two runs compare the same weights and inputs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _zoonets

__all__ = ["FULL", "SMALL", "ZOO", "ZooModel", "select_zoo"]


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: ``build()`` returns ``(eval-mode torch module, example args)``;
    ``needs`` are the optional packages it imports (besides torch)."""

    name: str
    description: str
    build_fn: Callable[[], tuple[Any, tuple]] = field(repr=False)
    needs: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """The packages of ``needs`` that are not installed."""
        return [p for p in self.needs if importlib.util.find_spec(p) is None]

    def build(self) -> tuple[Any, tuple]:
        """The module and its example arguments (ImportError naming the extra when a needed
        package is missing)."""
        gone = self.missing()
        if gone:
            raise ImportError(f"needs {', '.join(gone)} (pip install 'opsdk[zoo]' "
                              "-c <(echo torch==2.13.0))")
        from ..frontend import prepare_model_imports  # heavy: TVM

        prepare_model_imports()  # as load_model does: timm / transformers beside a CPU torch
        return self.build_fn()


def _timm(arch: str, size: int) -> Callable[[], tuple[Any, tuple]]:
    def build() -> tuple[Any, tuple]:
        import timm  # heavy: timm
        import torch  # heavy: torch

        torch.manual_seed(0)
        model = timm.create_model(arch, pretrained=False).eval()
        return model, (torch.randn(1, 3, size, size),)

    return build


def _bert() -> tuple[Any, tuple]:
    import torch  # heavy: torch
    from transformers import BertConfig, BertModel  # heavy: transformers

    torch.manual_seed(0)
    # BERT-Small (L=4, H=512, A=8: the size of Google's bert_uncased_L-4_H-512_A-8), base vocab.
    cfg = BertConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                     intermediate_size=2048)
    return BertModel(cfg).eval(), (torch.randint(0, cfg.vocab_size, (1, 128)),)


def _mobilebert() -> tuple[Any, tuple]:
    import torch  # heavy: torch
    from transformers import MobileBertConfig, MobileBertModel  # heavy: transformers

    torch.manual_seed(0)
    # MobileBERT's default config: 24 layers, width 512 with 128-wide bottlenecks, 4 heads,
    # 4 stacked FFNs of 512, NoNorm (an elementwise affine) instead of LayerNorm.
    cfg = MobileBertConfig()
    return MobileBertModel(cfg).eval(), (torch.randint(0, cfg.vocab_size, (1, 128)),)


def _gpt2() -> tuple[Any, tuple]:
    import torch  # heavy: torch
    from transformers import GPT2Config, GPT2LMHeadModel  # heavy: transformers

    torch.manual_seed(0)
    # GPT-2 blocks at width 512 (4 layers, 8 heads), full 50257 vocabulary and tied LM head;
    # one prefill of a 64-token prompt, no KV cache returned.
    cfg = GPT2Config(n_embd=512, n_layer=4, n_head=8, n_positions=128, use_cache=False)
    return GPT2LMHeadModel(cfg).eval(), (torch.randint(0, cfg.vocab_size, (1, 64)),)


_ENTRIES = (
    ZooModel("mobilenet_v2", "timm mobilenetv2_100, 224x224", _timm("mobilenetv2_100", 224),
             ("timm",)),
    ZooModel("mobilenet_v3_large", "timm mobilenetv3_large_100 (hardswish, SE), 224x224",
             _timm("mobilenetv3_large_100", 224), ("timm",)),
    ZooModel("efficientnet_b1", "timm efficientnet_b1 (SiLU, SE, depthwise 5x5), 240x240",
             _timm("efficientnet_b1", 240), ("timm",)),
    ZooModel("resnet50", "timm resnet50, 224x224", _timm("resnet50", 224), ("timm",)),
    ZooModel("regnetx_002", "timm regnetx_002 (RegNetX-200MF: 3x3 convs in 8-wide groups), "
             "224x224", _timm("regnetx_002", 224), ("timm",)),
    ZooModel("rexnet_100", "timm rexnet_100 (channel counts like 38 / 27 / 61, SiLU, SE, "
             "depthwise), 224x224", _timm("rexnet_100", 224), ("timm",)),
    ZooModel("convnext_tiny", "timm convnext_tiny (depthwise 7x7, LayerNorm, GELU), 224x224",
             _timm("convnext_tiny", 224), ("timm",)),
    ZooModel("deit_small", "timm deit_small_patch16_224 (ViT-S/16, 197 tokens)",
             _timm("deit_small_patch16_224", 224), ("timm",)),
    ZooModel("bert_small", "transformers BertModel, L=4 H=512 A=8, 128 tokens", _bert,
             ("transformers",)),
    ZooModel("mobilebert", "transformers MobileBertModel, default config (24 layers, width 512, "
             "128 bottleneck, 4 heads, 4 FFNs, NoNorm), 128 tokens", _mobilebert,
             ("transformers",)),
    ZooModel("gpt2_prefill", "transformers GPT2LMHeadModel, 4 layers, width 512, 50257 vocab, "
             "64-token prefill", _gpt2, ("transformers",)),
    ZooModel("yolov8n", "YOLOv8n-style detector by hand (C2f, SPPF, DFL head), 320x320",
             lambda: _zoonets.yolov8(width=16, depth=1, size=320)),
    ZooModel("unet", "UNet by hand, 4 levels from 16 channels, transposed-conv up, 256x256",
             lambda: _zoonets.unet(base=16, depth=4, size=256)),
    # The small set: seconds to compile, for tests and a quick check of the tool.
    ZooModel("unet_tiny", "UNet by hand, 2 levels from 4 channels, nearest up, 32x32",
             lambda: _zoonets.unet(base=4, depth=2, size=32, up="nearest")),
    ZooModel("yolov8_tiny", "YOLOv8-style detector by hand at width 4, 64x64, 3 classes",
             lambda: _zoonets.yolov8(width=4, depth=1, size=64, classes=3)),
)

#: Every zoo model by name.
ZOO: dict[str, ZooModel] = {z.name: z for z in _ENTRIES}
#: The small set (``--zoo small``): tiny hand-written nets that compile in seconds.
SMALL = ("unet_tiny",)
#: The default set (``--zoo`` / ``--zoo all``): the real-size architectures.
FULL = tuple(n for n in ZOO if n not in ("unet_tiny", "yolov8_tiny"))


def select_zoo(spec: str | Sequence[str] | None) -> list[ZooModel]:
    """The zoo models named by ``spec``: None or ``"all"`` (every real-size model),
    ``"small"``, or names separated by commas (sets may be mixed in).

    Examples
    --------
    >>> from opsdk.bench._zoo import select_zoo
    >>> [z.name for z in select_zoo("small,resnet50")]
    ['unet_tiny', 'resnet50']
    """
    items = [spec] if isinstance(spec, str) or spec is None else list(spec)
    names: list[str] = []
    for item in items:
        for name in ("all" if item is None else item).split(","):
            name = name.strip()
            if not name:
                continue
            if name == "all":
                names += FULL
            elif name == "small":
                names += SMALL
            elif name in ZOO:
                names.append(name)
            else:
                raise ValueError(f"unknown zoo model {name!r}; choose from all, small, "
                                 f"{', '.join(ZOO)}")
    return [ZOO[n] for n in dict.fromkeys(names)]
