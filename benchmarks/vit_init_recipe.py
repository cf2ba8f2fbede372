"""Why torchvision's small ViT trails fedfuse's own ViT of the same shape on short recipes.

issue 49 compares fused torchvision models with fedfuse's own architecture "trained with the same
recipe". For the ViT (16 patches of 7x7, 2 layers, 2 heads, hidden 32, MLP 64;
:func:`fedfuse.experiments.user_models.torchvision_vit`) the sites of the short recipe (3 epochs
of 3000 images) trained 5-10 points apart, and the fused models followed. This benchmark trains
ONE site (site 0 of 4 Dirichlet sites, the split of ``plain_models``) by fedfuse's training loop
(AdamW, lr 1e-3, one warm-up epoch, cosine) from three starts:

* ``torchvision``: the model as torchvision initialises it (zero-initialised head, Xavier MLP
  and attention projections);
* ``torchvision, default init``: the same class with every ``nn.Linear`` (the head and the MLPs)
  reset to PyTorch's default initialisation, the attention's input projection drawn as three
  default ``nn.Linear`` s, as fedfuse's ViT has them;
* ``fedfuse``: fedfuse's own ViT of that shape (:data:`fedfuse.experiments.user_models.OWN_SPECS`).

and prints each one's test accuracy (%), per recipe and seed. If only the start matters, the
second column follows the third and the gap closes as the recipe lengthens.

Run (one thread, about 10 minutes)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vit_init_recipe.py

Measured (2026-11-29, 2-core machine shared with other jobs; test accuracy %):

====== ====== ==== =========== ========================= =======
epochs images seed torchvision torchvision, default init fedfuse
====== ====== ==== =========== ========================= =======
3      3000   0    44.91       53.20                     51.98
3      3000   1    42.14       52.88                     49.57
10     8000   0    69.86       76.94                     77.18
10     8000   1    75.52       76.04                     78.06
20     14363  0    82.07       82.70                     82.44
20     14363  1    82.39       82.25                     82.27
====== ====== ==== =========== ========================= =======

The start alone makes the short recipes' gap: with PyTorch's default initialisation the same
torchvision class trains as fedfuse's ViT, and trained to convergence (20 epochs of the whole
share) the three are within half a point.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from fedfuse.data import load_dataset
from fedfuse.experiments.user_models import OWN_SPECS, USER_MODELS
from fedfuse.models import build_model
from fedfuse.partitions import partition_labels
from fedfuse.training.loop import TrainConfig, train

#: (epochs, images of the site kept; 0: all of them)
RECIPES = ((3, 3000), (10, 8000), (20, 0))


def _default_init(model: nn.Module) -> nn.Module:
    """torchvision's ViT with PyTorch's default initialisation of its linear maps."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, nn.MultiheadAttention):
            width = module.embed_dim
            for part in range(3):  # q, k, v as three default Linears
                linear = nn.Linear(width, width)
                rows = slice(part * width, (part + 1) * width)
                module.in_proj_weight.data[rows] = linear.weight.data
                module.in_proj_bias.data[rows] = linear.bias.data
    return model


STARTS: dict[str, Callable[[], nn.Module]] = {
    "torchvision": USER_MODELS["vit"],
    "torchvision, default init": lambda: _default_init(USER_MODELS["vit"]()),
    "fedfuse": lambda: build_model(OWN_SPECS["vit"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_set, test_set = (
        load_dataset("fashion-mnist", "train"),
        load_dataset("fashion-mnist", "test"),
    )
    part = partition_labels("dirichlet", train_set.labels.numpy(), 4, seed=0, alpha_min=0.5)[0]
    x_test, y_test = test_set.inputs(), test_set.labels
    print("| epochs | images | seed | " + " | ".join(STARTS) + " |")
    print("| --: | --: | --: |" + " --: |" * len(STARTS))
    for epochs, images in RECIPES:
        generator = torch.Generator().manual_seed(0)
        kept = part[torch.randperm(len(part), generator=generator).numpy()]
        share = train_set.subset(kept[:images] if images else kept)
        for seed in args.seeds:
            accuracies = []
            for build in STARTS.values():
                torch.manual_seed(seed)
                model = build()
                train(model, share, TrainConfig(epochs=epochs), seed=seed, progress=False)
                model.eval()
                with torch.no_grad():
                    hits = (model(x_test).argmax(1) == y_test).float().mean().item()
                accuracies.append(f"{100 * hits:.2f}")
            print(f"| {epochs} | {len(share)} | {seed} | " + " | ".join(accuracies) + " |")


if __name__ == "__main__":
    main()
