r"""ZipIt! (Stoica et al., ICLR 2024): merge models by zipping correlated features, N models.

For every feature space of the models (a hidden level's neurons; in a ViT, the residual stream
and each block's inner spaces), the ``K`` models' ``K d`` features are run on the fusion set
and their Pearson correlations computed. Features are then *zipped* greedily: the two most
correlated clusters are merged, within one model or across models, with average linkage,
until ``d`` clusters remain; clusters hold at most ``K`` features (for two models, disjoint
pairs as in the paper;
:func:`~fedfuse.fusion.methods.trained.fs_merge.initialisation.zipit_assignment`). That gives a
merge matrix ``M`` (``d x K d``, ``M[c, i] = 1 / |c|`` for feature ``i`` in cluster ``c``) and an
unmerge ``U = |c| M^T`` (``K d x d``: a merged feature is copied back to each of its members). A
layer of the merged model maps merged inputs to merged outputs through the models' own layers side
by side:

    ``W = M_out  blockdiag(W_1, ..., W_K)  U_in``,

so features zipped within one model are averaged and the redundancy they carry is removed,
and the classifier averages the models' logits on the unmerged features. No training and no
labels: the fusion set is read once, for the correlations.

This is FS-Merge's ZipIt initialisation folded without optimising it (FS-Merge, Sec. 3.1,
App. A.2): :class:`ZipIt` is :class:`~fedfuse.fusion.methods.trained.fs_merge.method.FSMerge` with
``init="zipit"`` and no epochs, so the two methods share the matching, the SuperNet and the
folding (one place for each). The paper's partial zipping (stopping before the last layers,
which then stay an ensemble) is not offered: fedfuse returns one model.
"""

from __future__ import annotations

from fedfuse.fusion.methods.trained.fs_merge.method import FSMerge
from fedfuse.fusion.registry import register_fusion_method


@register_fusion_method
class ZipIt(FSMerge):
    """ZipIt!: greedy within- and across-model matching of features by their correlation on
    the fusion set, merged by averaging, folded into one model (module docstring).

    Args:
        head: ``"mean"`` (the models' classifiers averaged on their unmerged features, as in
            the paper) or ``"first"`` (model 0's classifier).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        batch_size_capture: samples per forward pass when capturing the features.
    """

    name = "zipit"

    def __init__(
        self, *, head: str = "mean", device: str = "auto", batch_size_capture: int = 256
    ) -> None:
        super().__init__(
            "global",
            "zipit",
            rank=0,
            head=head,
            epochs=0,
            device=device,
            batch_size_capture=batch_size_capture,
        )


__all__ = ["ZipIt"]
