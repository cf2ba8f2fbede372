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

from fedfuse.fusion.base import FusionInputs, FusionMethod, FusionResult
from fedfuse.fusion.methods.averaging.fedavg import FedAvg, VanillaAveraging, average_state_dicts
from fedfuse.fusion.methods.averaging.fisher import FedFisherDiagonal, FedFisherKFAC, FisherMerging
from fedfuse.fusion.methods.matching.cca_merge import CCAMerge
from fedfuse.fusion.methods.matching.fedma import FedMAMatching
from fedfuse.fusion.methods.matching.git_rebasin import GitReBasin
from fedfuse.fusion.methods.matching.otfusion import OTFusion
from fedfuse.fusion.methods.matching.zipit import ZipIt
from fedfuse.fusion.methods.neuron_interpolation import (
    GRADIENT_PRESETS,
    HFGradient,
    HFLinear,
    KFGradient,
    KFLinear,
    NeuronInterpolation,
)
from fedfuse.fusion.methods.neuron_interpolation.grams import GramInterpolation, HFGrams, KFGrams
from fedfuse.fusion.methods.neuron_interpolation.sites import HFSites, KFSites, SiteInterpolation
from fedfuse.fusion.methods.neuron_interpolation.trusted import (
    HFTrust,
    KFTrust,
    TrustedInterpolation,
)
from fedfuse.fusion.methods.regression.regmean import RegMean
from fedfuse.fusion.methods.regression.regmean_fusion_set import RegMeanFusionSet
from fedfuse.fusion.methods.selection.auto import Auto
from fedfuse.fusion.methods.trained.dense import Dense
from fedfuse.fusion.methods.trained.distillation import KnowledgeDistillation, LinearProbe
from fedfuse.fusion.methods.trained.fs_merge import FSMerge
from fedfuse.fusion.options import parse_options
from fedfuse.fusion.registry import (
    FUSION_METHODS,
    as_fusion_methods,
    make_fusion_method,
    make_fusion_methods,
    register_fusion_method,
)
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest

__all__ = [
    "Auto",
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
