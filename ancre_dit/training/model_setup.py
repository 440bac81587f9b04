"""The network and objective a training config builds: create_model's keyword arguments from the config's model
section and the data's shape (one function, so what a run trains and what a study's cost estimate
counts, ancre_dit.studies.costs, are the same model), and the optimizer's parameter groups."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..models.dit import ARCHITECTURE_DEFAULTS
from ..models.topologies import topology_entry
from .config_sections import Config, ModelConfig


def model_kwargs(m: ModelConfig, input_size: int, in_channels: int, num_classes: int) -> dict[str, Any]:
    """create_model(m.name, **model_kwargs(...)) is the run's network."""
    kwargs: dict[str, Any] = dict(topology=m.topology, input_size=input_size, in_channels=in_channels,
                                  num_classes=num_classes, learn_sigma=m.learn_sigma,
                                  class_dropout_prob=m.class_dropout, **topology_options_of(m))
    for key in ("depth", "hidden_size", "num_heads", "patch_size"):
        if getattr(m, key) is not None:
            kwargs[key] = getattr(m, key)
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


def param_groups(model, weight_decay_of_routing: float, extra=None) -> tuple[list[dict[str, Any]], int | None]:
    """AdamW's groups of trainable parameters: the backbone, the topology's routing parameters (their
    own weight decay and lr), then `extra`'s (REPA's projector). Empty groups are left out; returns
    the groups and the index of the routing group (None when it is empty)."""
    routing = {id(p) for p in model.topology.routing_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if id(p) not in routing]},
              {"params": [p for p in trainable if id(p) in routing], "weight_decay": weight_decay_of_routing}]
    routing_group = 1 if groups[0]["params"] and groups[1]["params"] else (0 if groups[1]["params"] else None)
    if extra is not None:
        groups.append({"params": list(extra.parameters())})
    return [g for g in groups if g["params"]], routing_group
