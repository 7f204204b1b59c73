"""Unit tests of common/: no processes are launched here."""

import pytest
import torch

from common.cli import build_parser, parse_config
from common.config import SCHEDULES, STRATEGIES, Config
from common.data import GlobalBatchSampler, longest_shard, shard_range
from common.digits import make_digits
from common.errors import ConfigError
from common.model import BabyCNN, build_model
from common.model_sizes import MODEL_SIZES, blocks, max_stages, parameter_count, stage_starts, tp_layer_params, tp_pairs
from common.model_sizes import layers as size_layers
from common.pipeline import split_model
from common.versions import NEEDS_TP
from tests.helpers import needs_torch


# ---------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("in_channels,image_size", [(1, 28), (3, 32)])
def test_model_shapes(in_channels, image_size):
    model = BabyCNN(in_channels=in_channels, image_size=image_size, num_classes=10)
    logits = model(torch.randn(5, in_channels, image_size, image_size))
    assert logits.shape == (5, 10)
    assert model.norm.normalized_shape == (64, image_size - 4, image_size - 4)


def test_initial_weights_depend_on_the_seed_alone():
    torch.manual_seed(123)  # the global RNG must not matter
    a = build_model(seed=7, in_channels=1, image_size=28, num_classes=10, dropout=0.1)
    torch.rand(100)
    b = build_model(seed=7, in_channels=1, image_size=28, num_classes=10, dropout=0.1)
    c = build_model(seed=8, in_channels=1, image_size=28, num_classes=10, dropout=0.1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.conv1.weight, c.conv1.weight)


@pytest.mark.parametrize("size,n_stages", [*(("baby", n) for n in range(1, 9)), ("small", 4), ("small", 8)])
def test_split_model_is_the_model_in_pieces(size, n_stages):
    model = build_model(size=size, seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.0).eval()
    x = torch.randn(3, 1, 28, 28)
    stages = split_model(model, stage_starts(size, n_stages))
    assert len(stages) == n_stages
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    # the stages keep the model's parameter names, and together hold each parameter exactly once
    names = [name for stage in stages for name in stage.state_dict()]
    assert sorted(names) == sorted(model.state_dict())
    assert all(next(iter(stage._modules)) != "fc1" for stage in stages), "flatten must open its stage"


def test_a_cut_refuses_too_many_stages():
    for size in MODEL_SIZES:
        with pytest.raises(ValueError, match=f"1 to {max_stages(size)}"):
            stage_starts(size, max_stages(size) + 1)


@pytest.mark.parametrize("size", MODEL_SIZES)
def test_the_sizes_numbers_are_the_models(size):
    # common/model_sizes.py says what each size holds without torch (the preflight, the planner's formulas, the
    # cut): it must be the model the scripts build, layer by layer (on the meta device: 7b allocates nothing)
    with torch.device("meta"):
        model = BabyCNN(size=size)
    counted = {name: sum(p.numel() for p in layer.parameters()) for name, layer in model.named_children()}
    assert [(layer.name, layer.params) for layer in size_layers(size)] == list(counted.items())
    assert parameter_count(size) == sum(p.numel() for p in model.parameters())
    assert parameter_count("baby") == 1_273_610


def test_the_larger_sizes_are_cut_into_stages_of_equal_cost():
    # medium's 4 stages: the costliest is at most the cheapest that any cut of its layers at allowed places can
    # reach; here within 35% of a perfectly even split (the layers come in lumps)
    costs = {layer.name: 3 * layer.flops for layer in size_layers("medium")}
    names = list(costs)
    starts = stage_starts("medium", 4)
    bounds = [names.index(s) for s in starts] + [len(names)]
    stages = [sum(costs[n] for n in names[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(stages) <= 1.35 * sum(stages) / 4, stages
    assert "fc1" not in starts and starts[0] == "conv1"


# ---------------------------------------------------------------------------------------------- sampler
def test_sampler_covers_each_index_once_per_epoch_and_epochs_differ():
    sampler = GlobalBatchSampler(1000, 100, seed=3)
    assert sampler.steps_per_epoch == 10 and sampler.left_out_per_epoch == 0
    epochs = [torch.cat([sampler.global_batch(s) for s in range(1 + 10 * e, 11 + 10 * e)]) for e in range(3)]
    for indices in epochs:
        assert torch.equal(indices.sort().values, torch.arange(1000))
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_slices_are_disjoint_and_rebuild_the_global_batch(world_size):
    sampler = GlobalBatchSampler(2000, 96, seed=0)
    for step in (1, 2, 21, 22, 40):  # both sides of an epoch boundary (20 steps per epoch)
        slices = [sampler.rank_batch(step, r, world_size) for r in range(world_size)]
        assert all(len(s) == 96 // world_size for s in slices)
        assert torch.equal(torch.cat(slices), sampler.global_batch(step))
        assert len(set(torch.cat(slices).tolist())) == 96


def test_global_batches_do_not_depend_on_world_size_or_a_fresh_sampler():
    a, b = GlobalBatchSampler(2000, 96, seed=5), GlobalBatchSampler(2000, 96, seed=5)
    for step in (30, 1, 7, 30):  # any order: resuming at step s needs only s
        assert torch.equal(a.global_batch(step), b.global_batch(step))
    assert not torch.equal(a.global_batch(1), GlobalBatchSampler(2000, 96, seed=6).global_batch(1))


def test_sampler_reports_samples_left_out_per_epoch():
    sampler = GlobalBatchSampler(1000, 96, seed=0)
    assert (sampler.steps_per_epoch, sampler.left_out_per_epoch) == (10, 40)
    with pytest.raises(ConfigError, match="--batch-size: the global batch 96 is larger than the training set"):
        GlobalBatchSampler(50, 96, seed=0)


def test_shard_range_balances_and_covers():
    for n, world in [(10, 3), (2000, 4), (2001, 4), (3, 4), (0, 2)]:
        shards = [shard_range(n, r, world) for r in range(world)]
        assert [i for s in shards for i in s] == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        assert max(map(len, shards)) == longest_shard(n, world)


# ---------------------------------------------------------------------------------------------- data
def test_digits_are_deterministic_balanced_and_distinct_between_splits():
    (images, labels), (images_b, labels_b) = make_digits(600, seed=0), make_digits(600, seed=0)
    assert torch.equal(images, images_b) and torch.equal(labels, labels_b)
    assert images.shape == (600, 1, 28, 28) and images.dtype == torch.uint8
    assert not torch.equal(make_digits(600, seed=1)[0], images)
    assert not torch.equal(make_digits(600, seed=0, test=True)[0], images)
    counts = torch.bincount(labels, minlength=10)
    assert counts.min() > 30  # every digit present, roughly balanced
    # images of the same digit vary (position, shape, noise): they are not copies of a template
    ones = images[labels == 1].float()
    assert (ones[0] - ones[1]).abs().mean() > 5


# ---------------------------------------------------------------------------------------------- config
def test_every_flag_has_help_from_the_field_docs():
    for strategy in STRATEGIES:
        for action in build_parser(strategy)._actions:
            if action.dest != "help":
                assert action.help and len(action.help) > 10, action.dest


def test_flags_are_limited_to_their_strategy():
    assert parse_config("fsdp", ["--sharding", "grad-op"]).sharding == "grad-op"
    with pytest.raises(ConfigError, match="unrecognized arguments: --sharding"):
        parse_config("ddp", ["--sharding", "full"])
    assert parse_config("pippy", ["--schedule", SCHEDULES[0]]).schedule == SCHEDULES[0]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--dataset", "imagenet"], "--dataset"),
        (["--optimizer", "lamb"], "--optimizer"),
        (["--lr", "0"], "--lr"),
        (["--lr", "-1e-3"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "abc"], "--lr"),
        (["--epochs", "-1"], "--epochs"),
        (["--max-steps", "-1"], "--max-steps"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "12.5"], "--batch-size"),
        (["--dropout", "1"], "--dropout"),
        (["--precision", "fp8"], "--precision"),
        (["--batch-size", "10", "--grad-accum-steps", "3"], "--grad-accum-steps"),
        (["--model", "transformer"], "--model"),
        (["--model", "vit", "--model-size", "7b"], "--model-size"),  # a size of the other model
        (["--patch-size", "7"], "--patch-size"),  # a flag of the ViT given to BabyCNN
        (["--heads", "4"], "--heads"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as error:
        parse_config("ddp", argv)
    assert flag in str(error.value) and "\n" not in str(error.value)


def test_world_size_must_divide_the_global_batch():
    parse_config("ddp", ["--batch-size", "96"], world_size=3)
    with pytest.raises(ConfigError, match="--batch-size: the global batch 128 .* 3 processes; use a multiple of 3"):
        parse_config("ddp", [], world_size=3)
    with pytest.raises(ConfigError, match="--batch-size"):
        parse_config("ddp", ["--batch-size", "96", "--grad-accum-steps", "2"], world_size=5)


@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=() if s != "tp" else needs_torch(NEEDS_TP)) for s in STRATEGIES]
)
def test_defaults_are_valid_for_every_strategy(strategy):
    cfg = parse_config(strategy, [], world_size=4)
    assert cfg.out == f"runs/{strategy}" and isinstance(cfg, Config)


@pytest.mark.parametrize("size", ["baby", "small", "medium"])
def test_the_model_says_how_it_is_split_as_the_sizes_table_does(size):
    """BabyCNN's own blocks (FSDP's units) and TP plan, which the wraps take, are the layers the torch-free
    model_sizes.py reasons about before torchrun starts (the memory wall, the planner's tables)."""
    model = BabyCNN(size=size)
    names = {id(layer): name for name, layer in model.named_children()}
    assert [[names[id(layer)] for layer in block] for block in model.blocks()] == blocks(size)
    plan = model.tp_plan()
    assert list(plan) == [name for pair in tp_pairs(size) for name in pair]
    assert [type(plan[col]).__name__ for col, _ in tp_pairs(size)] == ["ColwiseParallel"] * len(tp_pairs(size))
    assert [type(plan[row]).__name__ for _, row in tp_pairs(size)] == ["RowwiseParallel"] * len(tp_pairs(size))


@needs_torch(NEEDS_TP)
def test_tp_splits_the_classifier_in_pairs_and_refuses_a_width_it_cannot_split():
    from runner.layout import check_layout

    assert tp_pairs("baby") == [("fc1", "fc2")]
    assert tp_pairs("small") == [("fc1", "hidden1"), ("hidden2", "hidden3")]  # fc2, the fifth, stays whole
    model = BabyCNN(size="small")
    held = tp_layer_params("small", 4)
    assert held["fc1"] == sum(p.numel() for p in model.fc1.parameters()) / 4  # column-wise: weight and bias
    assert held["hidden1"] == model.hidden1.weight.numel() / 4 + model.hidden1.bias.numel()  # row-wise: weight
    assert held["fc2"] == sum(p.numel() for p in model.fc2.parameters()) and held["conv2"] == 64 * 32 * 9 + 64
    assert tp_layer_params("small", 1) == {layer.name: layer.params for layer in size_layers("small")}
    parse_config("tp", ["--dp", "2"], world_size=8)  # 2 replicas x 4-way TP
    with pytest.raises(ConfigError, match="width 128 does not split over 3 TP ranks"):
        check_layout(parse_config("tp", [], world_size=3), 3)
    with pytest.raises(ConfigError, match="--dp: 3 does not divide the world size 4"):
        parse_config("tp", ["--dp", "3"], world_size=4)
    with pytest.raises(ConfigError, match="unrecognized arguments: --sharding"):
        parse_config("tp", ["--sharding", "full"])
    # the ViT: each TP rank computes whole heads, so TP must divide the heads (and the MLP's width), not the width
    check_layout(parse_config("tp", ["--model", "vit"], world_size=4), 4)  # 4 heads over 4
    with pytest.raises(ConfigError, match=r"^--heads: 2 heads \(MLP width 256\) do not split over 4 TP ranks .*1, 2 "):
        check_layout(parse_config("tp", ["--model", "vit", "--heads", "2"], world_size=4), 4)
    check_layout(parse_config("tp", ["--model", "vit", "--heads", "2", "--dp", "2"], world_size=4), 4)  # 2 x 2
    # sequence parallel: every TP rank an equal share of the tokens (16 in 7 x 7 patches; 49 in 4 x 4)
    sp = ["--model", "vit", "--sequence-parallel"]
    check_layout(parse_config("tp", sp, world_size=4), 4)
    with pytest.raises(ConfigError, match=r"^--sequence-parallel: the 49 tokens .* over 4 TP ranks.* 7 \(16 tokens\)"):
        check_layout(parse_config("tp", [*sp, "--patch-size", "4"], world_size=4), 4)
    check_layout(parse_config("tp", [*sp, "--patch-size", "4", "--dp", "4"], world_size=4), 4)  # 1 TP rank


# ---------------------------------------------------------------------------------------------- the ViT
# Published parameter counts: ViT-Ti/16 and -S/16 (DeiT, Touvron et al. 2021), -B/16, -L/16, -H/14 (Dosovitskiy et
# al. 2021), -g/14 (Zhai et al. 2022, "Scaling Vision Transformers"), ViT-22B (Dehghani et al. 2023)
PUBLISHED_PARAMETERS = {
    "ti16": 5.7e6,
    "s16": 22.1e6,
    "b16": 86.6e6,
    "l16": 304.3e6,
    "h14": 632.2e6,
    "g14": 1011e6,
    "22b": 21743e6,
}


@pytest.mark.parametrize("size", PUBLISHED_PARAMETERS)
def test_the_published_vit_sizes_have_their_published_parameter_counts(size):
    """At 224 x 224 with 1,000 classes, as they were published (mean pooling where they had a class token)."""
    assert parameter_count(size, model="vit") == pytest.approx(PUBLISHED_PARAMETERS[size], rel=0.01)


@pytest.mark.parametrize("size", ["baby", "small", "b16"])
def test_the_vit_is_its_sizes_table_and_says_how_it_is_split(size):
    from common.model_sizes import input_shape

    channels, side, classes = input_shape("vit", size)
    with torch.device("meta"):
        model = build_model(model="vit", size=size, seed=0, in_channels=channels, image_size=side, num_classes=classes)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(size, model="vit")
    assert [name for name, _ in model.named_children()] == [layer.name for layer in size_layers(size, model="vit")]
    names = {id(layer): name for name, layer in model.named_children()}
    assert [[names[id(block)]] for block in model.blocks()] == blocks(size, model="vit")  # FSDP's units
    plan = model.tp_plan()  # Megatron's split of every block: whole heads, whole MLP halves
    assert {type(plan[f"block0.attn.{p}"]).__name__ for p in "qkv"} == {"ColwiseParallel"}
    assert type(plan["block0.attn.proj"]).__name__ == type(plan["block0.mlp.fc2"]).__name__ == "RowwiseParallel"


def test_the_vit_trains_on_the_digits_in_its_own_recipe():
    cfg = parse_config("ddp", ["--model", "vit"])
    model = build_model(**cfg.model_kwargs(), in_channels=1, image_size=28, num_classes=10)
    x = torch.randn(3, 1, 28, 28)
    assert model(x).shape == (3, 10) and model.embed(x).shape == (3, 16, 64)  # 16 tokens: they split over 2, 4, 8
    assert (cfg.epochs, cfg.lr_schedule) == (8, "cosine")  # the ViT's defaults (docs/transformer.md)
    assert (parse_config("ddp", []).epochs, parse_config("ddp", []).lr_schedule) == (2, "constant")  # BabyCNN's
    # FSDP's units: a unit per block for the ViT, BabyCNN one unit (its fc1 is 93 % of it), unless told
    assert [parse_config("fsdp", f).shard_units for f in (["--model", "vit"], [])] == ["blocks", "model"]
    assert parse_config("fsdp", ["--model", "vit", "--shard-units", "model"]).shard_units == "model"
    a, b = (build_model(**cfg.model_kwargs(), in_channels=1, image_size=28, num_classes=10) for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # from the seed alone
    stages = split_model(a.eval(), stage_starts("baby", 3, model="vit"))
    assert torch.allclose(torch.nn.Sequential(*stages)(x), a(x))
    assert stage_starts("baby", 3, model="vit")[0] == "embed" and max_stages("baby", model="vit") == 6


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--model", "vit", "--model-size", "b16"], "--patch-size"),  # its patch 16 does not divide 28 pixels
        (["--model", "vit", "--patch-size", "5"], "--patch-size"),
        (["--model", "vit", "--heads", "5"], "--heads"),  # the width 64 in 5 heads
    ],
)
def test_what_the_vit_shape_does_not_allow_is_one_line(argv, flag):
    """Before torchrun (the runners' preflight) and where BabyViT is built (a script run without the runner)."""
    from common.model import build_model
    from runner.layout import check_layout

    cfg = parse_config("ddp", argv)
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        check_layout(cfg, 4)
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        build_model(**cfg.model_kwargs(), in_channels=1, image_size=28, num_classes=10)
