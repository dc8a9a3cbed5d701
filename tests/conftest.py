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


def pytest_report_header(config):
    if not HYPOTHESIS:
        return f"hypothesis is not installed: {len(collect_ignore)} modules not collected ({', '.join(collect_ignore)})"
    return None


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    """Files the fuzz tests name in their drawn flags (tests/fuzz.py)."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "data.txt").write_bytes(bytes(range(256)) * 8)
    (d / "empty.txt").write_bytes(b"")
    (d / "list.json").write_text("[1, 2]")
    (d / "broken.json").write_text('{"model_type": "gpt2",')
    return d
