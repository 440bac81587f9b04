"""Importing published checkpoints: files written here in the official layouts (DiT
release, ANCRe training checkpoint, per-source outgoing ablation) import into checkpoint folders
whose model gives the saved model's output exactly; a pickle that would run code is refused."""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, randomize, subprocess_env

from ancre_dit.errors import UserError
from ancre_dit.checkpoint import import_checkpoint, safe_torch_load
from ancre_dit.models import create_model, load_topology_json
from ancre_dit.checkpoint import load_trained_model

SCRIPT = ROOT / "scripts" / "import_checkpoint.py"
NAME = "DiT-T/4"  # 12 blocks of width 192; 64 px images -> 8x8x4 latents -> 4 tokens


def _model(topology: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = randomize(create_model(NAME, input_size=8, in_channels=4, num_classes=10, topology=topology), seed=seed)
    if topology.startswith("ancre"):
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for p in model.topology.logits:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)  # tau 0.01: clearly non-uniform weights
    return model


def _same_output(folder: Path, source: torch.nn.Module, weights: str = "ema") -> None:
    imported, _ = load_trained_model(folder, weights)
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([0, 500, 999]), torch.tensor([1, 7, 10])
    with torch.no_grad():
        assert torch.equal(imported(x, t, y), source.eval()(x, t, y))


def _official(state: dict, prefix: str) -> dict:
    """Our keys -> the official ANCRe code's (DDP / compile prefixes, ancre.* topology names)."""
    return {prefix + k.replace("topology.logits.", "ancre.shortcut_params.").replace("topology.tau", "ancre.softmax_temp"):
            v.clone() for k, v in state.items()}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_dit_release_state_dict_imports_with_the_same_output(tmp_path):
    source = _model("cascaded", 1)
    torch.save(source.state_dict(), tmp_path / "DiT-T-4-64x64.pt")  # the release layout: a bare state dict
    out = _run(str(tmp_path / "DiT-T-4-64x64.pt"), "--model", NAME, "--image-size", "64", "--out", str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr
    _same_output(tmp_path / "ckpt", source)
    _, spec = load_trained_model(tmp_path / "ckpt")
    assert spec["model"]["kwargs"]["topology"] == "cascaded" and spec["imported"]["weights"] == "state dict"
    assert spec["data"]["image_size"] == 64 and spec["data"]["kind"] == "latents"
    # The architecture is checked against the shapes: one line naming what differs.
    bad = _run(str(tmp_path / "DiT-T-4-64x64.pt"), "--model", "DiT-S/4", "--image-size", "64", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "hidden size 192 vs 384" in bad.stderr


@pytest.mark.slow
def test_official_ancre_training_checkpoint_prefers_ema_and_reads_its_args(tmp_path):
    ema, raw = _model("ancre", 2), _model("ancre", 3)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    raw(torch.randn(1, 4, 8, 8), torch.tensor([3]), torch.tensor([2])).square().mean().backward()
    opt.step()
    args = argparse.Namespace(model=NAME, image_size=64, num_classes=10, global_batch_size=256, results_dir="results")
    ckpt = {"model": _official(raw.state_dict(), "module."), "ema": _official(ema.state_dict(), "_orig_mod."),
            "opt": opt.state_dict(), "args": args}
    torch.save(ckpt, tmp_path / "0400000.pt")
    spec = import_checkpoint(tmp_path / "0400000.pt", tmp_path / "ema")  # no --model: the file's args say it
    assert spec["model"]["name"] == NAME and spec["step"] == 400000 and spec["imported"]["weights"] == "ema"
    assert spec["model"]["kwargs"]["topology"] == "ancre" and spec["model"]["kwargs"]["tau"] == pytest.approx(0.01)
    _same_output(tmp_path / "ema", ema)
    _same_output(tmp_path / "ema", ema, weights="model")  # both files hold the chosen weights
    assert torch.allclose(load_topology_json(tmp_path / "ema" / "topology.json"), ema.topology.probabilities())
    import_checkpoint(tmp_path / "0400000.pt", tmp_path / "raw", weights="model")
    _same_output(tmp_path / "raw", raw)
    with pytest.raises(UserError, match="contradicts the file"):
        import_checkpoint(tmp_path / "0400000.pt", tmp_path / "other", model="DiT-T/2")
    with pytest.raises(UserError, match="already holds a checkpoint"):
        import_checkpoint(tmp_path / "0400000.pt", tmp_path / "ema")
    import_checkpoint(tmp_path / "0400000.pt", tmp_path / "ema", weights="model", overwrite=True)
    _same_output(tmp_path / "ema", raw)
    # The file stores tau as float32 (0.0099999998): the user's 0.01 is the same value, 0.02 is not.
    assert import_checkpoint(tmp_path / "0400000.pt", tmp_path / "tau", tau=0.01)["model"]["kwargs"]["tau"] == \
        pytest.approx(0.01)
    with pytest.raises(UserError, match="--tau 0.02 contradicts the file"):
        import_checkpoint(tmp_path / "0400000.pt", tmp_path / "tau2", tau=0.02)


def test_outgoing_ablation_per_source_layout_is_remapped(tmp_path):
    source = _model("ancre-outgoing", 4)
    state = source.state_dict()
    K = len(source.topology.logits)
    # The official outgoing layout: shortcut_params.i = logits of source i's edges to blocks i+1..K.
    per_source = {f"topology.logits.{i}": torch.stack([state[f"topology.logits.{j}"][i] for j in range(i, K)])
                  for i in range(K)}
    state.update(per_source)
    assert [state[f"topology.logits.{i}"].numel() for i in range(K)] == list(range(K, 0, -1))
    torch.save({"ema": _official(state, "module."), "args": argparse.Namespace(model=NAME, image_size=64)},
               tmp_path / "outgoing.pt")
    spec = import_checkpoint(tmp_path / "outgoing.pt", tmp_path / "ckpt")
    assert spec["model"]["kwargs"]["topology"] == "ancre-outgoing" and spec["imported"]["logit_layout"] == "per-source"
    _same_output(tmp_path / "ckpt", source)
    with pytest.raises(UserError, match="--topology ancre-outgoing"):
        import_checkpoint(tmp_path / "outgoing.pt", tmp_path / "bad", topology="ancre")


class _Payload:
    """Unpickling this object would run code: here, create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.slow
def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": _model("cascaded", 5).state_dict(), "args": _Payload(marker)}, evil)
    torch.load(evil, weights_only=False)  # the file really is dangerous: a plain load runs the payload
    assert marker.exists()
    marker.unlink()
    out = _run(str(evil), "--model", NAME, "--image-size", "64", "--out", str(tmp_path / "ckpt"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "wants to run code" in out.stderr and "was not loaded" in out.stderr
    assert not marker.exists() and not (tmp_path / "ckpt").exists()
    with pytest.raises(UserError, match="wants to run code"):
        safe_torch_load(evil)
    assert not marker.exists()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable PyTorch checkpoint") as refused:
        safe_torch_load(tmp_path / "junk.pt")
    assert "weights_only" not in str(refused.value)  # never the unsafe advice torch's own message gives


# -- SiT and REPA: DiT's architecture and keys, trained as flows --------------------------------------
def _flow_backbone(seed: int, learn_sigma: bool) -> torch.nn.Module:
    """SiT's (and REPA's) network is DiT's, block for block and key for key: our DiT with random weights
    stands in for the source's model, its forward for the source's forward."""
    torch.manual_seed(seed)
    return randomize(create_model(NAME, input_size=8, in_channels=4, num_classes=10, learn_sigma=learn_sigma), seed)


def _flow_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, 8, 8, generator=g), torch.tensor([1, 7, 10])


def test_sit_checkpoints_import_as_flow_models_with_the_same_output(tmp_path):
    source = _flow_backbone(5, learn_sigma=True)  # SiT's release keeps DiT's sigma channels; its forward drops them
    torch.save(source.state_dict(), tmp_path / "SiT-T-4-64x64.pt")
    spec = import_checkpoint(tmp_path / "SiT-T-4-64x64.pt", tmp_path / "release", source="sit", model="SiT-T/4",
                             image_size=64)
    assert spec["diffusion"]["objective"] == "flow" and spec["diffusion"]["prediction"] == "velocity"
    assert spec["imported"]["from"] == "sit" and spec["model"]["name"] == NAME
    imported, _ = load_trained_model(tmp_path / "release")
    x, y = _flow_inputs()
    for t in (0.0, 0.4, 1.0):  # SiT's time: 0 noise, 1 data, fed to the embedding as it is
        tt = torch.full((3,), t)
        with torch.no_grad():
            assert torch.equal(imported(x, tt, y)[:, :4], source(x, tt, y)[:, :4])
    # A SiT training checkpoint is recognised by its transport flags; other paths are refused.
    args = argparse.Namespace(model="SiT-T/4", image_size=64, num_classes=10, path_type="Linear",
                              prediction="velocity", loss_weight=None)
    torch.save({"model": source.state_dict(), "ema": source.state_dict(), "opt": {}, "args": args},
               tmp_path / "0100000.pt")
    assert import_checkpoint(tmp_path / "0100000.pt", tmp_path / "train")["imported"]["from"] == "sit"
    # SiT's other paths, predictions and loss weights become the spec's, so sampling needs no flag.
    args.path_type, args.prediction, args.loss_weight = "GVP", "noise", "likelihood"
    torch.save({"ema": source.state_dict(), "args": args}, tmp_path / "gvp.pt")
    spec = import_checkpoint(tmp_path / "gvp.pt", tmp_path / "gvp")["diffusion"]
    assert (spec["path"], spec["prediction"], spec["loss_weight"]) == ("gvp", "noise", "likelihood")
    args.path_type = "EDM"
    torch.save({"ema": source.state_dict(), "args": args}, tmp_path / "edm.pt")
    with pytest.raises(UserError, match=r"trained with sit's path 'EDM' and prediction 'noise'; sit's paths Linear, "
                                        r"GVP, VP and predictions velocity, score, noise import here"):
        import_checkpoint(tmp_path / "edm.pt", tmp_path / "edm")


@pytest.mark.slow
def test_an_imported_sit_release_samples_with_its_protocol(tmp_path):
    from helpers import tiny_vae

    torch.save(_flow_backbone(5, learn_sigma=True).state_dict(), tmp_path / "SiT.pt")
    import_checkpoint(tmp_path / "SiT.pt", tmp_path / "sit", source="sit", model="SiT-T/4", image_size=64)
    out = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "sit"), "--vae",
                          str(tiny_vae(tmp_path / "vae")), "--protocol", "sit", "--num-samples", "2",
                          "--out", str(tmp_path / "s.npz")],
                         capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "with flow sde-250, cfg 1.5" in out.stdout and (tmp_path / "s.npz").is_file()


def _repa_file(tmp_path: Path, backbone: torch.nn.Module, **args) -> Path:
    """REPA's train.py checkpoint: {model, ema, opt, args, steps}, the SiT weights plus one projector
    (build_mlp: Linear, SiLU, Linear, SiLU, Linear) after encoder_depth blocks."""
    torch.manual_seed(9)
    projector = torch.nn.Sequential(torch.nn.Linear(192, 32), torch.nn.SiLU(), torch.nn.Linear(32, 32),
                                    torch.nn.SiLU(), torch.nn.Linear(32, 16))
    weights = {**backbone.state_dict(), **{f"projectors.0.{k}": v for k, v in projector.state_dict().items()}}
    args = argparse.Namespace(**{"model": "SiT-T/4", "resolution": 64, "num_classes": 10, "path_type": "linear",
                                 "prediction": "v", "weighting": "uniform", "enc_type": "dinov2-vit-b",
                                 "proj_coeff": 0.5, "encoder_depth": 8, "qk_norm": False, **args})
    path = tmp_path / "repa-0004000.pt"
    torch.save({"model": weights, "ema": weights, "opt": {}, "args": args, "steps": 4000}, path)
    return path


def test_repa_checkpoints_import_into_sits_time_convention(tmp_path):
    from ancre_dit.sampling import Guidance, sample_latents
    from ancre_dit.sampling.api import SampleNoise

    repa = _flow_backbone(6, learn_sigma=False)  # REPA's network: t = 1 noise, output noise - data
    spec = import_checkpoint(_repa_file(tmp_path, repa), tmp_path / "repa")
    assert spec["imported"]["from"] == "repa" and spec["imported"]["dropped"] == "1 REPA projector(s)"
    assert spec["step"] == 4000 and spec["data"]["image_size"] == 64 and spec["diffusion"]["objective"] == "flow"
    imported, _ = load_trained_model(tmp_path / "repa")
    assert not any(k.startswith("projectors") for k in imported.state_dict())
    x, y = _flow_inputs()
    with torch.no_grad():
        for t in (0.0, 0.3, 0.9, 1.0):  # ours at t is REPA's at 1 - t, with the velocity's sign turned
            tt = torch.full((3,), t)
            torch.testing.assert_close(imported(x, tt, y), -repa(x, 1 - tt, y), atol=2e-5, rtol=1e-4)
    # REPA's euler_sampler (samplers.py, cfg 1) written out: t from 1 to 0, x += (t_next - t_cur) * v.
    steps, labels = 4, [1, 7]
    z = SampleNoise(5, [0, 1], (4, 8, 8), torch.device("cpu")).next().double()
    t_steps = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    with torch.no_grad():
        for t_cur, t_next in zip(t_steps[:-1], t_steps[1:]):
            v = repa(z.float(), torch.full((2,), float(t_cur)), torch.tensor(labels)).double()
            z = z + (t_next - t_cur) * v
    ours = sample_latents(imported, spec["diffusion"], labels, sampler="euler", steps=steps, seed=5,
                          guidance=Guidance(1.0))
    torch.testing.assert_close(ours.double(), z, atol=1e-4, rtol=1e-4)
    # REPA's cosine path is SiT's GVP on the reversed time axis: the same fold makes it ours.
    cosine = import_checkpoint(_repa_file(tmp_path, repa, path_type="cosine"), tmp_path / "cos")
    assert cosine["diffusion"]["path"] == "gvp" and cosine["diffusion"]["prediction"] == "velocity"
    imported, _ = load_trained_model(tmp_path / "cos")
    with torch.no_grad():
        tt = torch.full((3,), 0.3)
        torch.testing.assert_close(imported(x, tt, y), -repa(x, 1 - tt, y), atol=2e-5, rtol=1e-4)
    # What does not import is said in one line: REPA's LayerNorm QK-norm, a wrong --source.
    qk = _repa_file(tmp_path, repa)
    raw = torch.load(qk, weights_only=False)
    raw["ema"]["blocks.0.attn.q_norm.weight"] = torch.ones(96)
    torch.save(raw, qk)
    with pytest.raises(UserError, match="REPA's --qk-norm"):
        import_checkpoint(qk, tmp_path / "qk")
    with pytest.raises(UserError, match="import it with --source repa, not sit"):
        import_checkpoint(_repa_file(tmp_path, repa), tmp_path / "sit", source="sit")


@pytest.mark.slow
def test_an_imported_repa_checkpoint_samples_with_its_protocol_and_evaluates(tmp_path):
    import json

    from helpers import tiny_vae
    from ancre_dit.evaluation import WEIGHTS_NAME, write_random_inception_weights

    import_checkpoint(_repa_file(tmp_path, _flow_backbone(7, learn_sigma=False)), tmp_path / "repa")
    vae = tiny_vae(tmp_path / "vae")

    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                              env=subprocess_env(), cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        return done

    common = ["--ckpt", str(tmp_path / "repa"), "--vae", str(vae), "--num-samples", "4"]
    out = run("sample.py", *common, "--protocol", "repa", "--out", str(tmp_path / "s.npz"))
    assert "--protocol repa" in out.stdout and "with flow sde-250" in out.stdout
    run("sample.py", *common, "--seed", "1", "--steps", "20", "--sampler", "euler", "--out", str(tmp_path / "r.npz"))
    weights = write_random_inception_weights(tmp_path / WEIGHTS_NAME, seed=0)
    run("evaluate.py", "--samples", str(tmp_path / "s.npz"), "--ref", str(tmp_path / "r.npz"), "--metrics", "fid",
        "--inception-weights", str(weights), "--json", str(tmp_path / "eval.json"))
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["sampling"]["protocol"] == "repa" and result["sampling"]["guidance_interval"] == [0.0, 0.7]
    assert result["metrics"]["fid"] >= 0


def test_the_reference_codes_parameterizations_import_or_are_refused(tmp_path):
    """--ancre-parameterization Softmax is ANCRe; Constant freezes zero logits, softmax(0) = 1/j, our
    fixed-dense; Hadamard has no topology here and is refused in one line."""
    ancre = _model("ancre", 8)
    constant = {k: (torch.zeros_like(v) if k.startswith("topology.logits.") else v) for k, v in ancre.state_dict().items()}
    for name, state in (("Softmax", ancre.state_dict()), ("Constant", constant), ("Hadamard", ancre.state_dict())):
        args = argparse.Namespace(model=NAME, image_size=64, ancre_parameterization=name)
        torch.save({"ema": _official(state, "module."), "args": args}, tmp_path / f"{name}.pt")
    assert import_checkpoint(tmp_path / "Softmax.pt", tmp_path / "softmax")["model"]["kwargs"]["topology"] == "ancre"
    _same_output(tmp_path / "softmax", ancre)
    spec = import_checkpoint(tmp_path / "Constant.pt", tmp_path / "constant")
    assert spec["model"]["kwargs"]["topology"] == "fixed-dense"
    zero_logits = _model("ancre", 8)
    zero_logits.load_state_dict(constant)
    _same_output(tmp_path / "constant", zero_logits)  # the reference model with frozen zero logits, exactly
    with pytest.raises(UserError, match="--ancre-parameterization Hadamard, which has no topology here"):
        import_checkpoint(tmp_path / "Hadamard.pt", tmp_path / "hadamard")
    bad = {**constant, "topology.logits.3": torch.ones_like(constant["topology.logits.3"])}
    torch.save({"ema": _official(bad, ""), "args": argparse.Namespace(model=NAME, image_size=64,
                                                                     ancre_parameterization="Constant")},
               tmp_path / "bad.pt")
    with pytest.raises(UserError, match="says --ancre-parameterization Constant but its logits are not all zero"):
        import_checkpoint(tmp_path / "bad.pt", tmp_path / "bad")


# -- LightningDiT: its block, written out from models/lightningdit.py ------------------------------------
LD = dict(depth=2, hidden=64, heads=4, channels=4, grid=4, classes=10)


def _lightningdit_state(seed: int, *, wo_shift: bool, qk_norm: bool) -> dict[str, torch.Tensor]:
    """Random weights under LightningDiT's key names and shapes (patch 1, RMSNorm, SwiGLU, RoPE)."""
    g = torch.Generator().manual_seed(seed)
    D, C, N, hd = LD["hidden"], LD["channels"], LD["grid"] ** 2, LD["hidden"] // LD["heads"]
    H = int(2 / 3 * int(D * 4.0))  # LightningDiTBlock: SwiGLUFFN(hidden, int(2/3 * mlp_hidden_dim))
    shapes = {"pos_embed": (1, N, D), "x_embedder.proj.weight": (D, C, 1, 1), "x_embedder.proj.bias": (D,),
              "t_embedder.mlp.0.weight": (D, 256), "t_embedder.mlp.0.bias": (D,), "t_embedder.mlp.2.weight": (D, D),
              "t_embedder.mlp.2.bias": (D,), "y_embedder.embedding_table.weight": (LD["classes"] + 1, D),
              "final_layer.norm_final.weight": (D,), "final_layer.linear.weight": (C, D), "final_layer.linear.bias": (C,),
              "final_layer.adaLN_modulation.1.weight": (2 * D, D), "final_layer.adaLN_modulation.1.bias": (2 * D,)}
    for j in range(LD["depth"]):
        b = f"blocks.{j}."
        shapes.update({b + "norm1.weight": (D,), b + "norm2.weight": (D,), b + "attn.qkv.weight": (3 * D, D),
                       b + "attn.qkv.bias": (3 * D,), b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
                       b + "mlp.w12.weight": (2 * H, D), b + "mlp.w12.bias": (2 * H,), b + "mlp.w3.weight": (D, H),
                       b + "mlp.w3.bias": (D,), b + "adaLN_modulation.1.weight": ((4 if wo_shift else 6) * D, D),
                       b + "adaLN_modulation.1.bias": ((4 if wo_shift else 6) * D,)})
        if qk_norm:
            shapes.update({b + "attn.q_norm.weight": (hd,), b + "attn.k_norm.weight": (hd,)})
    state = {k: torch.randn(shape, generator=g) * 0.2 for k, shape in shapes.items()}
    for k in state:
        if "norm" in k:  # RMSNorm weights start at one
            state[k] = 1 + state[k]
    # VisionRotaryEmbeddingFast(dim=head_dim // 2, pt_seq_len=grid): EVA's 2D tables, stored as buffers
    dim = hd // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    f = torch.einsum("n,f->nf", torch.arange(LD["grid"]).float(), freqs).repeat_interleave(2, -1)
    f = torch.cat([f[:, None, :].expand(-1, LD["grid"], -1), f[None, :, :].expand(LD["grid"], -1, -1)], -1)
    state["feat_rope.freqs_cos"], state["feat_rope.freqs_sin"] = f.cos().reshape(N, -1), f.sin().reshape(N, -1)
    return state


def _lightningdit_forward(sd: dict, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, *, wo_shift: bool,
                          qk_norm: bool) -> torch.Tensor:
    """LightningDiT.forward (patch 1, use_rmsnorm, use_swiglu, use_rope), written out."""
    F = torch.nn.functional
    D, heads = LD["hidden"], LD["heads"]

    def rms(v, w):  # RMSNorm: x * rsqrt(mean(x^2) + 1e-6) * weight
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rotate_half(v):
        v1, v2 = v.reshape(*v.shape[:-1], -1, 2).unbind(-1)
        return torch.stack((-v2, v1), -1).flatten(-2)

    def rope(v):
        return v * sd["feat_rope.freqs_cos"] + rotate_half(v) * sd["feat_rope.freqs_sin"]

    def linear(v, name):
        return F.linear(v, sd[name + ".weight"], sd[name + ".bias"])

    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"]).flatten(2).transpose(1, 2)
    h = h + sd["pos_embed"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    t_emb = linear(F.silu(linear(torch.cat([torch.cos(args), torch.sin(args)], -1), "t_embedder.mlp.0")),
                   "t_embedder.mlp.2")
    c = t_emb + sd["y_embedder.embedding_table.weight"][y]
    for j in range(LD["depth"]):
        b = f"blocks.{j}."
        mod = linear(F.silu(c), b + "adaLN_modulation.1").chunk(4 if wo_shift else 6, dim=1)
        if wo_shift:
            (scale_msa, gate_msa, scale_mlp, gate_mlp), shift_msa, shift_mlp = mod, 0, 0
        else:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
            shift_msa, shift_mlp = shift_msa.unsqueeze(1), shift_mlp.unsqueeze(1)
        a = rms(h, sd[b + "norm1.weight"]) * (1 + scale_msa.unsqueeze(1)) + shift_msa
        B, N, _ = a.shape
        q, k, v = linear(a, b + "attn.qkv").reshape(B, N, 3, heads, D // heads).permute(2, 0, 3, 1, 4).unbind(0)
        if qk_norm:
            q, k = rms(q, sd[b + "attn.q_norm.weight"]), rms(k, sd[b + "attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        h = h + gate_msa.unsqueeze(1) * linear(attn, b + "attn.proj")
        m = rms(h, sd[b + "norm2.weight"]) * (1 + scale_mlp.unsqueeze(1)) + shift_mlp
        x1, x2 = linear(m, b + "mlp.w12").chunk(2, dim=-1)
        h = h + gate_mlp.unsqueeze(1) * linear(F.silu(x1) * x2, b + "mlp.w3")
    shift, scale = linear(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    out = linear(rms(h, sd["final_layer.norm_final.weight"]) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1),
                 "final_layer.linear")  # (N, T, C) with patch 1
    return out.transpose(1, 2).reshape(x.shape[0], -1, LD["grid"], LD["grid"])


def _lightningdit_file(tmp_path: Path, state: dict, name: str = "ld.pt", **config) -> Path:
    config = {"model": {"model_type": "LightningDiT-B/1", "use_qknorm": False, "use_swiglu": True, "use_rope": True,
                        "use_rmsnorm": True, "wo_shift": False, "in_chans": LD["channels"]},
              "data": {"image_size": 64, "num_classes": LD["classes"], "latent_norm": True, "latent_multiplier": 1.0},
              "vae": {"model_name": "vavae_f16d32", "downsample_ratio": 16},
              "transport": {"path_type": "Linear", "prediction": "velocity", "use_cosine_loss": True,
                            "use_lognorm": True}, **config}
    torch.save({"model": state, "ema": state, "opt": {}, "config": config}, tmp_path / name)
    return tmp_path / name


SMALL = {"depth": LD["depth"], "hidden_size": LD["hidden"], "num_heads": LD["heads"]}  # a LightningDiT-B/1 made small


@pytest.mark.parametrize("wo_shift,qk_norm", [(False, False), (True, True)])
def test_lightningdit_checkpoints_import_with_the_same_output(tmp_path, wo_shift, qk_norm):
    import math  # noqa: F401 - used by the written-out forward

    state = _lightningdit_state(3, wo_shift=wo_shift, qk_norm=qk_norm)
    torch.save({"mean": torch.randn(1, 4, 1, 1), "std": torch.rand(1, 4, 1, 1) + 0.5}, tmp_path / "stats.pt")
    spec = import_checkpoint(_lightningdit_file(tmp_path, state), tmp_path / "ckpt", overrides=SMALL,
                             latent_stats=tmp_path / "stats.pt")
    kwargs = spec["model"]["kwargs"]
    assert spec["imported"]["from"] == "lightningdit" and spec["model"]["name"] == "DiT-B/2"
    assert (kwargs["patch_size"], kwargs["norm"], kwargs["mlp"], kwargs["pos_embed"], kwargs["qk_norm"]) == (
        1, "rmsnorm", "swiglu", "sincos+rope2d", qk_norm)
    assert kwargs["input_size"] == 64 // 16 and spec["data"]["latent_norm"] == "channel"
    assert spec["data"]["scaling_factor"] == 1.0 and len(spec["data"]["channel_mean"]) == 4
    d = spec["diffusion"]
    assert (d["path"], d["prediction"], d["time_sampling"], d["cosine_loss_weight"]) == (
        "linear", "velocity", "logit-normal", 1.0)
    imported, _ = load_trained_model(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(4)
    x, t, y = torch.randn(3, 4, 4, 4, generator=g), torch.tensor([0.0, 0.35, 1.0]), torch.tensor([1, 7, 10])
    with torch.no_grad():
        torch.testing.assert_close(imported(x, t, y), _lightningdit_forward(state, x, t, y, wo_shift=wo_shift,
                                                                            qk_norm=qk_norm), atol=2e-5, rtol=1e-4)


def test_lightningdit_files_that_do_not_fit_are_refused(tmp_path):
    state = _lightningdit_state(5, wo_shift=False, qk_norm=False)
    with pytest.raises(UserError, match=r"--model LightningDiT-1p6B/1: pass --model LightningDiT-<B\|L\|XL>/<patch>"):
        import_checkpoint(_lightningdit_file(tmp_path, state, model={"model_type": "LightningDiT-1p6B/1"}),
                          tmp_path / "big", overrides=SMALL)
    with pytest.raises(UserError, match="--latent-stats is LightningDiT's"):
        import_checkpoint(_repa_file(tmp_path, _flow_backbone(6, learn_sigma=False)), tmp_path / "r",
                          latent_stats=tmp_path / "stats.pt")
    state["blocks.0.attn.q_norm.bias"] = torch.zeros(16)
    with pytest.raises(UserError, match="QK-norm is a LayerNorm"):
        import_checkpoint(_lightningdit_file(tmp_path, state), tmp_path / "ln", overrides=SMALL)


@pytest.mark.slow
def test_an_imported_lightningdit_checkpoint_samples_with_its_protocol(tmp_path):
    import numpy as np

    from helpers import tiny_vae

    state = _lightningdit_state(7, wo_shift=False, qk_norm=False)
    torch.save({"mean": torch.zeros(4), "std": torch.ones(4)}, tmp_path / "stats.pt")
    import_checkpoint(_lightningdit_file(tmp_path, state), tmp_path / "ckpt", overrides=SMALL,
                      latent_stats=tmp_path / "stats.pt")
    out = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "ckpt"), "--vae",
                          str(tiny_vae(tmp_path / "vae")), "--protocol", "lightningdit", "--num-samples", "2",
                          "--out", str(tmp_path / "s.npz")],
                         capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "with flow euler-249 shifted 0.3" in out.stdout
    with np.load(tmp_path / "s.npz") as f:
        assert f["arr_0"].shape[0] == 2
