"""The zoo's torchvision and timm image classifiers (ten classes, ``IMAGE`` x ``IMAGE`` inputs).

BatchNorm stays on (its running statistics are buffers DDP broadcasts from rank 0 every step);
dropout and stochastic depth are off.
"""

from __future__ import annotations

from typing import Any, Callable

from bucketwise.benchmarks.zoo.spec import CLASSES, Built, ZooModel, images, labels, logits_loss, no_dropout

GPU_BATCH, GPU_IMAGE = 8, 64
"""Inputs of the one-GPU runs. With ``BATCH`` 2 images of ``IMAGE`` 32 pixels, a ResNet's last
BatchNorms normalize two values per channel (1 x 1 maps): their gradients then hang on the
difference of two nearly equal numbers, and Inductor's round-off alone (``local``) moves one
step's update by more than the update (NOTE [checking a config step by step] in zoo/speed.py)."""


def classifier(make: Callable[[], Any]) -> Callable[[], Built]:
    def build() -> Built:
        module = no_dropout(make())
        return Built(
            module=module,
            loss=logits_loss,
            batch=lambda r, s: {"x": images(r, s), "_labels": labels(r, s)},
            gpu_batch=lambda r, s: {
                "x": images(r, s, side=GPU_IMAGE, batch=GPU_BATCH),
                "_labels": labels(r, s, batch=GPU_BATCH),
            },
        )

    return build


def _tv() -> Any:
    import torchvision.models as models

    return models


def resnet50() -> Any:
    return _tv().resnet50(num_classes=CLASSES)


def resnet18() -> Any:
    return _tv().resnet18(num_classes=CLASSES)


def convnext() -> Any:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    blocks = [CNBlockConfig(32, 64, 1), CNBlockConfig(64, 128, 1), CNBlockConfig(128, None, 1)]
    return ConvNeXt(blocks, stochastic_depth_prob=0.0, num_classes=CLASSES)


def efficientnet() -> Any:
    return _tv().efficientnet_b0(num_classes=CLASSES, dropout=0.0, stochastic_depth_prob=0.0)


def swin() -> Any:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=32,
        depths=[1, 1, 1, 1],
        num_heads=[1, 2, 4, 8],
        window_size=[2, 2],
        stochastic_depth_prob=0.0,
        num_classes=CLASSES,
    )


def mobilenet() -> Any:
    return _tv().mobilenet_v3_small(num_classes=CLASSES, dropout=0.0)


def timm_model(name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)

    return make


TV = ("torchvision",)


def _tvm(name: str, source: str, make: Callable[[], Any], **kw: Any) -> ZooModel:
    return ZooModel(name=name, family="torchvision", source=source, build=classifier(make), needs=TV, **kw)


MODELS = [
    _tvm("resnet50", "resnet50(num_classes=10)", resnet50),
    _tvm("convnext", "ConvNeXt, 3 stages of 1 block (32, 64, 128 channels)", convnext),
    _tvm("efficientnet-b0", "efficientnet_b0(num_classes=10)", efficientnet),
    _tvm("swin", "SwinTransformer, embed 32, depths 1-1-1-1, window 2", swin),
    _tvm("mobilenet-v3", "mobilenet_v3_small(num_classes=10)", mobilenet),
    ZooModel(
        name="timm-vit",
        family="timm",
        source="timm vit_tiny_patch16_224 (img_size 32, patch 8, depth 2)",
        build=classifier(timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2)),
        needs=("timm",),
    ),
    ZooModel(
        name="timm-regnety",
        family="timm",
        source="timm regnety_002",
        build=classifier(timm_model("regnety_002")),
        needs=("timm",),
    ),
    ZooModel(
        name="batchnorm-cudagraphs",
        family="case",
        source="resnet18(num_classes=10), cudagraphs=True",
        build=classifier(resnet18),
        needs=TV,
        gpu_only="CUDA graphs need a GPU",
    ),
]
