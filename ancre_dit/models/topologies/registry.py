"""Name -> residual topology: the one place a topology name is interpreted.

A topology module registers a builder with the options (config keys) it takes:

    @register_topology("ancre", options={"tau": TopologyOption(float, 0.01, "softmax temperature", positive=True)},
                       summary="ANCRe: ingoing softmax over all earlier outputs")
    def build_ancre(num_blocks: int, hidden_size: int | None, tau: float) -> ResidualTopology: ...

The model (`create_model(..., topology="ancre", tau=0.1)`), the training config (`model.tau=0.1`),
the trainer and the checkpoint loader all ask this registry; none of them tests names. (timm's
`register_model` idea, reduced to a dict: no metaclasses.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ...errors import UserError

if TYPE_CHECKING:
    import torch

    from .base import ResidualTopology


@dataclass(frozen=True)
class TopologyOption:
    """A hyperparameter a topology takes: its type (bool, int, float or str), default and help."""
    type: type
    default: Any
    help: str = ""
    optional: bool = False  # None is allowed (e.g. a path that only some uses need)
    minimum: float | None = None  # smallest valid value (numbers)
    positive: bool = False        # must be > 0 (numbers)
    choices: tuple[str, ...] | None = None  # the valid values (strings)
    file: bool = False  # names a file that must exist (checked with the config's other paths)

    def check(self, name: str, value: Any) -> None:
        """A UserError naming `name` if `value` is out of this option's range."""
        if self.choices is not None and value is not None and value not in self.choices:
            raise UserError(f"{name} must be one of {', '.join(self.choices)}, got {value!r}")
        if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        if not math.isfinite(value):
            raise UserError(f"{name} must be a finite number, got {value}")
        if self.positive and not value > 0:
            raise UserError(f"{name} must be positive, got {value}")
        if self.minimum is not None and value < self.minimum:
            raise UserError(f"{name} must be at least {self.minimum:g}, got {value}")


@dataclass(frozen=True)
class TopologyEntry:
    name: str
    build: Callable[..., "ResidualTopology"]  # build(num_blocks, hidden_size, **options)
    options: Mapping[str, TopologyOption] = field(default_factory=dict)
    check: Callable[[dict[str, Any]], None] | None = None  # raises UserError on bad option values
    # Rebuilds the module from its own state dict (keys without the "topology." prefix) and its
    # options when the options alone are not enough, e.g. a frozen topology whose JSON is gone.
    restore: Callable[..., "ResidualTopology"] | None = None
    summary: str = ""
    # True: it can drop to each block's model.topology_topk strongest incoming edges after
    # train.topology_sparsify_step (its module has `enable_topk` and `sparsify`).
    sparse: bool = False


TOPOLOGIES: dict[str, TopologyEntry] = {}


def register_topology(name: str, *, options: Mapping[str, TopologyOption] | None = None,
                      check: Callable[[dict[str, Any]], None] | None = None,
                      restore: Callable[..., "ResidualTopology"] | None = None,
                      summary: str = "", sparse: bool = False) -> Callable:
    """Decorator: registers `build(num_blocks, hidden_size, **options)` under `name`."""
    def decorator(build: Callable[..., "ResidualTopology"]) -> Callable[..., "ResidualTopology"]:
        if name in TOPOLOGIES:
            raise ValueError(f"topology {name!r} is already registered")
        for key, option in (options or {}).items():
            known = all_topology_options().get(key)
            if known is not None and known.type is not option.type:
                raise ValueError(f"topology option {key!r} is already registered with type {known.type.__name__}")
        TOPOLOGIES[name] = TopologyEntry(name, build, dict(options or {}), check, restore, summary, sparse)
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


def resolve_options(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The options topology `name` is built with: its defaults updated by `given`.

    Options that belong to other topologies are ignored (a config or an older checkpoint spec
    always carries `tau`, for example), options no topology knows are refused, and the
    topology's own check runs on the result."""
    entry = topology_entry(name)
    unknown = sorted(set(given) - set(all_topology_options()))
    if unknown:
        raise UserError(f"unknown topology option(s) {', '.join(unknown)}; registered options: "
                        f"{', '.join(sorted(all_topology_options())) or '(none)'}")
    options = {key: given.get(key, option.default) for key, option in entry.options.items()}
    for key, option in entry.options.items():
        option.check(key, options[key])
    if entry.check is not None:
        entry.check(options)
    return options


def build_topology(name: str, num_blocks: int, hidden_size: int | None = None, **options: Any) -> "ResidualTopology":
    """Name -> residual topology for `num_blocks` blocks of width `hidden_size`."""
    return topology_entry(name).build(num_blocks, hidden_size, **resolve_options(name, options))


def restore_topology(name: str, state: Mapping[str, "torch.Tensor"],
                     options: Mapping[str, Any] | None = None) -> "ResidualTopology | None":
    """The topology rebuilt from a model state dict (keys `topology.*`) and the options it was built
    with, if `name` needs its weights to rebuild itself, else None (build it from its options as usual)."""
    entry = topology_entry(name)
    if entry.restore is None:
        return None
    own = {key[len("topology."):]: value for key, value in state.items() if key.startswith("topology.")}
    return entry.restore(own, **{k: v for k, v in (options or {}).items() if k in entry.options})
