#!/usr/bin/env python3
"""Convergence benchmark on the digits default: residual topologies with everything else equal.

For every seed, each topology starts from the same block weights (the topology module is built
after the blocks and ANCRe's logits start at zero, so it draws no random numbers) and sees the
same batches, timesteps, noise and label dropout. Every `--eval-every` steps the held-out split
is scored with the objective's MSE (epsilon for DDPM, velocity for flow, `--objective`) at ten
fixed times spread over the process and fixed noise. The script reports mean and
spread over seeds, and how many steps each topology needs to reach the first topology's final
held-out loss (the paper's "steps to the baseline").

A plain loop (model + objective + AdamW + EMA), not the Accelerate trainer, so the numbers
measure the architecture, not the framework.

    python scripts/bench_convergence.py --topologies cascaded ancre --depth 12 --tau 0.01 0.1 \
        --seeds 0 1 2 --steps 800 --out benchmarks/results/convergence
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ancre_dit.cli import run_cli
from ancre_dit.errors import UserError
from ancre_dit.data.digits import DIGITS_IMAGE_SIZE, DIGITS_NUM_CLASSES, DigitsDataset
from ancre_dit.diffusion import OBJECTIVES, Objective, build_objective
from ancre_dit.models import TOPOLOGIES, TopologyNotDefined, create_model, save_topology_json

# Fixed times of the held-out score, spread over the whole process like the training loss
# (the objective's evaluation_times: DDPM timesteps 50, 150, ..., 950; flow t = 0.05, ..., 0.95).
EVAL_TIMES = 10
EVAL_NOISE_SEED = 1234  # the same held-out noise for every seed, topology and run


@dataclass
class RunConfig:
    topology: str = "ancre"
    tau: float = 0.01
    depth: int = 12
    width: int = 64
    heads: int = 2
    patch: int = 2
    batch_size: int = 32
    lr: float = 1e-3
    ema_decay: float = 0.995
    learn_sigma: bool = True
    objective: str = "ddpm"
    time_sampling: str = "uniform"
    class_dropout: float = 0.1
    steps: int = 800
    eval_every: int = 100
    seed: int = 0
    topology_path: str | None = None  # the topology.json of a `frozen` run


@dataclass
class RunResult:
    config: dict
    steps: list[int] = field(default_factory=list)
    heldout_mse: list[float] = field(default_factory=list)
    heldout_mse_ema: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    topology: list[list[float]] | None = None


def build_model(cfg: RunConfig) -> torch.nn.Module:
    """The digits DiT; seeded so every topology of one seed starts from the same block weights."""
    torch.manual_seed(cfg.seed)
    extra = {"topology_path": cfg.topology_path} if cfg.topology_path is not None else {}
    return create_model(f"DiT-T/{cfg.patch}", depth=cfg.depth, hidden_size=cfg.width, num_heads=cfg.heads,
                        topology=cfg.topology, tau=cfg.tau, input_size=DIGITS_IMAGE_SIZE, in_channels=1,
                        num_classes=DIGITS_NUM_CLASSES, learn_sigma=cfg.learn_sigma,
                        class_dropout_prob=cfg.class_dropout, **extra)


def build_run_objective(cfg: RunConfig) -> Objective:
    return build_objective({"objective": cfg.objective, "learn_sigma": cfg.learn_sigma,
                            "time_sampling": cfg.time_sampling})


def heldout_batch(heldout: DigitsDataset, objective: Objective) -> tuple[torch.Tensor, ...]:
    """Every held-out image at every evaluation time, with noise fixed by EVAL_NOISE_SEED."""
    times = objective.evaluation_times(EVAL_TIMES)
    n, k = len(heldout), len(times)
    x0 = heldout.images.repeat(k, 1, 1, 1)
    y = heldout.labels.repeat(k)
    t = times.repeat_interleave(n)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(EVAL_NOISE_SEED))
    return x0, y, t, noise


@torch.no_grad()
def heldout_mse(model: torch.nn.Module, objective: Objective, batch, chunk: int = 1080) -> float:
    """Mean MSE of the objective's target over the fixed held-out (image, t, noise) triples, labels kept (eval mode)."""
    was_training = model.training
    model.eval()
    x0, y, t, noise = batch
    total = 0.0
    for s in range(0, len(x0), chunk):
        out = objective.losses(model, x0[s:s + chunk], y[s:s + chunk], (t[s:s + chunk], noise[s:s + chunk]))
        total += out["mse"].sum().item()
    model.train(was_training)
    return total / len(x0)


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """EMA of every parameter, the topology logits included (frozen ones are constant anyway)."""
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 1.0 - decay)


def train_run(cfg: RunConfig, train: DigitsDataset, heldout: DigitsDataset | None = None,
              progress: tqdm | None = None) -> tuple[RunResult, torch.nn.Module, torch.nn.Module]:
    """Trains one model; returns the result record, the model and its EMA."""
    model = build_model(cfg)
    ema = copy.deepcopy(model).requires_grad_(False)
    objective = build_run_objective(cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    # Data order, timesteps and noise come from a generator of their own, so they are the same
    # for every topology; the global RNG (label dropout) is reseeded for the same reason.
    data_gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    torch.manual_seed(20_000 + cfg.seed)
    batch = heldout_batch(heldout, objective) if heldout is not None else None
    result = RunResult(config=asdict(cfg))
    order, cursor, running, count = torch.randperm(len(train), generator=data_gen), 0, 0.0, 0
    start = time.perf_counter()
    model.train()
    for step in range(1, cfg.steps + 1):
        if cursor + cfg.batch_size > len(order):  # new epoch: fresh permutation, drop the remainder
            order, cursor = torch.randperm(len(train), generator=data_gen), 0
        idx = order[cursor:cursor + cfg.batch_size]
        cursor += cfg.batch_size
        x0, y = train.images[idx], train.labels[idx]
        loss = objective.losses(model, x0, y, objective.draw(x0, data_gen))["loss"].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ema_update(ema, model, cfg.ema_decay)
        running, count = running + loss.item(), count + 1
        if batch is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            result.steps.append(step)
            result.heldout_mse.append(heldout_mse(model, objective, batch))
            result.train_loss.append(running / count)
            running, count = 0.0, 0
        if progress is not None:
            progress.update(1)
    result.seconds = time.perf_counter() - start
    if batch is not None:  # the EMA only at the end: scoring it every time would double the cost
        result.heldout_mse_ema.append(heldout_mse(ema, objective, batch))
    try:
        result.topology = model.topology.probabilities().detach().tolist()
    except TopologyNotDefined:  # n-stream schemes (HC, mHC) have no block-to-block matrix
        result.topology = None
    return result, model, ema


def steps_to_reach(steps: list[int], curve: np.ndarray, target: float) -> int | None:
    """First evaluated step at which `curve` is at or below `target` (None if never)."""
    hits = np.nonzero(curve <= target)[0]
    return int(steps[hits[0]]) if len(hits) else None


def label_of(topology: str, tau: float, taus_matter: bool) -> str:
    return f"{topology} tau={tau:g}" if taus_matter else topology


def summarize(results: dict[str, list[RunResult]], baseline: str) -> str:
    """Mean +- std table of the held-out MSE per evaluation step, then steps to the baseline."""
    steps = next(iter(results.values()))[0].steps
    lines = ["held-out MSE (raw weights), mean +- std over seeds"]
    width = max(max(len(k) for k in results) + 2, 10)  # a value "0.1234 +- 0.0012" needs 16 + 2 columns
    lines.append("step".rjust(6) + "".join(k.rjust(width + 8) for k in results))
    curves = {k: np.array([r.heldout_mse for r in runs]) for k, runs in results.items()}
    for n, step in enumerate(steps):
        row = str(step).rjust(6)
        for k, c in curves.items():
            row += f"{c[:, n].mean():.4f} +- {c[:, n].std():.4f}".rjust(width + 8)
        lines.append(row)
    lines.append("held-out MSE (EMA weights) at the last step, mean +- std")
    for k, runs in results.items():
        e = np.array([r.heldout_mse_ema[-1] for r in runs])
        lines.append(f"  {k}: {e.mean():.4f} +- {e.std():.4f}")
    base_final = curves[baseline][:, -1].mean()
    lines.append(f"steps to the baseline ({baseline}'s final mean held-out MSE {base_final:.4f}):")
    for k, c in curves.items():
        mean_hit = steps_to_reach(steps, c.mean(axis=0), base_final)
        # Per seed: against the baseline's final loss of the same seed (same init and data).
        per_seed = [steps_to_reach(steps, c[s], curves[baseline][s, -1]) for s in range(len(c))]
        seeds = ", ".join("never" if h is None else str(h) for h in per_seed)
        reach = "not reached" if mean_hit is None else f"{mean_hit} steps ({100 * mean_hit / steps[-1]:.0f}% of {steps[-1]})"
        lines.append(f"  {k}: mean curve {reach}; per seed (vs that seed's baseline): {seeds}")
    secs = {k: np.mean([r.seconds for r in runs]) for k, runs in results.items()}
    lines.append("mean wall time per run: " + ", ".join(f"{k} {s:.0f}s" for k, s in secs.items()))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Digits convergence benchmark: residual topologies, everything else equal.")
    p.add_argument("--topologies", nargs="+", default=["cascaded", "ancre"],
                   help="the first one is the baseline of 'steps to the baseline'")
    p.add_argument("--depth", type=int, nargs="+", default=[12], help="one or more depths, run one after another")
    p.add_argument("--tau", type=float, nargs="+", default=[0.01, 0.1],
                   help="taus for topologies that have one (ANCRe and its variants)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema-decay", type=float, default=0.995,
                   help="short runs need a short EMA: 0.999 keeps 0.999^steps of the initial weights")
    p.add_argument("--fixed-sigma", action="store_true", help="MSE only (default: learned sigma, hybrid loss)")
    p.add_argument("--objective", choices=OBJECTIVES, default="ddpm",
                   help="ddpm (epsilon MSE) or flow (velocity MSE; implies --fixed-sigma)")
    p.add_argument("--time-sampling", choices=("uniform", "logit-normal"), default="uniform", help="flow's training time")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/convergence"))
    return p.parse_args()


TAU_TOPOLOGIES = {name for name, entry in TOPOLOGIES.items() if "tau" in entry.options}


def main() -> None:
    args = parse_args()
    for name in args.topologies:
        if name not in TOPOLOGIES:
            raise UserError(f"unknown topology {name!r}; choose from {', '.join(TOPOLOGIES)}")
    if args.eval_every <= 0 or args.steps < args.eval_every:
        raise UserError("--eval-every must be positive and at most --steps")
    if args.threads:
        torch.set_num_threads(args.threads)
    train, heldout = DigitsDataset("train"), DigitsDataset("heldout")
    (args.out / "topologies").mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    settings = [(t, tau) for t in args.topologies for tau in (args.tau if t in TAU_TOPOLOGIES else [args.tau[0]])]
    taus_matter = len(args.tau) > 1
    print(f"convergence benchmark {stamp}: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"digits {len(train)} train / {len(heldout)} held-out; width {args.width}, heads {args.heads}, "
          f"batch {args.batch_size}, AdamW lr {args.lr:g}, EMA {args.ema_decay:g}, "
          f"{'learned' if not args.fixed_sigma and args.objective == 'ddpm' else 'no learned'} sigma, {args.steps} steps, seeds {args.seeds}, "
          f"{args.objective} objective, held-out times "
          f"{build_objective({'objective': args.objective, 'learn_sigma': False}).evaluation_times(EVAL_TIMES).tolist()}")
    everything = {}
    for depth in args.depth:
        results: dict[str, list[RunResult]] = {}
        total = len(settings) * len(args.seeds) * args.steps
        with tqdm(total=total, desc=f"depth {depth}", unit="step") as bar:
            for seed in args.seeds:
                for topology, tau in settings:
                    cfg = RunConfig(topology=topology, tau=tau, depth=depth, width=args.width, heads=args.heads,
                                    batch_size=args.batch_size, lr=args.lr, ema_decay=args.ema_decay,
                                    learn_sigma=not args.fixed_sigma and args.objective == "ddpm",
                                    objective=args.objective, time_sampling=args.time_sampling, steps=args.steps,
                                    eval_every=args.eval_every, seed=seed, topology_path=args.topology_path)
                    result, _, _ = train_run(cfg, train, heldout, progress=bar)
                    if result.topology is not None and topology != "cascaded":  # for scripts/topology.py
                        save_topology_json(args.out / "topologies" / f"{topology}_tau{tau:g}_depth{depth}_seed{seed}.json",
                                           torch.tensor(result.topology), topology=topology, seed=seed, depth=depth)
                    results.setdefault(label_of(topology, tau, taus_matter and topology in TAU_TOPOLOGIES),
                                       []).append(result)
        baseline = label_of(*settings[0], taus_matter and settings[0][0] in TAU_TOPOLOGIES)
        print(f"\n=== depth {depth} ===")
        print(summarize(results, baseline))
        from ancre_dit.figures import plot_loss_curve  # matplotlib only when plotting

        steps = results[baseline][0].steps
        png = plot_loss_curve(steps, {k: [r.heldout_mse for r in runs] for k, runs in results.items()},
                              args.out / f"convergence_depth{depth}.png", ylabel=f"held-out {args.objective} MSE",
                              title=f"digits, depth {depth}, width {args.width}, {len(args.seeds)} seeds (mean +- std)")
        print(f"curves: {png}")
        everything[f"depth{depth}"] = {k: [asdict(r) for r in runs] for k, runs in results.items()}
    raw = args.out / "convergence.json"
    raw.write_text(json.dumps({"date": stamp, "args": {k: str(v) if isinstance(v, Path) else v
                                                        for k, v in vars(args).items()},
                               "runs": everything}, indent=1))
    print(f"raw results: {raw}")


if __name__ == "__main__":
    run_cli(main)
