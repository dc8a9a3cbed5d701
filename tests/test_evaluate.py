"""Evaluation (train/evaluate.py, --eval-every): the engine's forward without backward leaves nothing
behind that changes training, its loss is one device's on the same windows, and the trainer logs it
with the gradient norm, in metrics.jsonl and TensorBoard."""
from __future__ import annotations

import json

import pytest
import torch

from tests.bare import in_world
from tests.rounding import gamma

STEPS = 3


def run_engine(stage: int, eval_between: bool) -> tuple[list[float], dict, list[float]]:
    """Three steps of a GPT-2 with dropout on at `stage`, evaluating after each step or never: the
    training losses, the final weights, the evaluation losses."""
    import zerofunc
    from train.evaluate import evaluate
    from zerofunc.models import build_model, model_config
    from zerofunc.step import train_step

    with torch.device("meta"):
        model = build_model(model_config("gpt2-tiny", dropout=0.1, n_layer=3))
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                                 init=lambda name, shape: model.init_param(name, shape, 0))
    rank, world = engine.comm.rank, engine.comm.world_size
    gen = torch.Generator().manual_seed(5)
    held_out = torch.randint(0, 256, (2, 2 * world, 13), generator=gen)  # 2 global batches
    mine = [(b[2 * rank:2 * rank + 2, :-1], b[2 * rank:2 * rank + 2, 1:]) for b in held_out]
    losses, evals = [], []
    for step in range(STEPS):
        rows = torch.randint(0, 256, (2 * world, 13), generator=gen)
        ids = torch.arange(2 * world) + 100 * step
        part = slice(2 * rank, 2 * rank + 2)
        losses.append(train_step(engine, [(rows[part, :-1], rows[part, 1:], ids[part])]).item())
        if eval_between:
            evals.append(evaluate(engine, mine))
    return losses, engine.full_parameters(), evals + [evaluate(engine, mine), held_out, engine.full_parameters()]


def with_and_without(stages) -> dict:
    """Per stage: (training losses equal, weights bitwise equal, the evaluations), with and without."""
    out = {}
    for stage in stages:
        (losses, weights, evals), (plain_losses, plain_weights, _) = run_engine(stage, True), run_engine(stage, False)
        same_weights = all(torch.equal(weights[n], plain_weights[n]) for n in weights)
        # numpy arrays, not tensors: a tensor crosses the pipe as shared memory the exiting rank tears down
        evals = evals[:-2] + [evals[-2].numpy(), {n: t.numpy() for n, t in evals[-1].items()}]
        out[stage] = (losses == plain_losses, same_weights, evals)
    return out


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_evaluating_leaves_training_bit_identical(world):
    """Stages 0-3, dropout on: the losses and weights of a run that evaluates after every step equal, bit
    for bit, those of a run that never does (planted: evaluate() leaving the model in eval mode turns
    dropout off, and the second step's loss differs)."""
    for per_rank in in_world(world, with_and_without, [0, 1, 2, 3]):
        for stage, (same_losses, same_weights, _) in per_rank.items():
            assert same_losses and same_weights, f"stage {stage}"


def test_the_val_loss_is_one_devices_on_the_same_windows():
    """At stage 3 on 2 ranks, the evaluation loss equals the plain model's mean loss over the same global
    batches, computed here on one device, within the rounding of summing 2 x 2 per-batch means in
    another order (each batch's own loss is the same ops on the same rows and weights, bit for bit)."""
    from zerofunc.models import build_model, model_config

    per_rank = in_world(2, with_and_without, [3])
    evals = per_rank[0][3][2]
    val_loss, held_out, weights = evals[-3], torch.from_numpy(evals[-2]), evals[-1]
    model = build_model(model_config("gpt2-tiny", n_layer=3)).eval()
    model.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()}, strict=False)
    with torch.no_grad():
        terms = [model(b[2 * r:2 * r + 2, :-1], b[2 * r:2 * r + 2, 1:]).double() for b in held_out for r in range(2)]
    exact = sum(terms) / len(terms)
    budget = gamma(len(terms) + 2) * sum(t.abs() for t in terms) / len(terms)
    assert abs(val_loss - exact.item()) <= budget.item(), (val_loss, exact.item())
    assert all(r[3][2][-3] == val_loss for r in per_rank)  # every rank reports the same


@pytest.mark.slow
def test_the_trainer_logs_val_loss_and_grad_norm(tmp_path, capsys):
    """--eval-every 2 over 5 steps evaluates at steps 2, 4 and 5 (the last); every row has the gradient norm;
    TensorBoard gets the same values under its tags; --plot draws both curves."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.tokenizer import train_tokenizer
    from train.cli import main
    from train.data import stdlib_files
    from train.prepare import main as prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, path in enumerate(stdlib_files()[:40]):
        (docs / f"{i}.txt").write_text(path.read_text())
    train_tokenizer(tmp_path / "tokenizer.json", [p.read_text() for p in docs.iterdir()], vocab_size=256)
    data = tmp_path / "data"
    assert prepare(["--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(data), "--val-fraction", "0.1",
                    str(docs)]) == 0
    out, board = tmp_path / "run", tmp_path / "tb"
    assert main(["--data", str(data), "--steps", "5", "--seq", "32", "--eval-every", "2", "--eval-batches", "2",
                 "--out", str(out), "--tensorboard", str(board), "--plot", str(tmp_path / "loss.png")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 5]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert "val" in capsys.readouterr().out
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.value for e in events.Scalars("loss/val")] == pytest.approx([r["val_loss"] for r in rows
                                                                           if "val_loss" in r], rel=1e-7)
    assert [e.value for e in events.Scalars("optim/grad_norm")] == pytest.approx([r["grad_norm"] for r in rows],
                                                                                 rel=1e-7)
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_evaluation_needs_held_out_tokens(tmp_path, capsys, tiny_data):
    from train.cli import main

    assert main(["--data", tiny_data, "--eval-every", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "val.bin" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
