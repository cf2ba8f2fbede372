"""Grouping on many rows through the neurons' Gram: the same groups as on the columns themselves."""

import pytest
import torch

from fedfuse.fusion.blocks.costs import cluster_targets
from fedfuse.fusion.blocks.matching import linear_assignment
from fedfuse.fusion.methods.neuron_interpolation.grouping import (
    column_gram,
    gram_points,
    group_neurons,
    neuron_points,
    residual_labels,
)
from fedfuse.fusion.methods.neuron_interpolation.sublayers import group_targets
from fedfuse.models.affine import output_rows


def _feature_maps(generator, models=3, channels=5, samples=6):
    """Conv-like outputs ``(N, C, H, W)``: every model's channels are noisy copies of one set of
    five maps in another order, so each fused group holds one channel of each model."""
    shared = torch.randn(samples, channels, 7, 7, generator=generator, dtype=torch.float64)
    outputs = []
    for _ in range(models):
        order = torch.randperm(channels, generator=generator)
        noise = 0.05 * torch.randn(shared.shape, generator=generator, dtype=torch.float64)
        outputs.append((shared + noise)[:, order])
    return outputs


def _group(grouping):
    def group(points, weights, widths, k):
        return group_neurons(
            points,
            weights,
            widths,
            k,
            grouping=grouping,
            n_init=3,
            max_iter=50,
            tol=1e-6,
            seed=0,
            local_search_swaps=0,
        )

    return group


def test_gram_points_keep_every_inner_product_of_the_columns(generator):
    outputs = _feature_maps(generator)
    columns = torch.cat([output_rows(o) for o in outputs], 1)  # 294 rows, 15 columns
    points = gram_points(column_gram(outputs, chunk=4))
    assert points.shape[0] == 15 and points.shape[1] <= 15
    torch.testing.assert_close(points @ points.T, columns.T @ columns, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        torch.cdist(points, points), torch.cdist(columns.T, columns.T), rtol=1e-7, atol=1e-7
    )


def test_few_rows_are_grouped_on_the_columns_themselves(generator):
    outputs = [torch.randn(4, 6, generator=generator) for _ in range(2)]
    torch.testing.assert_close(neuron_points(outputs), torch.cat(outputs, 1).T)


@pytest.mark.parametrize("grouping", ["kmeans", "hungarian"])
def test_groups_and_targets_are_those_of_the_columns(grouping, generator):
    outputs = [o.float() for o in _feature_maps(generator)]
    rows = [output_rows(o) for o in outputs]
    weights = torch.rand(15, generator=generator) + 0.5
    labels, targets = group_targets(rows, weights, 5, None, _group(grouping))
    columns = torch.cat(rows, 1)
    direct = _group(grouping)(columns.T.contiguous(), weights, [5, 5, 5], 5)
    assert torch.equal(labels, direct)
    for m in range(3):  # one channel of every model in each group
        assert sorted(labels[5 * m : 5 * (m + 1)].tolist()) == list(range(5))
    torch.testing.assert_close(targets, cluster_targets(columns, labels, weights, 5))


def test_residual_groups_are_numbered_like_the_stream_they_add_to(generator):
    outputs = [o.float() for o in _feature_maps(generator, models=2)]
    stream = outputs[0][:, torch.tensor([3, 0, 4, 1, 2])] + 0.01
    weights = torch.ones(10)
    labels = residual_labels(stream, outputs, weights, [5, 5], 5, _group("kmeans"))
    # fused channel j is the group closest to stream channel j: the direct computation
    rows = torch.cat([output_rows(o) for o in outputs], 1)
    grouped = _group("kmeans")(rows.T.contiguous(), weights, [5, 5], 5)
    centres = cluster_targets(rows, grouped, weights, 5)
    cost = torch.cdist(output_rows(stream).T.double(), centres.T.double()).pow(2)
    order = linear_assignment(cost)
    expected = torch.empty_like(order)
    expected[order] = torch.arange(5)
    assert torch.equal(labels, expected[grouped])
    # model 0's channel c sits in stream channel where the permutation put it
    assert labels[:5].tolist() == [1, 3, 4, 0, 2]
