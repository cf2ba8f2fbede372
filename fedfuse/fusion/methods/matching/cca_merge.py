r"""CCA Merge (Horoi et al., ICML 2024): align models by canonical correlation, then average.

Permutation alignment (Git Re-Basin, OTFusion) assumes that a neuron of one model has a
counterpart in the other. Models trained from different initialisations spread a feature over
several neurons, so CCA Merge aligns them by an invertible linear map instead, the one under
which the models' neurons are maximally correlated on data.

For a hidden level with outputs ``Z_0`` (the reference, model 0) and ``Z_k`` (``n x d``: its
pre-activations on the fusion set, one row per sample and spatial position, centred), with
covariances ``S_00``, ``S_kk`` (each plus ``epsilon`` times its mean eigenvalue on the
diagonal) and ``S_0k``, canonical correlation analysis gives

    ``S_00^{-1/2} S_0k S_kk^{-1/2} = U diag(rho) V^T``,
    ``P_0 = S_00^{-1/2} U``, ``P_k = S_kk^{-1/2} V``,

so ``Z_0 P_0`` and ``Z_k P_k`` are white and correlated pairwise by ``rho``. Model ``k``'s
neurons are carried into the reference's basis by ``T_k = P_k P_0^{-1}`` (``Z_k T_k`` has the
canonical variables of ``Z_k`` where ``Z_0`` has its own): the level's weights become
``W_k T_k`` (``W`` as ``fan_in x d``, the bias its last row) and the next level reads its
inputs through ``T_k^{-1}`` (for each input channel's block of positions after flattening, or
of patch entries in a convolution). A permuted copy has ``T_k`` the permutation, and the
aligned model is the reference exactly; for any other ``T_k`` the ReLU between the levels does
not commute with it, which the paper accepts. Where the fusion set has fewer rows than a
level has neurons (400 samples, 512 neurons), the directions it does not measure have
canonical correlation 0 and are carried arbitrarily: no ridge can align what the data does not
show, a limit of CCA Merge on small fusion sets. Levels are aligned bottom-up, each on the
outputs of the already aligned model ``k``; every model is aligned to model 0 (the paper's
all-to-one alignment for ``N`` models), then all are averaged; the classifier's outputs (the
classes) are not transformed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from fedfuse.fusion.base import FusionInputs, FusionMethod
from fedfuse.fusion.blocks.alignment import affine_levels
from fedfuse.fusion.blocks.selection import fuse_with_option
from fedfuse.fusion.registry import register_fusion_method
from fedfuse.models import LeveledModel, ModelSpec
from fedfuse.models.affine import AffineLevel, channel_blocks, output_rows
from fedfuse.runtime import resolve_device

log = logging.getLogger(__name__)

#: the covariance ridges ``epsilon="auto"`` chooses from, by fusion-set accuracy
EPSILON_GRID = (0.01, 0.1, 1.0, 10.0)
#: the ridge ``"auto"`` takes without fusion-set labels
UNLABELLED = 1.0


def canonical_map(reference: torch.Tensor, other: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``T`` (``d x d``, float64) carrying ``other``'s columns into ``reference``'s basis by
    regularised CCA (module docstring); both are rows ``(n, d)`` of the same samples."""
    x = reference.double() - reference.double().mean(0)
    y = other.double() - other.double().mean(0)
    rows = max(1, len(x) - 1)
    s_xx, s_yy, s_xy = x.T @ x / rows, y.T @ y / rows, x.T @ y / rows

    def inverse_root(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, vectors = torch.linalg.eigh(cov)
        floor = epsilon * float(values.clamp_min(0).mean().clamp_min(1e-12))
        values = values.clamp_min(0) + floor
        return (vectors / values.sqrt()) @ vectors.T, (vectors * values.sqrt()) @ vectors.T

    x_inv, x_root = inverse_root(s_xx)
    y_inv, _ = inverse_root(s_yy)
    u, _, vh = torch.linalg.svd(x_inv @ s_xy @ y_inv)
    p_other = y_inv @ vh.T
    # P_x^{-1} = U^T S_xx^{1/2}
    return p_other @ (u.T @ x_root)


def _outputs(model: LeveledModel, index: int, data: torch.Tensor, batch: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [
                output_rows(model.forward_levels(data[i : i + batch], 0, index + 1))
                for i in range(0, len(data), batch)
            ]
        )


def _carry_outputs(view: AffineLevel, transform: torch.Tensor) -> None:
    """The level's outputs times ``transform`` (``W <- W T``, its bias row included)."""
    view.set_weights(view.weights().double() @ transform)


def _carry_inputs(view: AffineLevel, inverse: torch.Tensor) -> None:
    """The level reads inputs ``h T`` as it read ``h``: each input channel's block of design
    columns (positions after a flatten, patch entries in a convolution) mixed by ``T^{-1}``."""
    weights = view.weights().double()
    inputs = len(weights) - 1
    per_channel = inputs // len(inverse)
    if per_channel * len(inverse) != inputs:
        raise ValueError(
            f"{view.layer} has {inputs} inputs, not a multiple of {len(inverse)} channels"
        )
    mix = channel_blocks(inverse, per_channel)
    weights[:inputs] = mix @ weights[:inputs]
    view.set_weights(weights)


@register_fusion_method
class CCAMerge(FusionMethod):
    """CCA Merge: each model's hidden levels carried into model 0's basis by the linear map
    of regularised canonical correlation analysis on the fusion set, then averaged (module
    docstring). Affine levels (MLPs, plain CNNs, VGG without BatchNorm); any number of models.

    Args:
        epsilon: ridge of each covariance, relative to its mean eigenvalue (keeps ``T``
            invertible where the fusion set has fewer rows than neurons, or dead or collinear
            ones); ``"auto"``: the one of :data:`EPSILON_GRID` that
            :func:`~fedfuse.fusion.blocks.selection.best_on_fusion_set` keeps, by fusion-set
            accuracy, :data:`UNLABELLED` preferred (and taken without labels). Large ridges
            tend to orthogonal Procrustes alignment (``T`` the rotation closest to the
            cross-covariance).
        device: where the features are computed (``"auto"``: CUDA when available).
        batch_size: samples per forward pass.
    """

    name = "cca-merge"
    requires = frozenset({"data"})
    needs_affine_levels = True

    def __init__(
        self, epsilon: float | str = "auto", *, device: str = "auto", batch_size: int = 256
    ) -> None:
        if epsilon != "auto" and not (isinstance(epsilon, int | float) and epsilon > 0):
            raise ValueError(f"{self.name}: epsilon must be 'auto' or > 0, got {epsilon!r}")
        self.epsilon = epsilon
        self.device = device
        self.batch_size = batch_size

    def needs(self) -> frozenset[str]:
        return self.requirements() | ({"labels"} if self.epsilon == "auto" else set())

    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        data = inputs.data
        assert data is not None  # a requirement
        return fuse_with_option(
            self.name,
            "epsilon",
            self.epsilon,
            lambda epsilon: self._aligned_mean(models, data, epsilon),
            grid=EPSILON_GRID,
            unlabelled=UNLABELLED,
            inputs=inputs,
        )

    def _aligned_mean(
        self, models: list[LeveledModel], data: torch.Tensor, epsilon: float
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """Every model aligned to model 0 with covariance ridge ``epsilon``, averaged."""
        device = resolve_device(self.device)
        data = data.to(device)
        reference = copy.deepcopy(models[0]).to(device).eval()
        hidden = reference.neuron_levels[:-1]
        references = {i: _outputs(reference, i, data, self.batch_size) for i in hidden}
        aligned = [reference]
        correlations: dict[str, list[float]] = {}
        for number, model in enumerate(models[1:], start=1):
            moved = copy.deepcopy(model).to(device).eval()
            views = affine_levels(moved)
            levels = moved.neuron_levels
            for position, index in enumerate(hidden):
                own = _outputs(moved, index, data, self.batch_size)
                transform = canonical_map(references[index], own, epsilon).to(device)
                _carry_outputs(views[index], transform)
                _carry_inputs(views[levels[position + 1]], torch.linalg.inv(transform))
                fit = _outputs(moved, index, data, self.batch_size)
                correlations.setdefault(str(number), []).append(
                    _mean_correlation(references[index], fit)
                )
            aligned.append(moved)
        fused = copy.deepcopy(reference)
        with torch.no_grad():
            for name, tensor in fused.state_dict().items():
                if tensor.is_floating_point():
                    mean = sum(m.state_dict()[name].double() for m in aligned) / len(aligned)
                    tensor.copy_(mean.to(tensor.dtype))
        details = {"aligned_to": 0, "epsilon": epsilon, "correlation": correlations}
        return fused.cpu(), details


def _mean_correlation(reference: torch.Tensor, aligned: torch.Tensor) -> float:
    """Mean Pearson correlation of each reference neuron with the aligned model's same neuron."""
    x = reference.double() - reference.double().mean(0)
    y = aligned.double() - aligned.double().mean(0)
    norms = (x.norm(dim=0) * y.norm(dim=0)).clamp_min(1e-12)
    return float(((x * y).sum(0) / norms).mean())


__all__ = ["CCAMerge", "canonical_map"]
