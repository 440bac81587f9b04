"""Inception-v3 features as ADM's evaluator takes them, from torch-fidelity's port of the TF graph.

ADM (guided-diffusion evaluations/evaluator.py) runs TensorFlow's 2015-12-05 Inception graph on
uint8-valued NHWC images of any size and reads two tensors:
- `pool_3:0` (2048-d): FID, IS (through the softmax layer), precision / recall;
- `mixed_6/conv:0` (N, 17, 17, 192), of which it keeps channels [:7] and flattens per image in
  (H, W, C) order (7 x 17 x 17 = 2023 dims): sFID.
torch-fidelity's `inception-v3-compat` extractor (FeatureExtractorInceptionV3) is a port of that
graph (TF1-exact bilinear resize to 299, (x - 128) / 128): its '2048' output is `pool_3` and its
'logits_unbiased' output is `pool_3 @ softmax/weights` (no bias), the logits ADM's IS softmaxes.
TF's `mixed_6/conv` (a ReLU output) is torch-fidelity's `Mixed_6d.branch1x1` (conv + batch norm +
ReLU): a forward hook there gives ADM's spatial tensor, so our mu_s / sigma_s match ADM's batches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator
from unittest import mock

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..hardware import full_fp32
from ..data.adm_npz import to_rgb_uint8

WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + WEIGHTS_NAME
SPATIAL_CHANNELS = 7  # ADM keeps mixed_6/conv[..., :7]
POOL_DIM, LOGITS_DIM = 2048, 1008


def weights_hint(problem: str, flag: str = "--inception-weights ") -> str:
    """The one line shown for a missing or unusable weights file: what, where to get it, where to put it."""
    return (f"{problem}; the Inception metrics need {WEIGHTS_NAME} (torch-fidelity's port of TF's Inception, "
            f"~91 MB; nothing is downloaded for you: fetch it from {WEIGHTS_URL}), put it in ./weights/ "
            f"and pass {flag}weights/{WEIGHTS_NAME}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_LOADED: dict[type, tuple[tuple, Any]] = {}


def loaded(extractor: type, weights: str | os.PathLike | None, *args: Any):
    """`extractor(weights, *args)`, cached per (weights file, its mtime, args) so repeated calls reuse
    it; one network of each kind in memory at a time."""
    path = Path(weights) if weights else Path("")
    key = (str(path.resolve()), path.stat().st_mtime_ns if path.is_file() else None, *map(str, args))
    if _LOADED.get(extractor, (None,))[0] != key:
        _LOADED.pop(extractor, None)  # the old network goes before the new one loads
        _LOADED[extractor] = (key, extractor(weights, *args))
    return _LOADED[extractor][1]


def write_random_inception_weights(path: str | os.PathLike, seed: int = 0) -> Path:
    """Writes a RANDOMLY INITIALISED weights file shaped like the real one (tests and benchmarks
    only: its numbers mean nothing). He-normal convolutions and identity batch norms keep
    activations of order one through all 94 layers, so different images' features differ."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    # torch-fidelity's constructor always loads weights (downloading when given no path): stubbed out,
    # the module keeps its default (random) initialisation.
    with mock.patch("torch_fidelity.feature_extractor_inceptionv3.load_state_dict_from_url", lambda *a, **k: {}), \
            mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd, *a, **k: None):
        model = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("conv.weight"):
            fan_in = tensor[0].numel()
            value = torch.randn(tensor.shape, generator=gen) * (2.0 / fan_in) ** 0.5
        elif name == "fc.weight":
            # gain 10: random pool features share a large common part; this spreads the logits
            # enough that distinct images give an Inception Score measurably above 1.
            value = torch.randn(tensor.shape, generator=gen) * 10.0 * (1.0 / tensor.shape[1]) ** 0.5
        elif name.endswith(("bn.weight", "running_var")):
            value = torch.ones_like(tensor)
        elif name.endswith("num_batches_tracked"):
            value = tensor.clone()
        else:  # bn.bias, running_mean, fc.bias
            value = torch.zeros_like(tensor)
        state[name] = value
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def check_weights(path: str | os.PathLike | None) -> Path:
    """Returns the path if it holds a loadable Inception state dict; otherwise one clear UserError."""
    if path is None or str(path) == "":
        raise UserError(weights_hint("no Inception weights file given"))
    path = Path(path)
    if not path.is_file():
        raise UserError(weights_hint(f"Inception weights file {path} does not exist"))
    try:
        # weights_only: a tensors-only load, so a wrong file never runs pickled code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is the same user mistake
        raise UserError(weights_hint(f"{path} is not a readable PyTorch weights file "
                                     f"({type(err).__name__})")) from None
    # Two landmark tensors tell this file from other checkpoints; the strict load_state_dict in
    # InceptionExtractor checks every other key and shape.
    landmarks = {"fc.weight": (LOGITS_DIM, POOL_DIM), "Mixed_6d.branch1x1.conv.weight": (192, 768, 1, 1)}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), torch.Tensor) or tuple(state[k].shape) != shape
                                          for k, shape in landmarks.items()):
        raise UserError(weights_hint(f"{path} does not hold torch-fidelity's inception-v3-compat weights"))
    return path


@dataclass
class InceptionFeatures:
    """Per-image features, float32 numpy arrays on the CPU."""
    pool: np.ndarray      # (N, 2048) ADM's pool_3
    spatial: np.ndarray   # (N, 2023) ADM's mixed_6/conv[..., :7], flattened (H, W, C)
    logits: np.ndarray    # (N, 1008) pool_3 @ softmax weights (no bias): ADM's IS logits

    def __len__(self) -> int:
        return len(self.pool)


class InceptionExtractor:
    """torch-fidelity's inception-v3-compat with weights from a local file, plus ADM's spatial tensor."""

    def __init__(self, weights: str | os.PathLike, device: str | torch.device | None = None):
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        self.weights = check_weights(weights)
        self.device = torch.device(device) if device is not None else default_device()
        try:
            model = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                                feature_extractor_weights_path=str(self.weights))
        except Exception as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise UserError(weights_hint(f"{self.weights} could not be loaded ({type(err).__name__}: "
                                         f"{first_line[:200]})")) from None
        self.model = model.to(self.device).eval()
        self._spatial: torch.Tensor | None = None
        self.model.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output: torch.Tensor) -> None:
        # (N, 192, 17, 17) -> first 7 channels, flattened in TF's NHWC order (see module docstring).
        n = output.shape[0]
        self._spatial = output[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).reshape(n, -1).float()

    @torch.no_grad()
    def batch(self, images: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """uint8 (B, H, W, 3) -> (pool, spatial, logits) float32 tensors on the CPU."""
        x = torch.tensor(images, dtype=torch.uint8).to(self.device).permute(0, 3, 1, 2)  # a copy: memmaps are read-only
        with full_fp32():
            pool, logits = self.model(x)
        spatial, self._spatial = self._spatial, None
        return pool.cpu(), spatial.cpu(), logits.cpu()

    def extract(self, batches: Iterable[np.ndarray], total: int | None = None,
                desc: str = "inception features") -> InceptionFeatures:
        """Runs every uint8 NHWC batch through the network with a progress bar (`total` images)."""
        parts = []  # (pool, spatial, logits) per batch
        with tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True) as bar:
            for images in batches:
                parts.append(self.batch(images))
                bar.update(len(images))
        if not parts:
            raise UserError(f"no images to evaluate ({desc})")
        return InceptionFeatures(*(torch.cat(column).numpy() for column in zip(*parts)))


def iterate_batches(images: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """Slices an (N, H, W[, 1|3]) uint8 array (possibly memory-mapped) into RGB batches read one at a time."""
    for start in range(0, len(images), batch_size):
        yield to_rgb_uint8(np.asarray(images[start:start + batch_size]))
