import pytest
import torch

from fedfuse.cli.main import main
from fedfuse.data import load_dataset, save_npz_dataset
from fedfuse.federation.offline import (
    FusionSetSpec,
    format_level_summary,
    fuse_checkpoints,
    parse_data_spec,
    parse_options,
)
from fedfuse.io.checkpoint import load_checkpoint, save_checkpoint
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.importance import importance_scores
from fedfuse.training.loop import TrainConfig, train

SPEC = mlp_spec((1, 8, 8), 10, (32,))
QUICK = TrainConfig(epochs=3, batch_size=128, lr=1e-2)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", "train")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, digits):
    """Two MLPs trained on disjoint halves of digits, saved with conductance scores."""
    folder = tmp_path_factory.mktemp("ckpts")
    paths = []
    for seed in (0, 1):
        half = digits.subset(torch.arange(seed, len(digits), 2))
        model = build_model(SPEC, seed=seed)
        train(model, half, QUICK, seed=seed, progress=False)
        scores = importance_scores(
            model, half.inputs()[:64], half.labels[:64], method="conductance", n_steps=4
        )
        metadata = {
            "num_examples": len(half),
            "class_counts": torch.bincount(half.labels, minlength=10).tolist(),
        }
        path = folder / f"m{seed}.safetensors"
        paths.append(save_checkpoint(path, model, scores=scores, metadata=metadata))
    return paths


def run_fuse(argv):
    return main(["fuse", *map(str, argv)])


def fuse_args(checkpoints, output, *extra):
    return [*checkpoints, "--fusion-data", "digits:train:200:0", "--output", output, *extra]


def test_fuse_writes_a_loadable_checkpoint_naming_method_and_sources(tmp_path, checkpoints, capsys):
    output = tmp_path / "fused.safetensors"
    assert run_fuse(fuse_args(checkpoints, output, "--method", "kf-linear")) == 0
    fused = load_checkpoint(output)
    assert fused.model.spec == SPEC
    meta = fused.metadata
    assert meta["method"] == "kf-linear"
    assert meta["sources"] == [str(p) for p in checkpoints]
    assert meta["fusion_seconds"] > 0 and meta["fusion_examples"] == 200
    assert [level["level"] for level in meta["details"]["levels"]] == ["0:Linear", "2:Linear"]
    out = capsys.readouterr().out
    assert "grouping err" in out and "unreachable" in out and "repr. cost" in out
    assert "fusion time" in out


def test_kf_linear_fuses_into_other_widths_with_options(tmp_path, checkpoints):
    output = tmp_path / "wide.safetensors"
    argv = fuse_args(checkpoints, output, "--target-widths", "48", "--option", "seed=3")
    argv += ["--option", "ridge=null"]
    assert run_fuse(argv) == 0
    fused = load_checkpoint(output)
    assert fused.model.spec.widths == (48,)
    assert fused.metadata["options"] == {"seed": 3, "ridge": None}
    assert fused.metadata["resolved_options"]["n_init"] == 1


def test_test_data_prints_the_accuracy_table(tmp_path, checkpoints, capsys):
    output = tmp_path / "fused.safetensors"
    assert run_fuse(fuse_args(checkpoints, output, "--test-data", "digits:test")) == 0
    out = capsys.readouterr().out
    assert "base model 1" in out and "ensemble" in out and "fused: kf-linear" in out
    assert "(test set: 360 examples)" in out


def test_library_call_and_level_summary(checkpoints, digits):
    result, loaded = fuse_checkpoints(
        checkpoints, "hf-linear", fusion_data=digits.subset(range(100))
    )
    assert len(loaded) == 2 and result.model.spec == SPEC
    summary = format_level_summary(result)
    assert "variant: hungarian-linear" in summary and "rank" in summary
    # a method without a fusion set or scores: FedAvg from the checkpoints' num_examples
    result, _ = fuse_checkpoints(checkpoints, "fedavg")
    assert result.details["weights"] == pytest.approx([0.5, 0.5], abs=0.01)
    assert "no per-level details" in format_level_summary(result)


@pytest.fixture
def existing(tmp_path):
    """A pre-existing output file that a failed command must leave untouched."""
    path = tmp_path / "out.safetensors"
    path.write_bytes(b"previous result")
    return path


def assert_failed(capsys, existing, *needles):
    err = capsys.readouterr().err
    assert err.startswith("fedfuse fuse: error:"), err
    for needle in needles:
        assert needle in err, err
    assert existing.read_bytes() == b"previous result"


def test_corrupt_checkpoint_exits_2_naming_it(tmp_path, checkpoints, existing, capsys):
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00garbage" * 20)
    assert run_fuse(fuse_args([checkpoints[0], corrupt], existing)) == 2
    assert_failed(capsys, existing, "corrupt.safetensors", "not a readable safetensors")


def test_an_output_that_is_an_input_is_refused(tmp_path, capsys):
    """`fedfuse fuse a b --output a` overwrote the upload a."""
    from fedfuse.models import mlp_spec

    spec = mlp_spec((1, 8, 8), 10, (8,))
    a, b = (save_checkpoint(tmp_path / f"{n}.safetensors", build_model(spec)) for n in "ab")
    before = a.read_bytes()
    assert run_fuse([a, b, "--method", "fedavg", "--output", a]) == 2
    assert "is one of the inputs" in capsys.readouterr().err and a.read_bytes() == before


def test_missing_scores_exit_2_unless_not_needed(tmp_path, checkpoints, existing, capsys):
    bare = save_checkpoint(tmp_path / "bare.safetensors", load_checkpoint(checkpoints[1]).model)
    assert run_fuse(fuse_args([checkpoints[0], bare], existing)) == 2
    assert_failed(capsys, existing, "bare.safetensors", "use_scores")
    # uniform weights, or a method that ignores scores, need none
    output = tmp_path / "uniform.safetensors"
    argv = fuse_args([checkpoints[0], bare], output, "--option", "use_scores=false")
    assert run_fuse(argv) == 0 and output.is_file()
    assert run_fuse(fuse_args([checkpoints[0], bare], output, "--no-scores")) == 0
    assert run_fuse([checkpoints[0], bare, "--method", "vanilla", "--output", output]) == 0


def test_mismatched_architecture_exits_2(tmp_path, checkpoints, existing, capsys):
    deeper = build_model(mlp_spec((1, 8, 8), 10, (32, 32)), seed=0)
    other = save_checkpoint(tmp_path / "deeper.safetensors", deeper)
    assert run_fuse(fuse_args([checkpoints[0], other], existing)) == 2
    assert_failed(capsys, existing, "deeper.safetensors", "does not match", "m0.safetensors")


def test_unknown_option_exits_2(checkpoints, existing, capsys):
    assert run_fuse(fuse_args(checkpoints, existing, "--option", "bogus=1")) == 2
    assert_failed(capsys, existing, "'bogus'", "kf-linear")
    assert run_fuse(fuse_args(checkpoints, existing, "--option", "n_init=many")) == 2
    assert_failed(capsys, existing, "n_init", "int")


def test_malformed_data_spec_exits_2(checkpoints, existing, capsys):
    argv = [*checkpoints, "--fusion-data", "digits:train:lots", "--output", existing]
    assert run_fuse(argv) == 2
    assert_failed(capsys, existing, "'digits:train:lots'", "sample count")
    assert run_fuse(fuse_args(checkpoints, existing, "--test-data", "digits:validation")) == 2
    assert_failed(capsys, existing, "'digits:validation'", "split")


def test_parse_data_spec_npz_and_seeded_sample(tmp_path, digits):
    sample = parse_data_spec("digits:train:50:3")
    assert len(sample) == 50 and sample.num_classes == 10
    again = parse_data_spec("digits:train:50:3")
    assert torch.equal(sample.images, again.images) and torch.equal(sample.labels, again.labels)
    assert not torch.equal(parse_data_spec("digits:train:50:4").labels, sample.labels)
    assert len(parse_data_spec("digits:test")) == 360 and len(parse_data_spec("digits")) == 1437

    path = save_npz_dataset(tmp_path / "site.npz", digits.subset(range(30)))
    site = parse_data_spec(str(path))
    assert len(site) == 30 and torch.equal(site.images, digits.images[:30])

    for bad in ("", "digits:train:0", "digits:train:5:x", "a:b:c:d:e", ":train"):
        with pytest.raises(ValueError, match="data spec"):
            FusionSetSpec.parse(bad)
    with pytest.raises(ValueError, match="asks for 5000 samples"):
        parse_data_spec("digits:train:5000")


def test_parse_options_reads_json_else_strings():
    options = parse_options(["a=1", "b=0.5", "c=true", "d=False", "e=null", "f=setting2"])
    assert options == {"a": 1, "b": 0.5, "c": True, "d": False, "e": None, "f": "setting2"}
    with pytest.raises(ValueError, match="key=value"):
        parse_options(["novalue"])
