"""The benchmark harnesses bench_peer and bench_aggregation run (so they cannot rot), bench_peer times
models that are not at their zero init, and it prints the paired statistics of ancre_dit.evaluation.stats."""
from __future__ import annotations

import pytest
import torch

from benchmarks import bench_aggregation, bench_peer


@pytest.mark.slow
def test_bench_peer_runs_every_variant_and_mode(capsys):
    bench = bench_peer
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
    torch.manual_seed(0)
    model = bench_peer.build("cascaded", "DiT-S/2", 8, compile_=False).train()
    assert all(p.any() for p in model.parameters() if p.requires_grad)
    model(torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])).square().mean().backward()
    assert all(p.grad is not None and p.grad.any() for p in model.parameters() if p.requires_grad)


def test_bench_aggregation_times_every_form_after_checking_they_agree(capsys):
    bench = bench_aggregation
    args = bench.parse_args(["--depth", "4", "--tokens", "4", "--width", "8", "--rounds", "2", "--steps", "1",
                             "--threads", "1"])
    times = bench.measure(args)
    assert set(times) == {"chain", "stacked"} and all(len(v) == 2 and min(v) > 0 for v in times.values())
    assert bench.make_topology("chain", 4).use_chain and not bench.make_topology("stacked", 4).use_chain
    out = capsys.readouterr().out
    assert "faults/step" in out
    assert "one read of all 10 edge sources" in out
    read_ms, bandwidth = bench.edge_read_ms(4, (64, 1024), repeats=2)  # 1 MiB
    assert read_ms > 0 and bandwidth == pytest.approx(4 * 64 * 1024 * 4 / (read_ms / 1e3) / 1e9)


def test_paired_columns_print_the_median_quartiles_and_interval():
    times, reference = [2.0, 3.0, 4.0, 9.0, 5.0, 6.0], [1.0, 2.0, 2.0, 3.0, 5.0, 4.0]  # ratios 1, 1.5, 1.5, 2, 2, 3
    assert bench_peer.paired_ratio(times, reference) == "1.750 [1.375..2.250]"
    assert bench_peer.paired_interval(times, reference) == "1.000..3.000"
    assert bench_peer.paired_ratio([2.0, 3.0], [1.0, 1.0]) == "2.500"
    assert bench_peer.paired_interval([2.0] * 5, [1.0] * 5) == ""  # five rounds cannot reach 95%


@pytest.mark.parametrize("variant, message", [
    ("dar:chunk", "give options as key=value"),
    ("dar:query=bogus", "query must be 'static', 'static-t' or 'dynamic'"),
    ("dar:frob=1", "unknown topology option(s) frob"),
    ("cascaded:norm=batchnorm", "unknown norm 'batchnorm'"),
    ("ancr", "unknown variant 'ancr'"),
])
def test_a_bad_variant_is_one_line_before_anything_is_built(variant, message):
    from ancre_dit.errors import UserError

    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench_peer.parse_args(["--variants", variant])
    bench_peer.parse_args(["--variants", "dar:query=static-t,chunk=2", "cascaded:norm=rmsnorm,qk_norm=true"])
