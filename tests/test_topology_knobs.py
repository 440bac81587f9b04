"""The routing parameters' own optimizer knobs: train.topology_lr_mult, train.topology_warmup_steps and
train.topology_weight_decay reach whatever parameters the topology declares as routing, and their
defaults change nothing (tests/test_ddpm_pinned.py pins a whole run's numbers with them)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ancre_dit.training import train
from ancre_dit.training.trainer import Trainer

from helpers import accelerate_state, tiny_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def weights(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"{step:07d}" / "model.safetensors"))


def routing(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for k, v in sorted(state.items()) if k.startswith("topology.logits.")])


def run_tiny(run, *overrides: str) -> None:
    train(tiny_config(run, "model.depth=3", "train.ckpt_every=1", *overrides))


def checkpoint_steps(run) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_lr_mult_zero_holds_the_routing_while_the_rest_trains(tmp_path):
    run_tiny(tmp_path, "train.max_steps=3", "train.topology_lr_mult=0", "train.keep_last=0")
    last = weights(tmp_path, 3)
    assert torch.equal(routing(last), torch.zeros_like(routing(last)))  # ANCRe's zero logits, untouched
    assert last["final_layer.linear.weight"].abs().max() > 0  # zero at init (adaLN-Zero), trained since


@pytest.mark.slow
def test_warmup_holds_the_routing_for_exactly_n_steps(tmp_path):
    run_tiny(tmp_path, "train.max_steps=4", "train.topology_warmup_steps=3", "train.keep_last=0")
    assert checkpoint_steps(tmp_path) == [1, 2, 3, 4]
    for step in (1, 2, 3):
        assert torch.equal(routing(weights(tmp_path, step)), torch.zeros(6)), step  # 3 blocks: 1+2+3 logits
    assert routing(weights(tmp_path, 4)).abs().max() > 0  # the 4th update moves them


def test_groups_and_learning_rates(tmp_path):
    """The routing group is what the topology declares; its lr and decay follow the knobs."""
    with accelerate_state():
        trainer = Trainer(tiny_config(tmp_path / "a", "train.lr=0.01", "train.weight_decay=0.05",
                                      "train.topology_lr_mult=0.5", "train.topology_warmup_steps=2",
                                      "train.topology_weight_decay=0.2"))
        try:
            groups = trainer.optimizer.param_groups
            declared = {id(p) for p in trainer.raw_model.topology.routing_parameters() if p.requires_grad}
            assert {id(p) for p in groups[trainer.routing_group]["params"]} == declared
            assert groups[trainer.routing_group]["weight_decay"] == 0.2 and groups[0]["weight_decay"] == 0.05
            assert trainer._group_lrs(0.01) == [0.01, 0.0]  # step 0 of 2 held steps
            trainer.progress.step = 2
            assert trainer._group_lrs(0.01) == [0.01, 0.005]
        finally:
            trainer.accelerator.end_training()
    with accelerate_state():
        trainer = Trainer(tiny_config(tmp_path / "b", "train.lr=0.01", "model.topology=cascaded"))
        try:  # no routing parameters: one group, the knobs have nothing to act on
            assert trainer.routing_group is None and trainer._group_lrs(0.01) == [0.01]
        finally:
            trainer.accelerator.end_training()


def test_defaults_keep_the_optimizer_as_it_was(tmp_path):
    """Two groups as before the knobs existed: the backbone with train.weight_decay, the topology's
    logits with no decay, both at train.lr."""
    trainer = Trainer(tiny_config(tmp_path, "train.lr=0.01", "train.weight_decay=0.05"))
    try:
        groups = trainer.optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
        assert trainer._group_lrs(0.01) == [0.01, 0.01]
        topology = {id(p) for p in trainer.raw_model.topology.parameters() if p.requires_grad}
        assert {id(p) for p in groups[1]["params"]} == topology
    finally:
        trainer.accelerator.end_training()


@pytest.mark.parametrize("override, message", [
    ("train.topology_lr_mult=-1", "train.topology_lr_mult must be greater than or equal to 0"),
    ("train.topology_warmup_steps=-2", "train.topology_warmup_steps must be greater than or equal to 0"),
    ("train.topology_weight_decay=-0.1", "train.topology_weight_decay must be greater than or equal to 0"),
])
def test_bad_knobs_are_one_line(override, message, tmp_path):
    from ancre_dit.errors import UserError

    with pytest.raises(UserError, match=message):
        tiny_config(tmp_path, override)
