r"""FS-Merge: merging by a *Foldable SuperNet* of the frozen base models.

Kinderman, Hubara, Maron & Soudry, "Foldable SuperNets: Scalable Merging of Transformers with
Different Initializations and Tasks", TMLR 2025 (Sec. 2.1-2.2, Eq. 1-7; App. B, E, F.1, G.4, H).
The base models stay frozen; learnable merge/unmerge matrices between them form a SuperNet that
is trained, on the fusion set's inputs only, to reconstruct the base models' features, then
folded into one plain model of model 0's spec. One concept per module, imports running one way
(``matrices`` <- ``initialisation``, ``supernet``, ``spaces``, ``folding`` <- ``training`` <-
``method``):

* :mod:`~fedfuse.fusion.methods.trained.fs_merge.matrices`: the foldable merge/unmerge matrices,
  diagonal plus low rank (Eq. 7);
* :mod:`~fedfuse.fusion.methods.trained.fs_merge.initialisation`: their start (model 0, average,
  ZipIt);
* :mod:`~fedfuse.fusion.methods.trained.fs_merge.supernet`: the level-wise SuperNet of MLPs and VGGs
  (Eq. 2);
* :mod:`~fedfuse.fusion.methods.trained.fs_merge.spaces`: the feature-space SuperNet of ViTs (App.
  B), which folds itself;
* :mod:`~fedfuse.fusion.methods.trained.fs_merge.training`: the local and global objectives (Eq. 3,
  4), the loss and the paper's schedules (App. E.1);
* :mod:`~fedfuse.fusion.methods.trained.fs_merge.folding`: the level-wise SuperNet folded into a
  plain model (Eq. 5);
* :mod:`~fedfuse.fusion.methods.trained.fs_merge.method`: :class:`FSMerge`, the registered fusion
  method.
"""

from fedfuse.fusion.methods.trained.fs_merge.folding import HEADS, fold_levels
from fedfuse.fusion.methods.trained.fs_merge.initialisation import (
    INITS,
    correlation_matrix,
    initial_merge,
    initial_pair,
    zipit_assignment,
)
from fedfuse.fusion.methods.trained.fs_merge.matrices import (
    LOW_RANK_FACTOR,
    FoldableMatrix,
    on_channels,
)
from fedfuse.fusion.methods.trained.fs_merge.method import FSMerge
from fedfuse.fusion.methods.trained.fs_merge.spaces import (
    NORMS,
    Site,
    SpaceSuperNet,
    check_supported,
    head_input,
    map_axis,
    probe_rows,
)
from fedfuse.fusion.methods.trained.fs_merge.supernet import FoldableSuperNet, StackedLevel
from fedfuse.fusion.methods.trained.fs_merge.training import (
    COSINE_WARMUP_EPOCHS,
    OBJECTIVES,
    STEP_GAMMA,
    FitOptions,
    FSMergeSchedule,
    optimise,
    paper_schedule,
    recipe_schedule,
    train_levels,
)

__all__ = [
    "COSINE_WARMUP_EPOCHS",
    "HEADS",
    "INITS",
    "LOW_RANK_FACTOR",
    "NORMS",
    "OBJECTIVES",
    "STEP_GAMMA",
    "FSMerge",
    "FSMergeSchedule",
    "FitOptions",
    "FoldableMatrix",
    "FoldableSuperNet",
    "StackedLevel",
    "Site",
    "SpaceSuperNet",
    "check_supported",
    "correlation_matrix",
    "fold_levels",
    "head_input",
    "initial_merge",
    "initial_pair",
    "map_axis",
    "on_channels",
    "optimise",
    "paper_schedule",
    "recipe_schedule",
    "probe_rows",
    "train_levels",
    "zipit_assignment",
]
