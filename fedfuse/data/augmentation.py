"""Random crops and horizontal flips of images, written once.

* :func:`random_crop_flip` is the per-sample crop/flip that the sites' training and fine-tuning
  apply to each batch.
* :func:`augment_fusion_set` expands a fusion set with augmented copies of itself before fusion,
  the neuron-interpolation paper's remedy for small fusion sets (Sec. 5.5.1, Table 6: 1K samples
  plus augmentations closes most of the gap to 5K samples). :func:`augment_dataset` does the same
  for an :class:`~fedfuse.data.ImageDataset` (its raw uint8 images), which is how the
  ``fusion-augment-*`` run-config keys reach every entry point (:meth:`Scenario.fusion_set`).
"""

from __future__ import annotations

import torch

from fedfuse.data import ImageDataset


def random_crop_flip(
    images: torch.Tensor, generator: torch.Generator, *, padding: int = 4, flip: bool = True
) -> torch.Tensor:
    """A new batch: each image cropped at a random offset from its zero-padded version, then
    mirrored left-right with probability 1/2 (when ``flip``); the size is unchanged.

    Zero padding means black pixels for raw uint8 images (as torchvision's ``RandomCrop``) and
    the channel mean for normalised inputs. Offsets are drawn from ``generator`` (rows, columns,
    then flips), one per image; any dtype and device work.
    """
    if images.ndim != 4:
        raise ValueError(
            f"random crops and flips need images (N, C, H, W), got shape {tuple(images.shape)}"
        )
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    n, c, h, w = images.shape
    padded = images.new_zeros((n, c, h + 2 * padding, w + 2 * padding))
    padded[:, :, padding : padding + h, padding : padding + w] = images
    rows = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator) + torch.arange(h)
    cols = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator) + torch.arange(w)
    device = images.device
    out = padded[
        torch.arange(n, device=device)[:, None, None, None],
        torch.arange(c, device=device)[None, :, None, None],
        rows.to(device)[:, None, :, None],
        cols.to(device)[:, None, None, :],
    ]
    if flip:
        mirrored = (torch.rand(n, generator=generator) < 0.5).to(device)
        out[mirrored] = out[mirrored].flip(-1)
    return out


def augment_fusion_set(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    copies: int,
    seed: int,
    flip: bool = True,
    crop_padding: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fusion set followed by ``copies`` augmented copies of it: ``(1 + copies) * N`` rows.

    Copy ``k`` holds every image of ``inputs`` once, randomly cropped (by up to ``crop_padding``
    pixels from the zero-padded image) and, when ``flip``, mirrored left-right with probability
    1/2; ``labels`` are repeated alongside. Deterministic for one ``seed``; the originals come
    first, unchanged. Flips suit natural images; turn them off where left and right differ
    (digits, text).

    Args:
        inputs: images ``(N, C, H, W)`` (raw uint8 or normalised floats).
        labels: ``(N,)`` class labels.
        copies: augmented copies to append (0 gives the set back).
        seed: seed of the crops and flips.
        flip, crop_padding: as above.

    Raises:
        ValueError: ``inputs`` are not images (flat ``(N, D)`` vectors cannot be cropped or
            flipped), the sizes disagree, or ``copies`` or ``crop_padding`` is negative.
    """
    if inputs.ndim != 4:
        raise ValueError(
            f"augment_fusion_set needs image inputs (N, C, H, W), got shape "
            f"{tuple(inputs.shape)}; flat inputs cannot be cropped or flipped"
        )
    if labels.ndim != 1 or len(labels) != len(inputs):
        raise ValueError(
            f"augment_fusion_set: {len(inputs)} images but labels of shape {tuple(labels.shape)}"
        )
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise ValueError(f"copies must be an integer >= 0, got {copies!r}")
    if crop_padding < 0:
        raise ValueError(f"crop_padding must be >= 0, got {crop_padding}")
    generator = torch.Generator().manual_seed(seed)
    parts = [inputs]
    parts += [
        random_crop_flip(inputs, generator, padding=crop_padding, flip=flip) for _ in range(copies)
    ]
    return torch.cat(parts), labels.repeat(copies + 1)


def augment_dataset(
    dataset: ImageDataset, *, copies: int, seed: int, flip: bool = True, crop_padding: int = 4
) -> ImageDataset:
    """:func:`augment_fusion_set` of a dataset's raw images: a new dataset (same classes and
    normalisation) of ``(1 + copies) * len(dataset)`` samples, the originals first."""
    images, labels = augment_fusion_set(
        dataset.images,
        dataset.labels,
        copies=copies,
        seed=seed,
        flip=flip,
        crop_padding=crop_padding,
    )
    return ImageDataset(
        images=images,
        labels=labels,
        num_classes=dataset.num_classes,
        mean=dataset.mean,
        std=dataset.std,
        name=f"{dataset.name}+aug(x{copies})" if copies else dataset.name,
    )
