"""REPA (training/repa.py): the loss by hand, where gradients go, exact resume, 1 vs 2 processes, the
digits recipe end to end, the latent shards' clean images, and every mistake as one line.

The encoder is a tiny random-weight timm ViT written to a file by the tests (patch 4: at 16 px it
has the digits' 4 x 4 DiT token grid; the file is written at 32 px, so loading resamples its
position embedding as it does for DINOv2's 518 px weights)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import (REPA_ENCODER as ENCODER, REPA_ENCODER_KWARGS as ENCODER_KWARGS, ROOT, accelerate_state,
                     assert_same_weights, load_script, repa_overrides, run_forked_ranks, tiny_config, tiny_model,
                     tiny_repa_encoder, tiny_vae, train_tiny, write_latent_dir)
from safetensors.torch import load_file, save_file

from ancre_dit.errors import UserError
from ancre_dit.training import Trainer, train
from ancre_dit.training.config import load_config
from ancre_dit.training.config_sections import RepaConfig
from ancre_dit.training.repa import RepaAlignment, StateTap, build_encoder


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return tiny_repa_encoder(tmp_path_factory.mktemp("encoder") / "vit.safetensors")


def _repa_config(weights: Path, **fields) -> RepaConfig:
    return RepaConfig(**{"weight": 0.5, "depth": 1, "encoder": ENCODER, "encoder_weights": str(weights),
                         "encoder_kwargs": dict(ENCODER_KWARGS), "projector_dim": 16, **fields})


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"{step:07d}"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# -- the loss and its gradients ------------------------------------------------------------------
def test_loss_is_the_negative_cosine_of_projected_and_encoder_tokens(weights, one_thread):
    repa = RepaAlignment(_repa_config(weights), hidden_size=32, grid=4)
    assert repa.encoder.resolution == 16 and repa.encoder.dim == 32
    assert repa.encoder.encoder.pos_embed.shape == (1, 1 + 16, 32)  # resampled from the file's 8 x 8 grid
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 1, 8, 8), generator=g).float()  # digits: one channel in [0, 255]
    z = torch.randn(3, 16, 32, generator=g)
    repa.tap(0, torch.zeros(1))  # another block's state: ignored
    repa.tap(1, z)
    loss = repa.loss(repa.projector, images)

    # By hand: 3 channels, 8 -> 16 px bicubic, the encoder's mean / std (this ViT's: 0.5; DINOv2's:
    # ImageNet's), the ViT's tokens without its class token.
    assert timm.models.get_pretrained_cfg("vit_base_patch14_dinov2.lvd142m").mean == (0.485, 0.456, 0.406)
    x = F.interpolate((images / 255).repeat(1, 3, 1, 1), size=(16, 16), mode="bicubic", align_corners=False)
    x = (x - 0.5) / 0.5
    reference = timm.create_model(ENCODER, pretrained=False, num_classes=0, img_size=16, **ENCODER_KWARGS).eval()
    reference.load_state_dict(repa.encoder.encoder.state_dict())
    with torch.no_grad():
        target = reference.forward_features(x)[:, 1:]
    lin = [m for m in repa.projector if isinstance(m, torch.nn.Linear)]
    h = F.silu(z @ lin[0].weight.T + lin[0].bias)
    h = F.silu(h @ lin[1].weight.T + lin[1].bias)
    projected = h @ lin[2].weight.T + lin[2].bias
    cos = (projected * target).sum(-1) / (projected.norm(dim=-1) * target.norm(dim=-1))
    torch.testing.assert_close(loss, -cos.mean(), rtol=1e-5, atol=1e-6)
    assert -1 <= float(loss) <= 1
    with pytest.raises(RuntimeError, match="no state after block 1"):
        repa.loss(repa.projector, images)  # the tap hands its state over once


@pytest.mark.parametrize("topology, options, checkpointing", [
    ("ancre", {}, False), ("cascaded", {}, True), ("dar", {"query": "static-t", "chunk": 2}, False),
    ("hc", {"hc_streams": 2}, True)])
def test_gradients_reach_the_projector_and_the_blocks_up_to_depth_never_the_encoder(weights, topology, options,
                                                                                   checkpointing, one_thread):
    model = tiny_model(topology, **options).train()
    model.set_grad_checkpointing(checkpointing)
    repa = RepaAlignment(_repa_config(weights), hidden_size=32, grid=4)
    x, t, y = torch.randn(4, 1, 8, 8), torch.tensor([1, 10, 100, 999]), torch.tensor([0, 1, 2, 3])
    with repa.tap.attached(model.topology):
        model(x, t, y)
    assert model.topology.state_hook is None  # unset after the forward
    repa.loss(repa.projector, (x + 1) * 127.5).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in repa.projector.parameters())
    assert all(p.grad is None and not p.requires_grad for p in repa.encoder.parameters())
    assert model.x_embedder.proj.weight.grad.abs().sum() > 0  # below the aligned block
    assert model.final_layer.linear.weight.grad is None  # above it: only the diffusion loss reaches it
    repa.encoder.train()
    assert not repa.encoder.encoder.training  # frozen in eval mode whatever is asked


def test_encoder_runs_in_bf16_when_training_does(weights, one_thread):
    full = build_encoder(_repa_config(weights), grid=4)
    half = build_encoder(_repa_config(weights), grid=4, bf16=True)
    images = torch.randint(0, 256, (2, 3, 8, 8)).float()
    a, b = full(images), half(images)
    assert a.dtype == b.dtype == torch.float32 and a.shape == (2, 16, 32) and not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0.1, atol=0.1)


@pytest.mark.slow
def test_the_tap_compiles_into_the_models_graph(one_thread):
    """torch.compile of the model with the hook set: one graph, no break, the state caught."""
    model = tiny_model("ancre").train()
    tap = StateTap(1)
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    torch._dynamo.reset()
    with tap.attached(model.topology):
        explanation = torch._dynamo.explain(model)(x, t, y)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert tap.state is not None and tap.state.shape == (2, 16, 32)
    torch._dynamo.reset()


# -- training ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_encoder_stays_frozen_and_resume_is_exact(tmp_path, weights, one_thread):
    common = [*repa_overrides(weights), "train.ckpt_every=2", "train.ema_warmup=true"]
    with accelerate_state():
        trainer = Trainer(tiny_config(tmp_path / "straight", "train.max_steps=4", *common))
        encoder_before = {k: v.clone() for k, v in trainer.repa.encoder.state_dict().items()}
        projector_before = {k: v.clone() for k, v in trainer.repa.projector.state_dict().items()}
        trainer.run()
    for k, v in trainer.repa.encoder.state_dict().items():
        assert torch.equal(v, encoder_before[k]), k
    assert not all(torch.equal(v, projector_before[k]) for k, v in trainer.repa.projector.state_dict().items())
    with accelerate_state():
        train(tiny_config(tmp_path / "split", "train.max_steps=2", *common))
    with accelerate_state():
        train(tiny_config(tmp_path / "split", "train.max_steps=4", *common), resume="auto")
    a, b = _ckpt(tmp_path / "straight", 4), _ckpt(tmp_path / "split", 4)
    assert_same_weights(a, b)
    pa, pb = load_file(a / "repa_projector.safetensors"), load_file(b / "repa_projector.safetensors")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert all(torch.equal(pa[k], v.cpu()) for k, v in trainer.repa.projector.state_dict().items())
    assert [m["repa_loss"] for m in _metrics(tmp_path / "straight")] == [m["repa_loss"] for m in _metrics(tmp_path / "split")]
    with accelerate_state():  # paired seeds: with REPA off, the same network, batch and draws at step 1
        train(tiny_config(tmp_path / "off", "train.max_steps=1", "train.ckpt_every=2", "train.ema_warmup=true"))
    on, off = _metrics(tmp_path / "straight")[0], _metrics(tmp_path / "off")[0]
    assert (on["loss"], on["mse"]) == (off["loss"], off["mse"]) and "repa_loss" not in off
    # The sampled model is what it is without REPA: no projector in its files or spec.
    assert set(load_file(a / "model.safetensors")) == set(trainer.raw_model.state_dict())
    assert "repa" not in (a / "model_spec.json").read_text()
    with accelerate_state(), pytest.raises(UserError) as err:  # resuming without REPA would misread the optimizer state
        Trainer(tiny_config(tmp_path / "split", "train.max_steps=6"), resume="auto")
    assert "trained with REPA" in _one_line(err)
    with accelerate_state(), pytest.raises(UserError) as err:
        Trainer(tiny_config(tmp_path / "split", "train.max_steps=6", *common, "repa.projector_dim=8"), resume="auto")
    assert "its REPA projector has 0.weight (16, 32), this config's (8, 32)" in _one_line(err)
    with accelerate_state(), pytest.raises(UserError) as err:  # same projector shapes, another block: the saved settings tell
        Trainer(tiny_config(tmp_path / "split", "train.max_steps=6", *repa_overrides(weights, depth=2),
                            "train.ckpt_every=2", "train.ema_warmup=true"), resume="auto")
    assert "other REPA settings (repa.depth 1 in the checkpoint, 2 in the config)" in _one_line(err)


@pytest.mark.slow
def test_two_processes_log_the_losses_of_one(tmp_path, weights):
    from test_distributed import SETTINGS

    one, two = tmp_path / "one", tmp_path / "two"
    run_forked_ranks(train_tiny, 2, f"run_dir={two}", *SETTINGS, *repa_overrides(weights))
    run_forked_ranks(train_tiny, 1, f"run_dir={one}", *SETTINGS, *repa_overrides(weights))
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2]
    for a, b in zip(m1, m2):  # step 2 follows an update: the projector's gradients were averaged too
        for key in ("loss", "repa_loss"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
    p1 = load_file(str(_ckpt(one, 2) / "repa_projector.safetensors"))
    p2 = load_file(str(_ckpt(two, 2) / "repa_projector.safetensors"))
    for k in p1:
        assert torch.allclose(p1[k], p2[k], atol=1e-6, rtol=0), k


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_digits_recipe_with_repa_trains_checkpoints_and_samples(tmp_path, weights, one_thread):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "digits"
    config = load_config(ROOT / "configs" / "digits-ancre.yaml", [
        f"run_dir={run}", *repa_overrides(weights, depth=4), "train.max_steps=3", "train.ckpt_every=3",
        "train.log_every=1", "train.eval_every=0", "train.sample_every=3", "train.num_sample_images=10",
        "train.sample_steps=3", "train.diagnostics=false"])
    out = train(config)
    assert out["step"] == 3 and np.isfinite(out["metrics"]["repa_loss"])
    folder = _ckpt(run, 3)
    assert (folder / "repa_projector.safetensors").is_file() and (run / "samples" / "0000003.png").is_file()
    tags = EventAccumulator(str(next((run / "logs").rglob("events.out.tfevents*")).parent)).Reload().Tags()["scalars"]
    assert "train/repa_loss" in tags and "train/loss" in tags
    npz = tmp_path / "samples.npz"
    load_script(ROOT / "sample.py").main(["--ckpt", str(folder), "--num-samples", "4", "--steps", "3",
                                          "--sampler", "ddim", "--out", str(npz), "--cpu"])
    assert np.load(npz)["arr_0"].shape[:3] == (4, 8, 8)


# -- latent shards with their images ------------------------------------------------------------
def _latent_dir(root: Path, images: bool, n: int = 12, shape=(4, 4, 4), size: int = 16) -> Path:
    """Two shards. The moments make the draw tell its flip: mean 0 unflipped, 1 flipped, std 0; each
    image is dark on its left half, bright on its right."""
    shards = []
    for k, count in enumerate((n // 2, n - n // 2)):
        mean = torch.zeros(count, 2, *shape)
        mean[:, 1] = 1.0
        tensors = {"mean": mean.half(), "std": torch.zeros(count, 2, *shape).half(),
                   "label": torch.arange(count) % 3, "index": torch.arange(count) + k * (n // 2)}
        if images:
            img = torch.zeros(count, 3, size, size, dtype=torch.uint8)
            img[..., size // 2:] = 200
            img[:, 0, 0, 0] = torch.arange(count, dtype=torch.uint8) + 10 * k  # tells the images apart
            tensors["image"] = img
        shards.append(tensors)
    return write_latent_dir(root, shards, num_classes=3, image_size=size, images=images)


@pytest.mark.parametrize("workers", [0, 1])
def test_latent_images_come_with_their_batches_and_flip_with_the_latents(tmp_path, workers):
    from ancre_dit.data.latent_shards import LatentShardDataset
    from ancre_dit.training.data import DataInfo, GlobalBatchSampler, make_loader, prepare_batch

    root = _latent_dir(tmp_path / "lat", images=True)
    files, memory = LatentShardDataset(root, max_open_shards=1, images=True), LatentShardDataset(root, in_memory=True,
                                                                                                 images=True)
    plain = LatentShardDataset(root)  # older readers and the held-out sets: moments only
    for ds in (files, memory):
        moments, labels, images = ds.get_batch([11, 0, 6])
        assert images.dtype == torch.uint8 and images.shape == (3, 3, 16, 16)
        assert images[:, 0, 0, 0].tolist() == [15, 0, 10]  # row 5 of shard 1, row 0 of shard 0, row 0 of shard 1
        reference, ref_labels = plain.get_batch([11, 0, 6])
        assert torch.equal(moments, reference) and torch.equal(labels, ref_labels)
        assert torch.equal(ds[3][0], plain[3][0])
    info = DataInfo(files, "latents", 4, 4, 3, 16, 3)
    sampler = GlobalBatchSampler(len(files), 4, world=1, rank=0, accum=1, seed=1)
    g = torch.Generator().manual_seed(3)
    flips = []
    for batch, _ in zip(make_loader(info, sampler, workers, pin_memory=False), range(6)):
        x, y, clean = prepare_batch(info, batch, torch.device("cpu"), g, clean_images=True)
        flipped = x.flatten(1)[:, 0] == 1.0  # the draw took the flipped moments
        assert clean.shape == (4, 3, 16, 16) and clean.dtype == torch.float32
        left, right = clean[:, 1, :, :8].mean((1, 2)), clean[:, 1, :, 8:].mean((1, 2))
        assert torch.equal(left > right, flipped)  # the bright half moved left exactly when the latent flipped
        flips += flipped.tolist()
    assert any(flips) and not all(flips)
    # The draws do not depend on whether images come along.
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with_images = prepare_batch(info, files.get_batch([1, 2, 3]), torch.device("cpu"), g1, clean_images=True)
    without = prepare_batch(DataInfo(plain, "latents", 4, 4, 3, 16, 3), plain.get_batch([1, 2, 3]), torch.device("cpu"), g2)
    assert torch.equal(with_images[0], without[0]) and len(without) == 2


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_trains_on_latents_with_images_and_refuses_shards_without(tmp_path, weights, one_thread):
    latents = ["data.kind=latents", "data.image_size=16", "train.global_batch_size=4", "train.max_steps=2",
               "train.ckpt_every=2"]
    with_images = _latent_dir(tmp_path / "with", images=True)
    with accelerate_state():
        out = train(tiny_config(tmp_path / "run", *latents, f"data.path={with_images}", *repa_overrides(weights),
                                "train.mixed_precision=bf16", "train.grad_accum=2"))
    assert out["step"] == 2 and np.isfinite(out["metrics"]["repa_loss"])  # 16 px images, 8 px encoder input, 2 x 2 tokens
    without = _latent_dir(tmp_path / "without", images=False)
    with accelerate_state(), pytest.raises(UserError) as err:
        Trainer(tiny_config(tmp_path / "run2", *latents, f"data.path={without}", *repa_overrides(weights)))
    assert "holds no images" in _one_line(err) and "--keep-images" in str(err.value)
    with accelerate_state():
        out = train(tiny_config(tmp_path / "run3", *latents, f"data.path={without}"))
    assert out["step"] == 2  # REPA off: as before


@pytest.mark.slow
def test_extraction_keeps_the_crops_the_vae_saw(tmp_path, one_thread):
    from PIL import Image

    from ancre_dit.data.image_folder import load_rgb
    from ancre_dit.data.latent_shards import LatentShardDataset
    from ancre_dit.latents.extract import ExtractConfig, run_extraction
    from ancre_dit.latents.shards import verify_latent_dir

    tiny_vae(tmp_path / "vae")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / "img" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (20 + i, 27, 3), dtype=np.uint8)).save(tmp_path / "img" / name / f"{i}.png")
    config = dict(data_path=str(tmp_path / "img"), vae=str(tmp_path / "vae"), image_size=16, shard_size=3, batch_size=2)
    run_extraction(ExtractConfig(out=str(tmp_path / "out"), keep_images=True, **config))
    manifest, problems = verify_latent_dir(tmp_path / "out", progress=False)
    assert problems == [] and manifest["images"] is True
    ds = LatentShardDataset(tmp_path / "out", images=True)
    _, _, images = ds.get_batch(list(range(4)))
    files = sorted((tmp_path / "img").rglob("*.png"))
    for k, path in enumerate(files):
        assert torch.equal(images[k], torch.from_numpy(load_rgb(path, 16)).permute(2, 0, 1)), path
    # Without --keep-images the shards are as before; the two extractions never mix in one folder.
    run_extraction(ExtractConfig(out=str(tmp_path / "plain"), **config))
    assert "image" not in load_file(tmp_path / "plain" / "shard-00000.safetensors")
    with pytest.raises(UserError, match="different extraction"):
        run_extraction(ExtractConfig(out=str(tmp_path / "out"), **config))


# -- mistakes -------------------------------------------------------------------------------------
def test_config_mistakes_are_one_line(tmp_path, weights):
    def error(*overrides: str) -> str:
        with pytest.raises(UserError) as err:
            tiny_config(tmp_path / "run", *overrides)
        return _one_line(err)

    base = repa_overrides(weights)
    missing = error(*base, f"repa.encoder_weights={tmp_path / 'nowhere.pth'}")
    assert "nowhere.pth does not exist" in missing and "nothing is downloaded" in missing
    assert "needs repa.encoder_weights" in error(*base, "repa.encoder_weights=null")
    assert "repa.depth=3 is beyond the 2 blocks" in error(*base, "repa.depth=3")
    assert "not a timm model name" in error(*base, "repa.encoder=no_such_vit")
    assert "must not set img_size" in error(*base, "repa.encoder_kwargs={img_size: 64}")
    assert "repa.weight must be greater than or equal to 0" in error(*base, "repa.weight=-1")
    assert "repa.projector_dim must be greater than or equal to 1" in error(*base, "repa.projector_dim=0")
    assert not (tmp_path / "run").exists()  # nothing written before the checks
    # Off: none of it is looked at (the tiny model has 2 blocks, the default depth is 8).
    assert tiny_config(tmp_path / "run", "repa.depth=8", "repa.encoder_weights=nowhere").repa.weight == 0


def test_weights_that_are_not_the_encoders_are_one_line(tmp_path, weights):
    def error(path: Path, **fields) -> str:
        with pytest.raises(UserError) as err:
            build_encoder(_repa_config(path, **fields), grid=4)
        return _one_line(err)

    wider = tiny_repa_encoder(tmp_path / "wider.safetensors", embed_dim=64, num_heads=2)
    assert "does not hold the weights of repa.encoder vit_tiny_patch16_224: cls_token is (1, 1, 64) in the file" \
        in error(wider)
    patch8 = tiny_repa_encoder(tmp_path / "patch8.safetensors", patch_size=8)
    assert "patch_embed.proj.weight is (32, 3, 8, 8) in the file" in error(patch8)
    dit = tmp_path / "dit.safetensors"
    save_file(tiny_model("cascaded").state_dict(), str(dit))
    assert "does not hold the weights" in error(dit)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    assert "is not a readable weights file" in error(garbage)
    assert "gives the encoder a 5 x 5 patch grid" in error(weights, encoder_resolution=20)
    assert "a 4.5 x 4.5 patch grid" in error(weights, encoder_resolution=18)
    assert build_encoder(_repa_config(weights, encoder_resolution=16), grid=4).resolution == 16


@pytest.mark.slow
def test_benchmark_smoke(one_thread, capsys):
    from benchmarks import bench_repa

    result = bench_repa.measure(bench_repa.parse_args(["--smoke"]))
    assert result["on_ms"] > 0 and result["off_ms"] > 0 and result["ratio"] > 0 and result["encoder_share"] > 0
    out = capsys.readouterr().out
    assert "with / without" in out and "frozen encoder forward alone" in out
