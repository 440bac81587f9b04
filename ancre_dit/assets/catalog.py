"""Every asset the package knows, one entry each: the extension point for a new one."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Asset:
    """`url`: one plain file; `repo` + `files`: files of a hub repository. `sha256`: published checksums, or
    `hash_prefix` (torch.hub's file names), else the hub's ETag. `settings`: how configs point at it ({path})."""

    name: str
    what: str
    settings: tuple[str, ...]
    url: str | None = None
    repo: str | None = None
    revision: str = "main"
    files: tuple[str, ...] = ()
    sha256: dict[str, str] = field(default_factory=dict)
    hash_prefix: str | None = None

    @property
    def source(self) -> str:
        return self.url or f"https://huggingface.co/{self.repo} ({self.revision}): {', '.join(self.files)}"

    @property
    def file_names(self) -> tuple[str, ...]:
        return (self.url.rsplit("/", 1)[-1],) if self.url else self.files


_ADM = "https://openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/imagenet"
_TIMM_FILE = ("model.safetensors",)
_VAE_FILES = ("config.json", "diffusion_pytorch_model.safetensors")

ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset("inception", "torch-fidelity's port of TF's FID Inception (FID, sFID, IS, precision, recall)",
          ("eval.inception_weights={path}", "evaluate.py --inception-weights {path}"),
          url="https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
              "weights-inception-2015-12-05-6726825d.pth", hash_prefix="6726825d"),
    Asset("dinov2-vitb14", "DINOv2 ViT-B/14 (timm): REPA's encoder",
          ("repa.encoder=vit_base_patch14_dinov2.lvd142m", "repa.encoder_weights={path}"),
          repo="timm/vit_base_patch14_dinov2.lvd142m", files=_TIMM_FILE),
    Asset("dinov2-vitl14", "DINOv2 ViT-L/14 (timm): FD-DINOv2's features",
          ("eval.dinov2_weights={path}", "evaluate.py --dinov2-weights {path}"),
          repo="timm/vit_large_patch14_dinov2.lvd142m", files=_TIMM_FILE),
    Asset("sd-vae-ft-ema", "Stable Diffusion's VAE, EMA fine-tune (DiT's latents and decoding)",
          ("data.vae={path}", "scripts/extract_latents.py --vae {path}", "sample.py --vae {path}"),
          repo="stabilityai/sd-vae-ft-ema", files=_VAE_FILES),
    Asset("sd-vae-ft-mse", "Stable Diffusion's VAE, MSE fine-tune (DiT's other decoder)",
          ("data.vae={path}", "scripts/extract_latents.py --vae {path}", "sample.py --vae {path}"),
          repo="stabilityai/sd-vae-ft-mse", files=_VAE_FILES),
    Asset("adm-ref-256", "ADM's ImageNet 256x256 reference batch (FID-50K against it)",
          ("eval.ref={path}", "evaluate.py --ref {path}"), url=f"{_ADM}/256/VIRTUAL_imagenet256_labeled.npz"),
    Asset("adm-ref-512", "ADM's ImageNet 512x512 reference batch",
          ("eval.ref={path}", "evaluate.py --ref {path}"), url=f"{_ADM}/512/VIRTUAL_imagenet512.npz"),
)}
