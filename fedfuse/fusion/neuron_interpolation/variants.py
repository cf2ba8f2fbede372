"""The registered neuron-interpolation methods: HF/KF grouping x Linear/Gradient fit.

Each is :class:`~fedfuse.fusion.neuron_interpolation.methods.NeuronInterpolation` with its
grouping and approximation fixed, taking only the base's options that apply to it (with the
base's defaults: see :func:`~fedfuse.fusion.neuron_interpolation.options.fixed_variant`).
"""

from __future__ import annotations

from collections.abc import Callable

from fedfuse.fusion.base import register_fusion_method
from fedfuse.fusion.neuron_interpolation.methods import VARIANT_OPTIONS, NeuronInterpolation
from fedfuse.fusion.neuron_interpolation.options import fixed_variant


def _variant(grouping: str, approximation: str) -> Callable[[type], type]:
    """Fix ``grouping`` and ``approximation``; drop the options of the other choices."""
    without = [
        option
        for choice, options in VARIANT_OPTIONS.items()
        if choice not in (grouping, approximation)
        for option in options
    ]
    return fixed_variant(grouping, approximation, without=without)


@register_fusion_method
@_variant("hungarian", "linear")
class HFLinear(NeuronInterpolation):
    """Hungarian Fusion, Linear variant (paper Sec. 4): pairs two models' neurons one-to-one
    (Hungarian matching of their importance-weighted outputs), then refits each affine level in
    closed form to the pairs' weighted means, bottom-up from the fused levels below.

    Two models of the target's width. Args as :class:`NeuronInterpolation`: ``use_scores``,
    ``score_normalization``, ``fallback_scores``, ``head_weights`` (inputs); ``ridge``, ``rcond``,
    ``gram_precision`` (the closed-form fit); ``seed``, ``device``, ``batch_size_capture``,
    ``progress``.
    """

    name = "hf-linear"
    max_models = 2  # one-to-one matching (Sec. 4)


@register_fusion_method
@_variant("kmeans", "linear")
class KFLinear(NeuronInterpolation):
    """K-means Fusion, Linear variant (paper Sec. 4): clusters all models' neurons by
    importance-weighted K-means into the fused level's width, then refits each affine level in
    closed form to the cluster centres, bottom-up from the fused levels below.

    Any number of models, any target widths. Args as :class:`NeuronInterpolation`:
    ``use_scores``, ``score_normalization``, ``fallback_scores``, ``head_weights`` (inputs);
    ``ridge``, ``rcond``, ``gram_precision`` (the closed-form fit); ``n_init``, ``max_iter``,
    ``tol``, ``local_search_swaps`` (K-means); ``seed``, ``device``, ``batch_size_capture``,
    ``progress``.
    """

    name = "kf-linear"


@register_fusion_method
@_variant("hungarian", "gradient")
class HFGradient(NeuronInterpolation):
    """Hungarian Fusion, Gradient variant (paper Sec. 4, Table 9): pairs two models' neurons
    one-to-one (Hungarian), then fits each level by gradient descent on the MSE to the pairs'
    weighted means, with early stopping, bottom-up from the fused levels below.

    Two models of the target's width; any levels (not only affine ones). Args as
    :class:`NeuronInterpolation`: ``use_scores``, ``score_normalization``, ``fallback_scores``,
    ``head_weights`` (inputs); ``preset`` and its overrides ``epochs``, ``last_epochs``, ``lr``,
    ``last_lr``, ``epsilon``, ``batch_size``, ``patience``, and ``weighted_loss`` (the fit);
    ``seed``, ``device``, ``batch_size_capture``, ``progress``.
    """

    name = "hf-gradient"
    max_models = 2  # one-to-one matching (Sec. 4)


@register_fusion_method
@_variant("kmeans", "gradient")
class KFGradient(NeuronInterpolation):
    """K-means Fusion, Gradient variant (paper Sec. 4, Table 9): clusters all models' neurons by
    importance-weighted K-means, then fits each level by gradient descent on the MSE to the
    cluster centres, with early stopping, bottom-up from the fused levels below.

    Any number of models, any target widths, any levels. Args as :class:`NeuronInterpolation`:
    ``use_scores``, ``score_normalization``, ``fallback_scores``, ``head_weights`` (inputs);
    ``n_init``, ``max_iter``, ``tol``, ``local_search_swaps`` (K-means); ``preset`` and its
    overrides ``epochs``, ``last_epochs``, ``lr``, ``last_lr``, ``epsilon``, ``batch_size``,
    ``patience``, and ``weighted_loss`` (the fit); ``seed``, ``device``, ``batch_size_capture``,
    ``progress``.
    """

    name = "kf-gradient"
