r"""Folding FS-Merge's level-wise SuperNet back into one plain model of model 0's spec.

Once trained, every merge/unmerge pair is multiplied into the frozen base weights around it
(Eq. 5), so the fused model is an ordinary network of the base models' architecture that computes
exactly what the SuperNet computes; the classifier, which has no learned merge, is folded with a
fixed one.

**Folding** (Eq. 5): the fused model has model 0's spec, with
:math:`W_l^* = M_l \operatorname{blockdiag}(W_l^1,\dots,W_l^K)\,U_{l-1}` and
:math:`b_l^* = M_l (b_l^1\Vert\dots\Vert b_l^K)`, applied on the input-channel axis (conv kernels
and the ``Flatten`` before a classifier keep their spatial part). It computes exactly what the
SuperNet computes.

**The classifier** (our adaptation): the paper merges multi-task models and keeps one head per
task. Here all models share the label space and the fused model has one head, so the head is
folded with a fixed merge: ``head="mean"`` averages the models' logits, each computed by that
model's head on *its* reconstructed features, :math:`M_{\text{head}} = (I/K \dots I/K)`;
``head="first"`` keeps model 0's head on model 0's reconstruction (with ``init="first"`` and
``epochs=0`` the fused model is then model 0 exactly).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from fedfuse.fusion.blocks.alignment import affine_levels
from fedfuse.fusion.methods.trained.fs_merge.matrices import FoldableMatrix
from fedfuse.models import LeveledModel
from fedfuse.models.affine import AffineLevel

HEADS = ("mean", "first")


@torch.no_grad()
def fold_levels(
    models: Sequence[LeveledModel],
    merges: Sequence[FoldableMatrix],
    unmerges: Sequence[FoldableMatrix],
    head: str = "mean",
) -> LeveledModel:
    """Eq. 5 on every neuron level: ``W* = M blockdiag(W^k) U_prev``, ``b* = M (b^k)``.

    ``merges``/``unmerges`` are those of the hidden neuron levels, bottom-up; the classifier
    is folded with the fixed merge of ``head`` (``"mean"`` or ``"first"``). Returns a new model
    of model 0's spec.
    """
    views: list[dict[int, AffineLevel]] = [affine_levels(m) for m in models]
    count = len(models)
    if len(merges) != len(models[0].neuron_levels) - 1 or len(unmerges) != len(merges):
        raise ValueError(
            f"{len(merges)} merge and {len(unmerges)} unmerge matrices for "
            f"{len(models[0].neuron_levels) - 1} hidden neuron levels"
        )
    fused = copy.deepcopy(models[0]).cpu()
    fused_views = affine_levels(fused)
    neuron_levels = fused.neuron_levels
    for position, index in enumerate(neuron_levels):
        blocks, biases = [], []
        for k in range(count):
            layer = views[k][index].layer
            weight = layer.weight.detach().cpu().double()
            out = weight.shape[0]
            if position == 0:  # U_0 = (I; ...; I)
                grouped = weight.reshape(out, 1, -1)
            else:
                unmerge = unmerges[position - 1].dense().detach().cpu().double()
                previous = unmerges[position - 1].width
                block = unmerge[k * previous : (k + 1) * previous]  # (base, merged)
                grouped = torch.einsum("ocr,cj->ojr", weight.reshape(out, previous, -1), block)
            blocks.append(grouped)
            bias = layer.bias
            biases.append(
                bias.detach().cpu().double()
                if bias is not None
                else torch.zeros(out, dtype=torch.float64)
            )
        stacked = torch.cat(blocks, 0)
        if position < len(merges):
            merge = merges[position].dense().detach().cpu().double()
        else:  # the classifier
            out = blocks[0].shape[0]
            eye = torch.eye(out, dtype=torch.float64)
            parts = (
                [eye / count] * count
                if head == "mean"
                else [eye] + [torch.zeros_like(eye)] * (count - 1)
            )
            merge = torch.cat(parts, 1)
        weight = torch.einsum("so,ocr->scr", merge, stacked)
        target_layer = fused_views[index].layer
        target_layer.weight.copy_(
            weight.reshape(target_layer.weight.shape).to(target_layer.weight.dtype)
        )
        if target_layer.bias is not None:
            target_layer.bias.copy_((merge @ torch.cat(biases)).to(target_layer.bias.dtype))
    return fused.eval()
