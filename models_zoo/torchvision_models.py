"""torchvision classification models, random init (``weights=None``), 1000 classes.

torchvision is imported when a model is built, not when the zoo is imported, so listing the zoo
stays fast. Inputs are 64x64 (32x32 is the smallest every one of them accepts; 64 keeps the last
feature maps 2x2), which keeps a CPU training step well under a second at batch 2.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fxopt.models_zoo.entry import ZooEntry, float_inputs, zoo_entry

IMAGE_SIZE = 64


def torchvision_builder(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision.models

        return getattr(torchvision.models, name)(weights=None)

    return build


def _entry(name: str, description: str, tags: tuple[str, ...]) -> ZooEntry:
    return zoo_entry(name, torchvision_builder(name), float_inputs(3, IMAGE_SIZE, IMAGE_SIZE),
                     default_batch=2,
                     description=f"torchvision {name}(weights=None), {description}; "
                                 f"input (B,3,{IMAGE_SIZE},{IMAGE_SIZE}) -> (B,1000)",
                     tags=("cnn", "batchnorm", "torchvision", *tags))


ENTRIES: tuple[ZooEntry, ...] = (
    _entry("resnet18", "basic residual blocks", ("branchy", "residual")),
    _entry("resnet50", "bottleneck residual blocks", ("branchy", "residual")),
    _entry("resnet152", "bottleneck residual blocks, 60M parameters; for solver-time benchmarks",
           ("branchy", "residual", "large")),
    _entry("mobilenet_v2", "inverted residuals with depthwise convs, ReLU6, dropout",
           ("branchy", "residual", "depthwise", "dropout")),
    _entry("densenet121", "dense blocks concatenating every earlier feature map",
           ("branchy", "dense_concat")),
)
