"""--tensorboard: the trainer's metrics rows come back from the event files as the scalars they hold,
and a missing tensorboard package is one line that names the extra to install."""
from __future__ import annotations

import sys

import pytest

from train.tensorboard import GiB, TAGS, TensorBoardError, TensorBoardLog, check, scalars
from zerofunc.usage import UsageError

# rows as train/loop.py writes them: 2 sequences of 64 tokens per step on each of 2 ranks (256 tokens)
ROWS = [
    {"step": 1, "loss": 5.5, "tokens": 256, "time_s": 0.5, "elapsed_s": 0.5, "comm_volume_bytes": 1000,
     "peak_bytes": 3 * GiB // 2, "lr": 1e-3, "grad_norm": 2.25},
    {"step": 2, "loss": 4.25, "tokens": 512, "time_s": 0.25, "elapsed_s": 0.75, "comm_volume_bytes": 1000,
     "peak_bytes": 2 * GiB, "lr": 5e-4, "grad_norm": 1.5, "val_loss": 4.5},
    {"step": 3, "loss": 4.0, "tokens": 768, "time_s": 0.125, "elapsed_s": 0.875, "comm_volume_bytes": 1000,
     "peak_bytes": GiB, "lr": 2.5e-4, "loss_scale": 65536.0, "skipped_steps": 0, "nonfinite": True},
]


def read_back(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `log_dir`: tag -> [(step, value)]."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_rows_come_back_as_their_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    with TensorBoardLog(tmp_path / "tb") as log:
        for row in ROWS:
            log.write(row)
    got = read_back(tmp_path / "tb")
    assert got == {
        "loss/train": [(1, 5.5), (2, 4.25), (3, 4.0)],
        "loss/val": [(2, 4.5)],  # only where a row has it
        "optim/lr": [(1, pytest.approx(1e-3)), (2, pytest.approx(5e-4)), (3, pytest.approx(2.5e-4))],
        "optim/grad_norm": [(1, 2.25), (2, 1.5)],
        "optim/loss_scale": [(3, 65536.0)],  # fp16 only
        "speed/tokens_per_s": [(1, 512.0), (2, 1024.0), (3, 2048.0)],  # 256 tokens per step over the step's time
        "memory/peak_gib": [(1, 1.5), (2, 2.0), (3, 1.0)],
    }
    assert set(got) <= set(TAGS.values())


def test_step_may_be_given(tmp_path):
    pytest.importorskip("tensorboard")
    with TensorBoardLog(tmp_path) as log:
        log.write({"loss": 2.0}, step=7)
    assert read_back(tmp_path) == {"loss/train": [(7, 2.0)]}


def test_a_resumed_run_replaces_the_steps_it_runs_again(tmp_path):
    """A run killed after step 3 with its checkpoint at step 1 resumes at step 2: TensorBoard shows
    the resumed run's steps 2 and 3, not both runs', as metrics.jsonl keeps one row per step."""
    pytest.importorskip("tensorboard")
    with TensorBoardLog(tmp_path) as log:
        for row in ROWS:
            log.write(row)
    with TensorBoardLog(tmp_path, first_step=2) as log:
        for row in ROWS[1:]:
            log.write(row | {"loss": row["loss"] - 1})
    assert read_back(tmp_path)["loss/train"] == [(1, 5.5), (2, 3.25), (3, 3.0)]


def test_scalars_keep_numbers_only():
    nan = pytest.approx(float("nan"), nan_ok=True)  # a non-finite loss is news: logged as it is
    assert scalars({"step": 4, "loss": float("nan"), "lr": None, "nonfinite": True}) == {"loss/train": nan}
    assert scalars({"step": 1, "tokens": 10, "time_s": 0}) == {}  # no time, no rate


def test_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    """Without tensorboard, torch.utils.tensorboard's import fails; opening the log says what to install."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    for name in [m for m in sys.modules if m == "torch.utils.tensorboard" or m.startswith("torch.utils.tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    for attempt in (lambda: check(tmp_path), lambda: TensorBoardLog(tmp_path)):
        with pytest.raises(TensorBoardError) as e:
            attempt()
        message = str(e.value)
        assert "\n" not in message and "pip install 'zerofunc[tensorboard]'" in message
        assert message.startswith("--tensorboard needs the tensorboard package")
        assert isinstance(e.value, UsageError)  # train/cli.py prints it as "error: ..." and exits 2
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_file_is_not_a_log_directory(tmp_path):
    pytest.importorskip("tensorboard")
    file = tmp_path / "metrics.jsonl"
    file.write_text("")
    with pytest.raises(TensorBoardError, match="is a file, not a directory"):
        check(file)
