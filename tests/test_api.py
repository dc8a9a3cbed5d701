"""zerofunc.initialize: DeepSpeed's four lines train any nn.Module exactly like one device; a language model's
loss is the global batch's token mean, however its ignored targets (-100) fall on ranks and micro-steps."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import zerofunc
from tests.bare import in_world
from tests.modules import MODULES, OPTIM, AdaptedLM, PartlyRunLM, ResidualMLP, SequentialLM, TokenMLP, micro_batches
from tests.steps import check_steps, record_step
from zerofunc.api import default_units
from zerofunc.step import train_step
from zerofunc.stages import STAGES


def four_lines(stage: int, accum: int, kind: str):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MODULES[kind]()
    reference = copy.deepcopy(model)
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
                                         "zero_optimization": {"stage": stage}, "optimizer": OPTIM})
    units = [u.name for u in engine.units]
    released = all(p.device.type == "meta" for p in model.parameters())
    initial = engine.full_parameters()
    same_start = all(torch.equal(initial[n], p.detach()) for n, p in reference.named_parameters())
    steps_like_one_device(engine, reference, kind, accum, f"{kind}, stage {stage}")
    return units, released, same_start


def steps_like_one_device(engine, reference: nn.Module, kind: str, accum: int, what: str) -> float:
    """3 steps of `engine` on `kind`'s micro-batches, micro-step j of data-parallel rank r taking j * N + r, each
    held to `reference` on one device (tests/steps.py); the largest fraction of a budget used."""
    world, rank = engine.data_parallel_size, torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        everyone = micro_batches(kind, world, accum, gen)
        steps.append(record_step(engine, everyone[rank::world], everyone))
    return check_steps(reference, steps, what)


def every_stage(accum: int) -> dict[str, list]:
    return {kind: [four_lines(stage, accum, kind) for stage in STAGES] for kind in MODULES}


@pytest.fixture(scope="module")
def four_lines_world() -> list[dict]:
    """One 2-gloo-rank world trains every stage of both modules (a world per stage cost its start-up each):
    per rank, per module, per stage, four_lines' results."""
    return in_world(2, every_stage, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind, blocks", [("regression", ["blocks.0", "blocks.1", "blocks.2"]),
                                         ("tokens", ["blocks.0", "blocks.1"]),
                                         ("sequential", ["layers.1", "layers.2", "layers.3"]),
                                         ("reused", ["blocks.0", "blocks.1"]),
                                         ("partly run", ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
                                         ("called directly", ["blocks.0", "blocks.1"]),
                                         ("self-checkpointed", ["blocks.0", "blocks.1"]),
                                         ("encoder-decoder", [*(f"encoder.blocks.{i}" for i in range(2)),
                                                              *(f"decoder.blocks.{i}" for i in range(3))])])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_trains_any_module_like_one_device(four_lines_world, stage, kind, blocks):
    """2 gloo ranks, 2 micro-steps per step, DeepSpeed's calls as train_step makes them: the module's own
    weights are released and are where training starts, and each of 3 steps is one device's within fp32
    rounding (tests/steps.py). A language model that takes num_items_in_batch gets the global batch's token
    mean, a regression its micro-batches' mean. The units are the blocks of a ModuleList or a Sequential;
    the Sequential's embedding and tied head are the root's. A block the forward runs three times gets the sum
    of its runs' gradients; one it runs at the first micro-step only, that one's; one it never runs, zero. A
    block whose forward method the model calls directly runs its hooks all the same; one the model checkpoints
    itself is gathered and bound again when backward calls it to recompute it. An encoder's blocks and a decoder's,
    two stacks, are all units, in the modules' order."""
    for units, released, same_start in (per_rank[kind][stage] for per_rank in four_lines_world):
        assert units == ["", *blocks]
        assert released  # the module's own weights are gone; the engine's shards hold them
        assert same_start


def test_initialize_refuses_a_compiled_module():
    """torch.compile(model) would trace the engine's block hooks into dynamo, which fails deep inside the first
    forward: refused at once, in one line that says how to compile instead."""
    with pytest.raises(ValueError, match=r"^initialize takes the model itself, not torch.compile\(model\)"):
        zerofunc.initialize(torch.compile(ResidualMLP()), {"train_batch_size": 1})


class ReadsABlockWeight(TokenMLP):
    """TokenMLP whose loss adds a penalty on its first block's weight, read outside the block's forward."""

    def forward(self, idx, targets, num_items_in_batch=None):
        return super().forward(idx, targets, num_items_in_batch) + 0.01 * self.blocks[0][1].weight.pow(2).sum()


def _loss_or_refusal(model_class, names_tried: tuple) -> list[str]:
    """One stage-3 step of `model_class` with each of `names_tried` as unit_names=: its loss, or what refused it."""
    said = []
    for unit_names in names_tried:
        torch.manual_seed(0)
        engine = zerofunc.initialize(model_class(), {"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIM,
                                                     "zero_optimization": {"stage": 3}}, unit_names=unit_names)
        try:
            said.append(f"loss {train_step(engine, micro_batches('tokens', 1, 1, torch.Generator())).item():.3f}")
        except ValueError as e:
            said.append(str(e))
    return said


def test_a_block_weight_read_outside_the_block_is_refused_in_one_line():
    """A forward that reads a block's weight outside the block's forward, where the engine has not bound it (its
    module holds a released placeholder): refused in one line that names the weight (it failed later, on a meta
    tensor, at some other op), and the remedy it names, the block left out of unit_names=, trains."""
    refused, remedied = in_world(1, _loss_or_refusal, ReadsABlockWeight, (None, ["blocks.1"]))[0]
    assert refused.startswith("the forward read blocks.0.1.weight outside its block's forward"), refused
    assert remedied.startswith("loss "), remedied


def _blocks_run_by_rank(stage: int) -> list[str]:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, PartlyRunLM on sequences of 6 tokens on every rank (each runs its
    second block), then of 6 on rank 0 and 3 on rank 1 (rank 1 does not run it): what each forward said."""
    import os
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read as the engine starts; the process group is already up
    said = []
    for lengths in ((6, 6), (6, 3)):
        torch.manual_seed(0)
        engine = zerofunc.initialize(PartlyRunLM(), {"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIM,
                                                     "zero_optimization": {"stage": stage}})
        ids = torch.randint(0, 19, (2, lengths[engine.comm.rank] + 1), generator=torch.Generator().manual_seed(1))
        try:
            loss = engine(ids[:, :-1], ids[:, 1:])
        except RuntimeError as e:
            said.append(str(e))
            continue
        if lengths[0] == lengths[1]:  # alike: the step goes on (a step of ranks that are not would not pair)
            engine.backward(loss)
            engine.step()
        said.append("ran")
    return said


@pytest.mark.parametrize("stage", [1, 2])
def test_ranks_that_run_different_blocks_are_refused_under_detail_debugging(stage):
    """Blocks of one size: ranks whose forwards ran different blocks (a block run on long sequences only, and
    sequences of another length on each rank) would pair one block's reduction with another's, and no
    collective's shape tells them apart. Under torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, the forward checks,
    before backward's first collective, that every rank ran the same blocks, and says so on every rank."""
    for rank, (alike, apart) in enumerate(in_world(2, _blocks_run_by_rank, stage)):
        assert alike == "ran", alike
        blocks = "blocks.0, blocks.1, blocks.2" if rank == 0 else "blocks.0, blocks.2"
        assert apart == (f"the ranks' forwards ran different blocks (this rank's: {blocks}): every rank must run the "
                         "same blocks, in the same order, in each micro-step"), apart


def test_initialize_rejects_a_bad_config():
    with pytest.raises(zerofunc.ConfigError, match="unknown config key 'zero_optimisation'"):
        zerofunc.initialize(ResidualMLP(), {"train_batch_size": 1, "zero_optimisation": {"stage": 2}})


def _units_sharing_a_weight() -> str:
    try:
        zerofunc.initialize(SequentialLM(), {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                             "optimizer": OPTIM},
                            unit_names=[f"layers.{i}" for i in range(5)])
    except ValueError as e:
        return str(e)
    return "accepted"


def test_units_that_share_a_weight_are_refused():
    """Units named by the caller that split a tied weight (the embedding and its head, each a unit): one unit
    would be gathered without it. Refused in one line, naming both."""
    said = in_world(1, _units_sharing_a_weight)[0]
    assert said.startswith("unit 'layers.4' shares its parameter 'weight' with unit 'layers.0'"), said


def _partly_run_in_shard_groups(stage: int) -> float:
    torch.manual_seed(0)
    model = PartlyRunLM()
    reference = copy.deepcopy(model)
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                         "zero_optimization": {"stage": stage, "shard_group_size": 2,
                                                               "offload_optimizer": {"device": "cpu"}},
                                         "optimizer": OPTIM})
    return steps_like_one_device(engine, reference, "partly run", 2, f"partly run, hybrid stage {stage}, offload")


def _partly_run_at_stages_2_and_3() -> list[float]:
    return [_partly_run_in_shard_groups(stage) for stage in (2, 3)]


@pytest.mark.slow
def test_a_block_the_boundary_does_not_run_is_averaged_over_replicas_and_offloaded():
    """4 gloo ranks in 2 shard groups of 2, optimizer offload: at stages 2-3 PartlyRunLM's second block is
    reduce-scattered at the first micro-step only, and at the boundary its shard must still be averaged over
    the replicas and taken down to the host; each step one device's within fp32 rounding (tests/steps.py)."""
    assert len(in_world(4, _partly_run_at_stages_2_and_3)) == 4  # check_steps asserts inside every rank


class SaysItsLossTakesNoKeywords(TokenMLP):
    """TokenMLP whose forward takes **kwargs that do not reach its loss, and says so as Hugging Face's models do
    (`accepts_loss_kwargs = False`, Qwen2.5-VL's among them): it refuses a keyword, as a module it handed them to
    would."""

    accepts_loss_kwargs = False

    def forward(self, idx, targets, **kwargs):
        if kwargs:
            raise TypeError(f"forward() got unexpected keyword(s) {sorted(kwargs)}")
        return super().forward(idx, targets)


def _own_loss_and_logged() -> tuple[float, float]:
    torch.manual_seed(0)
    model = SaysItsLossTakesNoKeywords()
    batch = micro_batches("tokens", 1, 1, torch.Generator().manual_seed(1))
    own = model(*batch[0]).item()
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIM})
    return own, train_step(engine, batch).item()


def test_a_model_whose_loss_takes_no_keywords_gets_none():
    """A model that says its loss takes no keywords is handed no num_items_in_batch (as Hugging Face's Trainer
    decides), though its forward takes **kwargs: its loss stays its own, the micro-batch's token mean, which one
    micro-batch on one rank logs as it is."""
    own, logged = in_world(1, _own_loss_and_logged)[0]
    assert logged == own, f"logged {logged!r}, the model's own loss {own!r}"


def test_a_stack_whose_blocks_run_inside_others_is_no_unit():
    """Adapters a block is handed, from a stack beside the blocks' own, run inside the block: by default they are no
    units (their weights the root unit's) and the model trains at stage 3. Named as units, the first to run inside
    another is refused in one line that says how to leave it out (it failed with a message about tensors read
    other than through a block's arguments)."""
    assert default_units(AdaptedLM()) == ["blocks.0", "blocks.1"]
    default, named = in_world(1, _loss_or_refusal, AdaptedLM,
                              (None, ["blocks.0", "blocks.1", "adapters.0", "adapters.1"]))[0]
    assert default.startswith("loss "), default
    assert named.startswith("adapters.0 ran inside blocks.0's forward, and a unit cannot run inside another: leave "
                            "adapters.0 out of unit_names="), named
