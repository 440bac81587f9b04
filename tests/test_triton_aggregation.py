"""model.aggregation_kernel: the Triton kernels of the stacked aggregation against the plain chain,
run on CPU tensors by Triton's interpreter in a child python (tests/triton_checks.py, TRITON_INTERPRET=1
set before triton is imported, so this process and the other tests never see it); the bytes they
move against the floor; and the choice itself: the CPU default is today's torch path bitwise, triton
needs the package, and where its kernels cannot run a model takes the torch ops."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from ancre_dit.errors import UserError
from ancre_dit.models.topologies import aggregation
from ancre_dit.training.config_sections import ModelConfig
from ancre_dit.training.model_setup import model_kwargs
from benchmarks import traffic

from helpers import ROOT, inputs, randomize, subprocess_env, tiny_model

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.slow
@needs_triton
def test_interpreted_kernels_equal_the_plain_chain():
    """One child (its imports are most of its time): the trunk's output and the gradients of h_0, the
    blocks and the logits equal the chain's within fp32 rounding, dense and sparse, add and replace,
    fp32 and bf16 history, the kernels having run; aggregation_kernel=triton on a tiny DiT gives the
    torch path's output and gradients; and the bytes moved equal benchmarks/traffic.py's model."""
    env = {**subprocess_env(), "TRITON_INTERPRET": "1"}
    checks = ("trunk", "model", "traffic")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_checks.py"), *checks],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0 and all(f"{c} ok" in proc.stdout for c in checks), proc.stderr[-3000:]


@pytest.mark.parametrize("edges", [traffic.dense_edges(12), traffic.topk_edges(12, 2)], ids=["dense", "top-2"])
def test_the_kernels_move_the_floors_bytes_but_h0s_copy(edges):
    """Above the floor only h_0's copy into the store: its read and write with a fp32 history, its
    read alone with a bf16 one (the floor writes every history row in bf16 anyway)."""
    for history, extra in ((4, {"forward read": 1, "forward write": 1}), (2, {"forward read": 1})):
        kernels, floor = traffic.triton_passes(edges, 4, history), traffic.floor_passes(edges, 4, history)
        assert {k: sum(c.values()) - sum(floor[k].values()) for k, c in kernels.items()} == {
            k: extra.get(k, 0) for k in kernels}
    moved = {form: sum(traffic.total_bytes(count(edges, 4, 2), 1).values())
             for form, count in (("kernels", traffic.triton_passes), ("torch", traffic.stacked_passes))}
    assert moved["kernels"] < 0.6 * moved["torch"]  # a bf16 history: the torch ops sum it edge by edge


def test_auto_on_the_cpu_is_the_torch_path_bitwise(monkeypatch):
    """Even with the interpreter on: auto takes the kernels on CUDA only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aggregation.aggregation_kernels("auto", torch.device("cpu")) is None
    assert aggregation.aggregation_kernels("torch", torch.device("cpu")) is None
    x, t, y = inputs()
    outs = []
    for kernel in ("auto", "torch"):
        model = randomize(tiny_model("ancre", depth=3, aggregation_kernel=kernel))
        out = model(x, t, y)
        out.square().mean().backward()
        outs.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_triton_needs_the_package_and_elsewhere_than_cuda_runs_the_torch_ops(monkeypatch):
    """A training on a machine without CUDA is refused (tests/test_bad_inputs.py); a model built with
    it still runs where the kernels cannot (a FLOP count on the meta device, a CPU sampling): the
    torch ops, bitwise."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for device in ("cpu", "meta"):
        assert aggregation.aggregation_kernels("triton", torch.device(device)) is None
    with pytest.raises(UserError, match="aggregation_kernel=triton runs its kernels on a CUDA device"):
        aggregation.check_aggregation_kernel("triton", cuda=False)
    x, t, y = inputs()
    outs = [randomize(tiny_model("ancre", depth=2, aggregation_kernel=k))(x, t, y) for k in ("triton", "torch")]
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setattr(aggregation, "triton_installed", lambda: False)
    with pytest.raises(UserError, match=r"needs the triton package \(pip install 'ancre-dit\[triton\]'\)"):
        tiny_model("ancre", depth=2, aggregation_kernel="triton")
    with pytest.raises(UserError, match=r"needs the triton package"):
        aggregation.aggregation_kernels("triton", torch.device("cuda"))
    assert aggregation.aggregation_kernels("auto", torch.device("cuda")) is None  # auto without triton: torch
    with pytest.raises(UserError, match="unknown aggregation_kernel 'cuda'"):
        tiny_model("ancre", depth=2, aggregation_kernel="cuda")


def test_the_option_enters_the_model_spec_only_when_set():
    """Specs of runs that leave it at its default (torch) stay as they were, so older runs resume."""
    args = dict(input_size=8, in_channels=1, num_classes=10)
    assert "aggregation_kernel" not in model_kwargs(ModelConfig(), **args)
    assert model_kwargs(ModelConfig(aggregation_kernel="auto"), **args)["aggregation_kernel"] == "auto"
    model = tiny_model("ancre", depth=2, aggregation_kernel="auto")
    assert model.topology.aggregation_kernel == "auto"
    assert tiny_model("ancre", depth=2).topology.aggregation_kernel == "torch"
