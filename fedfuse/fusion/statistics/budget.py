"""A differential-privacy budget spent over all of a fusion's releases, and its account.

A method whose sites send noised statistics (``kf-sites`` once per round, RegMean with
``grams="sums"`` once per level) spreads ``(epsilon, delta)`` over every release: the noise
multiplier is calibrated once for their count (:func:`~.privacy.calibrate_noise`), each
release's mechanism records its clip, and the fusion's details report what was spent, by Opacus's
RDP accountant (:func:`~.privacy.spent_epsilon`). Both methods account the same way here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedfuse.fusion.statistics.privacy import GaussianStatistics, calibrate_noise, spent_epsilon


@dataclass
class PrivacyBudget:
    """``(epsilon, delta)`` over ``releases`` Gaussian releases of the same samples.

    Attributes:
        epsilon, delta: the budget of all releases together.
        releases: how many there are (rounds, or levels released at once).
        noise_seed: seeds every mechanism's noise (simulations only; None: drawn by the site).
        clips: each release's clip, in the order :meth:`mechanism` was called.
        noise_multiplier: the calibrated ``sigma``, the same for every release.
    """

    epsilon: float
    delta: float
    releases: int
    noise_seed: int | None = None
    clips: list[float] = field(default_factory=list)
    noise_multiplier: float = field(init=False)

    def __post_init__(self) -> None:
        self.noise_multiplier = calibrate_noise(self.epsilon, self.delta, self.releases)

    def mechanism(
        self, clip: float, target_scale: float = 1.0, design_scale: torch.Tensor | None = None
    ) -> GaussianStatistics:
        """The Gaussian mechanism of the next release, its clip recorded."""
        self.clips.append(clip)
        return GaussianStatistics(
            self.noise_multiplier, clip, self.noise_seed, target_scale, design_scale
        )

    def account(self) -> dict[str, Any]:
        """What the fusion's details report: the releases, their clips, the noise and the
        ``(epsilon, delta)`` spent."""
        return {
            "rounds": self.releases,
            "clips": self.clips,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "epsilon": spent_epsilon(self.noise_multiplier, self.delta, self.releases),
            "accountant": "Opacus RDP",
        }


__all__ = ["PrivacyBudget"]
