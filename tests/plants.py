"""The plant register: real bugs that the test suite must catch, each with the tests that must fail.

    python -m tests.plants                  plant each bug in a copy of the working tree, run its tests
    python -m tests.plants NAME [NAME ...]  only these
    python -m tests.plants --list           the entries
    python -m tests.plants --check          only whether each plant still applies (no tests run)
    python -m tests.plants --baseline ...   first run each selection without its plant: it must pass

The entries are in tests/plant_register/ (a file per area). For each plant the working tree (the files `git ls-files
-co --exclude-standard` lists: tracked ones and untracked ones git does not ignore, so uncommitted work
counts) is copied to a temporary directory, the plant applied there, and `python -m pytest -q -x -p no:cacheprovider SELECTION` run with the copy as the working
directory and as PYTHONPATH: the tests, and the ranks and commands they spawn, import the copy, not the
checkout the editable install points at.

Outcomes: `caught` (pytest exit 1: a test failed), `survived` (exit 0: the tests miss the bug), `no longer
applies` (an `old` is not found exactly once: the code moved, rewrite the entry), `error` (any other exit,
or the time limit). The command exits 1 unless every plant named is caught.
"""
from __future__ import annotations

import argparse
import os
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.plant_register import PLANTS, Plant

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1200  # per plant: tests that hang under a plant are an error, not a catch


# ---- running them ---------------------------------------------------------------------------------------
def applies(plant: Plant, root: Path = ROOT) -> list[str]:
    """What keeps the plant from applying to the tree at `root` (empty: it applies)."""
    problems = []
    for file, old, _ in plant.edits:
        path = root / file
        n = path.read_text().count(old) if path.is_file() else 0
        if n != 1:
            problems.append(f"{file}: the code to replace occurs {n} times")
    return problems


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it, uncommitted work included, ignored files (the venv) left out."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file() or src.is_symlink():  # a tracked file deleted in the tree is left out
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel, follow_symlinks=False)


def plant_in(plant: Plant, tree: Path) -> None:
    for file, old, new in plant.edits:
        path = tree / file
        path.write_text(path.read_text().replace(old, new, 1))


def pytest_in(tree: Path, selection: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """Run the selection in `tree`, importing `tree`: (pytest's exit code, None past `timeout`; its output).
    Past the timeout the whole session pytest started (the ranks it spawned too) is killed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection]
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0] + f"\n(stopped after {timeout:.0f} s)"


def run(plant: Plant, timeout: float, baseline: bool = False, show: bool = False) -> tuple[str, str]:
    """(outcome, detail) for one plant, each in a fresh copy of the working tree."""
    problems = applies(plant)
    if problems:
        return "no longer applies", "; ".join(problems)
    with tempfile.TemporaryDirectory(prefix=f"plant-{plant.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        if baseline:
            code, out = pytest_in(tree, plant.selection, timeout)
            if code != 0:
                return "error", f"the selection fails without the plant (exit {code}):\n{tail(out)}"
        plant_in(plant, tree)
        code, out = pytest_in(tree, plant.selection, timeout)
    if code == 1:
        return "caught", first_failure(out) + (f"\n{tail(out, 40)}" if show else "")
    if code == 0:
        return "survived", ""
    return "error", f"{'stopped at the time limit' if code is None else f'pytest exit {code}'}:\n{tail(out)}"


def tail(out: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in out.rstrip().splitlines()[-lines:])


def first_failure(out: str) -> str:
    """The first line of pytest's short summary that names a failing test (and its message)."""
    for line in out.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.plants", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="plants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the entries and exit")
    ap.add_argument("--check", action="store_true", help="only say whether each plant still applies")
    ap.add_argument("--baseline", action="store_true", help="first run each selection unplanted: it must pass")
    ap.add_argument("--show", action="store_true", help="print the tail of pytest's output for caught plants too")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per plant (default %(default)s)")
    a = ap.parse_args(argv)
    names = [p.name for p in PLANTS]
    dupes = {n for n in names if names.count(n) > 1}
    unknown = [n for n in a.names if n not in names]
    if dupes or unknown:
        print(f"error: {'duplicate' if dupes else 'unknown'} plant names: {', '.join(sorted(dupes) or unknown)}",
              file=sys.stderr)
        return 2
    chosen = [p for p in PLANTS if not a.names or p.name in a.names]
    if a.list:
        for p in chosen:
            print(f"{p.name}\n  {p.file}{' (+' + str(len(p.also)) + ' more)' if p.also else ''} -- {p.source}\n"
                  f"  why: {p.why}\n  tests: {shlex.join(p.selection)}")
        return 0
    if a.check:
        bad = [(p, applies(p)) for p in chosen]
        for p, problems in bad:
            print(f"{p.name:45s} {'applies' if not problems else 'no longer applies: ' + '; '.join(problems)}")
        return 1 if any(problems for _, problems in bad) else 0
    width = max(len(p.name) for p in chosen)
    outcomes, start = [], time.monotonic()
    for p in chosen:
        began = time.monotonic()
        outcome, detail = run(p, a.timeout, a.baseline, a.show)
        took = time.monotonic() - began
        outcomes.append(outcome)
        first, _, rest = detail.partition("\n")
        print(f"{p.name:{width}s}  {outcome:17s} {took:6.1f} s  {first}", flush=True)
        if rest:
            print(rest, flush=True)
    caught = outcomes.count("caught")
    others = ", ".join(f"{outcomes.count(o)} {o}" for o in ("survived", "no longer applies", "error") if o in outcomes)
    print(f"{caught} of {len(outcomes)} caught{'; ' + others if others else ''}, in {time.monotonic() - start:.0f} s")
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
