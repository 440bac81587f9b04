"""The training step makes no host round trip between log steps, counted at the dispatcher.

On a GPU a read of a device value on the host (`.item()`, `float(t)`, `bool(t)`, a 0-d tensor passed
where an op's Scalar overload wants a number), a tensor built from Python data (`torch.tensor(list)`,
an index given as a Python list) and a copy from host memory each wait on or feed the queue; on a
CPU they cost nothing, so no timing shows them. A TorchDispatchMode sees every one of them as the
aten op the GPU would pay for, wherever it comes from, Python or C++ (a Scalar overload's read is
`_local_scalar_dense` below Python). Left out: the data pipeline, which builds host tensors in its
workers (their copy to the device is the one pinned, asynchronous copy of a batch), and the stop
agreement, an all-reduce of a host integer over gloo.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import repa_overrides, tiny_config, tiny_repa_encoder

import ancre_dit
from ancre_dit.models.topologies.base import save_topology_json
from ancre_dit.training import Trainer
from ancre_dit.training.ema import EMA, ema_update_

PACKAGE = Path(ancre_dit.__file__).parent
TORCH = Path(torch.__file__).parent
NOT_COUNTED = (PACKAGE / "data", PACKAGE / "training" / "data.py", PACKAGE / "training" / "stopping.py")
aten = torch.ops.aten
# A read of a device value on the host, or an op whose output shape depends on device values.
READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero, aten._unique2,
         aten.unique_dim, aten.unique_consecutive}
# A tensor made from Python data: built on the host, then copied to the device.
FROM_HOST = {aten.lift_fresh, aten.lift_fresh_copy}
HOST_COPIES = {"tolist", "numpy", "cpu"}
COUNTER_FRAMES = {"record", "__torch_dispatch__", "__torch_function__"}


def _host_round_trip(func, args, kwargs) -> bool:
    if func.overloadpacket in READS or func.overloadpacket in FROM_HOST:
        return True
    if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):  # a boolean mask: nonzero inside
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    # A copy from host memory to another device (never seen on a CPU run; counted where one runs).
    if func.overloadpacket is aten._to_copy:
        device = kwargs.get("device")
        return args[0].device.type == "cpu" and device is not None and torch.device(device).type != "cpu"
    if func.overloadpacket is aten.copy_:
        return args[1].device.type == "cpu" and args[0].device.type != "cpu"
    return False


def _caller() -> str:
    """Where the code outside torch that made the current op stands, or '' where it is not counted."""
    frame = sys._getframe(1)
    while frame is not None and (TORCH in Path(frame.f_code.co_filename).parents
                                 or frame.f_code.co_name in COUNTER_FRAMES and frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = Path(frame.f_code.co_filename)
    if any(path == p or p in path.parents for p in NOT_COUNTED):
        return ""
    return f"{path.relative_to(PACKAGE) if PACKAGE in path.parents else path.name}:{frame.f_lineno}"


class _AtenTrips(TorchDispatchMode):
    def __init__(self, counter: "RoundTripCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.active and _host_round_trip(func, args, kwargs):
            self.counter.record(func)
        return func(*args, **kwargs)


class _HostCopies(TorchFunctionMode):
    """`.tolist()`, `.numpy()` and `.cpu()`: on a CPU tensor they reach no aten op, on a device tensor
    each is a copy to the host."""

    def __init__(self, counter: "RoundTripCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counter.active and getattr(func, "__name__", "") in HOST_COPIES:
            self.counter.record(func.__name__)
        return func(*args, **(kwargs or {}))


class RoundTripCounter:
    """While `active`, records each op a GPU would pay a host round trip for, with the place in the
    code (outside torch) that ran it: in `trips`."""

    def __init__(self):
        self.active = False
        self.trips: list[str] = []
        self._modes = (_HostCopies(self), _AtenTrips(self))

    def record(self, op) -> None:
        where = _caller()
        if where:
            self.trips.append(f"{where} {op}")

    def __enter__(self) -> "RoundTripCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def test_the_counter_sees_what_a_gpu_pays():
    """Each pattern the CPU hides is counted; its device-side form is not."""
    W, w = torch.randn(3, 3), torch.tensor(0.5)
    xs, ys = [torch.zeros(2)], [torch.ones(2)]
    host_patterns = {"foreach Scalar overload": lambda: torch._foreach_lerp_(xs, ys, w),
                     "index by a Python list": lambda: W[1, [0, 2]],
                     "tensor from a list": lambda: torch.tensor([True, False]),
                     "float()": lambda: float(W[0, 0]),
                     ".tolist()": lambda: W.tolist(),
                     "boolean mask": lambda: W[W > 0],
                     "masked assignment": lambda: W.__setitem__(W > 0, 0.0)}
    device_patterns = {"foreach List overload": lambda: torch._foreach_lerp_(xs, ys, [w]),
                       "slice and select": lambda: W[1, 0:2] + W[0:2, 2],
                       "a Python scalar": lambda: W * 0.5}
    for name, run in {**host_patterns, **device_patterns}.items():
        counter = RoundTripCounter()
        with counter:
            counter.active = True
            run()
        assert bool(counter.trips) == (name in host_patterns), (name, counter.trips)


def test_the_ema_update_reads_nothing_and_skips_bitwise():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, 0.9)
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    counter, skip = RoundTripCounter(), torch.tensor(True)
    with counter:
        counter.active = True
        ema_update_(ema, model, 5, skip)
    assert not counter.trips, counter.trips
    assert all(torch.equal(before[k], v) for k, v in ema.module.state_dict().items())  # a skipped step
    ema_update_(ema, model, 5, torch.tensor(False))
    expected = torch.lerp(before["weight"], model.weight.detach(), 0.1)
    assert torch.equal(ema.module.weight, expected)


DEPTH = ("model.depth=4",)
TOPOLOGIES = ("cascaded", "ancre-outgoing", "ancre-unnormalized", "learnable-scalars", "fixed-dense", "first-previous",
              "denseformer", "hc", "hc-dynamic", "mhc", "dar", "attnres")
RECIPES = {
    "ancre": (),
    "clip-warmup": ("train.grad_clip=1.0", "train.ema_warmup=true", "train.warmup_steps=3"),
    "replace": ("model.ancre_mode=replace",),
    "accumulate": ("train.grad_accum=2",),
    "flow": ("diffusion.objective=flow", "model.learn_sigma=false"),
    "bf16": ("train.mixed_precision=bf16",),
    "bf16-history": ("train.mixed_precision=bf16", "model.history_dtype=bfloat16"),
    # sparsified at step 1: the quiet steps run the sparse wiring
    "sparse-top2": ("model.topology_topk=2", "train.topology_sparsify_step=1"),
    # several EMAs and the post-hoc ones in one update, under a decaying lr
    "emas-cosine": ("train.ema_decays=[0.5,0.99]", "train.phema.stds=[0.05,0.1]", "train.phema.snapshot_every=1000",
                    "train.lr_schedule=cosine", "train.min_lr=1e-5"),
    **{name: (f"model.topology={name}",) for name in TOPOLOGIES},
}


def _round_trips_by_step(run_dir: Path, overrides: tuple[str, ...], log_every: int, max_steps: int,
                         monkeypatch) -> dict[int, list[str]]:
    counter = RoundTripCounter()
    by_step: dict[int, list[str]] = defaultdict(list)
    real_step = Trainer.train_step

    def step(self, batches):
        # The trips after step k's train_step (its logging, tasks, stop check) are step k's too:
        # each step's list runs from its train_step to the next one's.
        counter.trips = by_step[self.step + 1]
        return real_step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", step)
    trainer = Trainer(tiny_config(run_dir, *DEPTH, f"train.max_steps={max_steps}", f"train.log_every={log_every}",
                                  "train.ckpt_every=1000", *overrides))
    with counter:
        counter.active = True
        trainer.run()
    return dict(by_step)


@pytest.mark.parametrize("recipe", [*RECIPES, "frozen", "repa"])
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_no_host_round_trip_in_steps_that_log_nothing(tmp_path, monkeypatch, recipe):
    if recipe == "frozen":
        save_topology_json(tmp_path / "topology.json", torch.tril(torch.rand(4, 4)))
        overrides = ("model.topology=frozen", f"model.topology_path={tmp_path / 'topology.json'}")
    elif recipe == "repa":
        overrides = tuple(repa_overrides(tiny_repa_encoder(tmp_path / "vit.safetensors")))
    else:
        overrides = RECIPES[recipe]
    log_every, max_steps = 4, 6
    by_step = _round_trips_by_step(tmp_path / "run", overrides, log_every, max_steps, monkeypatch)
    assert sorted(by_step) == list(range(1, max_steps + 1))
    # The first step fills the device caches (the diffusion tables; a sparse run's new wiring is
    # made at the step-1 switch): a copy each, once per run.
    quiet = {s: trips for s, trips in by_step.items() if s >= 2 and s % log_every and s != max_steps}
    assert sorted(quiet) == [2, 3, 5] and not any(quiet.values()), quiet
    # The counter sees the trips where they belong: the log steps read the terms and the guard's flags.
    assert by_step[log_every] and by_step[max_steps]
