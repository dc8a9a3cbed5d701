"""Hardware profiles: the package's own, read-only, overridden by name by the user's file, where the
recorders write. A pip-installed package must not rewrite itself, and no test may depend on what a
machine last recorded: each test here brings its own figures and its own file (tests/conftest.py
points every other test at an absent one)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sim.hardware import (PROFILES_ENV, get_profile, profiles, record_measured, shipped_path, use_profiles,
                          user_path)
from train.cli import main as train_main
from zerofunc.check.__main__ import main as check_main
from zerofunc.comm import backend_link
from zerofunc.plan.__main__ import main as plan_main

ROOT = Path(__file__).resolve().parent.parent
# A link as measure_cpu_profile.py records it: fitted rates and each op's medians by ring bytes
LINK = {"alpha_s": 1e-4, "bandwidth": 2e9, "op_bandwidth": {"all_gather": 1e9}, "measured_ranks": 2,
        "op_seconds": {"all_gather": [[1024.0, 1e-3], [2.0**25, 0.5]], "all_reduce": [[2048.0, 1e-3], [2.0**26, 0.1]]}}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def user(tmp_path, monkeypatch) -> Path:
    """The user's profiles file, not yet written; the environment is restored after the test, whatever
    a command line under test set it to."""
    path = tmp_path / "config" / "zerofunc" / "profiles.json"
    monkeypatch.setenv(PROFILES_ENV, str(path))
    return path


def test_tests_see_the_shipped_profiles_only():
    path = Path(os.environ[PROFILES_ENV])
    assert user_path() == path and not path.exists()
    assert path != Path.home() / ".config" / "zerofunc" / "profiles.json"


def test_the_user_file_is_the_variable_else_under_the_config_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "mine.json"))
    assert user_path() == tmp_path / "mine.json"
    monkeypatch.delenv(PROFILES_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert user_path() == tmp_path / "xdg" / "zerofunc" / "profiles.json"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_path() == tmp_path / "home" / ".config" / "zerofunc" / "profiles.json"


def test_a_user_profile_overrides_the_shipped_one_by_name(user):
    shipped = dict(profiles())  # the env's file is absent: the shipped profiles alone
    new = json.loads(shipped_path().read_text())["a100-sxm"] | {"description": "a GPU of my own", "memory_gib": 48}
    user.parent.mkdir(parents=True)
    user.write_text(json.dumps({
        "h100-sxm": {"memory_gib": 40, "flops": {"bf16": 1e15}, "intra_node": {"bandwidth": 1e11},
                     "sources": {"memory_gib": "my card"}},
        "cpu-gloo": {"intra_node": LINK},
        "my-gpu": new}))
    overlaid = profiles()
    h100, was = overlaid["h100-sxm"], shipped["h100-sxm"]
    assert h100.memory_bytes == 40 * 2**30 and h100.reserved_bytes == was.reserved_bytes
    assert h100.flops == {**was.flops, "bf16": 1e15}  # an object's keys update the shipped object's
    assert h100.intra_node == replace(was.intra_node, bandwidth=1e11) and h100.inter_node == was.inter_node
    assert h100.sources["memory_gib"] == "my card" and set(was.sources) <= set(h100.sources)
    gloo = overlaid["cpu-gloo"].link(2)
    assert gloo.op_seconds["all_gather"] == ((1024.0, 1e-3), (2.0**25, 0.5)) and gloo.bandwidth == 2e9
    assert backend_link("gloo", 2) == gloo  # the trainer's ranks choose their collectives by the same rates
    assert get_profile("my-gpu").memory_bytes == 48 * 2**30 and get_profile("my-gpu").description == "a GPU of my own"
    assert {n: p for n, p in overlaid.items() if n not in ("h100-sxm", "cpu-gloo", "my-gpu")} == \
           {n: p for n, p in shipped.items() if n not in ("h100-sxm", "cpu-gloo")}


def test_recording_writes_the_user_file_and_never_the_package(user):
    """Into the user's file (made, with its directory, if absent), replaced whole, read back at once; the
    package's profiles.json byte for byte as shipped; a second recording updates the first."""
    shipped, before = digest(shipped_path()), get_profile("cpu-gloo")
    figures = {"flops": {"fp32": 5e10}, "memory_bandwidth": 3e9, "intra_node": LINK, "inter_node": LINK,
               "op_overhead_s": 2e-5, "overlap_hidden": 0.5}
    assert record_measured("cpu-gloo", figures, "measured by a test") == user
    written = json.loads(user.read_text())
    assert list(written) == ["cpu-gloo"] and written["cpu-gloo"]["intra_node"] == LINK
    after = get_profile("cpu-gloo")
    assert after.flops == {**before.flops, "fp32": 5e10} and after.overlap_hidden == 0.5
    assert after.link(2).op_seconds["all_reduce"] == ((2048.0, 1e-3), (2.0**26, 0.1)) and backend_link("gloo", 2) == after.link(2)
    measured = [k for k in after.sources if k.startswith("measured: ")]
    assert measured == ["measured: " + ", ".join(figures)] and after.sources[measured[0]] == "measured by a test"
    record_measured("cpu-gloo", {"flops": {"bf16": 6e10}}, "again")
    again = get_profile("cpu-gloo")
    assert again.flops == {**before.flops, "fp32": 5e10, "bf16": 6e10} and again.link(2) == after.link(2)
    assert [k for k in again.sources if k.startswith("measured: ")] == ["measured: flops"]
    assert sorted(p.name for p in user.parent.iterdir()) == ["profiles.json"]  # no partial file left
    with pytest.raises(ValueError, match="ships read-only"):
        record_measured("cpu-gloo", figures, "into the package", shipped_path())
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        record_measured("tpu", figures, "no such profile")
    assert digest(shipped_path()) == shipped


def test_measure_cpu_profile_records_into_the_user_file(user, capsys, monkeypatch):
    """benchmarks/measure_cpu_profile.py --record, its measurement stood in for (a minute of a quiet
    machine): the figures it writes, where it writes them; a file it cannot use, before measuring."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its probes, beside it
    spec = importlib.util.spec_from_file_location("measure_cpu_profile", ROOT / "benchmarks" / "measure_cpu_profile.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shipped = digest(shipped_path())
    measured = {"flops": {"fp32": 4e10, "bf16": 8e10, "fp16": 2e10}, "compute_efficiency": 0.8,
                "memory_bandwidth": 9e9, "op_overhead_s": 1e-5, "overlap_hidden": 0.3, "link": LINK, "measured": {}}
    assert bench.record_profile(measured, "a stand-in measurement") == user
    gloo = get_profile("cpu-gloo")
    assert gloo.flops == measured["flops"] and gloo.compute_efficiency == 0.8 and gloo.op_overhead_s == 1e-5
    assert gloo.intra_node == gloo.inter_node and gloo.link(2).bandwidth == 2e9
    assert digest(shipped_path()) == shipped
    user.write_text("[]")
    assert bench.cli(["--record", "--profiles", str(user)]) == 2  # returns before spawning any rank
    assert capsys.readouterr().err == f"error: {user}: expected an object of hardware profiles by name, got a list\n"


BROKEN = {
    "not JSON": ('{"h100-sxm": {"memory_gib": 40', "not JSON (Expecting"),
    "a list": ("[1, 2]", "expected an object of hardware profiles by name, got a list"),
    "an entry not an object": ('{"h100-sxm": 40}', "profile 'h100-sxm' is a int, not an object of fields"),
    "a field of the wrong kind": ('{"h100-sxm": {"flops": "fast"}}', "profile 'h100-sxm': flops must be an object"),
    "an unknown field": ('{"h100-sxm": {"memory_gb": 40}}', "profile 'h100-sxm': unknown field(s) memory_gb"),
    "a link's times": ('{"cpu-gloo": {"intra_node": {"op_seconds": {"all_gather": [[1, 2]]}}}}',
                       "profile 'cpu-gloo': intra_node: measured times of all_gather need 2 or more points"),
    "a new profile, incomplete": ('{"tpu": {"memory_gib": 16}}', "profile 'tpu': missing field(s) description"),
}


@pytest.mark.parametrize("text, message", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_user_file_is_one_line_naming_it(user, capsys, text, message):
    """Every command that reads the profiles: exit 2 and one line, "error: FILE: what", no traceback;
    by --profiles FILE and by the environment alike."""
    user.parent.mkdir(parents=True)
    user.write_text(text)
    with pytest.raises(ValueError, match="^" + str(user)):
        profiles()
    plan = ["--model", "gpt2-tiny", "--world-size", "2", "--levers", "none"]
    train = ["--steps", "1", "--out", str(user.parent / "run")]
    check = ["--world-sizes", "1", "--stage", "0", "--device", "cpu"]
    for main, argv in ((plan_main, plan), (train_main, train), (check_main, check)):
        for how in (["--profiles", str(user)], []):
            assert main(argv + how) == 2, (main, how)
            out, err = capsys.readouterr()
            assert err.startswith(f"error: {user}: ") and message in err and err.count("\n") == 1, err
            assert out == ""
    assert not (user.parent / "run").exists()


def test_a_broken_user_file_from_a_shell(user):
    """The command as a user runs it: the one line, and not a traceback's."""
    user.parent.mkdir(parents=True)
    user.write_text('{"cpu-gloo": {"flops": {"fp32": "fast"}}}')
    done = subprocess.run([sys.executable, "-m", "zerofunc.plan", "--world-size", "2", "--hardware", "cpu-gloo"],
                          capture_output=True, text=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"error: {user}: profile 'cpu-gloo': flops must be an object of numbers, "
                           f'got {{"fp32": "fast"}}\n')


def test_a_profiles_file_named_on_the_command_line_must_be_there(user, capsys, monkeypatch):
    """A reader told --profiles FILE reads FILE or stops (a typo must not plan with the shipped figures);
    a recorder makes it. Every rank inherits the file as an absolute path."""
    missing = user.parent / "typo.json"
    assert plan_main(["--world-size", "2", "--profiles", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --profiles {missing}: no such file\n"
    assert use_profiles(missing, must_exist=False) == missing and os.environ[PROFILES_ENV] == str(missing)
    user.parent.mkdir(parents=True)
    user.write_text(json.dumps({"h100-sxm": {"memory_gib": 8}}))
    monkeypatch.chdir(user.parent)
    assert use_profiles("profiles.json") == user
    assert get_profile("h100-sxm").memory_bytes == 8 * 2**30
    other = user.parent / "other.json"
    other.write_text(json.dumps({"h100-sxm": {"memory_gib": 16}}))
    assert plan_main(["--world-size", "2", "--levers", "none", "--stage", "0", "--json", "--prof", str(other)]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_bytes"] == 15 * 2**30  # 16 GiB less the H100's reserve
