"""Fuzzed input (issue 12): whatever a config file and the flags hold, `python -m train` either
starts its ranks or exits 2 with one line "error: ...", never a traceback.

`main` runs in this process with the launcher replaced by a recorder, so no rank starts; what
the recorder receives must be something a rank can run: each rank's first batch can be cut,
the learning rate and the fp16 loss scale are finite at every step asked for, the world fits
this machine. A few of the accepted cases then train one step for real, in one world of two
ranks. The number of cases tried is printed (pytest -s) and each outcome must occur, so a
strategy that drifted to only-valid or only-invalid input would fail here.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import example, given, settings, strategies as st

import train.cli
import train.data
from train.data import rank_batch
from zerofunc.config import MAX_GLOBAL_BATCH, MAX_MICRO_BATCH_TOKENS, MAX_PREFETCH_DEPTH, MAX_RANKS_PER_CORE
from zerofunc.recompute import MODES
from tests.fuzz import (FLOAT_ODD, FUZZ, HUGE, INT_ODD, TRIED, WORD_ODD, at_dir, config_files, covering,
                        flag_lists, ill_typed, ints, one_error_line, words)


TRAIN_FLAGS = {
    "--model": (words(*["gpt2-tiny"] * 4, "llama-tiny", "gpt2-small"),
                WORD_ODD + ["gpt3", "@list.json", "@broken.json", "@missing.json", "@"]),
    "--stage": (ints(0, 3), INT_ODD + ["4"]),
    "--nproc": (ints(1, 4), INT_ODD),
    "--steps": (ints(1, 50), INT_ODD),
    "--micro-batch": (ints(1, 8), INT_ODD),
    "--grad-accum": (ints(1, 4), INT_ODD),
    "--seq": (ints(1, 256), INT_ODD + ["257"]),
    "--lr": (words("1e-3", "0.01", "3e-4", "1e30", "0.1"), FLOAT_ODD),
    "--clip": (words("0", "1.0", "0.5"), FLOAT_ODD),
    "--precision": (words("fp32", "bf16", "fp16"), WORD_ODD),
    "--dropout": (words("0", "0.1", "0.5"), FLOAT_ODD + ["1"]),
    "--seed": (ints(0, 1000), INT_ODD),
    "--data": (words("@data.txt"), WORD_ODD + ["@empty.txt", "@missing.txt", "@"]),
    "--save-every": (ints(0, 5), INT_ODD),
    "--resume": None,
    "--plot": (words("@loss.png"), WORD_ODD + ["@no/such/dir/loss.png", "loss.jpg", "@"]),
    "--compile": None,
    "--no-compile": None,
    "--prefetch-depth": (ints(0, 3), INT_ODD),
    "--bucket-mb": (words("0", "1", "25", "0.5"), FLOAT_ODD),
    "--activation-checkpointing": (st.sampled_from(MODES), WORD_ODD),
    "--ac-every": (ints(1, 4), INT_ODD),
    "--offload-optimizer": (words("none", "cpu"), WORD_ODD),
    "--on-nonfinite": (words("stop", "skip"), WORD_ODD),
    "--on-save-error": (words("stop", "continue"), WORD_ODD),
    "--timeout": (words("30", "0.5", "600"), FLOAT_ODD),
    "--bogus": None,
}


def launchable(args, seen: dict) -> None:
    """What a rank computes from its arguments before and while it trains, short of the model:
    the run must not fail or hang on any of it, nor hold more than the machine can."""
    cfg = args.config
    assert not ill_typed(seen["config"]), f"accepted ill-typed keys {ill_typed(seen['config'])}"
    assert args.nproc <= MAX_RANKS_PER_CORE * (os.cpu_count() or 1), f"nproc {args.nproc}"
    assert cfg.micro_batch * args.seq <= MAX_MICRO_BATCH_TOKENS, f"micro-batch {cfg.micro_batch} x seq {args.seq}"
    assert cfg.train_batch_size <= MAX_GLOBAL_BATCH, f"global batch {cfg.train_batch_size}"
    assert cfg.train_batch_size == cfg.micro_batch * cfg.grad_accum * args.nproc
    assert math.isfinite(cfg.clip) and cfg.clip >= 0, f"clip {cfg.clip}"
    opt = cfg.optimizer
    assert math.isfinite(opt.lr) and opt.lr >= 0, f"lr {opt.lr}"
    assert math.isfinite(opt.eps) and opt.eps > 0, f"eps {opt.eps}"
    assert math.isfinite(opt.weight_decay) and opt.weight_decay >= 0, f"weight decay {opt.weight_decay}"
    assert all(0 <= b < 1 for b in opt.betas), f"betas {opt.betas}"
    for step in sorted({1, 2, 3, args.steps}):
        lr = cfg.lr(step)
        assert isinstance(lr, float) and math.isfinite(lr) and lr >= 0, f"step {step}: lr {lr}"
    scaler = cfg.loss_scaler()
    if scaler is not None:
        assert math.isfinite(scaler.scale) and math.isfinite(scaler.min_scale), f"loss scaler {scaler}"
    assert 0 <= cfg.overlap.prefetch_depth <= MAX_PREFETCH_DEPTH, f"prefetch depth {cfg.overlap.prefetch_depth}"
    if args.plot:
        assert Path(args.plot).parent.is_dir(), f"plot {args.plot}"
    tokens = seen["tokens"]
    rank_batch(tokens, 1, cfg.micro_batch, args.nproc, args.nproc - 1, args.seq, args.seed, cfg.grad_accum,
               cfg.grad_accum - 1)  # the last rank's last micro-batch of the first step


@functools.lru_cache(maxsize=1)
def _corpus(read=train.data.stdlib_corpus) -> bytes:
    return read()


def run_train(argv: list[str], monkeypatch) -> tuple[str, object]:
    """`train.cli.main(argv)` with the launcher replaced: ("launched", TrainArgs), ("refused", None)
    or ("help", None); fails on anything else."""
    seen = {}

    def spawn(fn, nprocs, args, **kwargs):
        assert fn is train.cli.train_rank and nprocs == args.nproc
        seen["args"] = args
        launchable(args, seen)
        return [{} for _ in range(min(nprocs, 2))]

    def parse_config(source, world):
        seen["config"] = source
        return real_parse_config(source, world)

    def load_corpus(path, seq):
        corpus = real_load_corpus(path, seq)
        seen["tokens"] = corpus
        return corpus

    real_parse_config, real_load_corpus = train.cli.parse_config, train.cli.load_corpus
    with monkeypatch.context() as m:
        m.setattr(train.cli, "spawn", spawn)
        m.setattr(train.cli, "parse_config", parse_config)
        m.setattr(train.cli, "load_corpus", load_corpus)
        m.setattr(train.data, "stdlib_corpus", _corpus)  # read once: it is 16 MiB of sources
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = train.cli.main(argv)
        except SystemExit as e:
            assert e.code == 0 and "-h" in argv and out.getvalue().startswith("usage: "), (e.code, err.getvalue())
            return "help", None
    if code == 2:
        one_error_line(err.getvalue(), out.getvalue())
        assert "args" not in seen
        return "refused", None
    assert code == 0 and "args" in seen, (code, err.getvalue())
    assert "error" not in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()
    return "launched", seen["args"]


def _json(raw: dict) -> tuple[bytes, None]:
    return json.dumps(raw).encode(), None


NO_CONFIG = (None, None)
MB1 = {"train_micro_batch_size_per_gpu": 1}
# Inputs that once crashed, hung or were silently accepted (found by this fuzz or its survey), with what
# they raised; each is tried first, every run.
TRAIN_REGRESSIONS = [
    (NO_CONFIG, ["stray"]),  # argparse: "usage: ..." and "error: ..." on two lines, SystemExit(2)
    (NO_CONFIG, ["--stage", ""]),  # the same
    (NO_CONFIG, ["--dropout=--"]),  # TypeError: Python 3.11's argparse reads "--dropout=--" as []
    ((b"\xff\xfe{}", None), []),  # UnicodeDecodeError reading the config file
    ((None, "\x00"), []),  # ValueError: embedded null byte
    (_json({**MB1, "fp16": {"enabled": False, "initial_scale_power": {"g": False}}}), []),  # accepted
    (_json({**MB1, "fp16": {"loss_scale": math.inf}}), []),  # accepted
    (_json({**MB1, "scheduler": {"type": []}}), []),  # TypeError: unhashable type: 'list'
    (_json({**MB1, "gradient_accumulation_steps": math.inf}), []),  # OverflowError in int(inf)
    (_json({**MB1, "gradient_clipping": math.nan}), []),  # accepted: a NaN clip
    (_json({**MB1, "optimizer": {"params": {"eps": 0}}}), []),  # accepted: Adam divides by sqrt(v) + 0
    (_json({**MB1, "optimizer": {"params": {"bias_correction": 0, "adam_w_mode": []}}}), []),  # accepted
    (_json({**MB1, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": 0}}}), []),  # accepted
    (_json({**MB1, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": 9}}}),
     []),  # ZeroDivisionError in the rank's first learning rate: log(1)
    (_json({**MB1, "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": []}}), []),  # accepted
    (NO_CONFIG, ["--plot", "@no/such/dir/loss.png"]),  # accepted: the run fails after its last step
    (NO_CONFIG, ["--bucket-mb=1e309"]),  # OverflowError: int(inf * 2**20)
    (NO_CONFIG, ["--bucket-mb=1e308"]),  # the same, past the float range once in bytes
    (NO_CONFIG, ["--micro-batch", str(HUGE)]),  # accepted: a batch no rank can hold
    (NO_CONFIG, ["--seed", str(HUGE)]),  # ValueError in every rank: the data generator's seed overflows
    (NO_CONFIG, ["--prefetch-depth", str(2**63)]),  # accepted: stage 3 loops over 2**63 blocks ahead
    (NO_CONFIG, ["--nproc", "1000"]),  # accepted: a thousand processes of torch on this machine
    (NO_CONFIG, ["--lr", "inf"]),  # accepted: an infinite learning rate
    (NO_CONFIG, ["--clip", "nan"]),  # accepted: a NaN clip
    (NO_CONFIG, ["-h"]),
]


TRAIN_EXAMPLES = 400
_accepted: dict = {}  # fuzz directory -> the accepted (argv, config content) of its train fuzz


def fuzz_train(d: Path, monkeypatch) -> list:
    """Check `run_train` on the regressions and TRAIN_EXAMPLES drawn cases; the accepted (argv, config
    content), kept for the next caller."""
    if d in _accepted:
        return _accepted[d]
    out, accepted = d / "out", []

    def prop(config, flags):
        content, odd_path = config
        argv = at_dir(flags, d)
        if odd_path is not None:
            argv += at_dir([f"--config={odd_path}"], d)
        elif content is not None:
            path = d / "ds_config.json"
            path.write_bytes(content)
            argv += ["--config", str(path)]
        outcome, args = run_train(argv + ["--device", "cpu", "--out", str(out)], monkeypatch)
        TRIED["train", outcome] += 1
        if outcome == "launched":
            accepted.append((argv, content))

    for config, flags in reversed(TRAIN_REGRESSIONS):
        prop = example(config=config, flags=flags)(prop)
    settings(FUZZ, max_examples=TRAIN_EXAMPLES)(given(config=config_files(), flags=flag_lists(TRAIN_FLAGS))(prop))()
    _accepted[d] = accepted
    return accepted


def test_fuzzed_config_and_flags_train_or_exit_2_with_one_line(fuzz_dir, monkeypatch):
    before = Counter(TRIED)
    fuzz_train(fuzz_dir, monkeypatch)
    tried = TRIED - before
    print(f"\ntrain fuzz: {sum(tried.values())} cases: {dict(tried)}")
    assert tried["train", "launched"] >= 20 and tried["train", "refused"] >= 100


# ---- a few accepted cases, trained for real ------------------------------------------------------

REAL_RUNS = 5


def train_cases(cases):
    """On each rank of one world: every case's TrainArgs trained; the results of rank 0."""
    from train.loop import train_rank
    return [train_rank(args) for args in cases]


@pytest.mark.slow
def test_accepted_fuzz_cases_train_one_step(fuzz_dir, monkeypatch, tmp_path, tiny_data):
    """Accepted cases of the fuzz (cheapened: one step of gpt2-tiny on 16 tokens, two ranks, no
    compile, no resume, tiny_data where a case names no --data) train: no rank fails, the step's loss is
    finite."""
    from tests.bare import in_world
    accepted = fuzz_train(fuzz_dir, monkeypatch)  # run already by the test above, unless run alone
    candidates = []
    for i, (argv, content) in enumerate(accepted):
        if "--resume" in argv or any(a.startswith("--compile") for a in argv):
            continue
        if content is not None:  # the fuzz's file is rewritten for every case
            path = tmp_path / f"ds{i}.json"
            path.write_bytes(content)
            argv = argv[:-1] + [str(path)]
        try:  # the flags given last win
            args = train.cli.parse(argv + ["--model", "gpt2-tiny", "--steps", "1", "--seq", "16", "--nproc", "2",
                                           "--no-compile", "--device", "cpu", "--out", str(tmp_path / f"run{i}")])
        except (train.cli.UsageError, train.cli.ConfigError):
            continue  # a batch size that needs another rank count
        if args.config.micro_batch * args.config.grad_accum <= 8:
            # matplotlib in a rank costs seconds; the built-in corpus, a read per case on each rank
            candidates.append(replace(args, plot=None, data=args.data or tiny_data))

    def features(args) -> set:
        cfg = args.config
        return {("stage", cfg.stage), ("precision", cfg.precision), ("offload", cfg.offload_optimizer),
                ("checkpointing", cfg.checkpointing.mode), ("schedule", cfg.schedule is not None),
                ("clip", cfg.clip > 0), ("accumulation", cfg.grad_accum > 1), ("dropout", args.dropout > 0)}

    cases, seen = covering(candidates, features, REAL_RUNS)
    assert len(cases) >= 3, accepted
    results = in_world(2, train_cases, cases)[0]
    print(f"\ntrained for real: {len(cases)} accepted cases, covering {sorted(seen)}")
    for args, result in zip(cases, results):
        assert "stopped" not in result, (args, result)
        rows = [json.loads(line) for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"]), (args, rows)


# ---- what the new refusals say -----------------------------------------------------------------------

@pytest.mark.parametrize("config, flags, message", [
    (None, ["stray"], "error: unrecognized arguments: stray"),
    (None, ["--lr=--"], "error: argument --lr: expected one argument"),
    (None, ["--nproc", "1000"], "--nproc 1000 is more CPU ranks than this machine holds"),
    (None, ["--seed", str(HUGE)], "--seed must lie in [0, 4194304)"),
    (None, ["--prefetch-depth", str(2**63)], "--prefetch-depth must lie in [0, 1024]"),
    (None, ["--bucket-mb", "inf"], "--bucket-mb must lie in [0, 1048576]"),
    (None, ["--clip", "nan"], "--clip must be >= 0 and finite"),
    (None, ["--micro-batch", "200000"], "over the bound of 16777216 tokens per rank per micro-step"),
    (None, ["--plot", "@no/such/dir/loss.png"], "its directory"),
    (b"\xff{}", [], "is not UTF-8 text"),
    ({**MB1, "gradient_accumulation_steps": math.inf}, [],
     "gradient_accumulation_steps must be an integer, got Infinity"),
    ({**MB1, "gradient_accumulation_steps": 2**30}, [], "over the bound of 16777216 sequences per optimizer step"),
    ({**MB1, "fp16": {"initial_scale_power": 1000}}, [], "fp16.initial_scale_power must lie in [0, 64]"),
    ({**MB1, "fp16": {"enabled": "false"}}, [], 'fp16.enabled must be true or false, got "false"'),
    ({**MB1, "optimizer": {"params": {"eps": 0}}}, [], "optimizer.params.eps must be positive"),
    ({**MB1, "optimizer": {"params": {"betas": [0.9, None]}}}, [], "optimizer.params.betas must be a number"),
    ({**MB1, "scheduler": {"type": ["WarmupLR"]}}, [], "scheduler.type ['WarmupLR'] is not supported"),
    ({**MB1, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, [],
     'scheduler.params.warmup_type must be "log" or "linear"'),
    ({**MB1, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}}, [],
     "scheduler.params.warmup_num_steps must be an integer"),
    ({**MB1, "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": -1}}, [],
     "zero_optimization.reduce_bucket_size must be >= 0"),
])
def test_refusals_name_the_flag_or_key(fuzz_dir, monkeypatch, capsys, config, flags, message):
    argv = at_dir(flags, fuzz_dir)
    if config is not None:
        path = fuzz_dir / "named.json"
        path.write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
        argv += ["--config", str(path)]
    assert train.cli.main(argv + ["--device", "cpu", "--out", str(fuzz_dir / "never")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (fuzz_dir / "never").exists()


def test_a_warm_up_of_one_step_is_read_as_deepspeed_reads_it():
    """DeepSpeed warms up over max(2, warmup_num_steps) steps; a log warm-up over 1 divided by log(1)."""
    from zerofunc.config import parse
    cfg = parse({**MB1, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                                      "warmup_num_steps": 1}}}, 1)
    assert [cfg.lr(step) for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
