"""torchvision and timm entries: CNNs, vision transformers and segmentation heads, random weights.

Each builds the library's own model code (``weights=None``; for ViT and Swin the library's
classes at a small width and depth) and exports it with a dynamic batch at 64x64 pixels.
"""

from __future__ import annotations

from typing import Any

from corpus import _compat
from corpus._torch import image_entry
from corpus.harness import Entry

TV = ("torchvision",)
TIMM = ("torchvision", "timm")


def _tv(name: str, **kwargs: Any) -> Any:
    def build() -> Any:
        return getattr(_compat.torchvision().models, name)(weights=None, **kwargs)

    return build


def _tv_seg(name: str, **kwargs: Any) -> Any:
    def build() -> Any:
        tv = _compat.torchvision()
        return getattr(tv.models.segmentation, name)(weights=None, weights_backbone=None, **kwargs)

    return build


def _vit() -> Any:
    tv = _compat.torchvision()
    import torch

    model = tv.models.vision_transformer.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )
    # torchvision starts the head at zero (for fine-tuning): all-zero logits would compare
    # equal whatever the engine computed, so give it random weights like the rest.
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def _swin() -> Any:
    tv = _compat.torchvision()
    return tv.models.swin_transformer.SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2, 2, 2], num_heads=[2, 4, 8, 16],
        window_size=[4, 4], stochastic_depth_prob=0.0,
    )  # fmt: skip


def _timm(name: str, **kwargs: Any) -> Any:
    def build() -> Any:
        return _compat.timm().create_model(name, pretrained=False, **kwargs)

    return build


ENTRIES: tuple[Entry, ...] = (
    image_entry("tv-resnet50", "torchvision", _tv("resnet50"), packages=TV),
    image_entry("tv-mobilenet_v3_small", "torchvision", _tv("mobilenet_v3_small"), packages=TV),
    image_entry("tv-efficientnet_b0", "torchvision", _tv("efficientnet_b0"), packages=TV),
    image_entry("tv-regnet_y_400mf", "torchvision", _tv("regnet_y_400mf"), packages=TV),
    image_entry("tv-convnext_tiny", "torchvision", _tv("convnext_tiny"), packages=TV),
    image_entry("tv-densenet121", "torchvision", _tv("densenet121"), packages=TV),
    image_entry("tv-shufflenet_v2_x0_5", "torchvision", _tv("shufflenet_v2_x0_5"), packages=TV),
    image_entry("tv-squeezenet1_1", "torchvision", _tv("squeezenet1_1"), packages=TV),
    image_entry("tv-mnasnet0_5", "torchvision", _tv("mnasnet0_5"), packages=TV),
    image_entry("tv-vit", "torchvision", _vit, packages=TV,
                about="VisionTransformer, 2 layers x 64 wide, 16px patches, 64x64 images"),
    image_entry("tv-swin", "torchvision", _swin, packages=TV,
                about="SwinTransformer, depths 2-2-2-2, 32 wide, window 4, 64x64 images"),
    image_entry("tv-lraspp_mobilenet_v3", "torchvision",
                _tv_seg("lraspp_mobilenet_v3_large", num_classes=8), packages=TV,
                about="LR-ASPP segmentation head on MobileNetV3-Large, 8 classes, 64x64"),
    image_entry("tv-deeplabv3_mobilenet_v3", "torchvision",
                _tv_seg("deeplabv3_mobilenet_v3_large", num_classes=8, aux_loss=False),
                packages=TV, about="DeepLabV3 segmentation head on MobileNetV3-Large, 64x64"),
    image_entry("tv-fcn_resnet50", "torchvision",
                _tv_seg("fcn_resnet50", num_classes=8, aux_loss=False), packages=TV,
                about="FCN segmentation head on ResNet-50, 8 classes, 64x64"),
    image_entry("timm-resnet10t", "timm", _timm("resnet10t"), packages=TIMM),
    image_entry("timm-efficientnet_lite0", "timm", _timm("efficientnet_lite0"), packages=TIMM),
    image_entry("timm-deit_tiny", "timm", _timm("deit_tiny_patch16_224", img_size=64),
                packages=TIMM, about="DeiT-Tiny (12 layers, 192 wide) at 64x64"),
    image_entry("timm-convnext_atto", "timm", _timm("convnext_atto"), packages=TIMM),
    image_entry("timm-mobilevit_xxs", "timm", _timm("mobilevit_xxs"), packages=TIMM),
)  # fmt: skip
