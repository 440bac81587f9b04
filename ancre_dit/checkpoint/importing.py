"""Published checkpoints (.pt) -> a checkpoint folder that sample.py and evaluate.py read. Sources: dit (the
DiT release); ancre (official ANCRe training checkpoints, the outgoing ablation's per-source logits and the
Constant ablation, as fixed-dense, included); sit and repa with their flow objective (REPA's projectors
dropped, its reversed time axis turned into SiT's exactly); lightningdit (its block, objective and VA-VAE
latents mapped exactly). The architecture comes from the file's `args`, else the caller, checked by a strict
load. Files are read with `torch.load(weights_only=True)` (plus argparse.Namespace): unpickling runs no code.
"""
from __future__ import annotations

import argparse
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..diffusion import FlowObjective
from ..diffusion.paths import PREDICTIONS
from ..diffusion.gaussian import DDPM_SCHEDULE
from ..errors import MissingFileError, UserError
from ..files import sha256_file
from ..models import create_model, load_state_dict_checked, official_logit_layout, save_topology_json
from ..models.convert import convert_official_state_dict, lightningdit_to_ours, reverse_time_axis
from ..models.topologies import topology_entry
from .model_spec import SPEC_FILE, make_model_spec, write_model_files

SAFE_GLOBALS = [argparse.Namespace]  # what the official training scripts store besides tensors
VAE_DOWNSAMPLE = 8  # SD VAE: 256 px -> 32 x 32 latents
SD_VAE_SCALING = 0.18215
# Topology of an imported file by its logit layout, when the caller does not name one.
DEFAULT_TOPOLOGY = {None: "cascaded", "per-target": "ancre", "per-source": "ancre-outgoing"}
SOURCES = ("dit", "ancre", "sit", "repa", "lightningdit")
FLOW_SOURCES = ("sit", "repa")


def recognise_source(state: Mapping[str, torch.Tensor], args: Mapping[str, Any], layout: str | None) -> str:
    """The source a file comes from, by what only it holds; else dit (SiT's bare release too: --source sit)."""
    if any(k.startswith("projectors.") for k in state):
        return "repa"
    if any(".mlp.w12." in k or k.endswith("norm1.weight") or k.startswith("feat_rope.") for k in state):
        return "lightningdit"
    if layout is not None:
        return "ancre"
    return "sit" if "path_type" in args else "dit"


# What SiT's and REPA's --path-type / --prediction / --loss-weight values are here.
SIT_PATHS = {"Linear": "linear", "GVP": "gvp", "VP": "vp"}
REPA_PATHS = {"linear": "linear", "cosine": "gvp"}  # REPA's cosine path is SiT's GVP on the reversed time axis
REPA_PREDICTIONS = {"v": "velocity"}


def _flow_source(source: str, args: Mapping[str, Any], state: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SiT's or REPA's objective as our flow spec, from the file's args or their defaults; what the spec's
    "imported" entry adds). A REPA state is turned into SiT's time convention in place."""
    paths, predictions = (SIT_PATHS, {p: p for p in PREDICTIONS}) if source == "sit" else (REPA_PATHS, REPA_PREDICTIONS)
    path = args.get("path_type") or next(iter(paths))
    prediction = args.get("prediction") or next(iter(predictions))
    if path not in paths or prediction not in predictions:
        raise UserError(f"the file was trained with {source}'s path {path!r} and prediction {prediction!r}; "
                        f"{source}'s paths {', '.join(paths)} and predictions {', '.join(predictions)} import here")
    loss_weight = args.get("loss_weight") if source == "sit" else None
    diffusion = FlowObjective(path=paths[path], prediction=predictions[prediction],
                              loss_weight=loss_weight if loss_weight and prediction != "velocity" else "none").spec()
    if source == "sit":
        return diffusion, {}
    if any(".q_norm." in k for k in state):
        raise UserError("the file was trained with REPA's --qk-norm (timm's LayerNorm on q and k), which our "
                        "QK-norm (RMSNorm) does not reproduce; it cannot be imported")
    dropped = {k.split(".")[1] for k in state if k.startswith("projectors.")}
    for key in [k for k in state if k.startswith("projectors.")]:
        del state[key]
    reverse_time_axis(state)
    return diffusion, {"dropped": f"{len(dropped)} REPA projector(s)", "time_axis": "reversed (REPA) -> SiT's"}


LIGHTNINGDIT_SIZES = {"B": "DiT-B/2", "L": "DiT-L/2", "XL": "DiT-XL/2"}  # LightningDiT-<size>/<patch>


def _lightningdit_source(raw: Mapping[str, Any], model: str | None, latent_stats: str | Path | None
                         ) -> dict[str, Any]:
    """What a LightningDiT file says besides its weights, from its training `config` or the caller: model,
    patch size, VAE downsampling, objective and latent normalisation (per channel, from latents_stats.pt)."""
    config = raw.get("config") if isinstance(raw.get("config"), Mapping) else {}
    section = lambda name: config.get(name) if isinstance(config.get(name), Mapping) else {}  # noqa: E731
    model_type = _pick("model", model, section("model").get("model_type"))
    size, _, patch = (model_type or "").removeprefix("LightningDiT-").partition("/")
    if size not in LIGHTNINGDIT_SIZES or not patch.isdigit():
        raise UserError(f"{'--model ' + model_type if model_type else 'the file names no model'}: pass --model "
                        f"LightningDiT-<{'|'.join(LIGHTNINGDIT_SIZES)}>/<patch>, e.g. LightningDiT-XL/1")
    transport = section("transport")
    path = SIT_PATHS.get(transport.get("path_type") or "Linear")  # LightningDiT's transport is SiT's
    if path is None or (transport.get("prediction") or "velocity") != "velocity":
        raise UserError(f"the file was trained with LightningDiT's path {transport.get('path_type')!r} and prediction "
                        f"{transport.get('prediction')!r}; its Linear, GVP and VP paths with velocity import here")
    diffusion = FlowObjective(time_sampling="logit-normal" if transport.get("use_lognorm") else "uniform",
                              cosine_loss_weight=1.0 if transport.get("use_cosine_loss") else 0.0, path=path).spec()
    data = section("data")
    norm: dict[str, Any] = {"scaling_factor": float(data.get("latent_multiplier", 1.0))}
    if latent_stats is not None:
        stats = safe_torch_load(latent_stats)
        if not isinstance(stats, Mapping) or not all(isinstance(stats.get(k), torch.Tensor) for k in ("mean", "std")):
            raise UserError(f"--latent-stats {latent_stats} holds no 'mean' and 'std' tensors (LightningDiT's "
                            f"latents_stats.pt)")
        norm.update(latent_norm="channel", channel_mean=stats["mean"].flatten().tolist(),
                    channel_std=stats["std"].flatten().tolist())
    return {"name": LIGHTNINGDIT_SIZES[size], "patch_size": int(patch), "diffusion": diffusion, "data": norm,
            "downsample": int(section("vae").get("downsample_ratio", 16)), "image_size": data.get("image_size")}


def _reason(path: Path, err: BaseException) -> str:
    """Why torch.load failed, in one line; never its advice to retry with weights_only=False (unsafe)."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head == b"PK" and not zipfile.is_zipfile(path):
        return "a torch archive without its zip directory: truncated or damaged"
    if not zipfile.is_zipfile(path) and head[:1] != b"\x80":  # neither torch.save's zip nor a pickle
        return "neither a torch archive nor a pickle: a text, YAML or other file?"
    text = " ".join(str(err).split()).split("WeightsUnpickler error:")[-1]
    sentences = [x for x in re.split(r"(?<=\.)\s+", text) if "weights_only" not in x and "trust" not in x]
    return (sentences[0].strip() if sentences else type(err).__name__)[:160]


def safe_torch_load(path: str | Path) -> Any:
    """torch.load that never runs code from the file; anything it cannot read is one UserError."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} not found; pass the .pt file to import")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a foreign file makes the legacy unpickler raise anything
        if isinstance(err, pickle.UnpicklingError) and "global" in str(err).lower():
            wanted = re.search(r"GLOBAL (\S+)", str(err)) or re.search(r"global[^`]*`?([\w.]+)", str(err))
            what = f" ({wanted.group(1)})" if wanted else ""
            raise UserError(f"{path} wants to run code when unpickled{what} and was not loaded; only tensors, "
                            f"plain containers and argparse.Namespace are accepted") from None
        raise UserError(f"{path} is not a readable PyTorch checkpoint ({_reason(path, err)}); pass a .pt file written "
                        f"by torch.save (the DiT release or an official ANCRe training checkpoint)") from None


def _select_weights(raw: Mapping[str, Any], weights: str | None) -> tuple[Mapping[str, Any], str]:
    """The state dict to import and which it is ("ema", "model" or "state dict" for a bare one)."""
    wrapped = [k for k in ("ema", "model") if isinstance(raw.get(k), Mapping)]
    if not wrapped:
        if not any(isinstance(v, torch.Tensor) for v in raw.values()):
            raise UserError(f"the file holds neither a state dict nor 'ema' / 'model' entries (keys: "
                            f"{', '.join(map(str, list(raw)[:8]))})")
        if weights not in (None, "ema"):
            raise UserError("the file is a bare state dict (one set of weights, EMA in the DiT release); "
                            "drop --weights")
        return raw, "state dict"
    choice = weights or wrapped[0]  # EMA preferred
    if choice not in wrapped:
        raise UserError(f"the file has no {choice!r} weights (it has {', '.join(wrapped)}); "
                        f"pass --weights {wrapped[0]}")
    return raw[choice], choice


def _pick(name: str, given: Any, from_file: Any, default: Any = None) -> Any:
    """A setting from the caller or the file's args; both given and different is an error. Floats compare
    at float32, the precision files store them in (0.01 is stored as 0.0099999998)."""
    floats = isinstance(from_file, float) or isinstance(given, float)
    same = np.float32(given) == np.float32(from_file) if floats else given == from_file
    if given is not None and from_file is not None and not same:
        raise UserError(f"--{name.replace('_', '-')} {given} contradicts the file, which was trained with "
                        f"{name} {from_file}; drop the flag or pass the file's value")
    return given if given is not None else (from_file if from_file is not None else default)


def import_checkpoint(src: str | Path, out: str | Path, *, model: str | None = None, image_size: int | None = None,
                      topology: str | None = None, tau: float | None = None, weights: str | None = None,
                      source: str | None = None, latent_stats: str | Path | None = None,
                      overrides: Mapping[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Writes OUT/model_spec.json, ema/model.safetensors (both the imported weights) and topology.json for
    ANCRe; returns the spec. `overrides`: extra create_model arguments for non-standard sizes."""
    src, out = Path(src), Path(out)
    if (out / SPEC_FILE).exists() and not overwrite:
        raise UserError(f"{out} already holds a checkpoint; choose another --out, or pass --overwrite to replace it")
    raw = safe_torch_load(src)
    if not isinstance(raw, Mapping):
        raise UserError(f"{src} holds a {type(raw).__name__}, not a state dict or a training checkpoint")
    args = raw.get("args")
    args = vars(args) if isinstance(args, argparse.Namespace) else (dict(args) if isinstance(args, Mapping) else {})
    chosen, which = _select_weights(raw, weights)
    state = convert_official_state_dict(chosen)
    layout = official_logit_layout(chosen)
    found = recognise_source(state, args, layout)
    source = source or found
    if source not in SOURCES:
        raise UserError(f"--source {source} is unknown; choose {', '.join(SOURCES)}")
    if found in ("repa", "ancre") and source != found:
        raise UserError(f"{src} holds {found}'s weights ({'projectors' if found == 'repa' else 'ANCRe logits'}); "
                        f"import it with --source {found}, not {source}")
    if latent_stats is not None and source != "lightningdit":
        raise UserError("--latent-stats is LightningDiT's latents_stats.pt; the other sources' latents are scaled only")
    diffusion, imported = _flow_source(source, args, state) if source in FLOW_SOURCES else (None, {})
    block: dict[str, Any] = {}
    facts = {"downsample": VAE_DOWNSAMPLE, "data": {"scaling_factor": SD_VAE_SCALING}}
    if source == "lightningdit":
        facts = _lightningdit_source(raw, model, latent_stats)
        state, block = lightningdit_to_ours(state)
        block["patch_size"] = facts["patch_size"]
        diffusion, model, args = facts["diffusion"], facts["name"], {"image_size": facts["image_size"]}

    given, in_file = (n.replace("SiT-", "DiT-") if n else None for n in (model, args.get("model")))  # SiT-XL/2: DiT's
    name = _pick("model", given, in_file)
    if name is None:
        raise UserError(f"{src} does not say which model it holds; pass --model (e.g. --model DiT-XL/2)")
    file_size = args.get("image_size", args.get("resolution"))  # REPA's train.py calls it resolution
    image_size = int(_pick("image_size", image_size, file_size, 256))
    downsample = facts["downsample"]
    if image_size < downsample or image_size % downsample:
        raise UserError(f"--image-size {image_size} must be a positive multiple of {downsample} (the VAE's "
                        f"downsampling), e.g. 256")
    parameterization = args.get("ancre_parameterization")  # the reference code's --ancre-parameterization
    if parameterization not in (None, "Softmax", "Constant"):
        raise UserError(f"{src} was trained with --ancre-parameterization {parameterization}, which has no topology "
                        f"here; Softmax files import as ancre, Constant ones as fixed-dense")
    if parameterization == "Constant":  # frozen zero logits: softmax(0) is fixed-dense's uniform 1/j
        logits = [state.pop(k) for k in [k for k in state if k.startswith("topology.logits.")]]
        state.pop("topology.tau", None)
        if any(bool(v.abs().max() > 0) for v in logits):
            raise UserError(f"{src} says --ancre-parameterization Constant but its logits are not all zero; the "
                            f"file is not what its args say")
        if topology not in (None, "fixed-dense"):
            raise UserError(f"{src} holds a Constant (frozen uniform) topology: import it as fixed-dense, "
                            f"not {topology}")
        topology, layout = "fixed-dense", None
    topology = topology or DEFAULT_TOPOLOGY[layout]
    if layout == "per-source" and topology != "ancre-outgoing":
        raise UserError(f"{src} stores its logits per source (the outgoing-normalisation ablation); import it with "
                        f"--topology ancre-outgoing, not {topology}")
    if layout is None and topology != "cascaded" and parameterization != "Constant":
        raise UserError(f"{src} holds no ANCRe logits (ancre.shortcut_params.*): it is a plain DiT; drop --topology")

    proj, final, table = (state.get(f"{key}.weight")
                          for key in ("x_embedder.proj", "final_layer.linear", "y_embedder.embedding_table"))
    if proj is None or final is None or table is None:
        raise UserError(f"{src} is not a DiT state dict (no x_embedder / final_layer / y_embedder weights)")
    in_channels, patch = int(proj.shape[1]), int(proj.shape[2])
    num_classes = int(args.get("num_classes") or table.shape[0] - 1)
    kwargs: dict[str, Any] = dict(
        topology=topology, input_size=image_size // downsample, in_channels=in_channels, num_classes=num_classes,
        learn_sigma=final.shape[0] == 2 * in_channels * patch * patch,
        class_dropout_prob=0.1 if table.shape[0] == num_classes + 1 else 0.0, **block, **(overrides or {}))
    if (tau_option := topology_entry(topology).options.get("tau")) is not None:
        file_tau = float(state["topology.tau"]) if "topology.tau" in state else args.get("tau")
        kwargs["tau"] = float(_pick("tau", tau, file_tau, tau_option.default))
        state.setdefault("topology.tau", torch.tensor(kwargs["tau"]))
    net = create_model(name, **kwargs)
    if topology == "fixed-dense":  # its frozen weights are the topology's own, not the file's
        state.update({k: v for k, v in net.state_dict().items() if k.startswith("topology.")})
    load_state_dict_checked(net, state, source=str(src))

    # SiT's release keeps DiT's learned-sigma channels, which its forward drops: our flow ignores them too.
    diffusion = diffusion or dict(objective="ddpm", **DDPM_SCHEDULE, learn_sigma=kwargs["learn_sigma"])
    spec = make_model_spec(name, kwargs, diffusion,
                           {"kind": "latents", "image_size": image_size, "image_channels": 3,
                            "num_classes": num_classes, "vae": None, **facts["data"]},
                           step=int(src.stem) if src.stem.isdigit() else int(raw.get("steps", 0) or 0))
    spec["imported"] = {"source": str(src.resolve()), "sha256": sha256_file(src), "weights": which,
                        "logit_layout": layout, "from": source, **imported}
    weights_state = net.state_dict()
    (out / "topology.json").unlink(missing_ok=True)  # an overwritten import's, which may not apply any more
    write_model_files(out, spec, weights_state, weights_state)
    if any(True for _ in net.topology.parameters()):  # a learned topology: for scripts/topology.py
        save_topology_json(out / "topology.json", net.topology.probabilities(), topology=topology, weights=which)
    return spec
