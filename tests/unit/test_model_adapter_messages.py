"""ModelAdapter's one-line messages for a misused factory and an input shape the model does not
take (no torch.fx traceback on stderr)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedfuse.models import ModelAdapter


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(torch.flatten(F.max_pool2d(F.relu(self.conv1(x)), 2), 1))


def test_an_instance_as_factory_says_what_to_pass():
    with pytest.raises(TypeError, match=r"factory is a Net instance.*factory=Net"):
        ModelAdapter(Net(), (3, 14, 14))


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((1, 14, 14), r"'conv1' \(Conv2d\) expects 3 channels, got shape \[1, 14, 14\]"),
        ((3, 16, 16), r"'fc1' \(Linear\) expects 144 features, got 196"),
    ],
)
def test_a_wrong_input_shape_is_one_line_without_traceback(capfd, shape, expected):
    with pytest.raises(ValueError, match=expected) as error:
        ModelAdapter(Net, shape)
    message = str(error.value)
    assert "\n" not in message and f"input_shape {list(shape)}" in message
    assert "input_shape=" in message
    assert "Traceback" not in capfd.readouterr().err
