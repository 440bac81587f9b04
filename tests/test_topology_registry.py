"""The topology registry is the one place a topology name is interpreted: a topology defined in
this file, with a hyperparameter of its own, trains, checkpoints and reloads without any change to
the config, trainer or checkpoint code. Also: the command-line error contract (user error vs bug)."""
from __future__ import annotations

from typing import Annotated

import pytest
import torch
from pydantic import AfterValidator, StrictFloat

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import create_model
from ancre_dit.models.topologies import (TOPOLOGIES, CascadedTopology, TopologyNotDefined, TopologyOption,
                                         register_topology, resolve_options, unregister_topology)
from ancre_dit.models.topologies.registry import Float, PositiveInt
from ancre_dit.checkpoint import load_trained_model
from ancre_dit.training import load_config, train
from helpers import TINY_DIT, TINY_NAME, TINY_TRAIN, tiny_model

class GainTopology(CascadedTopology):
    """h_j = B_j(h_{j-1}) + gain * h_{j-1}: a cascaded trunk with one hyperparameter."""

    def __init__(self, num_blocks: int, gain: float):
        super().__init__(num_blocks)
        self.gain = gain

    def forward(self, h0, blocks, c):
        h = h0
        for block in blocks:
            h = block(h, c) + self.gain * h
        return h

    def probabilities(self) -> torch.Tensor:
        return self.gain * torch.eye(self.num_blocks)


def _check_gain(options):
    if options["gain"] < 0:
        raise UserError(f"gain must be greater than or equal to 0, got {options['gain']}")


@pytest.fixture
def gain_topology():
    """Registers 'test-gain' for one test, the way a new topology module would."""
    register_topology("test-gain", options={"gain": TopologyOption(Float, 1.0, "skip gain")}, check=_check_gain)(
        lambda num_blocks, hidden_size, gain: GainTopology(num_blocks, gain))
    yield
    unregister_topology("test-gain")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_a_topology_registered_in_a_test_trains_checkpoints_and_reloads(tmp_path, gain_topology):
    config = load_config(None, [*TINY_TRAIN, f"run_dir={tmp_path / 'run'}", "model.topology=test-gain", "model.gain=0.5",
                                "train.max_steps=2", "train.ckpt_every=2"])
    assert config.model.topology_options == {"gain": 0.5}
    train(config)

    model, spec = load_trained_model(tmp_path / "run" / "checkpoints" / "0000002")
    assert spec["model"]["kwargs"]["gain"] == 0.5 and isinstance(model.topology, GainTopology)
    assert model.topology.gain == 0.5
    # The reloaded model is the trained one: same output as a fresh 0.5-gain model given its weights.
    fresh = tiny_model("test-gain", gain=0.5).eval()
    fresh.load_state_dict(model.state_dict())
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 500, 999]), torch.tensor([0, 3, 9])
    with torch.no_grad():
        assert torch.equal(fresh(x, t, y), model(x, t, y))
        other = tiny_model("test-gain", gain=2.0).eval()
        other.load_state_dict(model.state_dict())
        h0, c, _ = model.embed(x, t, y)  # the final LayerNorm hides a pure rescaling: compare the trunks
        assert not torch.equal(other.topology(h0, other.blocks, c), model.topology(h0, model.blocks, c))


def test_topology_options_are_typed_and_checked_by_their_entry(tmp_path, gain_topology):
    with pytest.raises(UserError, match="model.gain must be a valid number, got 'abc'"):
        load_config(None, [*TINY_TRAIN, "model.topology=test-gain", "model.gain=abc"])
    with pytest.raises(UserError, match="gain must be greater than or equal to 0"):
        load_config(None, [*TINY_TRAIN, "model.topology=test-gain", "model.gain=-1"])
    with pytest.raises(UserError, match="unknown config key model.gian"):
        load_config(None, [*TINY_TRAIN, "model.topology=test-gain", "model.gian=1"])
    with pytest.raises(UserError, match="unknown topology option"):
        tiny_model("test-gain", gian=1.0)
    config = load_config(None, [*TINY_TRAIN, "model.topology=test-gain", "model.gain=0.25"])
    assert config.model.topology_options == {"gain": 0.25}


def test_registry_holds_every_builtin_with_its_options():
    assert list(TOPOLOGIES)[:2] == ["cascaded", "ancre"]
    assert {"ancre-outgoing", "frozen", "denseformer", "hc", "hc-dynamic", "mhc"} <= set(TOPOLOGIES)
    assert resolve_options("ancre", {"tau": 0.1, "hc_streams": 3}) == {  # others' options ignored
        "tau": 0.1, "ancre_mode": "add", "topology_init": "uniform", "topology_init_gap": 4.0}
    assert resolve_options("mhc", {}) == {"hc_streams": 4, "sinkhorn_iters": 20}
    with pytest.raises(UserError, match="tau must be greater than 0, got 0.0"):
        resolve_options("ancre", {"tau": 0.0})


def test_a_config_load_checks_each_topology_option_once(gain_topology):
    """One rule per option (its type), run once per config load (resolve_options, with the config
    key; the load's own build of the model trusts it), and once more only where create_model builds
    the topology; builders and constructors trust what they are given."""
    seen = []

    def counted(value: float) -> float:
        seen.append(value)
        if value <= 0:
            raise ValueError("must be positive")
        return value

    register_topology("test-counted", options={"count_me": TopologyOption(
        Annotated[StrictFloat, AfterValidator(counted)], 1.0, "an option whose rule counts its checks")})(
        lambda num_blocks, hidden_size, count_me: GainTopology(num_blocks, count_me))
    assert seen == [1.0]  # its default, once, when registered
    seen.clear()
    try:
        config = load_config(None, [*TINY_TRAIN, "model.topology=test-counted", "model.count_me=0.5"])
        assert seen == [0.5] and config.model.topology_options == {"count_me": 0.5}
        tiny_model("test-counted", count_me=0.5)
        assert seen == [0.5, 0.5]
        with pytest.raises(UserError, match=r"model.count_me must be positive, got -1"):
            load_config(None, [*TINY_TRAIN, "model.topology=test-counted", "model.count_me=-1"])
    finally:
        unregister_topology("test-counted")


def test_topology_options_take_their_type_and_a_default_within_their_rule(gain_topology):
    with pytest.raises(UserError, match="tau must be a valid number, got 'big'"):
        tiny_model("ancre", tau="big")
    with pytest.raises(UserError, match="gain must be a finite number"):
        tiny_model("test-gain", gain=float("inf"))
    with pytest.raises(UserError, match="must be greater than or equal to 1"):  # a default out of its own range
        register_topology("test-bad-default", options={"width": TopologyOption(PositiveInt, 0, "")})(
            lambda num_blocks, hidden_size, width: CascadedTopology(num_blocks))
    assert "test-bad-default" not in TOPOLOGIES


def test_each_topology_declares_what_tools_need(tmp_path):
    """The entry's declarations (a matrix or not, weights per timestep, an incoming softmax) are what the built module does, so tools can ask the registry instead of testing names."""
    from ancre_dit.models import save_topology_json

    save_topology_json(tmp_path / "p.json", torch.tril(torch.ones(3, 3)) / 3)
    for name, entry in TOPOLOGIES.items():
        options = {"topology_path": str(tmp_path / "p.json")} if name == "frozen" else {}
        topology = tiny_model(name, depth=3, hc_streams=2, chunk=2, **options).topology
        try:
            P = topology.probabilities()
        except TopologyNotDefined:
            P = None
        assert (P is not None) == entry.matrix, name
        assert hasattr(topology, "routing_weights") == entry.weights_per_time, name
        if entry.incoming_softmax:
            torch.testing.assert_close(P.sum(1), torch.ones(3))


def test_frozen_topology_rebuilds_from_its_own_state_dict(tmp_path):
    P = torch.tensor([[1.0, 0.0], [0.25, 0.75]])
    from ancre_dit.models import save_topology_json
    from ancre_dit.checkpoint import make_model_spec, write_model_files
    save_topology_json(tmp_path / "p.json", P)
    kwargs = dict(TINY_DIT, topology="frozen", topology_path=str(tmp_path / "p.json"))
    model = create_model(TINY_NAME, **kwargs)
    write_model_files(tmp_path / "ckpt", make_model_spec(TINY_NAME, kwargs, {}, {}, 0), model.state_dict(),
                      model.state_dict())
    (tmp_path / "p.json").unlink()  # the JSON it came from is gone: the weights travel in the state dict
    loaded, _ = load_trained_model(tmp_path / "ckpt")
    assert torch.equal(loaded.topology.probabilities(), P)


def _exit_of(main, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        run_cli(main)
    return stop.value.code, capsys.readouterr().err


def test_cli_prints_one_line_for_a_user_error_and_a_traceback_for_a_bug(capsys, monkeypatch):
    monkeypatch.delenv("ANCRE_DEBUG", raising=False)

    def user_mistake():
        raise UserError("data path /nope does not exist; set data.path")

    code, err = _exit_of(user_mistake, capsys)
    assert code == 2 and err == "error: data path /nope does not exist; set data.path\n"

    def bug():
        return {}["mean"]  # a KeyError deep in the code is a bug, not the user's fault

    code, err = _exit_of(bug, capsys)
    assert code == 1
    assert "Traceback (most recent call last)" in err and "KeyError: 'mean'" in err
    assert err.strip().splitlines()[-1].startswith("internal error: this is a bug in ancre-dit")
    assert "error: mean" not in err
