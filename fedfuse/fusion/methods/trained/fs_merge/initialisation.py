r"""Where FS-Merge's merge and unmerge matrices start: model 0, the average, or ZipIt's matching.

An initialisation fixes, for every base neuron, the merged channel it starts in (``assign``) and
its starting weight in the merge, the diagonal of a
:class:`~fedfuse.fusion.methods.trained.fs_merge.matrices.FoldableMatrix`; the unmerge starts as the
matching copy-back. ZipIt's greedy matching reads the correlation of the models' features on the
fusion set (:func:`~fedfuse.fusion.blocks.matching.correlation`, one pass).

**Initialisations**: ``"first"`` (Eq. 6, App. G.4): :math:`M = (I\;0\dots0)`, :math:`U=(I;\dots;I)`,
folding to model 0 exactly; ``"average"`` (App. G.4): :math:`M = (I/K \dots I/K)`, :math:`U=(I;
\dots;I)`, plain averaging of the models' neuron ``i``; ``"zipit"`` (Sec. 3.1, App. A.2; Stoica
et al., 2024): neurons of all models (and within a model) are greedily paired by the correlation
of their features on the fusion set, :math:`M[p,i] = M[p,j] = 1/2` for a matched pair ``p``,
:math:`U = 2M^\top`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedfuse.fusion.blocks.matching import correlation
from fedfuse.fusion.methods.trained.fs_merge.matrices import FoldableMatrix
from fedfuse.models.affine import output_rows

INITS = ("first", "average", "zipit")


@torch.no_grad()
def correlation_matrix(features: Sequence[torch.Tensor], chunk: int = 65_536) -> torch.Tensor:
    """Pearson correlation ``(n, n)`` of the channels of the concatenated ``features``.

    ``features`` are per model ``(N, d, ...)``; each sample and spatial position is one
    observation, ``chunk`` of them per float64 block. Constant channels (e.g. dead ReLUs) get
    correlation 0 with everything (:func:`~fedfuse.fusion.blocks.matching.correlation` with
    ``one_pass``).
    """
    rows = torch.cat([output_rows(f) for f in features], 1)
    return correlation(rows, batch_size=chunk, one_pass=True)


@torch.no_grad()
def zipit_assignment(corr: torch.Tensor, models: int, width: int) -> torch.Tensor:
    """Greedy ZipIt matching: the merged channel (``0..width-1``) of each of ``n`` base neurons.

    Repeatedly merges the two most correlated clusters, within or across models, whose sizes
    add up to at most ``models`` (for two models: disjoint pairs, as in ZipIt), with average
    linkage, until ``width`` clusters remain. If the size cap blocks every merge (possible for
    three or more models), it is raised by one, so clusters may then differ in size. Clusters
    are numbered by their smallest member.
    """
    n = corr.shape[0]
    if n != models * width:
        raise ValueError(f"{n} neurons cannot form {width} clusters of {models} models")
    link = corr.double().clone()
    sizes = torch.ones(n, dtype=torch.long, device=corr.device)
    alive = torch.ones(n, dtype=torch.bool, device=corr.device)
    labels = torch.arange(n, device=corr.device)
    cap = models
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=corr.device)

    def scores() -> torch.Tensor:
        valid = alive[:, None] & alive[None, :] & (sizes[:, None] + sizes[None, :] <= cap)
        valid.fill_diagonal_(False)
        return torch.where(valid, link, minus_inf)

    # each row's best partner (first on ties), kept up to date instead of a full argmax per merge
    score = scores()
    best, partner = score.max(1)
    clusters = n
    while clusters > width:
        i = int(torch.argmax(best))  # the first row holding the largest score: flat argmax order
        j = int(partner[i])
        if not torch.isfinite(best[i]):
            if cap >= n:
                raise RuntimeError("ZipIt matching is stuck")  # cannot happen: clusters > 1
            cap += 1
            score = scores()
            best, partner = score.max(1)
            continue
        si, sj = sizes[i].item(), sizes[j].item()
        link[i] = (si * link[i] + sj * link[j]) / (si + sj)
        link[:, i] = link[i]
        sizes[i] += sj
        alive[j] = False
        labels[labels == j] = i
        clusters -= 1
        score[j] = minus_inf
        score[:, j] = minus_inf
        row = torch.where(alive & (sizes + sizes[i] <= cap), link[i], minus_inf)
        row[i] = minus_inf
        score[i] = row
        score[:, i] = row
        stale = (partner == i) | (partner == j)
        stale[i] = True
        if bool(stale.any()):
            best[stale], partner[stale] = score[stale].max(1)
        column = score[:, i]
        better = ~stale & ((column > best) | ((column == best) & (partner > i)))
        best[better], partner[better] = column[better], i
    roots = torch.unique(labels)
    first_member = torch.stack([torch.nonzero(labels == r)[0, 0] for r in roots])
    order = roots[torch.argsort(first_member)]
    relabel = torch.empty(n, dtype=torch.long, device=corr.device)
    relabel[order] = torch.arange(len(order), device=corr.device)
    return relabel[labels]


def initial_merge(
    init: str, count: int, width: int, features: Sequence[torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(assign, diagonal)`` of the merge of ``count`` models' ``width`` neurons for ``init``.

    ``assign[j]``: the merged channel of base neuron ``j`` (model-major); ``diagonal[j]``: its
    weight there. ``features`` (per model ``(N, width, ...)`` or rows ``(R, width)``) are read by
    ``"zipit"`` only, whose weights are one over the size of each neuron's cluster.
    """
    n = count * width
    if init == "zipit":
        if features is None:
            raise ValueError("the ZipIt initialisation needs the models' features")
        assign = zipit_assignment(correlation_matrix(features), count, width).cpu()
        sizes = torch.bincount(assign, minlength=width).double()
        diagonal = (1.0 / sizes[assign]).float()
    else:
        assign = torch.arange(width).repeat(count)
        if init == "first":
            diagonal = torch.zeros(n)
            diagonal[:width] = 1.0
        else:
            diagonal = torch.full((n,), 1.0 / count)
    return assign, diagonal


def initial_pair(
    init: str,
    features: Sequence[torch.Tensor],
    width: int,
    rank: int,
    generator: torch.Generator,
) -> tuple[FoldableMatrix, FoldableMatrix]:
    """``M`` and ``U`` of one hidden level, initialised as ``init`` says (``U``'s diagonal: 1)."""
    assign, merge_diagonal = initial_merge(init, len(features), width, features)
    merge = FoldableMatrix("merge", assign, merge_diagonal, width, rank, generator)
    unmerge = FoldableMatrix("unmerge", assign, torch.ones(len(assign)), width, rank, generator)
    return merge, unmerge
