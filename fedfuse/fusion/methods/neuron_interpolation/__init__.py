"""Neuron-interpolation fusion (paper Sec. 4, App. B, F): Hungarian/K-means x Linear/Gradient.

The fused model is built bottom-up, one level at a time, always from its **own** inputs (the
outputs of the fused levels below), so errors of earlier levels are accounted for:

1. *Grouping*: the neurons of all base models at this level (their outputs over the fusion set,
   and spatial positions, are their features) are grouped into as many clusters as the fused
   level has neurons: one-to-one Hungarian matching of two equal-width models (HF) or
   importance-weighted k-means (KF). The cluster centres ``T`` are the targets.
2. *Approximation*: the fused level's weights are fitted to produce ``T`` from its own inputs:
   in closed form for affine levels (Linear), where the base outputs are first projected onto
   the image of the fused level's design (Theorem 2), or by gradient descent on the MSE (Gradient).

The last level (the classifier) is fitted to the mean of the base models' logits, optionally
weighted per class by each model's share of that class's training samples (``head_weights``).

Modules: :mod:`.methods` (:class:`NeuronInterpolation`: the level-by-level loop),
:mod:`.interpolation_options` (its options and what they configure), :mod:`.variants` (the
registered ``hf-*``/``kf-*`` methods), :mod:`.grouping` (step 1), :mod:`.linear` and
:mod:`.gradient` (step 2), :mod:`.level_fit` (what one level's fit reads), :mod:`.costs` (a
fitted level's Theorem 1 cost), :mod:`.structure` (which base level each fused level fits),
:mod:`.options` (the variants' choices and constructors), :mod:`.prior` (the base weights a
Linear fit shrinks towards). Fitted on the
sites' statistics instead of the fusion set: :mod:`.sites` (``hf-sites``/``kf-sites``, one
statistics round per level), :mod:`.site_options` (the family's options), :mod:`.site_fits`
(the server's fit from the statistics), :mod:`.grams` (from uploaded Grams) and :mod:`.trusted`
(on the fusion set, each row to the models that know its label).
"""

from fedfuse.fusion.methods.neuron_interpolation.gradient import GRADIENT_PRESETS, GradientPreset
from fedfuse.fusion.methods.neuron_interpolation.grouping import GROUPINGS
from fedfuse.fusion.methods.neuron_interpolation.methods import NeuronInterpolation
from fedfuse.fusion.methods.neuron_interpolation.options import APPROXIMATIONS
from fedfuse.fusion.methods.neuron_interpolation.variants import (
    HFGradient,
    HFLinear,
    KFGradient,
    KFLinear,
)

__all__ = [
    "APPROXIMATIONS",
    "GRADIENT_PRESETS",
    "GROUPINGS",
    "GradientPreset",
    "HFGradient",
    "HFLinear",
    "KFGradient",
    "KFLinear",
    "NeuronInterpolation",
]
