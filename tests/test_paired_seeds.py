"""Paired seeds: every random draw of a run comes from its own stream derived from train.seed (model
init, data order, diffusion noise and times, label dropout; evaluation samples from eval.seed), so two
runs that differ only in topology (or tau) see the same network at init, the same batches in the same
order and the same noise, and can be compared seed by seed."""
from __future__ import annotations

import pytest
import torch

from ancre_dit import create_model
from ancre_dit.training.trainer import Trainer

from helpers import accelerate_state, tiny_config


def observe(run_dir, *overrides: str) -> dict:
    """What a fresh trainer will draw: its backbone weights, first batches, first noise draws, and
    the global random state (label dropout)."""
    with accelerate_state():
        trainer = Trainer(tiny_config(run_dir, *overrides))
        try:
            backbone = {k: v.clone() for k, v in trainer.raw_model.state_dict().items() if not k.startswith("topology.")}
            rng = torch.get_rng_state().clone()
            batches = iter(trainer._loader())
            first = [next(batches) for _ in range(3)]
            x = torch.zeros(16, 1, 8, 8)
            draws = [trainer.draw_timesteps_and_noise(x) for _ in range(2)]
        finally:
            trainer.accelerator.end_training()
    return {"backbone": backbone, "rng": rng, "batches": first, "draws": draws}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_runs_that_differ_only_in_topology_draw_the_same(tmp_path):
    cascaded = observe(tmp_path / "a", "model.topology=cascaded", "train.seed=3")
    for other in (["model.topology=ancre", "model.tau=0.1"], ["model.topology=hc"], ["model.topology=fixed-dense"]):
        routed = observe(tmp_path / other[0].split("=")[1], *other, "train.seed=3")
        for stream in ("backbone", "rng", "batches", "draws"):
            assert same(cascaded[stream], routed[stream]), (other, stream)
    reseeded = observe(tmp_path / "c", "model.topology=cascaded", "train.seed=4")
    for stream in ("backbone", "rng", "batches", "draws"):  # another seed changes every stream
        assert not same(cascaded[stream], reseeded[stream]), stream


def test_the_backbone_init_ignores_what_the_topology_draws():
    """A registered topology that draws random numbers when built leaves the backbone's weights unchanged."""
    from ancre_dit.models.topologies import CascadedTopology, register_topology, unregister_topology

    class Noisy(CascadedTopology):
        def __init__(self, num_blocks):
            super().__init__(num_blocks)
            self.extra = torch.nn.Parameter(torch.randn(1000))

    register_topology("test-noisy")(lambda num_blocks, hidden_size: Noisy(num_blocks))
    try:
        kw = dict(input_size=8, in_channels=1, num_classes=10, depth=2, hidden_size=32, num_heads=2)
        torch.manual_seed(0)
        plain = create_model("DiT-T/2", topology="cascaded", **kw).state_dict()
        after_plain = torch.rand(3)
        torch.manual_seed(0)
        noisy = create_model("DiT-T/2", topology="test-noisy", **kw).state_dict()
        after_noisy = torch.rand(3)
    finally:
        unregister_topology("test-noisy")
    assert all(torch.equal(plain[k], noisy[k]) for k in plain)
    assert torch.equal(after_plain, after_noisy)  # and what is drawn after the model is built
