"""The operations that act on every channel alike, as ``torch.fx`` records them.

Shared by the chain adapter (:mod:`fedfuse.models.adapter`), which keeps them as levels, and the
graph symmetry (:mod:`fedfuse.models.graph_symmetry`), which lets a feature space pass through
them unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: parameter-free modules that act on every channel alike (kept, one instance per use)
CHANNELWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Softplus,
    nn.Hardtanh, nn.Mish, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
    nn.Identity,
)  # fmt: skip
#: functional activations turned into modules (DeepLIFT sees module nonlinearities only)
ACTIVATION_FUNCTIONS: dict[Any, type[nn.Module]] = {
    F.relu: nn.ReLU, torch.relu: nn.ReLU, "relu": nn.ReLU,
    torch.sigmoid: nn.Sigmoid, F.sigmoid: nn.Sigmoid, "sigmoid": nn.Sigmoid,
    torch.tanh: nn.Tanh, F.tanh: nn.Tanh, "tanh": nn.Tanh,
    F.gelu: nn.GELU, F.silu: nn.SiLU, F.elu: nn.ELU, F.relu6: nn.ReLU6,
}  # fmt: skip
#: other channel-wise functions, applied as they are written (with their arguments)
CHANNELWISE_FUNCTIONS = frozenset(
    {F.leaky_relu, F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d,
     F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.dropout, F.dropout1d, F.dropout2d}
)  # fmt: skip
#: reshapes allowed as the flatten of ``(N, C, ...)`` into ``(N, C*...)`` before a Linear
FLATTENS = frozenset({torch.flatten, "flatten", "view", "reshape"})
