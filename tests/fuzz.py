"""The strategies and checks the fuzz tests share (tests/test_fuzz_train.py, tests/test_fuzz_plan.py).

Hypothesis draws a DeepSpeed-style config (for every key zerofunc knows, a plausible value or
any JSON at all: null, booleans, huge and negative integers, NaN, infinities, strings, lists,
objects; unknown keys; sections of the wrong type; files that are not JSON, not UTF-8, or hold
a list) and a set of flags with good, huge, negative, zero, non-finite and non-numeric values.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings, strategies as st

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


def ints(lo: int, hi: int):
    return st.integers(lo, hi).map(str)


def words(*words: str):
    return st.sampled_from(words)


# flag: (good values, odd values) or None for a flag without a value; "@name" is a file of `fuzz_dir`
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


def at_dir(argv: list[str], d: Path) -> list[str]:
    """`@name` -> a path in `d` ("@" alone: the directory itself, not a file)."""
    return [a.replace("@", str(d) + os.sep, 1) if "@" in a else a for a in argv]


def one_error_line(err: str, out: str) -> None:
    assert "Traceback" not in err, err
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n") and out == "", (out, err)


def kind_ok(value, kind: str) -> bool:
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
        return isinstance(value, list) and len(value) == 2 and all(kind_ok(b, "number") for b in value)
    raise AssertionError(kind)


def ill_typed(raw: dict, spec: dict = SCHEMA, prefix: str = "") -> list[str]:
    """The known keys of `raw` whose values are not of the kind zerofunc reads there."""
    bad = []
    for key, value in raw.items():
        if key not in spec:
            continue
        if isinstance(spec[key], dict):
            bad += ill_typed(value, spec[key], prefix + key + ".") if isinstance(value, dict) else [prefix + key]
        elif spec[key][1] is not None and value is not None and not kind_ok(value, spec[key][1]):
            bad.append(prefix + key)
    return bad


def covering(candidates: list, features, limit: int) -> tuple[list, set]:
    """Up to `limit` of `candidates`, greedily the one with the most features not yet covered
    first; (the chosen, the features they cover)."""
    candidates, chosen, seen = list(candidates), [], set()
    while candidates and len(chosen) < limit:
        best = max(candidates, key=lambda c: len(features(c) - seen))
        candidates.remove(best)
        chosen.append(best)
        seen |= features(best)
    return chosen, seen
