r"""FS-Merge on feature spaces: the Foldable SuperNet of a Vision Transformer (App. B).

Kinderman et al., "Foldable SuperNets", TMLR 2025, Sec. 2.2 and App. B.1-B.3. Every linear layer
of the ViT gets a learnable merge matrix on its output and an unmerge matrix on its input; the
residual stream, the LayerNorms, the attention softmax and the GELU act on the *merged* width.
Written with the feature spaces of :func:`fedfuse.models.symmetry.feature_spaces`, one *site*
per (space, module, side):

* a module producing features of space ``s`` (``q``, ``k``, ``v``, ``out``, ``fc1``, ``fc2``, the
  patch projection, the class token and position embedding) has its own merge
  :math:`M^{\text{site}} = (M^1 \dots M^K)`, ``d x Kd``, applied to its output rows and bias;
* a module consuming space ``s`` (``q``/``k``/``v`` read the stream, ``out`` reads ``v``,
  ``fc2`` reads the MLP hidden space, the classifier reads the stream) has its own unmerge
  :math:`U^{\text{site}} = (U^1; \dots; U^K)`, ``Kd x d``, applied to its input columns;
* LayerNorm weights and biases of the stream are learned directly in the merged space (App.
  B.1: "the layer norm parameters ... will be directly used in the merged model"), initialised
  with the initial merge of the stream.

The merged model's weights are then, for every tensor, :math:`W^* = \sum_k M^k_{\text{out}} W^k
U^k_{\text{in}}` (App. B.3 in column convention; a bias or embedding only has the ``M`` side).
The paper shares one ``U_l`` between ``q``, ``k`` and ``v`` (they read the same LayerNorm
output); here each has its own, a superset that starts identical. The classifier is not merged
by a learned ``M`` (one shared label space): ``head="mean"`` averages the models' heads applied
to their reconstructions :math:`U^k_{\text{head}} \bar x^*`, ``head="first"`` keeps model 0's.

**SuperNet = folded model.** The SuperNet's forward is the fused-spec model run by
:func:`torch.func.functional_call` on the merged state dict computed differentiably from the
``M``/``U`` parameters, so folding (:meth:`SpaceSuperNet.fused_state` without gradients, loaded
into a plain model) computes exactly what was trained.

**Objective** (global, App. B.2): reconstruct every base model's last representation (the
classifier's input, here the normalised class token) from the merged one,
:math:`\sum_k \lVert f_L^k(x) - U^k_{\text{head}} \bar x^*_L(x)\rVert^2`, on every fusion input
(one shared fusion set; the paper feeds model ``k`` only task ``k``'s images). The local
objective is refused: the paper finds it fails on transformers (Sec. 2.2, App. G.3).

**Initialisations**: ``"first"`` (App. G.4, the paper's best for ViTs: the fold is model 0),
``"average"``, and ``"zipit"`` (our extension: per feature space, ZipIt's greedy correlation
matching on the space's probes, e.g. the queries and keys of a block, every ``M``/``U`` of the
space starting from the matched average; it ignores head groups, which the learned ``M`` is not
bound to either).

**A user's own ViT** (torchvision's ``VisionTransformer`` given as a plain model) is merged on
the feature spaces read off its traced graph (:mod:`fedfuse.models.graph_symmetry`): the packed
attention ``in_proj``'s query, key and value rows are each a site of their own (an axis with an
``offset``; the three share the unmerge of the stream they read, as in the paper), and the
reconstructed representation is the input of the classifier, the last ``Linear`` of the last
level (:func:`classifier_prefix`), caught by a hook; the fold is a state dict of the adapted
model, so the user's class loads it.

Not supported: BatchNorm (ResNet) -- its running statistics would need recomputing in the
merged space; :func:`check_supported` says so before any site trains.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from fedfuse.fusion.methods.trained.fs_merge.matrices import FoldableMatrix
from fedfuse.models import LeveledModel
from fedfuse.models.capture import capture_modules, hooked, run_batches
from fedfuse.models.symmetry import FeatureSpace, feature_spaces

NORMS = (nn.LayerNorm, nn.GroupNorm)


@dataclass(frozen=True)
class Site:
    """The module ``prefix`` producing (``produces``) or consuming features of ``space``."""

    space: str
    prefix: str
    produces: bool
    offset: int | None = None


def _prefix(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def check_supported(model: LeveledModel) -> None:
    """Raise ValueError unless the feature-space FS-Merge can fuse models built like ``model``."""
    spaces = feature_spaces(model)  # a ValueError for architectures without described symmetries
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"{name} is a BatchNorm; FS-Merge's feature-space SuperNet handles LayerNorm "
                "models (ViT) only, BatchNorm running statistics in the merged space are not "
                "implemented"
            )
    prefix = classifier_prefix(model)
    consumed = {a.key for s in spaces for a in s.axes if not a.produces and a.dim == 1}
    if f"{prefix}.weight" not in consumed:
        raise ValueError(
            f"the classifier {prefix} does not read a feature space of the model (the "
            "representation FS-Merge reconstructs)"
        )


def classifier_prefix(model: LeveledModel) -> str:
    """The name of ``model``'s classifier: the last ``Linear`` of its last level, mapping the
    final representation to the classes (fedfuse's ViT: ``head[-1]``; a user's: e.g.
    ``heads.head``); a ValueError when there is none."""
    last = model.num_levels - 1
    found = [
        name for name, module in model.levels[last].named_modules() if isinstance(module, nn.Linear)
    ]
    if not found:
        raise ValueError("the last level holds no Linear classifier")
    name = found[-1]
    if model.levels[last].get_submodule(name).out_features != model.spec.num_classes:
        raise ValueError(f"the last Linear of the last level ({name}) does not output the classes")
    return f"levels.{last}.{name}" if name else f"levels.{last}"


def map_axis(
    tensor: torch.Tensor,
    dim: int,
    repeat: int,
    matrix: torch.Tensor,
    offset: int | None = None,
) -> torch.Tensor:
    """``tensor`` with dim ``dim`` (features of ``repeat`` entries each) mapped by ``matrix``
    ``(new, old)``; differentiable (unlike :func:`~fedfuse.models.symmetry.map_state`). With an
    ``offset`` only the ``old * repeat`` entries from it are the features (the rows of one
    projection in a packed attention ``in_proj``); the others are kept."""
    moved = tensor.movedim(dim, 0)
    start = offset or 0
    stop = start + matrix.shape[1] * repeat
    blocks = moved[start:stop].reshape(matrix.shape[1], repeat, *moved.shape[1:])
    mixed = torch.tensordot(matrix.to(tensor.dtype), blocks, dims=([1], [0]))
    mixed = mixed.reshape(-1, *moved.shape[1:])
    if offset is not None:
        mixed = torch.cat([moved[:start], mixed, moved[stop:]], 0)
    return mixed.movedim(0, dim)


class _Body(nn.Module):
    """The model's head input (the classifier's input features) and logits."""

    def __init__(self, model: LeveledModel) -> None:
        super().__init__()
        self.model = model
        self.classifier = classifier_prefix(model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen: list[torch.Tensor] = []

        def keep(_module: nn.Module, args: tuple) -> None:
            seen.append(args[0])

        handle = self.model.get_submodule(self.classifier).register_forward_pre_hook(keep)
        try:
            logits = self.model(x)
        finally:
            handle.remove()
        return seen[-1], logits


def head_input(model: LeveledModel, x: torch.Tensor) -> torch.Tensor:
    """The classifier's input features of ``model`` on ``x``."""
    return _Body(model)(x)[0]


class SpaceSuperNet(nn.Module):
    """The merge/unmerge matrices of every site, the merged LayerNorm parameters, and the
    differentiable merged forward pass of ``K`` frozen base models."""

    def __init__(
        self,
        models: Sequence[LeveledModel],
        inits: dict[str, tuple[torch.Tensor, torch.Tensor]],
        rank: int,
        head_coefficients: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        """``inits[space] = (assign, merge_diagonal)`` for the :class:`FoldableMatrix` of every
        site of that space (unmerge diagonal: ones)."""
        super().__init__()
        self.count = len(models)
        skeleton = copy.deepcopy(models[0]).eval().requires_grad_(False)
        self._body = [_Body(skeleton)]  # not a submodule: its parameters are not learned
        self.states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
        self.register_buffer("head_coefficients", head_coefficients.float().clone())
        modules = dict(skeleton.named_modules())
        self.spaces = {space.name: space for space in feature_spaces(skeleton)}
        self.sites: list[Site] = []
        self.matrices = nn.ModuleDict()
        self.norms = nn.ParameterDict()
        self.plan: dict[str, list[tuple[int, int, int | None, str]] | str] = {}
        site_names: dict[Site, str] = {}
        for space in self.spaces.values():
            assign, diagonal = inits[space.name]
            reference = FoldableMatrix("merge", assign, diagonal, space.size, 0, generator)
            merge_ref = reference.dense().detach()
            for axis in space.axes:
                prefix = _prefix(axis.key)
                if axis.produces and isinstance(modules.get(prefix), NORMS):
                    name = f"n{len(self.norms)}"
                    stacked = torch.cat(
                        [s[axis.key].float().movedim(axis.dim, 0) for s in self.states], 0
                    )
                    value = torch.tensordot(merge_ref.to(stacked.device), stacked, dims=([1], [0]))
                    self.norms[name] = nn.Parameter(value.movedim(0, axis.dim).contiguous())
                    self.plan[axis.key] = name
                    continue
                site = Site(space.name, prefix, axis.produces, axis.offset)
                if site not in site_names:
                    site_names[site] = f"s{len(self.sites)}"
                    self.sites.append(site)
                    kind = "merge" if axis.produces else "unmerge"
                    values = diagonal if axis.produces else torch.ones(len(assign))
                    self.matrices[site_names[site]] = FoldableMatrix(
                        kind, assign, values, space.size, rank, generator
                    )
                entry = self.plan.setdefault(axis.key, [])
                assert isinstance(entry, list)
                entry.append((axis.dim, axis.repeat, axis.offset, site_names[site]))
        for key in self.states[0]:
            self.plan.setdefault(key, [])
        head_prefix = classifier_prefix(skeleton)
        self.head_site = next(
            name for site, name in site_names.items() if site.prefix == head_prefix
        )

    @property
    def model(self) -> LeveledModel:
        return self._body[0].model

    def _blocks(self, name: str, index: int, dense: torch.Tensor) -> torch.Tensor:
        """Model ``index``'s map ``(merged, base)`` of site ``name``: ``M^k`` or ``U^k^T``."""
        matrix = self.matrices[name]
        width = matrix.width
        if matrix.kind == "merge":
            return dense[:, index * width : (index + 1) * width]
        return dense[index * width : (index + 1) * width].T

    def fused_state(self) -> dict[str, torch.Tensor]:
        """The merged model's state dict, differentiable in the SuperNet's parameters."""
        dense = {name: m.dense() for name, m in self.matrices.items()}
        fused: dict[str, torch.Tensor] = {}
        for key, plan in self.plan.items():
            if isinstance(plan, str):
                fused[key] = self.norms[plan]
                continue
            producing = any(self.matrices[site].kind == "merge" for *_, site in plan)
            total = None
            for index, state in enumerate(self.states):
                tensor = state[key]
                if not tensor.is_floating_point():
                    total = tensor
                    break
                for dim, repeat, offset, site in plan:
                    block = self._blocks(site, index, dense[site])
                    tensor = map_axis(tensor, dim, repeat, block, offset)
                if not producing:  # the classifier: a fixed merge of the models' heads
                    tensor = tensor * self.head_coefficients[index]
                total = tensor if total is None else total + tensor
            assert total is not None
            fused[key] = total
        return fused

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged model's head input ``(N, d)`` and logits, differentiably."""
        state = {f"model.{k}": v for k, v in self.fused_state().items()}
        return functional_call(self._body[0], state, (x,))

    def reconstruction(self, x: torch.Tensor) -> torch.Tensor:
        """``U_head (merged features)``: every model's head input reconstructed, ``(N, K d)``."""
        features, _ = self(x)
        return self.matrices[self.head_site](features)

    @torch.no_grad()
    def fold(self) -> LeveledModel:
        """A plain model of model 0's spec computing what the SuperNet computes."""
        model = copy.deepcopy(self.model).requires_grad_(True)
        model.load_state_dict({k: v.detach().clone() for k, v in self.fused_state().items()})
        return model.eval()


@torch.no_grad()
def probe_rows(
    model: LeveledModel, data: torch.Tensor, space: FeatureSpace, batch_size: int = 256
) -> torch.Tensor:
    """The features of ``space`` at its probes on ``data``, as rows ``(R, size)`` (float32), in
    the order the probes fire, batch by batch; the model runs in eval mode on its device. A
    packed attention projection's probe (``"<module>#in_proj:..."``, a user's
    ``nn.MultiheadAttention``) is read by :func:`~fedfuse.models.capture.capture_modules`, probe
    by probe."""
    device = next(model.parameters()).device
    if any("#" in name for name, _ in space.probes):
        captured = capture_modules(
            model, data, space.probes, batch_size=batch_size, device=device, store_device=device
        )
        return torch.cat([captured[probe].float() for probe in space.probes], 0)
    modules = dict(model.named_modules())
    rows: list[torch.Tensor] = []

    def record(probe: int, _module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        moved = output.detach().movedim(space.probes[probe][1], -1)
        rows.append(moved.reshape(-1, moved.shape[-1]).float())

    watched = {i: modules[name] for i, (name, _) in enumerate(space.probes)}
    with hooked(watched, record):
        run_batches(model, data, batch_size=batch_size, device=device)
    return torch.cat(rows, 0)
