"""Fuzzed input (issue 12): whatever the flags hold, `python -m zerofunc.plan` either simulates or
exits 2 with one line "error: ...", never a traceback. The simulation is replaced by a recorder
that checks what it was asked; a few cheap accepted cases are then planned for real.
"""
from __future__ import annotations

import contextlib
import io
from collections import Counter

import pytest
from hypothesis import example, given, settings, strategies as st

import zerofunc.plan.__main__ as plan_cli
from sim.hardware import profiles
from zerofunc.config import MAX_MICRO_BATCH_TOKENS, MAX_PREFETCH_DEPTH
from zerofunc.recompute import MODES
from tests.fuzz import (FLOAT_ODD, FUZZ, HUGE, INT_ODD, TRIED, WORD_ODD, at_dir, covering, flag_lists, ints,
                        one_error_line, words)


# ---- the planner's flags -------------------------------------------------------------------------

PLAN_FLAGS = {
    "--model": (words("gpt2-tiny", "gpt2-tiny", "llama-tiny"), WORD_ODD + ["gpt5", "@list.json", "@missing.json"]),
    "--params": (words("1000", "1000000", "7000000000"), INT_ODD + [str(10**20)]),
    "--world-size": (words("1", "2", "3", "8", "3,1", "auto", "AUTO"),
                     INT_ODD + ["1,,2", "2,x", ",", "auto,2", str(10**9), f"1,{HUGE}"]),
    "--gpus-per-node": (ints(1, 8), INT_ODD),
    "--max-world-size": (ints(1, 16), INT_ODD + [str(10**9)]),
    "--micro-batch": (ints(1, 8), INT_ODD),
    "--levers": (words("auto", "none", "none"), WORD_ODD),
    "--activation-checkpointing": (st.sampled_from(MODES), WORD_ODD),
    "--ac-every": (ints(1, 4), INT_ODD),
    "--offload-optimizer": (words("none", "cpu"), WORD_ODD),
    "--host-memory": (words("64", "0.5", "1000"), FLOAT_ODD),
    "--seq": (ints(1, 256), INT_ODD),
    "--precision": (words("fp32", "bf16", "fp16"), WORD_ODD + ["fp8"]),
    "--hardware": (st.sampled_from(sorted(profiles())), WORD_ODD + ["tpu"]),
    "--gpu-memory": (words("80", "0.01", "16"), FLOAT_ODD),
    "--prefetch-depth": (ints(0, 3), INT_ODD),
    "--bucket-mb": (words("0", "1", "25", "0.5"), FLOAT_ODD),
    "--json": None,
    "--plot": (words("@plan.png"), WORD_ODD + ["plan.jpg", "@no/such/dir/plan.png"]),
    "--bogus": None,
}


@st.composite
def plan_flag_lists(draw):
    """The planner's flags: mostly a good --world-size (it is required) and often a small model first (the
    default, gpt2-small, takes longer to plan), and --stage 0-2 times."""
    world = ["--world-size", draw(PLAN_FLAGS["--world-size"][0])] if draw(st.integers(0, 7)) else []
    model = ["--model", draw(words("gpt2-tiny", "llama-tiny"))] if draw(st.booleans()) else []
    stages = draw(st.lists(ints(0, 3) | st.sampled_from(INT_ODD), max_size=2))
    return world + model + draw(flag_lists(PLAN_FLAGS)) + [a for s in stages for a in ("--stage", s)]


# inputs that once crashed, hung or were silently accepted, as in tests/test_fuzz_train.py
PLAN_REGRESSIONS = [
    [],  # argparse: --world-size is required, said in two lines with SystemExit(2)
    ["--world-size", "2", "--stage", ""],  # the same
    ["--world-size=2", "--ac-every=--"],  # TypeError: Python 3.11's argparse reads "--ac-every=--" as []
    ["--world-size", str(2**63)],  # accepted: torch's sizes overflow in the simulation
    ["--world-size", "8", "--world-size", str(HUGE)],  # the same
    ["--world-size", "auto", "--max-world-size=99999999", "--gpus-per-node", "1"],  # a list of 10**8 candidates
    ["--world-size", "3", "--gpu-memory=inf"],  # OverflowError: int(inf * GiB)
    ["--world-size", "2", "--host-memory", "1e300"],  # the same
    ["--world-size", "8", "--bucket-mb", "1e309", "--params=1000000"],  # OverflowError: int(inf * 2**20)
    ["--world-size", "2", "--prefetch-depth", str(10**12)],  # accepted: stage 3 loops over 10**12 blocks ahead
    ["--world-size", "2", "--params", str(10**20)],  # accepted: torch's sizes overflow in the simulation
    ["--world-size", "2", "--micro-batch", str(10**12), "--model", "gpt2-tiny"],  # accepted: the same
    ["-h"],
]


def _examples(cases: list):
    def apply(prop):
        for flags in reversed(cases):
            prop = example(flags=flags)(prop)
        return prop
    return apply


REAL_PLANS = 4  # a plan of several stages takes ~2 s here: the planner forks a worker per stage


class Reached(Exception):
    """The planner got past its input checks to the simulation."""


def run_plan(argv: list[str], monkeypatch) -> tuple[str, list]:
    """`zerofunc.plan.__main__.main(argv)` with the simulation replaced: ("planned", plans),
    ("refused", []) or ("help", []); fails on anything else."""
    seen = []

    def simulation(plans, *args, **kwargs):
        plans = plans if isinstance(plans, list) else [plans]
        for world_sizes in (a for a in args if isinstance(a, list)):  # the candidates of --world-size auto
            assert len(world_sizes) <= plan_cli.MAX_WORLD_SIZE and max(world_sizes) <= plan_cli.MAX_WORLD_SIZE
        for p in plans:
            assert 1 <= p.world_size <= plan_cli.MAX_WORLD_SIZE
            assert p.params is None or 1 <= p.params <= plan_cli.MAX_PARAMS
            assert p.params is not None or p.micro_batch * p.tokens <= MAX_MICRO_BATCH_TOKENS
            assert 0 <= p.prefetch_depth <= MAX_PREFETCH_DEPTH
        seen.extend(plans)
        raise Reached

    with monkeypatch.context() as m:
        m.setattr(plan_cli, "report_stages", simulation)
        m.setattr(plan_cli, "fewest_ranks", simulation)
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = plan_cli.main(argv)
        except Reached:
            assert err.getvalue() == "" and out.getvalue() == "", err.getvalue()
            return "planned", seen
        except SystemExit as e:
            assert e.code == 0 and "-h" in argv and out.getvalue().startswith("usage: "), (e.code, err.getvalue())
            return "help", []
    assert code == 2, (code, out.getvalue(), err.getvalue())
    one_error_line(err.getvalue(), out.getvalue())
    return "refused", []


def test_fuzzed_plan_flags_plan_or_exit_2_with_one_line(fuzz_dir, monkeypatch):
    before = Counter(TRIED)
    cheap = []

    @settings(FUZZ, max_examples=400)
    @given(flags=plan_flag_lists())
    @_examples(PLAN_REGRESSIONS)
    def prop(flags):
        argv = at_dir(flags, fuzz_dir)
        outcome, plans = run_plan(argv, monkeypatch)
        TRIED["plan", outcome] += 1
        if outcome == "planned" and _cheap(argv, plans):
            cheap.append(argv)

    prop()
    tried = TRIED - before
    print(f"\nplan fuzz: {sum(tried.values())} cases: {dict(tried)}")
    assert tried["plan", "planned"] >= 20 and tried["plan", "refused"] >= 100
    # a few cheap accepted cases, planned for real: exit 0 and a table or JSON on stdout
    real, seen = covering(cheap, _plan_features, REAL_PLANS)
    assert len(real) >= 3
    for argv in real:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = plan_cli.main(argv)
        assert code == 0 and out.getvalue() and "Traceback" not in err.getvalue(), (argv, err.getvalue())
    print(f"planned for real: {len(real)} accepted cases, covering {sorted(seen, key=str)}")


def _cheap(argv: list[str], plans: list) -> bool:
    """Few simulations of a small model: no lever search over checkpointing, no plot."""
    a = plan_cli.parse(argv)
    small = all(p.params is not None or p.model in ("gpt2-tiny", "llama-tiny") for p in plans)
    return small and (a.params is not None or a.levers == "none") and len(plans) <= 4 and a.plot is None


def _plan_features(argv: list[str]) -> set:
    a = plan_cli.parse(argv)
    return {("params", a.params is not None), ("model", a.model if a.params is None else None),
            ("auto", a.world_size.strip().lower() == "auto"),
            ("json", a.json), ("precision", a.precision), ("checkpointing", a.activation_checkpointing),
            ("offload", a.offload_optimizer), ("hardware", a.hardware), ("stages", len(set(a.stage or [0, 1, 2, 3])))}


@pytest.mark.parametrize("argv, message", [
    ([], "error: the following arguments are required: --world-size"),
    (["--world-size", str(2**63)], "world size must be at most 1048576"),
    (["--world-size", "auto", "--max-world-size", "99999999"], "--max-world-size must be at most 1048576"),
    (["--world-size", "2", "--params", str(10**20)], "--params must be at most 1125899906842624"),
    (["--world-size", "2", "--gpu-memory", "inf"], "--gpu-memory must be positive, in GiB up to 1048576"),
    (["--world-size", "2", "--prefetch-depth", str(10**12)], "--prefetch-depth must lie in [0, 1024]"),
    (["--world-size", "2", "--bucket-mb", "nan"], "--bucket-mb must lie in [0, 1048576]"),
    (["--world-size", "2", "--model", "gpt2-tiny", "--micro-batch", str(10**12)], "over the bound of 16777216"),
    (["--world-size", "2", "--plot", "/no/such/dir/plan.png"], "its directory '/no/such/dir' does not exist"),
])
def test_plan_refusals_name_the_flag(capsys, argv, message):
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
