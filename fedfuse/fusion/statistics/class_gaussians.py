r"""A skewed fusion set completed from the sites' class-conditional Gaussians (one upload).

The paper's fusion set is drawn from one site, so on class-sharded or Dirichlet sites it shows
little or nothing of the other sites' data, and every fit on it (neuron interpolation's levels,
their grouping, the trust routing of ``kf-trust``) sees only part of what the fused model must
do. BatchNorm inversion (:mod:`fedfuse.fusion.inversion`) completes it for models that carry
their data's statistics; this module completes it for *any* model, from a small summary each
site computes on its own training data and uploads once, beside its weights: for every class
:math:`c` it holds, the count :math:`n_c`, the mean :math:`\mu_c` of its inputs and a
probabilistic-PCA model of their covariance (Tipping & Bishop, "Probabilistic Principal
Component Analysis", JRSS-B 1999):

.. math::

    x \mid c \;\sim\; \mathcal N\big(\mu_c,\; W_c W_c^\top + \sigma_c^2 I\big),\qquad
    W_c = V_r\,(\Lambda_r - \sigma_c^2 I)^{1/2},\qquad
    \sigma_c^2 = \frac{1}{d-r}\sum_{j>r} \lambda_j,

the maximum-likelihood fit of rank :math:`r`: :math:`\lambda_1 \ge \dots \ge \lambda_d` and
:math:`V` are the eigenvalues and eigenvectors of the class's sample covariance (``n - 1`` in
the denominator), the top :math:`r` directions kept exactly and the rest replaced by isotropic
noise of the same total variance. With :math:`r \ge d` it is the sample covariance itself. A
site uploads :math:`(r + 1)\,d + 2` numbers per class (:attr:`ClassGaussians.nbytes`): at the
default rank 64, 0.2 MB per class of a 28x28 image, about the weights of a small CNN for ten
classes.

The server draws ``samples`` rows per site, spread over its classes by their counts and labelled
with them, and appends them to the real fusion set, which comes first and unchanged
(:class:`GaussianFusionSet`). The rows are not images; what they give the fits is each site's
first and second moments per class, in the input space every model reads, so the linear fits
of the first levels see each site's input covariance (what RegMean's Grams give a first level),
and the label-routed targets of ``kf-trust`` see rows of every class a site holds.

Privacy: a class mean is an average image of the site's class, and the principal directions
describe its variation. That is more than RegMean's pooled Gram (which mixes the classes) says,
so the upload is opt-in (``fusion_set.gaussian_samples``), and a site should hold enough
samples per class for an average to reveal no single record.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from fedfuse.fusion.base import FusionMethod
from fedfuse.fusion.inputs import FusionInputs

log = logging.getLogger(__name__)

#: the tensors of one site's upload, by key (:meth:`ClassGaussians.to_tensors`)
TENSOR_KEYS = ("counts", "means", "factors", "noise")


@dataclass(frozen=True)
class ClassGaussians:
    """One site's class-conditional Gaussians (module docstring): a rank-``r`` PPCA per class.

    Attributes:
        counts: ``(C,)`` int64, the site's training samples per class (0: a class it lacks).
        means: ``(C, d)`` class means of the flattened inputs (zeros where the count is 0).
        factors: ``(C, d, r)`` the PPCA loadings :math:`W_c` (columns: principal directions
            scaled by :math:`\\sqrt{\\lambda_j - \\sigma_c^2}`).
        noise: ``(C,)`` the isotropic variances :math:`\\sigma_c^2` of the other directions.
        input_shape: the shape of one input (e.g. ``(1, 28, 28)``), ``d`` its product.
    """

    counts: torch.Tensor
    means: torch.Tensor
    factors: torch.Tensor
    noise: torch.Tensor
    input_shape: tuple[int, ...]

    @property
    def classes(self) -> int:
        return int(self.counts.shape[0])

    @property
    def rank(self) -> int:
        return int(self.factors.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the upload (every tensor as stored)."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    def covariance(self, label: int) -> torch.Tensor:
        """The model's covariance ``W W^T + sigma^2 I`` of class ``label`` (float64, ``d x d``)."""
        factor = self.factors[label].double()
        eye = torch.eye(factor.shape[0], dtype=torch.float64)
        return factor @ factor.T + float(self.noise[label]) * eye

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The upload as named tensors (safetensors / Flower ``ArrayRecord``), keys
        :data:`TENSOR_KEYS`; :meth:`from_tensors` reads them back."""
        return {
            "counts": self.counts,
            "means": self.means,
            "factors": self.factors,
            "noise": self.noise,
        }

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        input_shape: Sequence[int],
        *,
        num_classes: int | None = None,
        source: str = "the upload",
    ) -> ClassGaussians:
        """Read and check an upload (untrusted): every key present, consistent shapes for
        inputs of ``input_shape`` (and ``num_classes`` classes when given), finite values,
        non-negative counts and variances. A ValueError names ``source`` and the tensor."""
        missing = [key for key in TENSOR_KEYS if key not in tensors]
        if missing:
            raise ValueError(f"{source}: class Gaussians lack tensor(s) {missing}")
        unknown = sorted(set(tensors) - set(TENSOR_KEYS))
        if unknown:
            raise ValueError(f"{source}: class Gaussians have unknown tensor(s) {unknown}")
        counts, means, factors, noise = (torch.as_tensor(tensors[key]) for key in TENSOR_KEYS)
        shape = tuple(int(s) for s in input_shape)
        dim = math.prod(shape)
        classes = int(counts.shape[0]) if counts.ndim == 1 else -1
        expected = {
            "counts": (classes,),
            "means": (classes, dim),
            "factors": (classes, dim, factors.shape[-1] if factors.ndim == 3 else -1),
            "noise": (classes,),
        }
        for key, tensor in zip(TENSOR_KEYS, (counts, means, factors, noise), strict=True):
            if classes < 0 or tuple(tensor.shape) != expected[key]:
                raise ValueError(
                    f"{source}: class Gaussians tensor {key!r} has shape {tuple(tensor.shape)}, "
                    f"expected {expected[key]} for {classes} classes of inputs {shape}"
                )
        if num_classes is not None and classes != num_classes:
            raise ValueError(f"{source}: class Gaussians for {classes} classes, need {num_classes}")
        if counts.dtype.is_floating_point or counts.dtype == torch.bool:
            raise ValueError(f"{source}: class Gaussians tensor 'counts' must be integers")
        for key, tensor in (("means", means), ("factors", factors), ("noise", noise)):
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"{source}: class Gaussians tensor {key!r} must be floating point")
            if not torch.isfinite(tensor).all():
                raise ValueError(f"{source}: class Gaussians tensor {key!r} has NaN or Inf values")
        if (counts < 0).any() or (noise < 0).any():
            raise ValueError(f"{source}: class Gaussians have negative counts or variances")
        if int(counts.sum()) <= 0:
            raise ValueError(f"{source}: class Gaussians describe no sample (every count is 0)")
        return cls(counts.long(), means.float(), factors.float(), noise.float(), shape)

    def sample(self, rows: int, *, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` inputs drawn from the mixture, spread over the classes by their counts
        (largest remainder), and their labels; inputs shaped ``(rows, *input_shape)``."""
        per_class = allocate(rows, self.counts)
        data, labels = [], []
        for label in per_class.nonzero().flatten().tolist():
            n = int(per_class[label])
            factor = self.factors[label].double()
            low = torch.randn(n, factor.shape[1], generator=generator, dtype=torch.float64)
            iso = torch.randn(n, factor.shape[0], generator=generator, dtype=torch.float64)
            x = self.means[label].double() + low @ factor.T + math.sqrt(self.noise[label]) * iso
            data.append(x.float())
            labels.append(torch.full((n,), label, dtype=torch.int64))
        if not data:
            return torch.empty(0, *self.input_shape), torch.empty(0, dtype=torch.int64)
        return torch.cat(data).reshape(-1, *self.input_shape), torch.cat(labels)


def allocate(rows: int, counts: torch.Tensor) -> torch.Tensor:
    """``rows`` split in proportion to ``counts`` by largest remainder (ties to the lower
    class): integers that sum to ``rows``, 0 wherever a count is 0."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    if rows <= 0 or counts.sum() <= 0:
        return torch.zeros(len(counts), dtype=torch.int64)
    exact = rows * counts / counts.sum()
    whole = exact.floor().long()
    left = rows - int(whole.sum())
    order = sorted(range(len(counts)), key=lambda c: (-(float(exact[c] - whole[c])), c))
    for c in order[:left]:
        whole[c] += 1
    return whole


def fit_class_gaussians(
    inputs: torch.Tensor, labels: torch.Tensor, num_classes: int, *, rank: int = 64
) -> ClassGaussians:
    """A site's upload: the rank-``rank`` PPCA of its inputs' distribution in each class
    (module docstring); computed in float64 from the class's covariance (``d x d``).

    A class of one sample has its mean and no variance; a class the site lacks is all zeros
    with count 0.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if len(inputs) != len(labels):
        raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
    labels = torch.as_tensor(labels).long()
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]"
        )
    shape = tuple(inputs.shape[1:])
    flat = inputs.reshape(len(inputs), -1)
    dim = flat.shape[1]
    kept = min(rank, dim)
    counts = torch.bincount(labels, minlength=num_classes)
    means = torch.zeros(num_classes, dim)
    factors = torch.zeros(num_classes, dim, kept)
    noise = torch.zeros(num_classes)
    for label in counts.nonzero().flatten().tolist():
        x = flat[labels == label].double()
        mean = x.mean(0)
        means[label] = mean.float()
        if len(x) < 2:
            continue
        centred = x - mean
        values, vectors = top_principal_components(centred, kept)
        total = float(centred.square().sum()) / (len(x) - 1)
        rest = max(total - float(values.sum()), 0.0)
        sigma2 = rest / (dim - kept) if kept < dim else 0.0
        scale = (values - sigma2).clamp_min(0).sqrt()
        factors[label, :, : len(values)] = (vectors * scale).float()
        noise[label] = sigma2
    return ClassGaussians(counts, means, factors, noise, shape)


def top_principal_components(
    centred: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` largest eigenvalues (descending) and unit eigenvectors ``(d, count)`` of
    the sample covariance ``C^T C / (n - 1)`` of the centred rows ``C`` (``n x d``), through
    the smaller of the ``d x d`` covariance and the ``n x n`` Gram; fewer than ``count``
    where the covariance has lower rank than that (the rest are zero)."""
    rows, dim = centred.shape
    if dim <= rows:
        values, vectors = torch.linalg.eigh(centred.T @ centred / (rows - 1))
    else:  # C C^T u = l u  =>  C^T C (C^T u) = l (C^T u), |C^T u| = sqrt(l)
        values, gram_vectors = torch.linalg.eigh(centred @ centred.T / (rows - 1))
        positive = values > values.max().clamp_min(0) * 1e-12
        values, gram_vectors = values[positive], gram_vectors[:, positive]
        vectors = centred.T @ gram_vectors / (values * (rows - 1)).sqrt()
    values, vectors = values.flip(0)[:count].clamp_min(0), vectors.flip(1)[:, :count]
    return values, vectors


@dataclass
class GaussianFusionSet:
    """The fusion set completed with ``samples`` rows per site drawn from its
    :class:`ClassGaussians` (module docstring), labelled with their classes.

    Args:
        samples: rows per site (0: the real set unchanged).
        rank: the PPCA rank a site fits (:func:`fit_class_gaussians`).
        seed: the draws' seed (site ``k`` draws from ``seed + k``).
    """

    samples: int = 400
    rank: int = 64
    seed: int = 0
    #: wall seconds of the last completion (None before one)
    seconds: float | None = None

    def complete(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None,
        gaussians: Sequence[ClassGaussians],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The real rows ``(inputs, labels)`` followed by each site's drawn rows; unlabelled
        real rows (``labels`` None) give unlabelled rows."""
        if self.samples <= 0:
            return inputs, labels
        started = time.perf_counter()
        rows, targets = [inputs], [labels if labels is not None else torch.empty(0).long()]
        for k, site in enumerate(gaussians):
            if site.input_shape != tuple(inputs.shape[1:]):
                raise ValueError(
                    f"site {k}: class Gaussians of inputs {site.input_shape}, but the fusion set's "
                    f"are {tuple(inputs.shape[1:])}"
                )
            generator = torch.Generator().manual_seed(self.seed + k)
            data, drawn = site.sample(self.samples, generator=generator)
            rows.append(data.to(inputs.dtype))
            targets.append(drawn)
        self.seconds = time.perf_counter() - started
        log.info(
            "fusion set completed with %d Gaussian rows per site (%d sites) in %.2f s",
            self.samples,
            len(gaussians),
            self.seconds,
        )
        return torch.cat(rows), None if labels is None else torch.cat(targets).to(labels.dtype)

    def complete_inputs(
        self, inputs: FusionInputs, gaussians: Sequence[ClassGaussians]
    ) -> FusionInputs:
        """``inputs`` with their fusion set completed (:meth:`complete`); unchanged without
        a fusion set."""
        if inputs.data is None:
            return inputs
        data, labels = self.complete(inputs.data, inputs.labels, gaussians)
        return replace(inputs, data=data, labels=labels)


def upload_rank(completion: GaussianFusionSet | None, methods: Iterable[FusionMethod]) -> int:
    """The rank of the class Gaussians the sites must upload for ``completion`` (0: none, also
    when no method of the run reads a fusion set, so nothing is sent for nothing)."""
    reads = any(method.needs() & {"data", "labels"} for method in methods)
    return completion.rank if completion is not None and completion.samples > 0 and reads else 0


__all__ = [
    "TENSOR_KEYS",
    "ClassGaussians",
    "GaussianFusionSet",
    "allocate",
    "fit_class_gaussians",
    "top_principal_components",
    "upload_rank",
]
