"""Name -> residual topology: the one place a topology name is interpreted. `register_topology` adds a
builder `build(num_blocks, hidden_size, **options)`; `resolve_options` checks the options (config keys)
once, so builders trust them. An entry also declares what tools need to know of the topology, so no code
outside this package tests names or classes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Mapping

import torch
from pydantic import Field, StrictFloat, StrictInt, TypeAdapter, ValidationError

from ...errors import UserError, invalid_value
from .base import ResidualTopology

# Option types, strict as the config's fields are (true is no number, 2.5 no int), with their ranges.
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
PositiveFloat = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]


@dataclass(frozen=True)
class TopologyOption:
    """A topology's hyperparameter: pydantic type with its range or choices (`PositiveFloat`), default, help."""
    type: Any
    default: Any
    help: str = ""
    file: bool = False  # names a file that must exist (checked with the config's other paths)

    def validate(self, key: str, value: Any) -> Any:
        """`value` as this option's type; a UserError naming `key` if it is not one."""
        try:
            return _adapter(self.type).validate_python(value)
        except ValidationError as err:
            raise invalid_value(err, key) from None


_adapter = functools.cache(TypeAdapter)  # one adapter per option type


@dataclass(frozen=True)
class TopologyEntry:
    name: str
    build: Callable[..., ResidualTopology]  # build(num_blocks, hidden_size, **options)
    options: Mapping[str, TopologyOption] = field(default_factory=dict)
    check: Callable[[dict[str, Any]], None] | None = None  # raises UserError on bad option values
    restore: Callable[..., ResidualTopology] | None = None  # (state dict without "topology.", options) -> module
    summary: str = ""
    # What tools need to know (the module declares `takes_time_embedding`, which can depend on its options):
    sparse: bool = False  # it can keep each block's model.topology_topk strongest edges (`enable_topk`, `sparsify`)
    matrix: bool = True  # False: `probabilities()` raises TopologyNotDefined (no topology.json, heatmap, compare)
    incoming_softmax: bool = False  # its rows are softmax distributions: the entropy regulariser applies
    weights_per_time: bool = False  # per token and timestep: `routing_weights()` gives their mean (`show --t`)
    width: bool = False  # its builder needs the model's hidden_size


TOPOLOGIES: dict[str, TopologyEntry] = {}


def register_topology(name: str, *, options: Mapping[str, TopologyOption] | None = None, **fields: Any) -> Callable:
    """Decorator: registers `build(num_blocks, hidden_size, **options)` under `name`; `fields` are the
    other `TopologyEntry` fields (check, restore, summary, sparse, matrix, ...)."""
    def decorator(build: Callable[..., ResidualTopology]) -> Callable[..., ResidualTopology]:
        if name in TOPOLOGIES:
            raise ValueError(f"topology {name!r} is already registered")
        for key, option in (options or {}).items():
            known = all_topology_options().get(key)
            if known is not None and known.type != option.type:
                raise ValueError(f"topology option {key!r} is already registered with another type")
            option.validate(key, option.default)  # a default out of its own range is a bug here
        TOPOLOGIES[name] = TopologyEntry(name, build, dict(options or {}), **fields)
        return build
    return decorator


def unregister_topology(name: str) -> None:
    """Removes a registered topology (for tests that register their own)."""
    TOPOLOGIES.pop(name, None)


def topology_entry(name: str) -> TopologyEntry:
    if name not in TOPOLOGIES:
        raise UserError(f"unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def all_topology_options() -> dict[str, TopologyOption]:
    """Every option any registered topology takes (the config keys they add to `model:`)."""
    options: dict[str, TopologyOption] = {}
    for entry in TOPOLOGIES.values():
        for key, option in entry.options.items():
            options.setdefault(key, option)
    return options


def resolve_options(name: str, given: Mapping[str, Any], prefix: str = "",
                    keep_others: bool = False) -> dict[str, Any]:
    """Topology `name`'s options: its defaults updated by `given`, checked (a UserError names `prefix + key`,
    e.g. "model.tau"), then the entry's check. Other topologies' options are dropped once checked (a config
    always carries `tau`), or kept with `keep_others`; options no topology knows are refused."""
    entry = topology_entry(name)
    registered = all_topology_options()
    unknown = sorted(set(given) - set(registered))
    if unknown:
        raise UserError(f"unknown topology option(s) {', '.join(unknown)}; registered options: "
                        f"{', '.join(sorted(registered)) or '(none)'}")
    given = {key: registered[key].validate(prefix + key, value) for key, value in given.items()}
    options = {key: given.get(key, option.default) for key, option in entry.options.items()}
    if entry.check is not None:
        entry.check(options)
    return {**given, **options} if keep_others else options


def build_topology(name: str, num_blocks: int, hidden_size: int | None = None, **options: Any) -> ResidualTopology:
    """Name -> residual topology for `num_blocks` blocks of width `hidden_size`."""
    entry = topology_entry(name)
    if entry.width and hidden_size is None:
        raise UserError(f"topology {name!r} needs hidden_size=<model width>; build it through create_model")
    return entry.build(num_blocks, hidden_size, **resolve_options(name, options))


def restore_topology(name: str, state: Mapping[str, torch.Tensor],
                     options: Mapping[str, Any] | None = None) -> ResidualTopology | None:
    """The topology rebuilt from a state dict's `topology.*` and options if `name` needs its weights, else None."""
    entry = topology_entry(name)
    if entry.restore is None:
        return None
    own = {key[len("topology."):]: value for key, value in state.items() if key.startswith("topology.")}
    return entry.restore(own, **{k: v for k, v in (options or {}).items() if k in entry.options})
