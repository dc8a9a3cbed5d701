"""python -m train: stages and rank counts agree step for step; bad input fails cleanly."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from train.cli import DEFAULTS, main


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert all({"step", "loss", "tokens", "time_s"} <= set(r) for r in rows)
    return [r["loss"] for r in rows]


@pytest.mark.slow
def test_every_stage_and_rank_count_gives_the_same_losses(tmp_path, tiny_data):
    """The issue's acceptance run: stages 0-3 on 2 ranks and stage 0 on 1 rank with twice the micro-batch."""
    runs = {f"stage{s}": ["--stage", str(s), "--nproc", "2"] for s in range(4)}
    runs["one-rank"] = ["--stage", "0", "--nproc", "1", "--micro-batch", str(2 * DEFAULTS["micro_batch"])]
    curves = {}
    for name, flags in runs.items():
        assert main(flags + ["--steps", "10", "--seq", "64", "--seed", "0", "--out", str(tmp_path / name),
                             "--device", "cpu", "--data", tiny_data]) == 0
        curves[name] = losses(tmp_path / name)
    assert_same_curves(curves, "one-rank", steps=10)


def assert_same_curves(curves: dict[str, list[float]], reference_name: str, steps: int) -> None:
    """Every curve within 1e-4 of the reference, relatively, at every step. Sized, not derived (AdamW turns
    reordered fp32 sums into lr-sized steps where a gradient cancels: tests/steps.py says why no whole-run
    bound can be): correct runs differ by 1.1e-7 (stages) and 2.0e-7 (dropout), measured 2026-11-26. What
    it is for, the data each rank trains on: every rank taking micro-batch 0 of the global batch moves the
    losses by 3.1e-2, dropout masks drawn per rank rather than per global sample by 3.7e-3 (tests/plants.py:
    ranks_take_the_same_rows, dropout_ids_per_rank), 37x above the bound."""
    reference = curves.pop(reference_name)
    assert len(reference) == steps and reference[-1] < reference[0]  # it learns
    for name, curve in curves.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
        assert worst <= 1e-4, f"{name} differs from {reference_name} by {worst:.2e}"


@pytest.mark.slow
def test_dropout_keeps_rank_counts_equivalent(tmp_path, tiny_data):
    """With dropout on, 2 ranks at stage 3 still match 1 rank: masks follow the sample, not the rank."""
    common = ["--dropout", "0.1", "--steps", "5", "--seq", "32", "--device", "cpu", "--data", tiny_data]
    runs = {"one-rank": ["--nproc", "1", "--micro-batch", "4"], "two-ranks": ["--nproc", "2", "--micro-batch", "2"]}
    curves = {}
    for name, flags in runs.items():
        assert main(flags + common + ["--out", str(tmp_path / name)]) == 0
        curves[name] = losses(tmp_path / name)
    assert_same_curves(curves, "one-rank", steps=5)


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--stage", "4"], "--stage must be 0, 1, 2 or 3"),
    (["--model", "gpt3"], "unknown model 'gpt3'"),
    (["--seq", "257"], "longer than gpt2-tiny's context of 256"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--dropout", "1"], "--dropout must lie in [0, 1)"),
    (["--plot", "loss.jpg"], "--plot writes a PNG"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["--data", "/no/such/file"], "does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main(flags + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not out.exists()


def test_empty_or_too_short_data_file(tmp_path, capsys):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_bytes(b"")
    short.write_bytes(b"abc")
    assert main(["--data", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "is empty" in capsys.readouterr().err
    assert main(["--data", str(short), "--seq", "8", "--out", str(tmp_path / "o")]) == 2
    assert "fewer than one sequence" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_command_line_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train", "--nproc", "-1", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --nproc must be at least 1, got -1"


@pytest.mark.slow
def test_accumulation_matches_the_big_batch(tmp_path, tiny_data):
    """2 ranks x 2 micro-steps x 4 sequences = 1 rank x 1 micro-step x 16 sequences, step for step."""
    runs = {"one-rank": ["--nproc", "1", "--micro-batch", "16"],
            "accumulated": ["--nproc", "2", "--micro-batch", "4", "--grad-accum", "2", "--stage", "2"]}
    curves = {}
    for name, flags in runs.items():
        assert main(flags + ["--steps", "8", "--out", str(tmp_path / name), "--device", "cpu",
                             "--data", tiny_data]) == 0
        curves[name] = losses(tmp_path / name)
    assert_same_curves(curves, "one-rank", steps=8)


@pytest.mark.slow
def test_deepspeed_stage2_config_trains(tmp_path, capfd, tiny_data):
    """DeepSpeed's documented ZeRO-2 config, with AdamW, bf16 and accumulation 4, through --config."""
    config = Path(__file__).parent.parent / "examples" / "ds_config_zero2.json"
    out = tmp_path / "ds"
    assert main(["--config", str(config), "--steps", "12", "--seq", "64", "--out", str(out), "--device", "cpu",
                 "--data", tiny_data]) == 0
    err = capfd.readouterr().err
    assert err.count("warning: zerofunc ignores these DeepSpeed settings") == 1 and "allgather_bucket_size" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["tokens"] == 12 * 4 * 4 * 2 * 64  # steps x micro-batch x accumulation x ranks x seq
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.slow
def test_fp16_trains_with_a_dynamic_loss_scale(tmp_path, tiny_data):
    out = tmp_path / "fp16"
    assert main(["--precision", "fp16", "--stage", "3", "--steps", "12", "--seq", "64", "--out", str(out),
                 "--device", "cpu", "--data", tiny_data]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["loss_scale"] <= 2.0**16 and "skipped_steps" in rows[-1]


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ('{"train_batch_size": 4,', "not valid JSON"),
    ('{"train_batch_size": 4, "zero_optimisation": {"stage": 2}}', "unknown config key 'zero_optimisation'"),
    ('{"train_batch_size": 4, "fp16": {"enabled": true}, "bf16": {"enabled": true}}', "both enabled"),
    ('{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}',
     "inconsistent batch sizes"),
])
def test_bad_config_is_one_line_and_writes_nothing(tmp_path, capsys, content, message):
    config = tmp_path / "ds.json"
    if content is not None:
        config.write_text(content)
    out = tmp_path / "out"
    assert main(["--config", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not out.exists()


@pytest.mark.slow
def test_summary_lists_every_rank_and_plot_draws_the_loss(tmp_path, capfd):
    """As a user first types it: the built-in corpus (the one launch here that reads it, in the launcher
    and in both ranks; the others take tests/conftest.py's tiny_data)."""
    png = tmp_path / "loss.png"
    assert main(["--steps", "3", "--seq", "32", "--out", str(tmp_path / "run"), "--plot", str(png),
                 "--device", "cpu"]) == 0
    out = capfd.readouterr().out
    assert "done: 3 steps" in out and "rank 0: " in out and "rank 1: " in out and "per step" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
