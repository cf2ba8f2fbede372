"""Fusion methods behind one interface (:class:`FusionMethod`), found by name in a registry.

One method per module (``averaging``, ``regmean``, ``regmean_fusion_set``, ``otfusion``,
``git_rebasin``, ``fedma``, ``neuron_interpolation``, ``site_interpolation``,
``gram_interpolation``, ``fs_merge``, ``distillation``, ``fisher``) over shared steps, each in one
place (``site_statistics``: what sites compute for statistics rounds): ``base`` (the interface,
options and configs), ``inputs`` (checking and resolving :class:`FusionInputs`: scores, model and
head weights, levels), ``matching`` (neuron costs and the Hungarian assignment), ``kmeans``,
``least_squares``, ``alignment``, ``affine``, ``costs``, ``repair``; training loops live in
:mod:`fedfuse.training.loop`.
"""

from fedfuse.fusion.averaging import FedAvg, VanillaAveraging, average_state_dicts
from fedfuse.fusion.base import (
    FUSION_METHODS,
    FusionInputs,
    FusionMethod,
    FusionResult,
    as_fusion_methods,
    make_fusion_method,
    make_fusion_methods,
    parse_options,
    register_fusion_method,
)
from fedfuse.fusion.cca_merge import CCAMerge
from fedfuse.fusion.dense import Dense
from fedfuse.fusion.distillation import KnowledgeDistillation, LinearProbe
from fedfuse.fusion.fedma import FedMAMatching
from fedfuse.fusion.fisher import FedFisherDiagonal, FedFisherKFAC, FisherMerging
from fedfuse.fusion.fs_merge import FSMerge
from fedfuse.fusion.git_rebasin import GitReBasin
from fedfuse.fusion.gram_interpolation import GramInterpolation, HFGrams, KFGrams
from fedfuse.fusion.neuron_interpolation import (
    GRADIENT_PRESETS,
    HFGradient,
    HFLinear,
    KFGradient,
    KFLinear,
    NeuronInterpolation,
)
from fedfuse.fusion.otfusion import OTFusion
from fedfuse.fusion.regmean import RegMean
from fedfuse.fusion.regmean_fusion_set import RegMeanFusionSet
from fedfuse.fusion.site_interpolation import HFSites, KFSites, SiteInterpolation
from fedfuse.fusion.site_statistics import (
    LocalSites,
    SiteStatistics,
    StatisticsRequest,
    site_statistics,
)
from fedfuse.fusion.trusted_interpolation import HFTrust, KFTrust, TrustedInterpolation
from fedfuse.fusion.zipit import ZipIt

__all__ = [
    "CCAMerge",
    "Dense",
    "FedFisherDiagonal",
    "FedFisherKFAC",
    "FisherMerging",
    "GRADIENT_PRESETS",
    "HFGradient",
    "GramInterpolation",
    "HFGrams",
    "HFSites",
    "HFTrust",
    "KFGrams",
    "KFSites",
    "KFTrust",
    "LocalSites",
    "SiteInterpolation",
    "TrustedInterpolation",
    "SiteStatistics",
    "StatisticsRequest",
    "site_statistics",
    "HFLinear",
    "KFGradient",
    "KFLinear",
    "KnowledgeDistillation",
    "LinearProbe",
    "NeuronInterpolation",
    "FUSION_METHODS",
    "FedAvg",
    "FusionInputs",
    "FusionMethod",
    "FSMerge",
    "FedMAMatching",
    "FusionResult",
    "RegMean",
    "RegMeanFusionSet",
    "GitReBasin",
    "OTFusion",
    "VanillaAveraging",
    "ZipIt",
    "average_state_dicts",
    "make_fusion_method",
    "as_fusion_methods",
    "make_fusion_methods",
    "parse_options",
    "register_fusion_method",
]
