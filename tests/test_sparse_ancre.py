"""Sparse ANCRe: dense until train.topology_sparsify_step, then each block keeps its
model.topology_topk strongest incoming edges (the softmax renormalised over them, the rest skipped)."""
from __future__ import annotations

import json

import pytest
import torch

from ancre_dit.models.topologies import FixedTopology

from helpers import inputs, randomize, tiny_model


def _sparse_model(topk: int = 2, mode: str = "add", seed: int = 0):
    model = randomize(tiny_model("ancre", ancre_mode=mode, topology_topk=topk, depth=4), seed=seed)
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():  # distinct weights, so the strongest edges are well defined
        for logits in model.topology.logits:
            logits.copy_(0.02 * torch.randn(logits.shape, generator=g))
    return model


@pytest.mark.parametrize("mode", ["add", "replace"])
def test_sparsify_keeps_the_strongest_edges_renormalised(mode):
    model = _sparse_model(mode=mode)
    topology = model.topology
    dense = topology.probabilities().detach()
    assert not topology.is_sparse
    topology.sparsify()
    assert topology.is_sparse
    P = topology.probabilities().detach()
    K = topology.num_blocks
    for j in range(K):
        kept = torch.nonzero(P[j]).flatten().tolist()
        strongest = torch.argsort(-dense[j, : j + 1], stable=True)[: min(2, j + 1)].sort().values.tolist()
        assert kept == strongest, j
        assert torch.allclose(P[j, kept], dense[j, kept] / dense[j, kept].sum())
        assert topology.edges[j] == sorted(set(kept) | ({j} if mode == "replace" else set()))
    assert torch.allclose(P.sum(1), torch.ones(K))


@pytest.mark.parametrize("mode", ["add", "replace"])
def test_sparse_forward_and_gradients_equal_the_fixed_matrix(mode):
    """The sparse trunk (fused eager and plain chain) computes what a dense trunk with the zeroed
    matrix computes; the dropped logits get no gradient."""
    model = _sparse_model(mode=mode).double()
    model.topology.sparsify()
    x, t, y = (v.double() if v.is_floating_point() else v for v in inputs())
    reference = tiny_model("ancre", depth=4).double()
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("topology.")},
                              strict=False)
    P = model.topology.probabilities().detach()
    reference.topology = FixedTopology(P, mode).double()
    reference.topology.weights.copy_(P)  # (built in fp32)
    reference.topology.set_edges([list(range(j + 1)) for j in range(model.topology.num_blocks)])  # every edge read
    expected = reference.eval()(x, t, y)
    for fused in (True, False):
        model.topology.use_chain = not fused
        model.zero_grad(set_to_none=True)
        out = model(x, t, y)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        out.square().sum().backward()
        for j, logits in enumerate(model.topology.logits[1:], start=1):
            dropped = ~model.topology.kept[j, : j + 1]
            assert torch.all(logits.grad[dropped] == 0), j
            assert torch.any(logits.grad[~dropped] != 0) or j + 1 <= 2, j


def test_the_kept_edges_travel_in_the_state_dict():
    model = _sparse_model(topk=1)
    model.topology.sparsify()
    x, t, y = inputs()
    expected = model(x, t, y)
    fresh = tiny_model("ancre", topology_topk=1, depth=4).eval()
    assert not fresh.topology.is_sparse
    fresh.load_state_dict(model.state_dict())
    assert fresh.topology.edges == model.topology.edges and fresh.topology.is_sparse
    torch.testing.assert_close(fresh(x, t, y), expected, rtol=0, atol=0)


def test_a_dense_model_has_no_mask_in_its_state_dict():
    """Models without topk keep the state dict they had (older checkpoints load)."""
    assert not any(k.startswith("topology.kept") for k in tiny_model("ancre").state_dict())


@pytest.mark.slow
def test_resume_across_the_switch_is_bitwise_and_files_show_the_sparse_matrix(tmp_path):
    from safetensors.torch import load_file

    from ancre_dit.checkpoint import load_trained_model

    from helpers import train_straight_and_resumed

    folder = train_straight_and_resumed(tmp_path, "model.depth=4", "model.topology_topk=1", "train.topology_sparsify_step=2",
                                        "train.ckpt_every=2", "train.lr=3e-2")
    K = 4
    for name in ("model.safetensors", "ema.safetensors"):
        kept = load_file(str(folder / name))["topology.kept"]
        assert kept.sum(1).tolist() == [1] * K, name
    P = torch.tensor(json.loads((folder / "topology.json").read_text())["probabilities"])
    assert (P > 0).sum(1).tolist() == [1] * K and torch.allclose(P.sum(1), torch.ones(K))
    spec = json.loads((folder / "model_spec.json").read_text())
    assert spec["model"]["kwargs"]["topology_topk"] == 1
    model, _ = load_trained_model(folder)
    assert model.topology.is_sparse and all(len(e) == 1 for e in model.topology.edges)
