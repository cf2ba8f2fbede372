r"""Differential privacy for the statistics a site sends: clip each sample, add Gaussian noise.

A statistics reply (:mod:`fedfuse.fusion.statistics.rounds`) is made of blocks of one matrix, the
joint second moments of a site's rows ``v = [x, z]`` (``x`` the fused level's design row, ``z``
the site model's outputs on it):

.. math::

    M = \sum_{i \in \text{site}} \sum_{p} v_{ip} v_{ip}^T
      = \begin{pmatrix} X^T X & X^T Z \\ Z^T X & Z^T Z \end{pmatrix}

(``p`` runs over a sample's output positions: one for a linear level, every patch for a
convolution). The mechanism (the "Analyze Gauss" mechanism of Dwork et al., 2014):

1. **Clip** every sample so that ``sum_p ||v_ip||^2 <= C^2`` (its rows scaled by one factor).
   Adding or removing one sample then changes ``M`` by at most ``C^2`` in Frobenius norm, which
   bounds the L2 norm of the change of ``M``'s upper triangle: the sensitivity is ``C^2``.
2. **Add noise**: a symmetric matrix whose upper-triangle entries are independent
   ``N(0, (sigma C^2)^2)``, ``sigma`` the noise multiplier.
3. **Post-process** (no privacy cost): the noisy matrix is projected onto the positive
   semi-definite cone (negative eigenvalues set to 0) and the design block ``X^T X`` is shifted
   by ``2 sigma C^2 sqrt(d)``, about the spectral norm of the noise (``d`` the joint matrix's
   size): a ridge as large as the noise, without which every fit on noisy moments follows the
   noise in the directions where the data is weak. The blocks are the reply, and the site's
   translation (its ridge fit) is computed from them. Nothing computed from the raw sums
   leaves the site.

A run of ``R`` statistics rounds composes ``R`` such Gaussian mechanisms on the same samples.
The noise multiplier for a target ``(epsilon, delta)`` over ``R`` rounds, and the epsilon a run
spent, come from Opacus's Rényi-DP accountant (:func:`calibrate_noise`, :func:`spent_epsilon`),
never from a formula of ours.

What is **not** protected: the site's model weights, importance scores and sample count, which
every method's upload carries; ``docs/privacy.md`` says so.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from fedfuse.fusion.blocks.pieces import linear_pieces
from fedfuse.models import LeveledModel

#: Rényi orders the accountant tries: Opacus's defaults, extended upwards (few rounds of much
#: noise have their best bound at high orders)
_ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(12, 256)) + [256, 384, 512, 768, 1024]


@dataclass(frozen=True)
class GaussianStatistics:
    """The mechanism applied to one statistics reply.

    Attributes:
        noise_multiplier: ``sigma``: the noise's standard deviation over the sensitivity.
        clip: ``C``: bound on a sample's norm over its rows (``sqrt(sum_p ||v_p||^2)``).
        noise_seed: seeds the noise, for reproducible simulations only. None (always in a
            deployment: the ClientApp ignores any seed) draws it from the operating system, so
            the server cannot know the noise and subtract it.
        target_scale: ``z`` is multiplied by it before clipping and the reply's ``X^T Z`` and
            ``Z^T Z`` divided by it and its square after the noise (post-processing): it sets
            how the noise splits between the design's and the targets' moments.
        design_scale: one factor per design column, applied and undone the same way, so that
            every column (the intercept's too) meets the noise at the same scale (None: 1).
    """

    noise_multiplier: float
    clip: float
    noise_seed: int | None = None
    target_scale: float = 1.0
    design_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and self.clip > 0 and self.target_scale > 0):
            raise ValueError(
                f"noise multiplier must be >= 0, clip and target scale > 0, got "
                f"{self.noise_multiplier}, {self.clip} and {self.target_scale}"
            )

    @property
    def noise_std(self) -> float:
        """Standard deviation of every noise entry: ``sigma C^2``."""
        return self.noise_multiplier * self.clip**2


def calibrate_noise(epsilon: float, delta: float, rounds: int) -> float:
    """The smallest noise multiplier whose ``rounds`` Gaussian mechanisms spend at most
    ``(epsilon, delta)`` (Opacus's RDP accountant; 0 for ``epsilon = inf``)."""
    _check_budget(epsilon, delta, rounds)
    if epsilon == float("inf"):
        return 0.0
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=1.0,
            steps=rounds,
            accountant="rdp",
            epsilon_tolerance=0.01,
            alphas=_ORDERS,
        )
    )


def spent_epsilon(noise_multiplier: float, delta: float, rounds: int) -> float:
    """The epsilon of ``rounds`` Gaussian mechanisms of ``noise_multiplier`` at ``delta``
    (Opacus's RDP accountant; inf without noise)."""
    _check_budget(1.0, delta, rounds)
    if noise_multiplier <= 0:
        return float("inf")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, 1.0, rounds)]
    return float(accountant.get_epsilon(delta, alphas=_ORDERS))


def clip_samples(rows: torch.Tensor, samples: int, clip: float) -> torch.Tensor:
    """``rows`` (``samples * positions`` rows, sample by sample) with each sample's rows scaled
    so that their squared norms sum to at most ``clip^2``."""
    if samples < 1 or len(rows) % samples:
        raise ValueError(f"{len(rows)} rows do not split into {samples} samples")
    grouped = rows.reshape(samples, len(rows) // samples, rows.shape[1])
    norms = grouped.double().pow(2).sum((1, 2)).sqrt()
    scale = (clip / norms.clamp_min(1e-300)).clamp(max=1.0).to(rows.dtype)
    return (grouped * scale[:, None, None]).reshape(rows.shape)


def noisy_moments(
    joint: torch.Tensor, mechanism: GaussianStatistics, *, design: int = 0
) -> torch.Tensor:
    """The joint second-moment matrix plus symmetric Gaussian noise, projected onto the positive
    semi-definite matrices, its first ``design`` diagonal entries shifted by the noise's
    spectral norm (float64)."""
    seed = mechanism.noise_seed if mechanism.noise_seed is not None else secrets.randbits(63)
    generator = torch.Generator().manual_seed(seed)
    size = joint.shape[0]
    noise = torch.randn(size, size, generator=generator, dtype=torch.float64)
    noise = (noise.triu() + noise.triu(1).T) * mechanism.noise_std
    noisy = joint.double().cpu() + noise
    eigenvalues, vectors = torch.linalg.eigh(noisy)
    projected = (vectors * eigenvalues.clamp_min(0)) @ vectors.T
    projected = (projected + projected.T) / 2
    projected.diagonal()[:design] += 2 * mechanism.noise_std * size**0.5
    return projected.to(joint.device)


@torch.no_grad()
def fusion_set_mechanism(
    models: list[LeveledModel], fused: LeveledModel, index: int, number: int, data: torch.Tensor
) -> tuple[float, float, torch.Tensor]:
    """``(clip, target_scale, design_scale)`` for piece ``number`` of level ``index``, chosen on
    the server's fusion set (``x`` the design rows under ``fused``'s prefix, ``z`` each model's
    own outputs), never on the sites' data:

    - ``design_scale`` gives every design column a root mean square of 1 (a column that is 0
      on the fusion set keeps 1), so that the noise, as large on every entry, does not drown
      the weak columns first (the intercept's 1 among pixels, a rarely active neuron);
    - ``target_scale`` makes the median norm of the scaled ``z`` that of the scaled ``x``, so
      that the noise weighs as much on ``X^T X`` as on ``X^T Z`` and ``Z^T Z``;
    - ``clip`` is the median norm of a sample's scaled rows (the largest median over the
      models), as adaptive clipping in DP training aims for (Andrew et al., 2021): the noise
      grows with the square of the bound, while clipping the larger half of the samples only
      shortens them.
    """
    level = fused.levels[index]
    pieces = linear_pieces(level)
    assert pieces is not None
    fused_inputs = fused.forward_levels(data, 0, index)
    samples = len(data)
    design = pieces[number].design(level, fused_inputs).double()
    rms = design.pow(2).mean(0).sqrt()
    design_scale = torch.where(rms > 1e-12, 1 / rms.clamp_min(1e-12), torch.ones_like(rms))
    x_norms = (design * design_scale).pow(2).reshape(samples, -1).sum(1)
    z_norms = []
    for model in models:
        own_level = model.levels[index]
        own_pieces = linear_pieces(own_level)
        assert own_pieces is not None
        z = own_pieces[number].target(own_level, model.forward_levels(data, 0, index))
        z_norms.append(z.double().pow(2).reshape(samples, -1).sum(1))
    typical_z = float(torch.stack(z_norms).median().sqrt())
    scale = float(x_norms.median().sqrt()) / typical_z if typical_z > 0 else 1.0
    clip = max(float((x_norms + scale**2 * z).median().sqrt()) for z in z_norms)
    return clip, scale, design_scale.float()


def check_dp_options(
    epsilon: float | None, delta: float, clip: float | None, where: str
) -> float | None:
    """Check a method's ``dp_epsilon``, ``dp_delta`` and ``dp_clip`` options when it is built
    (ValueError naming ``where`` and the value); returns epsilon as a float (None: no DP)."""
    if epsilon is None:
        return None
    try:
        calibrate_noise(float(epsilon), delta, 1)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if clip is not None and not clip > 0:
        raise ValueError(f"{where}: dp_clip must be > 0 or None, got {clip}")
    return float(epsilon)


def _check_budget(epsilon: float, delta: float, rounds: int) -> None:
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0 (inf: no noise), got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if rounds < 1:
        raise ValueError(f"the privacy budget needs at least one round, got {rounds}")
