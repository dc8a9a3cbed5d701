"""Fuzzed input (issue 12): whatever a config file and the flags hold, `python -m train` either
starts its ranks or exits 2 with one line "error: ...", never a traceback; the same for the
flags of `python -m zerofunc.plan`.

Hypothesis draws a DeepSpeed-style config (for every key zerofunc knows, a plausible value or
any JSON at all: null, booleans, huge and negative integers, NaN, infinities, strings, lists,
objects; unknown keys; sections of the wrong type; files that are not JSON, not UTF-8, or hold
a list) and a set of flags with good, huge, negative, zero, non-finite and non-numeric values.
`main` runs in this process with the launcher replaced by a recorder, so no rank starts; what
the recorder receives must be something a rank can run: each rank's first batch can be cut,
the learning rate and the fp16 loss scale are finite at every step asked for, the world fits
this machine. A few of the accepted cases then train one step for real, in one world of two
ranks. The planner's flags are fuzzed the same way, with its simulation replaced by a recorder,
and a few cheap accepted cases are planned for real.

The number of cases each property tried is printed (pytest -s) and each outcome must occur,
so a strategy that drifted to only-valid or only-invalid input would fail here.
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
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

import train.cli
import train.data
import zerofunc.plan.__main__ as plan_cli
from sim.hardware import profiles
from train.data import rank_batch
from zerofunc.config import MAX_GLOBAL_BATCH, MAX_MICRO_BATCH_TOKENS, MAX_PREFETCH_DEPTH, MAX_RANKS_PER_CORE
from zerofunc.recompute import MODES
from zerofunc.schedule import SCHEDULES

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
TRIED: Counter = Counter()  # (property, outcome) -> cases; printed by each test

HUGE = 10**30
ODD_INTS = [0, -1, -7, HUGE, -HUGE, 2**63, -(2**63) - 1, 2**64, 2**31]
ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, -1.5, 0.5, 1e30]
SCALARS = (st.none() | st.booleans() | st.sampled_from(ODD_INTS) | st.integers(-3, 12) | st.sampled_from(ODD_FLOATS)
           | st.floats() | st.text(max_size=6) | st.sampled_from(["auto", "cpu", "none", "true", "1", "nan"]))
ODD_VALUES = ODD_INTS + ODD_FLOATS + [None, True, False, "", "1", "auto", [], [1, 2], {}, {"a": 1}]
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


# Every config key zerofunc reads, with (a strategy of plausible values, the JSON kind a run's config
# must have had there); kind None: a DeepSpeed key zerofunc ignores, any value goes.
BETAS = st.lists(st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.999]), min_size=2, max_size=2)
SCHEMA = {
    "train_batch_size": (st.integers(1, 16), "int"),
    "train_micro_batch_size_per_gpu": (st.integers(1, 4), "int"),
    "gradient_accumulation_steps": (st.integers(1, 3), "int"),
    "gradient_clipping": (st.sampled_from([0.0, 0.5, 1.0, 1]), "number"),
    "comm_timeout": (st.sampled_from([30, 300.0, 0.5]), "number"),
    "steps_per_print": (st.integers(1, 100), None),
    "wall_clock_breakdown": (st.booleans(), None),
    "zero_optimization": {
        "stage": (st.integers(0, 3), "int"),
        "overlap_comm": (st.booleans(), "bool"),
        "reduce_bucket_size": (st.sampled_from([0, 1000, 5e8, 200_000_000]), "int"),
        "contiguous_gradients": (st.booleans(), None),
        "offload_optimizer": {"device": (st.sampled_from(["cpu", "none"]), "str"), "pin_memory": (st.booleans(), None)},
        "offload_param": {"device": (st.just("none"), "str")},
        "cpu_offload": (st.booleans(), "bool"),
    },
    "fp16": {
        "enabled": (st.booleans(), "bool"),
        "loss_scale": (st.sampled_from([0, 0.0, 128, 1024.0]), "number"),
        "initial_scale_power": (st.integers(0, 32), "int"),
        "loss_scale_window": (st.integers(1, 2000), "int"),
        "hysteresis": (st.integers(1, 4), "int"),
        "min_loss_scale": (st.sampled_from([1, 0.25, 1e-4]), "number"),
        "auto_cast": (st.booleans(), None),
    },
    "bf16": {"enabled": (st.booleans(), "bool")},
    "optimizer": {
        "type": (st.sampled_from(["Adam", "AdamW", "adamw", "ADAM"]), "str"),
        "params": {
            "lr": (st.sampled_from([1e-3, 3e-4, 0.01, 1]), "number"),
            "betas": (BETAS, "betas"),
            "eps": (st.sampled_from([1e-8, 1e-6]), "number"),
            "weight_decay": (st.sampled_from([0, 0.01, 0.1]), "number"),
            "adam_w_mode": (st.just(True), "bool"),
            "bias_correction": (st.just(True), "bool"),
            "torch_adam": (st.booleans(), None),
        },
    },
    "scheduler": {
        "type": (st.sampled_from(list(SCHEDULES)), "str"),
        "params": {
            "warmup_min_lr": (st.sampled_from([0, 1e-5]), "number"),
            "warmup_max_lr": (st.sampled_from([1e-3, 0.01]), "number"),
            "warmup_num_steps": (st.integers(0, 100), "int"),
            "warmup_type": (st.sampled_from(["log", "linear"]), "str"),
            "total_num_steps": (st.integers(1, 1000), "int"),
            "warmup_min_ratio": (st.sampled_from([0, 0.1]), "number"),
            "cos_min_ratio": (st.sampled_from([1e-4, 0.0, 0.1]), "number"),
        },
    },
    "activation_checkpointing": {
        "mode": (st.sampled_from(MODES), "str"),
        "every": (st.integers(1, 4), "int"),
        "cpu_checkpointing": (st.just(False), "bool"),
        "partition_activations": (st.booleans(), None),
    },
}


def _paths_of(spec: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path of `spec`, sections included."""
    out = []
    for key, value in spec.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out += _paths_of(value, prefix + (key,))
    return out


SCHEMA_PATHS = _paths_of(SCHEMA)


@st.composite
def configs(draw, spec=None, odd=None, rnd=None, prefix=()):
    """A config section after `spec`: each key present or not, its value plausible or odd (any JSON
    at all): none, exactly one (a valid config but for one key), or each at a drawn rate; now and
    then an unknown key."""
    if rnd is None:
        rnd = draw(st.randoms(use_true_random=False))  # rates, not shrinking
        odd = rnd.choice([0, 0, "one", "one", 0.05, 0.3])
        if odd == "one":
            odd = rnd.choice(SCHEMA_PATHS + [("?",)])
        spec = SCHEMA

    def is_odd(path: tuple) -> bool:
        return path == odd if isinstance(odd, tuple) else rnd.random() < odd

    def odd_value():
        return draw(st.sampled_from(ODD_VALUES) if rnd.random() < 0.7 else ANY_JSON)

    out = {}
    for key, value in spec.items():
        path = prefix + (key,)
        on_the_way = isinstance(odd, tuple) and odd[:len(path)] == path  # to the one odd key
        if not on_the_way and rnd.random() < (0.1 if key in ("type", "enabled") else 0.5):
            continue
        if is_odd(path):
            out[key] = odd_value()
        elif isinstance(value, dict):
            out[key] = draw(configs(value, odd, rnd, path))
        else:
            out[key] = draw(value[0])
    if is_odd(prefix + ("?",)):
        out[draw(st.text(min_size=1, max_size=8))] = odd_value()
    if prefix == ():  # mostly a batch size, and a scheduler's params of its type: more cases get past those
        if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(out) and rnd.random() < 0.8:
            out["train_micro_batch_size_per_gpu"] = draw(SCHEMA["train_micro_batch_size_per_gpu"][0])
        sched = out.get("scheduler")
        if isinstance(sched, dict) and sched.get("type") in list(SCHEDULES) and isinstance(sched.get("params"), dict):
            known = SCHEDULES[sched["type"]]
            sched["params"] = {k: v for k, v in sched["params"].items()
                               if k in known or odd == ("scheduler", "params", k)}
            if "total_num_steps" in known:
                sched["params"].setdefault("total_num_steps", draw(st.integers(1, 1000)))
    return out


@st.composite
def config_files(draw):
    """(what --config names: file content as bytes, or None for no --config; or a path as given)."""
    kind = draw(st.randoms(use_true_random=False)).choice(["dict"] * 10 + ["none"] * 6 + ["text", "bytes", "list",
                                                                                         "scalar", "path"])
    if kind == "dict":
        return json.dumps(draw(configs())).encode(), None  # NaN, Infinity: the literals Python's json writes, reads
    if kind == "none":
        return None, None
    if kind == "text":
        text = st.sampled_from(["", "{", '{"train_batch_size": 2,}', "NaN", "null"]) | st.text(max_size=8)
        return draw(text).encode(), None
    if kind == "bytes":
        binary = st.sampled_from([b"\xff\xfe{}", b'{"train_batch_size": "\xe9"}', b"\x00"]) | st.binary(max_size=8)
        return draw(binary), None
    if kind == "list":
        return json.dumps(draw(st.lists(ANY_JSON, max_size=3))).encode(), None
    if kind == "scalar":
        return json.dumps(draw(SCALARS)).encode(), None
    return None, draw(st.sampled_from(["@missing.json", "@", "", "\x00", "@data.txt"]) | st.text(max_size=4))


# odd values by the kind of flag: wrong in every way a shell can spell them
INT_ODD = ["0", "-1", "1000", "100000", "99999999", str(2**63), str(HUGE), str(-HUGE), "1.5", "abc", "", " 3 ",
           "\u0663", "--"]
FLOAT_ODD = ["nan", "inf", "-inf", "1e309", "1e308", "-1", "0", "-0.0", "1e-320", "abc", "", "--"]
WORD_ODD = ["", "x", "FP32", "--", "none ", "\x00"]


def _ints(lo: int, hi: int):
    return st.integers(lo, hi).map(str)


def _words(*words: str):
    return st.sampled_from(words)


# flag: (good values, odd values) or None for a flag without a value; "@name" is a file of `fuzz_dir`
TRAIN_FLAGS = {
    "--model": (_words(*["gpt2-tiny"] * 4, "llama-tiny", "gpt2-small"),
                WORD_ODD + ["gpt3", "@list.json", "@broken.json", "@missing.json", "@"]),
    "--stage": (_ints(0, 3), INT_ODD + ["4"]),
    "--nproc": (_ints(1, 4), INT_ODD),
    "--steps": (_ints(1, 50), INT_ODD),
    "--micro-batch": (_ints(1, 8), INT_ODD),
    "--grad-accum": (_ints(1, 4), INT_ODD),
    "--seq": (_ints(1, 256), INT_ODD + ["257"]),
    "--lr": (_words("1e-3", "0.01", "3e-4", "1e30", "0.1"), FLOAT_ODD),
    "--clip": (_words("0", "1.0", "0.5"), FLOAT_ODD),
    "--precision": (_words("fp32", "bf16", "fp16"), WORD_ODD),
    "--dropout": (_words("0", "0.1", "0.5"), FLOAT_ODD + ["1"]),
    "--seed": (_ints(0, 1000), INT_ODD),
    "--data": (_words("@data.txt"), WORD_ODD + ["@empty.txt", "@missing.txt", "@"]),
    "--save-every": (_ints(0, 5), INT_ODD),
    "--resume": None,
    "--plot": (_words("@loss.png"), WORD_ODD + ["@no/such/dir/loss.png", "loss.jpg", "@"]),
    "--compile": None,
    "--no-compile": None,
    "--prefetch-depth": (_ints(0, 3), INT_ODD),
    "--bucket-mb": (_words("0", "1", "25", "0.5"), FLOAT_ODD),
    "--activation-checkpointing": (st.sampled_from(MODES), WORD_ODD),
    "--ac-every": (_ints(1, 4), INT_ODD),
    "--offload-optimizer": (_words("none", "cpu"), WORD_ODD),
    "--on-nonfinite": (_words("stop", "skip"), WORD_ODD),
    "--on-save-error": (_words("stop", "continue"), WORD_ODD),
    "--timeout": (_words("30", "0.5", "600"), FLOAT_ODD),
    "--bogus": None,
}


@st.composite
def flag_lists(draw, flags: dict):
    """argv: a few of `flags`, each with a good value or an odd one (none, exactly one, or each at a
    drawn rate), as "--flag value" or "--flag=value"; now and then a stray argument or -h."""
    rnd = draw(st.randoms(use_true_random=False))
    names = rnd.sample(sorted(flags), rnd.randint(0, 7))
    odd = rnd.choice([0, 0, "one", "one", 0.1, 0.4])
    if odd == "one":
        odd = rnd.choice(names) if names else 0
    argv = []
    for name in names:
        odd_one = name == odd if isinstance(odd, str) else rnd.random() < odd
        if flags[name] is None:
            if name != "--bogus" or odd_one:
                argv.append(name)
            continue
        good, odd_values = flags[name]
        if odd_one:
            value = rnd.choice(odd_values) if rnd.random() < 0.85 else draw(st.text(max_size=4))
        else:
            value = draw(good)
        argv += [f"{name}={value}"] if value.startswith("-") or rnd.random() < 0.5 else [name, value]
    if isinstance(odd, float) and rnd.random() < odd / 4:
        argv.append(rnd.choice(["stray", "-h"]))
    return argv


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "data.txt").write_bytes(bytes(range(256)) * 8)
    (d / "empty.txt").write_bytes(b"")
    (d / "list.json").write_text("[1, 2]")
    (d / "broken.json").write_text('{"model_type": "gpt2",')
    return d


def _paths(argv: list[str], d: Path) -> list[str]:
    """`@name` -> a path in `d` ("@" alone: the directory itself, not a file)."""
    return [a.replace("@", str(d) + os.sep, 1) if "@" in a else a for a in argv]


def _one_error_line(err: str, out: str) -> None:
    assert "Traceback" not in err, err
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n") and out == "", (out, err)


def _kind_ok(value, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "number":
        return number and math.isfinite(value)
    if kind == "int":
        return number and math.isfinite(value) and value == int(value)
    if kind == "betas":
        return isinstance(value, list) and len(value) == 2 and all(_kind_ok(b, "number") for b in value)
    raise AssertionError(kind)


def _ill_typed(raw: dict, spec: dict = SCHEMA, prefix: str = "") -> list[str]:
    """The known keys of `raw` whose values are not of the kind zerofunc reads there."""
    bad = []
    for key, value in raw.items():
        if key not in spec:
            continue
        if isinstance(spec[key], dict):
            bad += _ill_typed(value, spec[key], prefix + key + ".") if isinstance(value, dict) else [prefix + key]
        elif spec[key][1] is not None and value is not None and not _kind_ok(value, spec[key][1]):
            bad.append(prefix + key)
    return bad


def launchable(args, seen: dict) -> None:
    """What a rank computes from its arguments before and while it trains, short of the model:
    the run must not fail or hang on any of it, nor hold more than the machine can."""
    cfg = args.config
    assert not _ill_typed(seen["config"]), f"accepted ill-typed keys {_ill_typed(seen['config'])}"
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

    def load_tokens(path, seq):
        tokens = real_load_tokens(path, seq)
        seen["tokens"] = tokens
        return tokens

    real_parse_config, real_load_tokens = train.cli.parse_config, train.cli.load_tokens
    with monkeypatch.context() as m:
        m.setattr(train.cli, "spawn", spawn)
        m.setattr(train.cli, "parse_config", parse_config)
        m.setattr(train.cli, "load_tokens", load_tokens)
        m.setattr(train.data, "stdlib_corpus", _corpus)  # read once: it is 16 MiB of sources
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = train.cli.main(argv)
        except SystemExit as e:
            assert e.code == 0 and "-h" in argv and out.getvalue().startswith("usage: "), (e.code, err.getvalue())
            return "help", None
    if code == 2:
        _one_error_line(err.getvalue(), out.getvalue())
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
        argv = _paths(flags, d)
        if odd_path is not None:
            argv += _paths([f"--config={odd_path}"], d)
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


def test_accepted_fuzz_cases_train_one_step(fuzz_dir, monkeypatch, tmp_path):
    """Accepted cases of the fuzz (cheapened: one step of gpt2-tiny on 16 tokens, two ranks, no
    compile, no resume) train: no rank fails, the step's loss is finite."""
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
            candidates.append(replace(args, plot=None))  # matplotlib in a rank costs seconds

    def features(args) -> set:
        cfg = args.config
        return {("stage", cfg.stage), ("precision", cfg.precision), ("offload", cfg.offload_optimizer),
                ("checkpointing", cfg.checkpointing.mode), ("schedule", cfg.schedule is not None),
                ("clip", cfg.clip > 0), ("accumulation", cfg.grad_accum > 1), ("dropout", args.dropout > 0)}

    cases, seen = [], set()
    while candidates and len(cases) < REAL_RUNS:  # the most features not yet trained, first
        best = max(candidates, key=lambda c: len(features(c) - seen))
        candidates.remove(best)
        cases.append(best)
        seen |= features(best)
    assert len(cases) >= 3, accepted
    results = in_world(2, train_cases, cases)[0]
    print(f"\ntrained for real: {len(cases)} accepted cases, covering {sorted(seen)}")
    for args, result in zip(cases, results):
        assert "stopped" not in result, (args, result)
        rows = [json.loads(line) for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"]), (args, rows)


# ---- the planner's flags -------------------------------------------------------------------------

PLAN_FLAGS = {
    "--model": (_words("gpt2-tiny", "gpt2-tiny", "llama-tiny"), WORD_ODD + ["gpt5", "@list.json", "@missing.json"]),
    "--params": (_words("1000", "1000000", "7000000000"), INT_ODD + [str(10**20)]),
    "--world-size": (_words("1", "2", "3", "8", "3,1", "auto", "AUTO"),
                     INT_ODD + ["1,,2", "2,x", ",", "auto,2", str(10**9), f"1,{HUGE}"]),
    "--gpus-per-node": (_ints(1, 8), INT_ODD),
    "--max-world-size": (_ints(1, 16), INT_ODD + [str(10**9)]),
    "--micro-batch": (_ints(1, 8), INT_ODD),
    "--levers": (_words("auto", "none", "none"), WORD_ODD),
    "--activation-checkpointing": (st.sampled_from(MODES), WORD_ODD),
    "--ac-every": (_ints(1, 4), INT_ODD),
    "--offload-optimizer": (_words("none", "cpu"), WORD_ODD),
    "--host-memory": (_words("64", "0.5", "1000"), FLOAT_ODD),
    "--seq": (_ints(1, 256), INT_ODD),
    "--precision": (_words("fp32", "bf16", "fp16"), WORD_ODD + ["fp8"]),
    "--hardware": (st.sampled_from(sorted(profiles())), WORD_ODD + ["tpu"]),
    "--gpu-memory": (_words("80", "0.01", "16"), FLOAT_ODD),
    "--prefetch-depth": (_ints(0, 3), INT_ODD),
    "--bucket-mb": (_words("0", "1", "25", "0.5"), FLOAT_ODD),
    "--json": None,
    "--plot": (_words("@plan.png"), WORD_ODD + ["plan.jpg", "@no/such/dir/plan.png"]),
    "--bogus": None,
}


@st.composite
def plan_flag_lists(draw):
    """The planner's flags: mostly a good --world-size (it is required) and often a small model first (the
    default, gpt2-small, takes longer to plan), and --stage 0-2 times."""
    world = ["--world-size", draw(PLAN_FLAGS["--world-size"][0])] if draw(st.integers(0, 7)) else []
    model = ["--model", draw(_words("gpt2-tiny", "llama-tiny"))] if draw(st.booleans()) else []
    stages = draw(st.lists(_ints(0, 3) | st.sampled_from(INT_ODD), max_size=2))
    return world + model + draw(flag_lists(PLAN_FLAGS)) + [a for s in stages for a in ("--stage", s)]


# as TRAIN_REGRESSIONS, for the planner
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
        m.setattr(plan_cli, "smallest_fitting", simulation)
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
    _one_error_line(err.getvalue(), out.getvalue())
    return "refused", []


def test_fuzzed_plan_flags_plan_or_exit_2_with_one_line(fuzz_dir, monkeypatch):
    before = Counter(TRIED)
    cheap = []

    @settings(FUZZ, max_examples=400)
    @given(flags=plan_flag_lists())
    @_examples(PLAN_REGRESSIONS)
    def prop(flags):
        argv = _paths(flags, fuzz_dir)
        outcome, plans = run_plan(argv, monkeypatch)
        TRIED["plan", outcome] += 1
        if outcome == "planned" and _cheap(argv, plans):
            cheap.append(argv)

    prop()
    tried = TRIED - before
    print(f"\nplan fuzz: {sum(tried.values())} cases: {dict(tried)}")
    assert tried["plan", "planned"] >= 20 and tried["plan", "refused"] >= 100
    # a few cheap accepted cases, planned for real: exit 0 and a table or JSON on stdout
    real, seen = [], set()
    while cheap and len(real) < REAL_PLANS:  # the most features not yet planned, first
        best = max(cheap, key=lambda c: len(_plan_features(c) - seen))
        cheap.remove(best)
        real.append(best)
        seen |= _plan_features(best)
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
    argv = _paths(flags, fuzz_dir)
    if config is not None:
        path = fuzz_dir / "named.json"
        path.write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
        argv += ["--config", str(path)]
    assert train.cli.main(argv + ["--device", "cpu", "--out", str(fuzz_dir / "never")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (fuzz_dir / "never").exists()


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


def test_a_warm_up_of_one_step_is_read_as_deepspeed_reads_it():
    """DeepSpeed warms up over max(2, warmup_num_steps) steps; a log warm-up over 1 divided by log(1)."""
    from zerofunc.config import parse
    cfg = parse({**MB1, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                                      "warmup_num_steps": 1}}}, 1)
    assert [cfg.lr(step) for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
