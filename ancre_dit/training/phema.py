"""Post-hoc EMA (Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion Models"):
power-function EMAs tracked during training, and the EMA of any length rebuilt from their snapshots.

A power-function EMA with exponent g, read at step t, averages the weights of steps s in [0, t] with
density p(s) = (g + 1) s^g / t^(g + 1), of relative std sqrt((g + 1) / ((g + 2)^2 (g + 3))) (EDM2: 0.05
to 0.10); tracking it is one lerp a step with beta_t = (1 - 1/t)^(g + 1). The EMA of another std at
step T is the combination of snapshots whose density is closest to the target's in L2: a linear solve
of their inner products (the paper's equations, counted in steps rather than images seen).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import UserError
from ..files import write_atomic
from .ema import EMA, ema_names


MAX_STD = 12 ** -0.5  # g = 0, the plain average, is the widest profile: std 1/sqrt(12)


def check_std(std: float, name: str = "std") -> None:
    """A power-function EMA's std lies in (0, MAX_STD); `name`: what the caller calls it."""
    if not 0 < std < MAX_STD:
        raise UserError(f"{name} holds {std:g}; a power-function EMA's std lies in (0, {MAX_STD:.4f}) (EDM2 "
                        "tracks 0.05 and 0.10)")


@lru_cache(maxsize=None)  # read at every step by the tracking rule
def exponent_of_std(std: float) -> float:
    """The exponent g whose profile has relative standard deviation `std`: the largest real root of
    std^2 (g + 2)^2 (g + 3) = g + 1, a cubic in g."""
    check_std(std)
    k = std ** -2
    roots = np.roots([1.0, 7.0, 16.0 - k, 12.0 - k])
    return float(roots[np.abs(roots.imag) < 1e-9].real.max())


def std_of_exponent(exponent: float) -> float:
    return float(np.sqrt((exponent + 1) / ((exponent + 2) ** 2 * (exponent + 3))))


def tracking_beta(std: float, step: int) -> float:
    """The decay of the update at optimizer step `step` (1-based) that keeps the EMA on the profile."""
    return (1.0 - 1.0 / step) ** (exponent_of_std(std) + 1.0)


def profile_inner_product(t_a: np.ndarray, g_a: np.ndarray, t_b: np.ndarray, g_b: np.ndarray) -> np.ndarray:
    """The integral of p_a(s) p_b(s) over s, for profiles read at t_a, t_b with exponents g_a, g_b:
    (g_a + 1)(g_b + 1) m^(g_a + g_b + 1) / ((g_a + g_b + 1) t_a^(g_a + 1) t_b^(g_b + 1)), m = min(t_a, t_b),
    computed as ratios to m so that large exponents do not overflow."""
    m = np.minimum(t_a, t_b)
    return ((g_a + 1) * (g_b + 1) / (g_a + g_b + 1) * (m / t_a) ** (g_a + 1) * (m / t_b) ** (g_b + 1) / m)


def reconstruction_weights(snapshot_steps: Sequence[int], snapshot_stds: Sequence[float], target_step: int,
                           target_std: float) -> np.ndarray:
    """The weights x (one per snapshot, summing to 1) of the snapshots' combination whose profile is
    closest to the target's: A x = b with A the snapshots' inner products and b theirs with the target."""
    t = np.asarray(snapshot_steps, dtype=np.float64)
    g = np.array([exponent_of_std(s) for s in snapshot_stds])
    gram = profile_inner_product(t[:, None], g[:, None], t[None, :], g[None, :])
    target = profile_inner_product(t, g, np.float64(target_step), np.float64(exponent_of_std(target_std)))
    x = np.linalg.solve(gram, target)
    return x / x.sum()


def check_ema_choices(train, evaluated: list[str]) -> None:
    """Each EMA kept once (its weights file is named by its decay), `evaluated` (eval.emas) among them, and
    train.phema's stds inside a power-function profile's range, distinct, with a snapshot period."""
    for d in train.ema_decays:
        if d == train.ema_decay or train.ema_decays.count(d) > 1:
            what = "the decay of train.ema_decay" if d == train.ema_decay else "given twice"
            raise UserError(f"train.ema_decays holds {d:g}, {what}; keep each EMA once")
    kept = ema_names(train)
    for name in evaluated:
        if name not in kept:
            raise UserError(f"eval.emas names {name}, which this run does not keep; choose from {', '.join(kept)} "
                            "(more with train.ema_decays or train.phema.stds)")
    stds, snapshot_every = train.phema.stds, train.phema.snapshot_every
    for std in stds:
        check_std(std, "train.phema.stds")
    if len(set(stds)) != len(stds):
        raise UserError(f"train.phema.stds {list(stds)} repeats a std; give each once")
    if stds and not snapshot_every:
        raise UserError("train.phema.stds needs train.phema.snapshot_every (steps between snapshots; the "
                        "reconstruction wants a few hundred of them over a run)")
    if snapshot_every and not stds:
        raise UserError("train.phema.snapshot_every needs train.phema.stds (e.g. [0.05, 0.10])")


class PowerFunctionEMA(EMA):
    """An EMA on the power-function profile of relative std `std`: its decay follows the step count."""

    def __init__(self, model: torch.nn.Module, std: float):
        super().__init__(model, decay=0.0)
        self.std = std

    def decay(self, updates: int) -> float:
        return tracking_beta(self.std, updates + 1)


SNAPSHOT_DIR = "phema"  # RUN/phema/<step>.safetensors: every tracked std's weights at one step


def write_snapshot(run_dir: Path, step: int, emas: dict[float, dict[str, torch.Tensor]]) -> Path:
    """One file per step, keys "<std>/<name>", written atomically (a kill leaves no half snapshot)."""
    from safetensors.torch import save

    folder = Path(run_dir) / SNAPSHOT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"{std:g}/{k}": v.detach().cpu().contiguous() for std, state in emas.items() for k, v in state.items()}
    path = folder / f"{step:07d}.safetensors"
    write_atomic(path, save(tensors, metadata={"step": str(step), "stds": json.dumps(sorted(emas))}))
    return path


def reconstruct(run_dir: Path, std: float, at: int | None = None, name: str = "--std"
                ) -> tuple[dict[str, torch.Tensor], int, list[int]]:
    """The EMA of length `std` (`name`: what the caller calls it) at step `at` (default: the last snapshot), rebuilt
    from the snapshots up to it: (state dict, step, snapshot steps used); non-float tensors are the last one's."""
    from safetensors import safe_open

    check_std(std, name)
    folder = Path(run_dir) / SNAPSHOT_DIR
    steps = sorted(int(p.stem) for p in folder.glob("*.safetensors") if p.stem.isdigit())
    steps = [s for s in steps if at is None or s <= at]
    if not steps:
        raise UserError(f"no post-hoc EMA snapshots in {folder}{f' up to step {at}' if at is not None else ''}; "
                        "train with train.phema.stds and train.phema.snapshot_every")
    target = steps[-1] if at is None else at
    snapshots = []  # (the stds a snapshot holds, its tensors "<std>/<name>")
    for s in steps:
        with safe_open(str(folder / f"{s:07d}.safetensors"), framework="pt") as f:
            snapshots.append((json.loads(f.metadata()["stds"]), {k: f.get_tensor(k) for k in f.keys()}))
    tracked = [(i, d) for i, (stds, _) in enumerate(snapshots) for d in stds]
    weights = reconstruction_weights([steps[i] for i, _ in tracked], [d for _, d in tracked], target, std)
    last_stds, last = snapshots[-1]
    out = {}
    for name in sorted({key.split("/", 1)[1] for key in last}):
        reference = last[f"{last_stds[0]:g}/{name}"]
        if not reference.is_floating_point():
            out[name] = reference
            continue
        total = sum(float(w) * snapshots[i][1][f"{d:g}/{name}"].double() for w, (i, d) in zip(weights, tracked))
        out[name] = total.to(reference.dtype)
    return out, target, steps


def write_reconstruction(run_dir: Path, std: float, at: int | None, out: Path) -> dict:
    """A checkpoint folder (model_spec.json + ema.safetensors) holding the rebuilt EMA, read like any other; its
    spec (returned) is the run's newest checkpoint's, at the step rebuilt, with the std and snapshots."""
    from ..checkpoint import SPEC_FILE, WEIGHT_FILES, load_model_spec, save_safetensors
    from .checkpointing import list_checkpoints

    state, step, steps = reconstruct(run_dir, std, at)
    found = list_checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir} has no checkpoint to take the model's spec from; train until its first "
                        "checkpoint (train.ckpt_every)")
    spec = {**load_model_spec(found[-1][1]), "step": step,
            "posthoc_ema": {"std": std, "snapshots": len(steps), "first": steps[0], "last": steps[-1]}}
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, out / WEIGHT_FILES["ema"])
    write_atomic(out / SPEC_FILE, json.dumps(spec, indent=1).encode())  # last: the folder is complete
    return spec
