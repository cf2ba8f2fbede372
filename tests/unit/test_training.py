import torch

from fedfuse.data import load_dataset
from fedfuse.models import build_model, mlp_spec
from fedfuse.training.loop import TrainConfig, _augment, evaluate, train


def test_training_learns_digits_and_is_deterministic():
    data = load_dataset("digits", "train")
    test = load_dataset("digits", "test")
    config = TrainConfig(epochs=4, batch_size=64, lr=3e-3, warmup_epochs=0.5)
    spec = mlp_spec(data.input_shape, 10, (32,))
    before = evaluate(build_model(spec, seed=0), test, device="cpu").accuracy
    runs = []
    for _ in range(2):
        model = build_model(spec, seed=0)
        losses = train(model, data, config, seed=5, device="cpu", progress=False)
        runs.append((losses, model))
    assert runs[0][0] == runs[1][0]
    assert runs[0][0][-1] < runs[0][0][0]
    after = evaluate(runs[0][1], test, device="cpu")
    assert after.accuracy > 0.85 > before
    assert after.num_examples == len(test)


def test_augmentation_crops_and_flips_within_bounds():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float).view(2, 3, 8, 8)
    out = _augment(x, torch.Generator().manual_seed(0), padding=2)
    assert out.shape == x.shape
    # every output pixel is an input pixel or padding zero
    assert set(out.unique().tolist()) <= set(x.unique().tolist()) | {0.0}
