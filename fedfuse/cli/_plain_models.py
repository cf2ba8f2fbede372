"""Two plain ``nn.Module`` s as a user writes them, for ``fedfuse methods``' architecture
columns (apart from :mod:`fedfuse.cli.methods`, which the command line imports without
PyTorch)."""

from __future__ import annotations

from torch import nn


class _PlainChain(nn.Module):
    """A user's plain CNN (as in Flower's PyTorch template), for the architecture column."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        return self.fc(self.pool(self.conv(x).relu()).flatten(1))


class _PlainResidual(nn.Module):
    """A user's plain CNN with BatchNorm and a residual add, for the architecture column."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        x = self.bn1(self.conv1(x)).relu()
        x = (x + self.bn2(self.conv2(x))).relu()
        return self.fc(self.pool(x).flatten(1))
