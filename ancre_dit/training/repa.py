"""REPA, representation alignment (Yu et al., 2024): an extra training loss that makes the DiT's
state after block `repa.depth`, projected by a small trained MLP, point the way a frozen pretrained
encoder's patch tokens of the clean image do (negative cosine similarity, token by token). The
projector is trained with the model but is not part of it: the sampled model files are the same.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import MissingFileError, UserError
from ..models.timm_weights import load_timm_weights, weights_hint
from .config_sections import RepaConfig


class StateTap:
    """The topology's `state_hook` during a training forward: keeps z_depth, the state fed to block
    depth + 1, with its graph. One tap serves the whole run: torch.compile guards on the hook's identity."""

    def __init__(self, depth: int):
        self.depth = depth
        self.state: torch.Tensor | None = None

    def __call__(self, k: int, z: torch.Tensor) -> None:
        if k == self.depth:
            self.state = z

    @contextmanager
    def attached(self, topology: nn.Module) -> Iterator["StateTap"]:
        """The hook set for the body only (diagnostics and sampling run without it)."""
        self.state = None
        topology.state_hook = self
        try:
            yield self
        finally:
            topology.state_hook = None

    def take(self) -> torch.Tensor:
        state, self.state = self.state, None
        if state is None:
            raise RuntimeError(f"the topology reported no state after block {self.depth} during the forward")
        return state


def make_projector(hidden_size: int, projector_dim: int, encoder_dim: int) -> nn.Sequential:
    """REPA's projector, Linear(d, P) SiLU Linear(P, P) SiLU Linear(P, encoder_dim), with DiT's init
    of linears (xavier-uniform weights, zero biases)."""
    layers = nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(), nn.Linear(projector_dim, projector_dim),
                           nn.SiLU(), nn.Linear(projector_dim, encoder_dim))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return layers


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over batch and tokens of -cos(projected token, encoder token), in float32; both (N, T, E)."""
    if projected.shape != target.shape:
        raise UserError(f"REPA: the projected DiT tokens are {tuple(projected.shape)} but the encoder's patch tokens "
                        f"{tuple(target.shape)}; the token grids must match")
    p = F.normalize(projected.float(), dim=-1)
    e = F.normalize(target.float(), dim=-1)
    return -(p * e).sum(-1).mean()


class FrozenEncoder(nn.Module):
    """A frozen timm ViT, always in eval mode: clean images (N, 1 or 3, H, W) in [0, 255] -> its patch
    tokens (N, grid^2, dim), class and register tokens dropped."""

    def __init__(self, encoder: nn.Module, resolution: int, bf16: bool):
        super().__init__()
        self.encoder = encoder.eval().requires_grad_(False)
        self.resolution, self.bf16 = resolution, bf16
        # The normalisation the encoder was trained with (DINOv2's: ImageNet's mean / std, the fallback).
        cfg = getattr(encoder, "pretrained_cfg", None) or {}
        mean, std = cfg.get("mean", (0.485, 0.456, 0.406)), cfg.get("std", (0.229, 0.224, 0.225))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.dim = int(encoder.num_features)

    def train(self, mode: bool = True) -> "FrozenEncoder":
        return super().train(False)  # dropout / drop-path stay off whatever the caller asks

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Resizes the image, not the features, so that token i of both grids covers the same region (DINOv2-B/14
        under a 256 px DiT-B/2: 16 x 16 patches of 14 px at 224 px), antialiased as in the encoder's training."""
        x = images.float() / 255.0
        if x.shape[1] == 1:  # grey (the digits): the same value in R, G and B
            x = x.expand(-1, 3, -1, -1)
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bicubic", align_corners=False,
                              antialias=x.shape[-1] > self.resolution)
        x = (x - self.mean) / self.std
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            tokens = self.encoder.forward_features(x)
        return tokens[:, getattr(self.encoder, "num_prefix_tokens", 0):].float()


def _create(cfg: RepaConfig, **extra: Any) -> nn.Module:
    import timm

    try:
        return timm.create_model(cfg.encoder, pretrained=False, num_classes=0, **cfg.encoder_kwargs, **extra)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"repa.encoder {cfg.encoder} could not be built with repa.encoder_kwargs "
                        f"{cfg.encoder_kwargs} ({' '.join(str(err).split())})") from None


def build_encoder(cfg: RepaConfig, grid: int, device: torch.device | str = "cpu", bf16: bool = False,
                  load_weights: bool = True) -> FrozenEncoder:
    """The frozen encoder for a `grid` x `grid` DiT token grid, fed images of side grid x its patch size (read
    from the encoder built on the meta device, or the CPU where that fails), which repa.encoder_resolution may
    restate; `load_weights=False` keeps the random init (benchmarks time the architecture)."""
    with torch.random.fork_rng(devices=[]):  # the random inits (overwritten) do not move the training streams
        try:
            with torch.device("meta"):
                probe = _create(cfg)
        except UserError:
            probe = _create(cfg)
    patch = getattr(getattr(probe, "patch_embed", None), "patch_size", None)
    if patch is None or not hasattr(probe, "forward_features"):
        raise UserError(f"repa.encoder {cfg.encoder} has no patch embedding; REPA needs a ViT-style encoder "
                        f"whose patch tokens can match the DiT's tokens (e.g. vit_base_patch14_dinov2.lvd142m)")
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch, patch)
    if patch[0] != patch[1]:
        raise UserError(f"repa.encoder {cfg.encoder} has non-square patches {patch}; use one with square patches")
    p, r = int(patch[0]), cfg.encoder_resolution
    if r is not None and r != grid * p:
        raise UserError(f"repa.encoder_resolution={r} gives the encoder a {r / p:g} x {r / p:g} patch grid (patch "
                        f"{p}), but the DiT has {grid} x {grid} tokens; set repa.encoder_resolution={grid * p} or null")
    with torch.random.fork_rng(devices=[]):
        model = _create(cfg, img_size=grid * p)
    if load_weights:
        load_timm_weights(model, cfg.encoder_weights, cfg.encoder)
    tokens = int(model.patch_embed.num_patches)
    if tokens != grid * grid:
        raise UserError(f"repa.encoder {cfg.encoder} gives {tokens} patch tokens at {grid * p} px, the DiT "
                        f"{grid * grid}; REPA needs one encoder token per DiT token")
    return FrozenEncoder(model, grid * p, bf16).to(device)


class RepaAlignment:
    """What a REPA run holds besides the model: the frozen encoder, the projector and the tap."""

    PROJECTOR_FILE = "repa_projector.safetensors"

    def __init__(self, cfg: RepaConfig, hidden_size: int, grid: int, device: torch.device | str = "cpu",
                 bf16: bool = False, seed: int = 0):
        self.weight = float(cfg.weight)
        self.encoder = build_encoder(cfg, grid, device, bf16)
        with torch.random.fork_rng(devices=[]):  # its own stream: the model's init is the same with REPA off
            torch.default_generator.manual_seed(seed)
            self.projector = make_projector(hidden_size, cfg.projector_dim, self.encoder.dim).to(device)
        self.tap = StateTap(cfg.depth)

    def settings(self, cfg: RepaConfig) -> dict[str, Any]:
        """What a REPA checkpoint must be resumed with (the loss weight may change between launches)."""
        return {"depth": cfg.depth, "encoder": cfg.encoder, "encoder_kwargs": dict(cfg.encoder_kwargs),
                "projector_dim": cfg.projector_dim, "encoder_resolution": self.encoder.resolution}

    def loss(self, projector: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The unweighted loss of the state the tap caught; `projector`: self.projector as prepared (DDP)."""
        return alignment_loss(projector(self.tap.take()), self.encoder(images))


def check_repa_settings(r: RepaConfig, found: Callable[[str, str], bool]) -> None:
    """At config load, REPA on: an encoder timm knows, its weights a local file (`found(key, path)`)."""
    if not r.weight:
        return
    import timm

    if not timm.is_model(r.encoder):
        raise UserError(f"repa.encoder {r.encoder!r} is not a timm model name; use e.g. "
                        f"vit_base_patch14_dinov2.lvd142m (DINOv2 ViT-B/14, REPA's choice)")
    for key in ("img_size", "num_classes", "pretrained"):
        if key in r.encoder_kwargs:
            raise UserError(f"repa.encoder_kwargs must not set {key}: the trainer sets it"
                            f"{' (use repa.encoder_resolution)' if key == 'img_size' else ''}")
    if not r.encoder_weights or not found("repa.encoder_weights", r.encoder_weights):
        problem = (f"repa.encoder_weights {r.encoder_weights} does not exist" if r.encoder_weights
                   else f"repa.weight={r.weight:g} needs repa.encoder_weights")
        raise MissingFileError(f"{problem}; {weights_hint(r.encoder)}")


def build_repa(cfg: RepaConfig, model: nn.Module, input_size: int, device: torch.device, bf16: bool, seed: int,
               log) -> RepaAlignment | None:
    """REPA's encoder, projector and tap for this model's token grid and width; None with repa.weight 0."""
    if not cfg.weight:
        return None
    repa = RepaAlignment(cfg, model.pos_embed.shape[-1], input_size // model.patch_size, device, bf16=bf16, seed=seed)
    log.info("REPA: the state after block %d, projected to %d dims, aligned with the patch tokens of %s at %d px "
             "(weight %g; logged as train/repa_loss)", cfg.depth, repa.encoder.dim, cfg.encoder,
             repa.encoder.resolution, cfg.weight)
    return repa


def check_resume(folder: Path, state: dict[str, Any], repa: RepaAlignment | None, cfg: RepaConfig) -> None:
    """Before a resume: the checkpoint was trained with REPA exactly when this config uses it, with the
    same settings and projector shapes (else Accelerate fails deep inside with a size mismatch)."""
    with_repa = (folder / RepaAlignment.PROJECTOR_FILE).is_file()
    run_config = folder.parent.parent / "config.yaml"
    if with_repa != (repa is not None):
        raise UserError(f"--resume {folder} was trained {'with' if with_repa else 'without'} REPA but repa.weight="
                        f"{cfg.weight:g} here; resume with the config the run was started with ({run_config}), or "
                        f"start a new run_dir")
    if repa is None:
        return
    from safetensors import safe_open  # shapes from the header (the file was checked sound with its checkpoint)

    with safe_open(str(folder / RepaAlignment.PROJECTOR_FILE), framework="pt") as f:
        saved_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    shapes = {k: tuple(v.shape) for k, v in repa.projector.state_dict().items()}
    if saved_shapes != shapes:
        diff = next((k for k in shapes if saved_shapes.get(k) != shapes[k]), next(iter(saved_shapes), ""))
        raise UserError(f"--resume {folder}: its REPA projector has {diff} {saved_shapes.get(diff)}, this config's "
                        f"{shapes.get(diff)} (repa.projector_dim or repa.encoder differ); resume with the run's config")
    saved, own = state.get("repa"), json.loads(json.dumps(repa.settings(cfg)))  # tuples -> lists, as read back
    diffs = [f"repa.{k} {saved.get(k)!r} in the checkpoint, {own[k]!r} in the config"
             for k in own if saved is not None and saved.get(k) != own[k]]
    if diffs:
        raise UserError(f"--resume {folder} was trained with other REPA settings ({'; '.join(diffs)}); resume with "
                        f"the config the run was started with ({run_config}), or start a new run_dir")
