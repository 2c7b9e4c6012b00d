"""Small hand-written networks: the PyTorch MNIST example, an MLP and two odd-shaped CNNs.

All are plain modules that torch.fx traces without leaf fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxopt.models_zoo.entry import ZooEntry, float_inputs, zoo_entry


class MnistNet(nn.Module):
    """The classic ``Net`` of PyTorch's MNIST example (functional relu, pooling and flatten)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def mlp() -> nn.Sequential:
    """Four Linear layers of decreasing, not-power-of-two widths, ReLU and dropout between them."""
    return nn.Sequential(
        nn.Linear(784, 300), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(300, 150), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(150, 75), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(75, 10),
    )


def _conv_bn_relu(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, stride=stride), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=False)]


def odd_channel_cnn() -> nn.Sequential:
    """Conv-BN-ReLU x3 with 30/60/100 channels (deliberately not multiples of 8), pool, Linear."""
    return nn.Sequential(
        *_conv_bn_relu(3, 30, 1),
        *_conv_bn_relu(30, 60, 2),
        *_conv_bn_relu(60, 100, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(100, 10),
    )


def grouped_cnn() -> nn.Sequential:
    """A grouped conv (groups=3, 6->12), a depthwise (groups=12) and a pointwise conv; BN, ReLU6."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU6(),
        nn.Conv2d(6, 12, 3, padding=1, groups=3), nn.BatchNorm2d(12), nn.ReLU6(),
        nn.Conv2d(12, 12, 3, padding=1, stride=2, groups=12), nn.BatchNorm2d(12), nn.ReLU6(),
        nn.Conv2d(12, 30, 1), nn.BatchNorm2d(30), nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(30, 10),
    )


ENTRIES: tuple[ZooEntry, ...] = (
    zoo_entry("mnist_net", MnistNet, float_inputs(1, 28, 28), default_batch=4,
              description="PyTorch MNIST example Net: 2 convs, max-pool, 2 dropouts, 2 linears, "
                          "log_softmax; input (B,1,28,28)",
              tags=("cnn", "dropout", "functional")),
    zoo_entry("mlp", mlp, float_inputs(784), default_batch=8,
              description="4-layer MLP 784-300-150-75-10 with ReLU and dropout; input (B,784)",
              tags=("mlp", "dropout")),
    zoo_entry("odd_channel_cnn", odd_channel_cnn, float_inputs(3, 32, 32), default_batch=4,
              description="3 conv-BN-ReLU blocks with 30/60/100 channels, avg-pool, Linear; "
                          "input (B,3,32,32)",
              tags=("cnn", "batchnorm", "odd_channels")),
    zoo_entry("grouped_cnn", grouped_cnn, float_inputs(3, 32, 32), default_batch=4,
              description="grouped (groups=3) and depthwise convs with BN and ReLU6; "
                          "input (B,3,32,32)",
              tags=("cnn", "batchnorm", "grouped_conv", "depthwise", "odd_channels")),
)
