"""Session set-up that has to happen before any test imports the library."""
from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decides interpreted-or-compiled when @triton.jit decorates a function
    # (triton 3.9 reads TRITON_INTERPRET there), i.e. when zerofunc.fused is first
    # imported, which collecting almost any test module does. Without a GPU, the
    # interpreter is the only way the kernels run; spawned ranks inherit the setting
    # but keep to the torch reference unless ZEROFUNC_TRITON=1.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hardware profiles: the shipped ones only. A developer's own file ($ZEROFUNC_PROFILES, or
# ~/.config/zerofunc/profiles.json: sim/hardware.py) must not change what a test sees, nor a test write
# it; ranks and subprocesses inherit this absent file. A test of the user's file sets its own.
os.environ["ZEROFUNC_PROFILES"] = os.path.join(tempfile.gettempdir(), f"zerofunc-tests-{os.getpid()}", "profiles.json")

# A GPU image may carry torch and pytest but not hypothesis, and nothing can be installed
# there. The property-based modules then cannot even be collected; leave them out, say
# so in the header, and let `pytest -m cuda` run what needs no more than torch.
HYPOTHESIS = importlib.util.find_spec("hypothesis") is not None
_HERE = os.path.dirname(os.path.abspath(__file__))


def _needs_hypothesis(name: str) -> bool:
    with open(os.path.join(_HERE, name)) as f:
        return any(line.startswith(("from hypothesis", "import hypothesis", "from tests.worlds")) for line in f)


collect_ignore = [] if HYPOTHESIS else [n for n in sorted(os.listdir(_HERE))
                                        if n.startswith("test_") and n.endswith(".py") and _needs_hypothesis(n)]


# Hypothesis profiles: `--hypothesis-profile NAME` (hypothesis' own pytest option) or ZEROFUNC_HYPOTHESIS_PROFILE=NAME
# (the option wins). Without either, hypothesis' own profile is active ("default", or "ci" where a CI
# variable is set), and each world of the equivalence test draws 6 cases. A profile's max_examples is what
# each such world draws (tests/worlds.py: examples_in_world, read here and passed to the ranks as an
# argument: they do not load this file); the other property tests name their own counts.
# - fast: 2 cases per world (both model families), for a quick look at a property that starts worlds;
# - full: 40 cases per world, the long run (it was ZEROFUNC_EXAMPLES=40).
# Both inherit the rest from the profile active here (derandomized under "ci").
PROFILES = {"fast": 2, "full": 40}
if HYPOTHESIS:
    from hypothesis import settings

    for _name, _examples in PROFILES.items():
        settings.register_profile(_name, max_examples=_examples)
    if os.environ.get("ZEROFUNC_HYPOTHESIS_PROFILE"):
        settings.load_profile(os.environ["ZEROFUNC_HYPOTHESIS_PROFILE"])


def pytest_report_header(config):
    if not HYPOTHESIS:
        return f"hypothesis is not installed: {len(collect_ignore)} modules not collected ({', '.join(collect_ignore)})"
    return None


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """A --data file of 8 KiB, the built-in corpus's first bytes, for launches that do not test the corpus:
    the built-in corpus is 16 MiB of standard-library sources, read in the launcher and again in every rank
    (about 0.6 s each here)."""
    from train.data import stdlib_corpus
    path = tmp_path_factory.mktemp("data") / "tiny.txt"
    path.write_bytes(stdlib_corpus(cap=8 << 10))
    return str(path)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    """Files the fuzz tests name in their drawn flags (tests/fuzz.py)."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "data.txt").write_bytes(bytes(range(256)) * 8)
    (d / "empty.txt").write_bytes(b"")
    (d / "list.json").write_text("[1, 2]")
    (d / "broken.json").write_text('{"model_type": "gpt2",')
    return d


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """About 40 small standard-library sources: real text, present on every machine."""
    from train.data import stdlib_files
    small = [p for p in stdlib_files()[:200] if p.stat().st_size < 8000][:40]
    return [p.read_text() for p in small]


@pytest.fixture(scope="module")
def tok(texts, tmp_path_factory):
    """A byte-level BPE tokenizer.json trained on `texts` (tests/tokenizer.py)."""
    from tests.tokenizer import train_tokenizer
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(path, texts)
    return path
