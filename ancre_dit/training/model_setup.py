"""The network a training config builds: create_model's keyword arguments from the config's model
section and the data's shape (one function, so what a run trains and what a study's cost estimate
counts, ancre_dit.studies.costs, are the same model), the same network built on the meta device to
check the config, the objective's spec, and the optimizer's parameter groups."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import MissingFileError, UserError
from ..models import create_model
from ..models.dit import ARCHITECTURE_DEFAULTS, model_size
from ..models.topologies import all_topology_options, resolve_options, topology_entry
from ..models.topologies.aggregation import check_aggregation_kernel
from .config_sections import Config, ModelConfig


def model_kwargs(m: ModelConfig, input_size: int, in_channels: int, num_classes: int) -> dict[str, Any]:
    """create_model(m.name, **model_kwargs(...)) is the run's network."""
    kwargs: dict[str, Any] = dict(topology=m.topology, input_size=input_size, in_channels=in_channels,
                                  num_classes=num_classes, learn_sigma=m.learn_sigma,
                                  class_dropout_prob=m.class_dropout, **topology_options_of(m))
    kwargs.update({key: getattr(m, key) for key in ("depth", "hidden_size", "num_heads", "patch_size")
                   if getattr(m, key) is not None})
    # The architecture choices only where they differ from the DiT's defaults: specs of default runs
    # (and of runs from before a choice existed) stay what they were, so those runs resume.
    kwargs.update({key: getattr(m, key) for key, default in ARCHITECTURE_DEFAULTS.items()
                   if getattr(m, key) != default})
    return kwargs


def diffusion_spec(config: Config) -> dict[str, Any]:
    """The diffusion section as the spec `ancre_dit.diffusion.build_objective` reads."""
    return {**dataclasses.asdict(config.diffusion), "learn_sigma": config.model.learn_sigma}


def topology_options_of(m: ModelConfig) -> dict[str, Any]:
    """The options the chosen topology is built with: those given, else its defaults."""
    options = topology_entry(m.topology).options
    return {key: m.topology_options.get(key, option.default) for key, option in options.items()}


def check_model(config: Config, found: Callable[..., bool]) -> None:
    """At config load: the network on the meta device, so its size, layers, topology and aggregation settings
    check themselves (the data's shape, build_data's check, a stand-in); records model.topology_options.
    `found`: validate_config's (a topology's file missing where paths are not checked skips the build)."""
    m = config.model
    if not _resolve_topology_options(m, found):
        return
    if m.topology_entropy_weight and not topology_entry(m.topology).incoming_softmax:
        raise UserError(f"model.topology_entropy_weight needs the ancre topology (a learned softmax over each "
                        f"block's incoming edges), not {m.topology}; set it to 0 or use model.topology=ancre")
    kwargs = model_kwargs(m, input_size=8 * (m.patch_size or 1), in_channels=4, num_classes=10)  # a fitting stand-in
    # The topology on the CPU (small; some read their values at build; its options checked above), the rest on meta.
    size = {**model_size(m.name), **kwargs}
    kwargs["topology"] = topology_entry(m.topology).build(size["depth"], size["hidden_size"], **topology_options_of(m))
    with torch.device("meta"):
        model = create_model(m.name, **kwargs)
    check_aggregation_kernel(m.aggregation_kernel, cuda=torch.cuda.is_available())  # where the run will be
    blocks = len(model.blocks)
    if config.repa.weight and config.repa.depth > blocks:
        raise UserError(f"repa.depth={config.repa.depth} is beyond the {blocks} blocks of {m.name}; choose "
                        f"1..{blocks} (REPA aligns block 8 of 12-block models)")


def _resolve_topology_options(m: ModelConfig, found: Callable[..., bool]) -> bool:
    """Checks the topology options given and the files they name; records them with the defaults, in the registry's
    order (byte-stable config.yaml), others' as given. False when a file it names is missing here (unchecked)."""
    resolved = resolve_options(m.topology, m.topology_options, prefix="model.", keep_others=True)
    files = {key: option for key, option in topology_entry(m.topology).options.items()
             if option.file and resolved[key] is not None}
    for key, option in files.items():
        if not found(f"model.{key}", resolved[key]):
            raise MissingFileError(f"model.{key} {resolved[key]} not found; pass an existing file ({option.help})")
    m.topology_options = {key: resolved[key] for key in all_topology_options() if key in resolved}
    return all(Path(resolved[key]).is_file() for key in files)


def param_groups(model, weight_decay_of_routing: float, extra=None) -> tuple[list[dict[str, Any]], int | None]:
    """AdamW's groups of trainable parameters: the backbone, the topology's routing parameters (own weight decay and
    lr), then `extra`'s (REPA's projector), empty ones left out; and the routing group's index (None: empty)."""
    routing = {id(p) for p in model.topology.routing_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if id(p) not in routing]},
              {"params": [p for p in trainable if id(p) in routing], "weight_decay": weight_decay_of_routing}]
    routing_group = 1 if groups[0]["params"] and groups[1]["params"] else (0 if groups[1]["params"] else None)
    if extra is not None:
        groups.append({"params": list(extra.parameters())})
    return [g for g in groups if g["params"]], routing_group
