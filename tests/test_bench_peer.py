"""scripts/bench_peer.py runs (so it cannot rot) and times models that are not at their zero init."""
from __future__ import annotations

import pytest
import torch

from helpers import ROOT, load_script


@pytest.mark.slow
def test_bench_peer_runs_every_variant_and_mode(capsys):
    bench = load_script(ROOT / "scripts" / "bench_peer.py")
    args = bench.parse_args(["--models", "DiT-S/2", "--batch-sizes", "1", "--input-size", "8", "--rounds", "1",
                             "--steps", "1", "--warmup", "0", "--threads", "1", "--variants", "cascaded", "ancre",
                             "diffusers", "--share", "1"])
    results = bench.measure(args)
    times = results[("DiT-S/2", 1)]["time"]
    assert {v for v, _ in times} == {"cascaded", "ancre", "diffusers"} and all(t > 0 for t in times.values())
    out = capsys.readouterr().out
    assert "cascaded / diffusers" in out and "paired" in out
    share = float(out.split("ancre aggregation")[1].split("=")[1].split("%")[0])
    assert 0 < share < 50


def test_timed_models_have_no_all_zero_tensors_and_every_gradient_moves():
    """At DiT's adaLN-Zero init most gradients are exactly zero (AdamW's CPU step is slower on
    those); the benchmark's models get small random values there first."""
    bench = load_script(ROOT / "scripts" / "bench_peer.py")
    torch.manual_seed(0)
    model = bench.build("cascaded", "DiT-S/2", 8, compile_=False).train()
    assert all(p.any() for p in model.parameters() if p.requires_grad)
    model(torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])).square().mean().backward()
    assert all(p.grad is not None and p.grad.any() for p in model.parameters() if p.requires_grad)


def test_bench_aggregation_times_every_form_after_checking_they_agree(capsys):
    bench = load_script(ROOT / "scripts" / "bench_aggregation.py")
    args = bench.parse_args(["--depth", "4", "--tokens", "4", "--width", "8", "--rounds", "2", "--steps", "1",
                             "--threads", "1"])
    times = bench.measure(args)
    assert set(times) == {"chain", "fused", "routed"} and all(len(v) == 2 and min(v) > 0 for v in times.values())
    topology = bench.make_topology("fused", 4)
    assert topology.fused_aggregation and not topology.route_gradients
    out = capsys.readouterr().out
    assert "faults/step" in out
    assert "one read of all 10 edge sources" in out
    read_ms, bandwidth = bench.edge_read_ms(4, (64, 1024), repeats=2)  # 1 MiB
    assert read_ms > 0 and bandwidth == pytest.approx(4 * 64 * 1024 * 4 / (read_ms / 1e3) / 1e9)


def test_median_interval_is_the_binomial_order_statistics():
    """n=10: x_(2)..x_(9) covers the median with 97.9% (x_(3)..x_(8) only 89%); n=6: x_(1)..x_(6)
    (96.9%); five values cannot reach 95% (two-sided 1/16 > 5%)."""
    bench = load_script(ROOT / "scripts" / "bench_peer.py")
    assert bench.median_confidence_interval([float(v) for v in range(10, 0, -1)]) == (2.0, 9.0)
    assert bench.median_confidence_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert bench.median_confidence_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert bench.paired_interval([2.0] * 5, [1.0] * 5) == ""
