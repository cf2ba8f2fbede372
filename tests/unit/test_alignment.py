import pytest
import torch

from fedfuse.fusion.blocks.alignment import affine_levels, map_incoming, map_outgoing, permute_level
from fedfuse.models import build_model, mlp_spec, vgg11_spec


@pytest.mark.parametrize(
    "spec",
    [mlp_spec((1, 4, 4), 3, (8, 6)), vgg11_spec((1, 28, 28), 10, width_multiplier=1 / 16)],
    ids=["mlp", "vgg"],
)
def test_permuting_any_hidden_level_keeps_the_function(spec):
    model = build_model(spec, seed=0).eval()
    x = torch.randn(4, *spec.input_shape)
    before = model(x)
    for index in model.neuron_levels[:-1]:
        width = model.level_width(index)
        generator = torch.Generator().manual_seed(index)
        permute_level(model, index, torch.randperm(width, generator=generator))
    assert torch.allclose(model(x), before, atol=1e-5)
    with pytest.raises(ValueError, match="never permuted"):
        permute_level(model, model.neuron_levels[-1], torch.arange(spec.num_classes))


def test_duplicating_neurons_into_a_wider_level_keeps_the_function():
    model = build_model(mlp_spec((1, 4, 4), 3, (4,)), seed=0).eval()
    x = torch.randn(5, 1, 4, 4)
    before = model(x)
    views = affine_levels(model)
    # 6 new neurons: copies of old ones; the next level splits each old neuron's weight over
    # its copies, so the sum is unchanged
    up = torch.eye(4)[torch.tensor([0, 1, 2, 3, 0, 1])]  # (6, 4)
    map_outgoing(views[0], up)
    map_incoming(views[2], up / up.sum(0, keepdim=True), channels=4)
    assert views[0].layer.weight.shape == (6, 16) and views[2].layer.weight.shape == (3, 6)
    assert torch.allclose(model(x), before, atol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation"),
    [(3, 1, 1, 1), (3, 2, 0, 1), (2, 2, 1, 1), (3, 1, 2, 2)],
)
def test_conv_design_rows_reproduce_the_convolution(kernel, stride, padding, dilation):
    from fedfuse.models.affine import affine_view, output_rows

    conv = torch.nn.Conv2d(3, 5, kernel, stride=stride, padding=padding, dilation=dilation)
    view = affine_view(conv)
    x = torch.randn(2, 3, 9, 9)
    rows = view.design(x) @ view.weights()
    assert torch.allclose(rows, output_rows(conv(x)), atol=1e-5)
