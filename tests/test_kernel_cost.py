"""The GPU's cost per op class (sim.kernel_cost), on ops run on meta tensors under the roofline, each against
a figure worked by hand from the constants (never from the code under test)."""
from __future__ import annotations

import json

import pytest
import torch

from sim.hardware import ProfilesError, get_profile, profiles, shipped_path, use_profiles
from sim.kernel_cost import KernelCosts
from sim.roofline import Roofline

PEAK, BANDWIDTH = 1e15, 2e12
COSTS = KernelCosts(gemm_ceiling=0.8, sms=100, gemm_tile=(256, 128), attention_forward=0.7, attention_backward=0.5,
                    memory_efficiency=((100e6, 0.9), (1e6, 0.6), (0.0, 0.3)), floor_s=5e-6)


def seconds(fn, *shapes, dtype=torch.bfloat16) -> float:
    """The roofline's device seconds for fn on meta tensors of `shapes`."""
    roofline = Roofline({"bf16": PEAK, "fp32": PEAK / 16}, BANDWIDTH, compute_efficiency=0.5, kernels=COSTS)
    tensors = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
    with roofline:
        fn(*tensors)
    return roofline.time_s


def test_a_gemm_runs_at_the_ceiling_times_its_waves():
    """2 * m * n * k FLOPs at peak x 0.8 x the useful share of its waves. 100 tiles of 256 x 128 fill the 100 SMs
    once: all useful. One more row of tiles (m + 256: 110 tiles in 2 waves of 100) wastes 90 of 200 slots, and
    so does padding m by one row (m + 1 needs a 11th row of tiles of which one row is used). (k is long enough
    that each is bound by its FLOPs, not its bytes.)"""
    k = 16384
    full = seconds(torch.mm, (2560, k), (k, 1280))
    assert full == pytest.approx(2 * 2560 * 1280 * k / (PEAK * 0.8))
    two_waves = seconds(torch.mm, (2560 + 256, k), (k, 1280))
    assert two_waves == pytest.approx(2 * 2816 * 1280 * k / (PEAK * 0.8 * (2816 * 1280 / (200 * 256 * 128))))
    padded = seconds(torch.mm, (2561, k), (k, 1280))
    assert padded == pytest.approx(2 * 2560 * 1280 * k / (PEAK * 0.8 * (2560 * 1280 / (200 * 256 * 128))), rel=1e-3)
    # an output narrower than a tile (a rank-8 fp32 adapter's) runs as a skinny kernel, bound by its bytes:
    # reading the 25600 x 4096 input and the 4096 x 8 adapter, writing 25600 x 8, at 0.9 of the bandwidth
    # (233 us; cut into 100 tiles of 256 x 128 of which 8 columns are used, its FLOPs would take 537 us)
    m, k, r = 25600, 4096, 8
    assert seconds(torch.mm, (m, k), (k, r), dtype=torch.float32) == pytest.approx(
        4 * (m * k + k * r + m * r) / (BANDWIDTH * 0.9))
    # a batched matmul tiles each of its outputs: 4 x 50 tiles, two full waves
    k = 8192
    assert seconds(torch.bmm, (4, 1280, k), (4, k, 1280)) == pytest.approx(2 * 4 * 1280 * 1280 * k / (PEAK * 0.8))


def test_causal_attention_costs_the_flops_it_executes():
    """torch counts the full T x T square for attention (4 * b * h * T^2 * d forward); a causal kernel executes
    (T + 1) / 2T of it, at the flash forward efficiency (0.7); backward counts 2.5 times the forward's FLOPs
    (torch's formula) at 0.5."""
    b, h, t, d = 2, 8, 4096, 128
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    forward = 4 * b * h * t * t * d
    full = seconds(lambda q, k, v: flash(q, k, v, 0.0, False), *[(b, h, t, d)] * 3)
    causal = seconds(lambda q, k, v: flash(q, k, v, 0.0, True), *[(b, h, t, d)] * 3)
    assert full == pytest.approx(forward / (PEAK * 0.7))
    assert causal == pytest.approx(forward * (t + 1) / (2 * t) / (PEAK * 0.7))

    def backward(q, k, v, causal):
        out, lse, cq, ck, mq, mk, seed, offset, _ = flash(q, k, v, 0.0, causal)
        roofline = Roofline({"bf16": PEAK, "fp32": PEAK / 16}, BANDWIDTH, kernels=COSTS)
        with roofline:
            torch.ops.aten._scaled_dot_product_flash_attention_backward(out, q, k, v, out, lse, cq, ck, mq, mk, 0.0,
                                                                        causal, seed, offset)
        return roofline.time_s
    qkv = [torch.empty(b, h, t, d, dtype=torch.bfloat16, device="meta") for _ in range(3)]
    assert backward(*qkv, True) == pytest.approx(2.5 * forward * (t + 1) / (2 * t) / (PEAK * 0.5))


def test_other_ops_run_at_the_bandwidth_their_size_reaches_and_no_kernel_is_quicker_than_the_floor():
    """An add reads two tensors and writes one: 3 x 64 MiB moved, over 100 MB, at 0.9 of the bandwidth; 3 x 8 MiB
    at 0.6; a one-element add at the 5 us floor; an empty tensor launches nothing."""
    big, small = 2**25, 2**22  # bf16 elements: 64 MiB, 8 MiB
    assert seconds(torch.add, (big,), (big,)) == pytest.approx(3 * 2 * big / (BANDWIDTH * 0.9))
    assert seconds(torch.add, (small,), (small,)) == pytest.approx(3 * 2 * small / (BANDWIDTH * 0.6))
    assert seconds(torch.add, (1,), (1,)) == pytest.approx(5e-6)
    assert seconds(lambda: torch.empty(big, device="meta")) == 0.0


def test_the_shipped_gpu_profiles_price_by_class_and_the_cpu_keeps_its_measured_roofline():
    for name in ("a100-sxm", "h100-sxm", "h100-sxm-96gb-500w", "h200-sxm"):
        p = get_profile(name)
        assert p.kernels is not None and "kernels" in p.sources
        assert p.intra_node.compute_share > p.inter_node.compute_share > 0
    assert get_profile("cpu-gloo").kernels is None and get_profile("cpu-gloo").intra_node.compute_share == 0


@pytest.mark.parametrize("kernels, says", [
    ({"gemm_ceilng": 0.8}, "unknown field(s) gemm_ceilng"),
    ({**{k: v for k, v in COSTS.__dict__.items() if k != "memory_efficiency"}, "memory_efficiency": [[1e6, 0.5]]},
     "descending bytes down to 0"),
    ({**COSTS.__dict__, "attention_forward": 1.5, "memory_efficiency": [[0, 0.5]]}, "fractions in (0, 1]"),
])
def test_a_bad_kernels_entry_is_refused_in_one_line_naming_the_profile(tmp_path, monkeypatch, kernels, says):
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"a100-sxm": {"kernels": kernels}}))
    monkeypatch.setenv("ZEROFUNC_PROFILES", str(path))
    with pytest.raises(ProfilesError, match="a100-sxm") as e:
        use_profiles(None)
    assert says in str(e.value) and "\n" not in str(e.value)
    monkeypatch.delenv("ZEROFUNC_PROFILES")
    assert profiles()["a100-sxm"].kernels is not None


def test_a_users_file_overrides_one_constant_and_keeps_the_rest(tmp_path, monkeypatch):
    """A measured GEMM ceiling (zerofunc.check --calibrate's kind of figure) replaces the published one only."""
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"a100-sxm": {"kernels": {"gemm_ceiling": 0.7}}}))
    monkeypatch.setenv("ZEROFUNC_PROFILES", str(path))
    shipped = json.loads(shipped_path().read_text())["a100-sxm"]["kernels"]
    kernels = get_profile("a100-sxm").kernels
    assert kernels.gemm_ceiling == 0.7 and kernels.sms == shipped["sms"] != 0
    assert kernels.attention_backward == shipped["attention_backward"]


def test_op_constants_records_the_ceiling_that_reproduces_the_measured_gemms(tmp_path):
    """benchmarks/op_constants.py's measured profile: GEMMs measured at 0.7 of peak times each shape's wave
    efficiency give back a ceiling of 0.7 (the planner then prices each at what was measured); attention and
    the floor as measured; a copy at 0.81 of HBM scales the published 0.9 for 100 MB and more to 0.81."""
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "op_constants.py"
    spec = importlib.util.spec_from_file_location("op_constants", path)
    module = sys.modules["op_constants"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    profile = get_profile("h100-sxm")
    shapes = [(8192, 4096), (8192, 1024), (4096, 4096), (14336, 4096), (8192, 14336)]
    rows = {"gemm": [{"name": f"g{i}", "m": m, "n": n, "fraction_of_peak": 0.7 * profile.kernels.wave_efficiency(
                1, m, n)} for i, (m, n) in enumerate(shapes)] + [{"name": "ref 8192^3", "m": 8192, "n": 8192,
                                                                   "fraction_of_peak": 0.99}],
            "attention": {"forward_fraction_of_peak": 0.3, "backward_fraction_of_peak": 0.25},
            "copy": {"fraction_of_hbm": 0.81}, "kernel_floor_s": 4e-6}
    kernels = module.measured_kernels(rows, profile)
    assert kernels["gemm_ceiling"] == pytest.approx(0.7)
    assert (kernels["attention_forward"], kernels["attention_backward"], kernels["floor_s"]) == (0.3, 0.25, 4e-6)
    assert kernels["memory_efficiency"][0] == [100e6, pytest.approx(0.81)]
