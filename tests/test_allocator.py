"""CUDA's allocator as the trainer and the check run it (zerofunc/allocator.py): expandable segments unless
the user chose, set before the rank's first CUDA allocation. No GPU here, so torch's setter and the CUDA
device calls are recorded rather than run; that the setting lowers the reserve is measured on a GPU
(docs/CUDA.md, sixth run)."""
from __future__ import annotations

import warnings

import pytest
import torch

from train.loop import rank_device
from zerofunc import allocator


@pytest.fixture
def calls(monkeypatch):
    """Clear the user's allocator variables and record, in order, torch's allocator setter and the
    CUDA device calls a rank makes."""
    for v in allocator.CONFIG_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    seen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: seen.append(("allocator", s)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return seen


def test_cuda_gets_expandable_segments_and_the_variable_says_so(calls):
    with warnings.catch_warnings():  # torch's deprecated CUDA setter warned on every rank of a GPU run
        warnings.simplefilter("error", FutureWarning)
        assert allocator.configure(torch.device("cuda"))
    assert calls == [("allocator", "expandable_segments:True")]
    assert allocator.settings() == "expandable_segments:True"


@pytest.mark.parametrize("variable", allocator.CONFIG_VARIABLES)
def test_a_users_setting_is_left_as_it_is(calls, monkeypatch, variable):
    monkeypatch.setenv(variable, "expandable_segments:False")
    assert not allocator.configure(torch.device("cuda"))
    assert calls == []
    assert allocator.settings() == "expandable_segments:False"


def test_a_cpu_run_is_not_touched(calls):
    assert not allocator.configure(torch.device("cpu"))
    assert calls == [] and allocator.settings() == ""


def test_a_cuda_rank_sets_the_allocator_before_it_takes_its_device(calls):
    """The trainer's rank configures the allocator first: after its first allocation the setting would
    shape only later segments."""
    assert rank_device("cuda") == torch.device("cuda", 0)
    assert calls == [("allocator", "expandable_segments:True"), ("set_device", 0)]
