"""A small U-Net with a hypercolumn head: long skip connections and many-input concatenations.

Encoder: three levels of two conv-BN-ReLU layers (8, 16, 32 channels) with 2x max-pool between
them, then a 64-channel bottleneck. Decoder: upsample (bilinear at two levels, a transposed conv
at one), concatenate with the encoder feature map of the same resolution, conv-BN-ReLU. Head: the
decoder maps of all three levels are upsampled to full resolution, concatenated and mixed by a
1x1 conv. Input height and width must be divisible by 8.
"""

from __future__ import annotations

import torch
from torch import nn

from fxopt.models_zoo.entry import ZooEntry, float_inputs, zoo_entry

ENCODER_WIDTHS = (8, 16, 32)
BOTTLENECK_WIDTH = 64


def double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
    )


def bilinear_up(factor: int) -> nn.Upsample:
    return nn.Upsample(scale_factor=factor, mode="bilinear", align_corners=False)


class HypercolumnUNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 2) -> None:
        super().__init__()
        w1, w2, w3 = ENCODER_WIDTHS
        self.enc1 = double_conv(in_channels, w1)
        self.enc2 = double_conv(w1, w2)
        self.enc3 = double_conv(w2, w3)
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = double_conv(w3, BOTTLENECK_WIDTH)

        self.up3 = nn.ConvTranspose2d(BOTTLENECK_WIDTH, w3, 2, stride=2)
        self.dec3 = double_conv(w3 + w3, w3)
        self.up2 = bilinear_up(2)
        self.dec2 = double_conv(w3 + w2, w2)
        self.up1 = bilinear_up(2)
        self.dec1 = double_conv(w2 + w1, w1)

        self.column3 = bilinear_up(4)
        self.column2 = bilinear_up(2)
        self.head = nn.Conv2d(w3 + w2 + w1, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip1 = self.enc1(x)
        skip2 = self.enc2(self.pool(skip1))
        skip3 = self.enc3(self.pool(skip2))
        bottom = self.bottleneck(self.pool(skip3))

        dec3 = self.dec3(torch.cat([self.up3(bottom), skip3], dim=1))
        dec2 = self.dec2(torch.cat([self.up2(dec3), skip2], dim=1))
        dec1 = self.dec1(torch.cat([self.up1(dec2), skip1], dim=1))

        hypercolumn = torch.cat([self.column3(dec3), self.column2(dec2), dec1], dim=1)
        return self.head(hypercolumn)


ENTRIES: tuple[ZooEntry, ...] = (
    zoo_entry("unet", HypercolumnUNet, float_inputs(3, 64, 64), default_batch=2,
              description="U-Net, 3 encoder levels + bottleneck, skip concats, hypercolumn head; "
                          "input (B,3,64,64) -> (B,2,64,64)",
              tags=("cnn", "batchnorm", "branchy", "unet", "upsample")),
)
