"""Depth diagnostics: forward inflation, backward decay and redundancy of the state after each block,
the routing's own statistics, logged while training (without touching the run's numbers) and measured
on any checkpoint by `scripts/topology.py diagnose`."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ancre_dit import create_model
from ancre_dit.checkpoint import make_model_spec, write_model_files
from ancre_dit.diffusion import build_objective
from ancre_dit.errors import UserError
from ancre_dit.evaluation.diagnostics import RoutingWatch, depth_profile, time_probe_r2
from ancre_dit.files import read_jsonl
from ancre_dit.models.topologies import TOPOLOGIES, save_topology_json
from ancre_dit.training import train

from helpers import ROOT, accelerate_state, load_script, tiny_config

KW = dict(input_size=8, in_channels=1, num_classes=10, learn_sigma=False, hidden_size=32, num_heads=2)
FLOW = {"objective": "flow", "learn_sigma": False}


def probe(n: int = 6):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.arange(n) % 10
    return x, y, (torch.rand(n, generator=g), torch.randn(n, 1, 8, 8, generator=g))


def test_profile_at_init_follows_the_topology():
    """Every block is the identity at init (adaLN-Zero): a plain DiT keeps the state and its gradient
    unchanged through depth (cosine 1), ANCRe's uniform add start inflates it block after block."""
    objective = build_objective(FLOW)
    x, y, draws = probe()
    plain = depth_profile(create_model("DiT-S/2", depth=4, topology="cascaded", **KW), objective, x, y, draws)
    assert len(plain["rms"]) == len(plain["grad_rms"]) == 5 and len(plain["cosine"]) == 4
    assert np.allclose(plain["rms"], plain["rms"][0], rtol=1e-5)
    assert np.allclose(plain["cosine"], 1.0, atol=1e-5)
    routed = depth_profile(create_model("DiT-S/2", depth=4, topology="ancre", **KW), objective, x, y, draws)
    assert all(b > 1.4 * a for a, b in zip(routed["rms"], routed["rms"][1:]))


def test_profile_leaves_the_model_and_random_streams_as_they_were():
    model = create_model("DiT-S/2", depth=3, topology="ancre", **KW).train()
    x, y, draws = probe()
    torch.manual_seed(5)
    depth_profile(model, build_objective(FLOW), x, y, draws)
    after = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(2)) and model.training and model.topology.state_hook is None
    assert all(p.grad is None for p in model.parameters())


def test_routing_watch_counts_changes_and_the_ema_gap():
    raw = create_model("DiT-S/2", depth=3, topology="ancre", tau=1.0, **KW)
    ema = create_model("DiT-S/2", depth=3, topology="ancre", tau=1.0, **KW)
    watch = RoutingWatch()
    first = watch.look(ema, raw)
    assert first["strongest_changed"] == 0 and first["ema_raw_gap"] == 0.0
    assert first["routing_entropy"] == pytest.approx(1.0)  # uniform rows
    with torch.no_grad():
        raw.topology.logits[2][1] = 5.0  # block 3 now takes source 1
    second = watch.look(ema, raw)
    assert second["strongest_changed"] == 1
    gap = torch.softmax(torch.tensor([0.0, 5.0, 0.0]), 0)[1].item() - 1 / 3
    assert second["ema_raw_gap"] == pytest.approx(gap, rel=1e-6)
    assert second["routing_entropy"] < 1.0
    assert RoutingWatch().look(create_model("DiT-S/2", depth=3, topology="hc", **KW),
                               create_model("DiT-S/2", depth=3, topology="hc", **KW)) == {}


def test_time_probe_reads_a_linear_time_and_not_noise():
    rng = np.random.default_rng(0)
    t = rng.uniform(0, 1, 200)
    readable = np.stack([t, rng.normal(size=200)], axis=1) @ rng.normal(size=(2, 8))
    assert time_probe_r2(readable, t) > 0.99
    assert time_probe_r2(rng.normal(size=(200, 8)), t) < 0.2


@pytest.mark.slow
def test_training_logs_diagnostics_without_changing_the_run(tmp_path):
    runs = {}
    for name, switch in (("on", "true"), ("off", "false")):
        with accelerate_state():
            train(tiny_config(tmp_path / name, "train.max_steps=4", "train.log_every=2", "train.ckpt_every=4",
                              f"train.diagnostics={switch}", f"log.tensorboard={switch}", "log.figures=true"))
        runs[name] = load_file(str(tmp_path / name / "checkpoints" / "0000004" / "model.safetensors"))
    assert all(torch.equal(runs["on"][k], runs["off"][k]) for k in runs["on"])  # the run itself is untouched
    records = read_jsonl(tmp_path / "on" / "logs" / "diagnostics.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    assert len(records[0]["rms"]) == 3 and len(records[0]["cosine"]) == 2  # 2 blocks: z_0, z_1, z_2
    assert {"routing_entropy", "strongest_changed", "ema_raw_gap"} <= records[-1].keys()
    assert (tmp_path / "on" / "diagnostics.png").is_file() and not (tmp_path / "off" / "diagnostics.png").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "on" / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert {"diagnostics/rms_0", "diagnostics/grad_rms_2", "diagnostics/cosine_1",
            "diagnostics/routing_entropy"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_diagnose_works_on_a_checkpoint_of_every_topology(name, tmp_path, capsys):
    path = tmp_path / "p.json"
    save_topology_json(path, torch.tril(torch.ones(3, 3)) / 3)
    options = {"topology_path": str(path)} if name == "frozen" else {"chunk": 2} if name == "dar" else {}
    kwargs = dict(KW, depth=3, topology=name, **options)  # 6 sublayers: DAR's default chunk 4 does not divide them
    model = create_model("DiT-S/2", **kwargs)
    data = {"kind": "digits", "image_size": 8, "image_channels": 1, "num_classes": 10, "vae": None,
            "scaling_factor": None}
    folder = tmp_path / "run" / "checkpoints" / "0000007"
    write_model_files(folder, make_model_spec("DiT-S/2", kwargs, FLOW, data, 7), model.state_dict(),
                      model.state_dict())
    (folder / "trainer_state.json").write_text("{}")  # what marks a checkpoint complete for a run
    main = load_script(ROOT / "scripts" / "topology.py").main
    assert main(["diagnose", str(folder), "--t", "0.2", "0.8", "--samples", "8", "--out", str(tmp_path / "d")]) == 0
    result = json.loads((tmp_path / "d" / "diagnose.json").read_text())
    assert result["topology"] == name and result["inputs"] == "held-out digits"
    assert set(result["profiles"]) == {"0.2", "0.8"} and len(result["profiles"]["0.2"]["rms"]) == 4
    assert len(result["time_probe_r2"]) == 4 and (tmp_path / "d" / "diagnose.png").is_file()
    assert "time probe R^2" in capsys.readouterr().out


def test_diagnose_refuses_bad_times_and_outputs(tmp_path):
    main = load_script(ROOT / "scripts" / "topology.py").main
    with pytest.raises(UserError, match="normalised times in"):
        main(["diagnose", str(tmp_path), "--t", "2", "--out", str(tmp_path / "d")])
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file; give a folder"):
        main(["diagnose", str(tmp_path), "--out", str(tmp_path / "file")])
    with pytest.raises(UserError, match="neither a checkpoint folder nor a run"):
        main(["diagnose", str(tmp_path), "--out", str(tmp_path / "d")])


@pytest.mark.parametrize("mode", ["add", "replace"])
def test_grad_rms_of_ancre_is_the_gradient_autograd_gives_on_the_plain_chain(mode):
    """The fused aggregation hands part of each state's gradient to the node that made it, after
    autograd has read the state's: the profile must still report the whole gradient."""
    from helpers import randomize

    objective = build_objective(FLOW)
    x, y, draws = probe()
    model = randomize(create_model("DiT-S/2", depth=4, topology="ancre", ancre_mode=mode, **KW)).double()
    x, draws = x.double(), tuple(d.double() for d in draws)
    profile = depth_profile(model, objective, x, y, draws)
    assert not model.topology.use_chain  # (restored)
    states = []
    model.topology.use_chain = True  # the plain addcmul chain, autograd's own backward
    model.topology.state_hook = lambda k, z: states.append(z)
    loss = objective.losses(model, x, y, draws)["loss"].mean()
    model.topology.state_hook = None
    expected = [float(g.pow(2).mean().sqrt()) for g in torch.autograd.grad(loss, states)]
    np.testing.assert_allclose(profile["grad_rms"], expected, rtol=1e-6)  # (the profile rounds to fp32)
    assert min(expected[1:-1]) > 0
