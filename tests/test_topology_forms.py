"""How the ANCRe family's mix enters (`ancre_mode` add | replace), where it starts
(`topology_init` uniform | first | previous), and the block states a topology reports."""
from __future__ import annotations

import math

import pytest
import torch

from ancre_dit import create_model
from ancre_dit.errors import UserError
from ancre_dit.models.topologies import FixedTopology, TOPOLOGIES, save_topology_json

KW = dict(input_size=8, in_channels=1, num_classes=10, learn_sigma=False, hidden_size=32, num_heads=2)


def batch(n: int = 4):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 1000, (n,), generator=g),
            torch.randint(0, 10, (n,), generator=g))


def randomize_blocks(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere but the topology (adaLN-Zero would make every block the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("topology.") and name != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def states_at_init(depth: int, **options) -> list[float]:
    """RMS of z_0 .. z_K (z_k: the state after block k) at init, relative to z_0."""
    model = create_model("DiT-S/2", depth=depth, **KW, **options).eval()
    states: dict[int, torch.Tensor] = {}
    model.topology.state_hook = lambda k, z: states.__setitem__(k, z.detach())
    with torch.no_grad():
        model(*batch())
    rms = [float(states[k].pow(2).mean().sqrt()) for k in range(depth + 1)]
    return [r / rms[0] for r in rms]


def test_residual_scale_at_init_grows_with_depth_as_the_start_dictates():
    """Every block is the identity at init (adaLN-Zero), so the stream's growth is the topology's alone:
    cascaded keeps it; ANCRe's uniform add start multiplies it ~100x over 12 blocks (each block adds the
    mean of all earlier states on top of its own residual); favouring h_0 adds about one embedding per
    block plus a little of the grown states (~18x); favouring h_{j-1} nearly doubles it per block
    (exponential); the replace form
    keeps it whatever the start (its mix is convex and takes the place of the residual)."""
    growth = {name: states_at_init(12, topology=topo, **opts) for name, (topo, opts) in {
        "cascaded": ("cascaded", {}),
        "uniform": ("ancre", {}),
        "first": ("ancre", {"topology_init": "first"}),
        "previous": ("ancre", {"topology_init": "previous"}),
        "replace-uniform": ("ancre", {"ancre_mode": "replace"}),
        "replace-previous": ("ancre", {"ancre_mode": "replace", "topology_init": "previous"}),
    }.items()}
    assert growth["cascaded"][-1] == pytest.approx(1.0, abs=1e-5)
    assert 80 < growth["uniform"][-1] < 150
    steps = [b - a for a, b in zip(growth["first"][1:], growth["first"][2:])]
    assert min(steps) > 0.9 and max(steps) < 2.5 and 10 < growth["first"][-1] < 25  # about one h_0 a block
    ratios = [b / a for a, b in zip(growth["previous"][4:], growth["previous"][5:])]
    assert min(ratios) > 1.8 and growth["previous"][-1] > 1000
    for name in ("replace-uniform", "replace-previous"):
        assert max(abs(r - 1.0) for r in growth[name]) < 1e-4, name
    # Growth with depth: deeper uniform-add models inflate more, the replace form never does.
    assert states_at_init(6, topology="ancre")[-1] < growth["uniform"][-1] / 5
    assert states_at_init(24, topology="ancre", ancre_mode="replace")[-1] == pytest.approx(1.0, abs=1e-4)


def test_replace_with_a_frozen_one_hot_previous_topology_is_the_plain_dit(tmp_path):
    K = 6
    one_hot = torch.eye(K)  # row j: block j+1 takes its input h_j, nothing else
    path = tmp_path / "previous.json"
    save_topology_json(path, one_hot)
    torch.manual_seed(0)
    plain = randomize_blocks(create_model("DiT-S/2", depth=K, topology="cascaded", **KW))
    routed = create_model("DiT-S/2", depth=K, topology="frozen", topology_path=str(path), ancre_mode="replace", **KW)
    routed.load_state_dict({**plain.state_dict(), "topology.weights": one_hot})
    added = create_model("DiT-S/2", depth=K, topology="frozen", topology_path=str(path), **KW)
    added.load_state_dict({**plain.state_dict(), "topology.weights": one_hot})
    for m in (plain, routed, added):
        m.eval()  # no label dropout
    x, t, y = batch()
    torch.testing.assert_close(routed(x, t, y), plain(x, t, y), rtol=1e-5, atol=1e-5)
    assert (added(x, t, y) - plain(x, t, y)).abs().max() > 1e-2  # the add form is not the plain DiT


def test_replace_matches_its_definition_with_learned_weights():
    """h_j = B_j(h_{j-1}) - h_{j-1} + sum_i p_ij h_i, written out by hand, eager and compiled forms alike."""
    torch.manual_seed(0)
    model = randomize_blocks(create_model("DiT-S/2", depth=4, topology="ancre", ancre_mode="replace", tau=0.5, **KW))
    model.eval()
    with torch.no_grad():
        for p in model.topology.logits:
            p.normal_()
    x, t, y = batch()
    P = model.topology.probabilities()
    h0 = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, False)
    history = [h0]
    for j, block in enumerate(model.blocks):
        h = block(history[-1], c) - history[-1] + sum(P[j, i] * history[i] for i in range(j + 1))
        history.append(h)
    expected = model.unpatchify(model.final_layer(history[-1], c))
    torch.testing.assert_close(model(x, t, y), expected, rtol=1e-5, atol=1e-5)
    model.topology.use_chain = True  # the addcmul chain torch.compile sees
    torch.testing.assert_close(model(x, t, y), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("init,source", [("first", lambda j: 0), ("previous", lambda j: j)])
def test_topology_init_favours_one_source_by_the_gap(init, source):
    gap, tau = 3.0, 0.1
    P = create_model("DiT-S/2", depth=5, topology="ancre", tau=tau, topology_init=init, topology_init_gap=gap,
                     **KW).topology.probabilities()
    for j in range(1, 5):
        favoured = math.exp(gap) / (math.exp(gap) + j)  # e^gap against j other sources of weight 1
        assert float(P[j, source(j)]) == pytest.approx(favoured, rel=1e-5)
        assert float(P[j, : j + 1].sum()) == pytest.approx(1.0, rel=1e-6)
    uniform = create_model("DiT-S/2", depth=5, topology="ancre", **KW).topology.probabilities()
    torch.testing.assert_close(uniform[4, :5], torch.full((5,), 0.2))


def test_bad_form_options_are_one_line():
    with pytest.raises(UserError, match="ancre_mode must be 'add' or 'replace'"):
        create_model("DiT-S/2", depth=3, topology="ancre", ancre_mode="sum", **KW)
    with pytest.raises(UserError, match="topology_init must be 'uniform', 'first' or 'previous'"):
        create_model("DiT-S/2", depth=3, topology="ancre", topology_init="last", **KW)
    with pytest.raises(UserError, match="topology_init_gap must be greater than or equal to 0"):
        create_model("DiT-S/2", depth=3, topology="ancre", topology_init_gap=-1.0, **KW)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_every_topology_reports_the_state_it_feeds_each_next_block(name, tmp_path):
    path = tmp_path / "p.json"
    save_topology_json(path, torch.tril(torch.ones(3, 3)) / 3)
    options = {"topology_path": str(path)} if name == "frozen" else {"chunk": 2} if name == "dar" else {}
    model = create_model("DiT-S/2", depth=3, topology=name, **KW, **options).eval()
    states: dict[int, torch.Tensor] = {}
    model.topology.state_hook = lambda k, z: states.__setitem__(k, z)
    x, t, y = batch()
    out = model(x, t, y)
    assert sorted(states) == [0, 1, 2, 3]
    h0 = model.x_embedder(x) + model.pos_embed
    torch.testing.assert_close(states[0], h0)
    c = model.t_embedder(t) + model.y_embedder(y, False)
    torch.testing.assert_close(model.unpatchify(model.final_layer(states[3], c)), out)  # z_K is the trunk's output
    assert all(p in set(model.topology.parameters()) for p in model.topology.routing_parameters())


def test_a_frozen_replace_topology_restores_from_its_checkpoint(tmp_path):
    from ancre_dit.checkpoint import load_trained_model, make_model_spec, write_model_files

    path = tmp_path / "p.json"
    save_topology_json(path, torch.eye(3))
    kwargs = dict(KW, depth=3, topology="frozen", topology_path=str(path), ancre_mode="replace")
    model = randomize_blocks(create_model("DiT-S/2", **kwargs))
    write_model_files(tmp_path / "ckpt", make_model_spec("DiT-S/2", kwargs, {}, {}, 0), model.state_dict())
    path.unlink()  # the JSON is gone: the matrix comes from the weights, the mode from the spec
    loaded, _ = load_trained_model(tmp_path / "ckpt", "model")
    assert isinstance(loaded.topology, FixedTopology) and loaded.topology.mode == "replace"
    torch.testing.assert_close(loaded(*batch()), model.eval()(*batch()))
