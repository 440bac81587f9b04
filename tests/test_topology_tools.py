"""Topology tools: show (heatmap + per-block summary), compare (Pearson, strongest-edge agreement),
prune to a frozen sparse topology that trains and samples with its zero edges skipped, evolution
strips, and the Tsallis-entropy regulariser."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ROOT, accelerate_state, tiny_config

import ancre_dit.models.topologies.base as topology_base
from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.models import create_model, load_topology_json
from ancre_dit.models.topologies import ANCReTopology, FixedTopology
from ancre_dit.models.topologies.base import WeightedHistoryTopology
from ancre_dit.models.topologies.analysis import (compare_topologies, format_topology_summary, learned_edges, pearson,
                                                  prune_topology, strongest_edge_agreement, topology_entropy,
                                                  topology_summary, tsallis_entropy, write_topology)

SCRIPT = ROOT / "scripts" / "topology.py"


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _random_topology(K: int, seed: int) -> np.ndarray:
    logits = torch.randn(K, K, generator=torch.Generator().manual_seed(seed))
    return torch.softmax(logits.masked_fill(torch.triu(torch.ones(K, K, dtype=torch.bool), 1), -torch.inf), 1).numpy()


def _load_script():
    spec = importlib.util.spec_from_file_location("topology_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(*args: str) -> subprocess.CompletedProcess:
    """scripts/topology.py in this process (a subprocess costs seconds of imports): exit code, stdout, stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_cli(lambda: _load_script().main(list(args)))
    return subprocess.CompletedProcess(args, exit_.value.code, out.getvalue(), err.getvalue())


def test_compare_identical_topologies_gives_one():
    P = _random_topology(6, 0)
    assert pearson(P, P.copy()) == pytest.approx(1.0, abs=1e-12)
    assert strongest_edge_agreement(P, P.copy()) == 1.0
    result = compare_topologies({"a": P, "b": P.copy(), "c": P.copy()})
    assert len(result["pairs"]) == 3 and result["mean_pearson"] == pytest.approx(1.0)


def test_compare_matches_the_hand_computed_values():
    # Learned edges (block 1's fixed single edge left out): a = [1, 0, 1, 0, 0], b = [0, 1, 1, 0, 0].
    # Centred (means 0.4): sum da*db = 0.2, sum da^2 = sum db^2 = 1.2, so r = 1/6. Strongest sources:
    # block 2 -> 0 vs 1 (differ), block 3 -> 0 vs 0 (agree): agreement 1/2.
    P = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=float)
    Q = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0]], dtype=float)
    np.testing.assert_array_equal(learned_edges(P), [1, 0, 1, 0, 0])
    assert pearson(P, Q) == pytest.approx(1 / 6, abs=1e-12)
    assert strongest_edge_agreement(P, Q) == 0.5
    # Anti-correlated by construction: Q' = 1/2 - (P - 1/2) on the two-edge rows.
    P2 = np.array([[1, 0], [0.8, 0.2]])
    Q2 = np.array([[1, 0], [0.2, 0.8]])
    assert pearson(P2, Q2) == pytest.approx(-1.0)
    assert strongest_edge_agreement(P2, Q2) == 0.0
    with pytest.raises(UserError, match="different depths"):
        pearson(P, P2)


def test_prune_keeps_the_strongest_edges_and_renormalises():
    P = np.array([[1.0, 0, 0, 0], [0.3, 0.7, 0, 0], [0.5, 0.2, 0.3, 0], [0.1, 0.4, 0.1, 0.4]])
    top1 = prune_topology(P, top_k=1)
    np.testing.assert_allclose(top1, [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]])  # tie -> lower index
    top2 = prune_topology(P, top_k=2)
    np.testing.assert_allclose(top2[2], [0.5 / 0.8, 0, 0.3 / 0.8, 0])
    np.testing.assert_allclose(top2.sum(1), 1.0)
    th = prune_topology(P, threshold=0.35)
    np.testing.assert_allclose(th[1], [0, 1, 0, 0])
    np.testing.assert_allclose(th[3], [0, 0.5, 0, 0.5])
    np.testing.assert_allclose(prune_topology(P, threshold=0.9)[2], [1, 0, 0, 0])  # a row keeps its strongest edge
    np.testing.assert_allclose(prune_topology(P, top_k=10), P)
    assert not prune_topology(np.zeros((3, 3)), top_k=1).any()  # cascaded stays cascaded
    for bad in ({}, {"top_k": 1, "threshold": 0.1}, {"top_k": 0}, {"threshold": 2.0}):
        with pytest.raises(UserError):
            prune_topology(P, **bad)


def test_zero_edges_of_a_pruned_frozen_topology_cost_nothing(monkeypatch):
    """FixedTopology runs one addcmul per kept edge only, and gives the same output as the same
    matrix run over every edge (zero weights included)."""
    K = 6
    pruned = torch.tensor(prune_topology(_random_topology(K, 3), top_k=2), dtype=torch.float32)
    torch.manual_seed(0)
    model = create_model("DiT-T/2", depth=K, hidden_size=32, num_heads=2, input_size=8, in_channels=1,
                         num_classes=10, topology="cascaded").eval()
    blocks, h0, c = model.blocks, torch.randn(2, 16, 32), torch.randn(2, 32)
    for block in blocks:  # non-zero adaLN so the blocks are not the identity
        torch.nn.init.normal_(block.adaLN_modulation[-1].weight, std=0.05)
    dense = WeightedHistoryTopology(K)
    dense.probabilities = lambda: pruned  # same weights, every edge visited
    calls = []  # one entry per history tensor read by the addcmul chain
    real_addcmul = torch.addcmul
    with monkeypatch.context() as patch:
        patch.setattr(WeightedHistoryTopology, "use_chain", True)
        patch.setattr(topology_base.torch, "addcmul", lambda *a, **k: calls.append(1) or real_addcmul(*a, **k))
        with torch.no_grad():
            out_sparse = FixedTopology(pruned)(h0, blocks, c)
            sparse_calls = len(calls)
            out_dense = dense(h0, blocks, c)
    assert sparse_calls == int((pruned != 0).sum()) == 1 + 2 * (K - 1)
    assert len(calls) - sparse_calls == K * (K + 1) // 2
    torch.testing.assert_close(out_sparse, out_dense, rtol=0, atol=1e-6)
    stacked = FixedTopology(pruned)  # the stacked form reads the kept edges only, and agrees
    assert sum(map(len, stacked._stacked_plan.edges)) == int((pruned != 0).sum())
    with torch.no_grad():
        torch.testing.assert_close(stacked(h0, blocks, c), out_dense, rtol=1e-5, atol=1e-5)


def test_tsallis_entropy_values_and_gradient():
    one_hot = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1]])
    assert tsallis_entropy(one_hot).item() == 0.0
    uniform = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]])
    # Rows 2 and 3: 1 - sum p^2 = 1/2 and 2/3; mean 7/12. Shannon (q = 1): (log 2 + log 3) / 2.
    assert tsallis_entropy(uniform).item() == pytest.approx(7 / 12)
    assert tsallis_entropy(uniform, q=1.0).item() == pytest.approx((np.log(2) + np.log(3)) / 2)
    assert tsallis_entropy(uniform, q=3.0).item() == pytest.approx(((1 - 2 / 8) / 2 + (1 - 3 / 27) / 2) / 2)
    topology = ANCReTopology(4, tau=1.0)
    with torch.no_grad():
        topology.logits[3].copy_(torch.tensor([2.0, 0.0, 0.0, 0.0]))
    topology_entropy(topology).backward()
    # Descending the entropy sharpens the row toward its strongest edge.
    assert topology.logits[3].grad[0] < 0 and (topology.logits[3].grad[1:] > 0).all()


def test_show_draws_the_heatmap_and_prints_the_summary_of_a_file_or_a_run(tmp_path):
    path = write_topology(tmp_path / "topology.json", _random_topology(4, 3))
    P = load_topology_json(path)  # what the command reads
    out = _run_script("show", str(path), "--summary-json", str(tmp_path / "sub" / "summary.json"), "--title", "t")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "topology.png").stat().st_size > 0  # default: next to the JSON
    summary = json.loads((tmp_path / "sub" / "summary.json").read_text())
    assert summary == json.loads(json.dumps(topology_summary(P)))
    assert out.stdout.endswith(f"heatmap written to {tmp_path / 'topology.png'}\n") and "summary written to" in out.stdout
    run_out = _run_script("show", str(tmp_path), "--out", str(tmp_path / "run.png"))  # a run dir: its topology.json
    assert run_out.returncode == 0, run_out.stderr
    assert (tmp_path / "run.png").stat().st_size > 0 and format_topology_summary(topology_summary(P)) in run_out.stdout
    bad = _run_script("show", str(tmp_path / "sub"))
    assert bad.returncode == 2 and "holds no topology.json" in bad.stderr and "Traceback" not in bad.stderr


def test_compare_and_prune_commands(tmp_path):
    paths = []
    for seed, P in enumerate([_random_topology(5, 0), _random_topology(5, 0), _random_topology(5, 1)]):
        paths.append(write_topology(tmp_path / f"seed{seed}.json", P))
    out = _run_script("compare", *map(str, paths), "--out", str(tmp_path / "cmp.png"), "--json", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "c.json").read_text())
    first = result["pairs"][0]
    assert (first["a"], first["b"]) == ("seed0", "seed1") and first["pearson"] == pytest.approx(1.0, abs=1e-6)
    assert result["pairs"][1]["pearson"] == pytest.approx(pearson(_random_topology(5, 0), _random_topology(5, 1)),
                                                          abs=1e-6)
    assert (tmp_path / "cmp.png").stat().st_size > 0 and "mean" in out.stdout
    out = _run_script("prune", str(paths[2]), "--top-k", "2", "--out", str(tmp_path / "sparse.json"))
    assert out.returncode == 0, out.stderr
    sparse = load_topology_json(tmp_path / "sparse.json")
    assert ((sparse > 0).sum(1) == torch.tensor([1, 2, 2, 2, 2])).all()
    bad = _run_script("prune", str(paths[2]), "--out", str(tmp_path / "x.json"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: prune needs exactly one of")
    bad = _run_script("compare", str(paths[0]), str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "not found" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_pruned_frozen_topology_trains_samples_and_evolution_draws(tmp_path):
    from ancre_dit.sampling.api import sample_images
    from ancre_dit.checkpoint import load_trained_model
    from ancre_dit.training import train

    common = ("model.depth=4", "train.global_batch_size=32", "model.learn_sigma=false")
    # An ANCRe run with two checkpoints: its evolution strip, then its topology pruned and frozen.
    run = tmp_path / "ancre"
    with accelerate_state():
        train(tiny_config(run, *common, "train.max_steps=20", "train.ckpt_every=10"))
    out = _run_script("evolution", str(run), "--gif", str(tmp_path / "evo.gif"))
    assert out.returncode == 0, out.stderr
    assert "2 checkpoints" in out.stdout and (run / "topology_evolution.png").stat().st_size > 0
    from PIL import Image
    assert Image.open(tmp_path / "evo.gif").n_frames == 2
    sparse = tmp_path / "sparse.json"
    assert _run_script("prune", str(run), "--top-k", "1", "--out", str(sparse)).returncode == 0
    P = load_topology_json(sparse)
    frozen = tmp_path / "frozen"
    with accelerate_state():
        train(tiny_config(frozen, *common, "model.topology=frozen", f"model.topology_path={sparse}",
                          "train.max_steps=60", "train.log_every=10", "train.ckpt_every=60"))
    losses = [json.loads(line)["loss"] for line in (frozen / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.8 * losses[0], losses
    model, spec = load_trained_model(frozen / "checkpoints" / "0000060")
    assert torch.equal(model.topology.probabilities(), P) and sum(map(len, model.topology.edges)) == 4
    images = sample_images(model, spec["diffusion"], [3, 7], sampler="ddim", steps=4, seed=0)
    assert images.shape == (2, 8, 8, 1) and images.dtype == np.uint8 and images.std() > 0


@pytest.mark.slow
def test_entropy_regulariser_is_added_logged_and_sharpens(tmp_path):
    from ancre_dit.training import train

    common = ("model.depth=4", "train.max_steps=12", "train.log_every=4")
    run = tmp_path / "ent"
    with accelerate_state():
        train(tiny_config(run, *common, "model.topology_entropy_weight=100.0"))
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all("topology_entropy" in r for r in rows)
    with accelerate_state():
        train(tiny_config(tmp_path / "plain", *common))
    plain = [json.loads(line) for line in (tmp_path / "plain" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert "topology_entropy" not in plain[0]

    def raw_topology(folder: Path) -> torch.Tensor:  # the trained (not EMA) weights at the last step
        payload = json.loads((folder / "checkpoints" / "0000012" / "topology.json").read_text())
        return torch.tensor(payload["training_probabilities"])

    # The penalty changes the trajectory (it is in the loss, not only logged) and lowers the logged
    # entropy at every log point, from the uniform start's (1/2 + 2/3 + 3/4) / 3.
    assert (raw_topology(run) - raw_topology(tmp_path / "plain")).abs().max() > 0.01
    logged = [r["topology_entropy"] for r in rows]
    assert logged[0] < (1 / 2 + 2 / 3 + 3 / 4) / 3 and logged[1] < logged[0] and logged[2] < logged[1], logged
    with accelerate_state(), pytest.raises(UserError, match="needs the ancre topology"):
        train(tiny_config(tmp_path / "casc", "model.topology=cascaded", "model.topology_entropy_weight=1.0"))
    with pytest.raises(UserError, match="topology_entropy_weight must be"):
        tiny_config(tmp_path / "neg", "model.topology_entropy_weight=-1")
