"""Plain helpers shared by the tests and by the scripts they launch (not collected).

Importable as ``helpers``: pyproject's ``[tool.pytest.ini_options] pythonpath = ["tests"]`` puts this
folder on sys.path, and a script run from this folder (``_dist_train.py``) has it there by default.
It is not a ``tests`` package on purpose: torch-fidelity installs a top-level ``tests`` package of
its own, which ``import tests.helpers`` could pick up instead. conftest.py wraps these as fixtures.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ancre_dit.models import create_model
from ancre_dit.training.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]

# The one tiny DiT of the suite, shaped for the 8x8 one-channel digits: 2 blocks of width 32.
TINY_NAME = "DiT-T/2"
TINY_DIT = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, in_channels=1, num_classes=10)

# The same model as training-config overrides (input size, channels and classes come from the
# digits data), with settings that run many CPU steps per second and log every step.
TINY_TRAIN = [f"model.name={TINY_NAME}", f"model.depth={TINY_DIT['depth']}",
              f"model.hidden_size={TINY_DIT['hidden_size']}", f"model.num_heads={TINY_DIT['num_heads']}",
              "model.topology=ancre", "data.kind=digits", "data.image_size=8", "data.num_workers=0",
              "train.global_batch_size=16", "train.lr=1e-3", "train.ema_decay=0.9", "train.mixed_precision=no",
              "train.log_every=1", "train.sample_every=0", "train.ckpt_every=1000", "log.tensorboard=false",
              "train.diagnostics=false",  # tests/test_diagnostics.py turns them on
              "log.figures=false"]  # the tests of each figure turn them on


def tiny_model(topology: str = "ancre", seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny DiT with the given topology, built after seeding torch with ``seed``; any DiT
    argument (depth=4, learn_sigma=False, hc_streams=3, ...) overrides TINY_DIT."""
    torch.manual_seed(seed)
    return create_model(TINY_NAME, **{**TINY_DIT, "topology": topology, **overrides})


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """adaLN-Zero makes every block the identity at init; random weights make the tests meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "final_layer" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def inputs(n: int = 3, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n (<= 3) digits-shaped inputs, timesteps spanning the schedule, labels including the null class."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.tensor([0, 10, 999][:n]), torch.tensor([1, 5, 10][:n])


def tiny_overrides(*overrides: str) -> list[str]:
    """TINY_TRAIN with overrides on top, each key once with the last value, as a command line
    must give it (train.py refuses a key given twice)."""
    merged = {item.partition("=")[0]: item for item in [*TINY_TRAIN, *overrides]}
    return list(merged.values())


def write_latent_dir(root: Path, shards: list[dict[str, torch.Tensor]], num_classes: int, image_size: int,
                     **manifest: Any) -> Path:
    """A latent directory in ancre_dit.data.latent_shards' format from each shard's tensors (mean and std
    (n, 2, C, h, w) float16, label, index[, image]), written with the extractor's shard writer;
    `manifest` adds or replaces manifest entries."""
    from ancre_dit.data.latent_shards import FORMAT_NAME, FORMAT_VERSION, shard_file_name
    from ancre_dit.latents.shards import write_shard

    root.mkdir(parents=True)
    entries = []
    for k, tensors in enumerate(shards):
        count = len(tensors["label"])
        digest = write_shard(root, k, tensors, {"shard": k, "count": count, "report": []})
        entries.append({"file": shard_file_name(k), "count": count, "sha256": digest})
    (root / "manifest.json").write_text(json.dumps({
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "num_images": sum(e["count"] for e in entries),
        "num_classes": num_classes, "latent_shape": list(shards[0]["mean"].shape[2:]), "image_size": image_size,
        "scaling_factor": 0.18215, "vae": None, "shards": entries, **manifest}))
    return root


def tiny_config(run_dir: Path, *overrides: str) -> Config:
    """A training config for the tiny model on digits writing to run_dir; overrides win."""
    return load_config(None, [*TINY_TRAIN, f"run_dir={run_dir}", *overrides])


def assert_same_weights(a: Path, b: Path) -> None:
    """Two checkpoint folders hold bitwise the same model and EMA weights."""
    from safetensors.torch import load_file

    for name in ("model.safetensors", "ema.safetensors"):
        sa, sb = load_file(str(a / name)), load_file(str(b / name))
        assert sa.keys() == sb.keys(), name
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{name}:{k} differs"


def train_straight_and_resumed(root: Path, *overrides: str, steps: int = 4, stop_at: int = 2) -> Path:
    """Trains the tiny config straight to `steps`, and again stopped at `stop_at` then resumed with
    --resume auto; asserts both end bitwise equal and returns the resumed run's last checkpoint."""
    from ancre_dit.training import train

    for folder, legs in ((root / "straight", [(steps, None)]), (root / "resumed", [(stop_at, None), (steps, "auto")])):
        for max_steps, resume in legs:
            with accelerate_state():
                train(tiny_config(folder, *overrides, f"train.max_steps={max_steps}"), resume=resume)
    last = f"{steps:07d}"
    assert_same_weights(root / "straight" / "checkpoints" / last, root / "resumed" / "checkpoints" / last)
    return root / "resumed" / "checkpoints" / last


def tiny_vae(path: Path) -> Path:
    """A tiny random AutoencoderKL (4 latent channels, 4x downsampling) saved to `path`."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=16).save_pretrained(path)
    return path


# REPA's encoder in the tests: a tiny random-weight timm ViT (patch 4: at 16 px it has the digits'
# 4 x 4 DiT token grid; written at 32 px, so loading resamples its position embedding as it does for
# DINOv2's 518 px weights).
REPA_ENCODER = "vit_tiny_patch16_224"
REPA_ENCODER_KWARGS = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2)


def tiny_repa_encoder(path: Path, seed: int = 0, img_size: int = 32, **overrides) -> Path:
    """The tiny REPA encoder's random weights, written to `path` (safetensors); overrides change its shape."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = timm.create_model(REPA_ENCODER, pretrained=False, num_classes=0, img_size=img_size,
                              **{**REPA_ENCODER_KWARGS, **overrides})
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def repa_overrides(weights: Path, depth: int = 1) -> list[str]:
    """Training overrides that align block `depth` with the tiny encoder at `weights`."""
    kwargs = "{" + ", ".join(f"{k}: {v}" for k, v in REPA_ENCODER_KWARGS.items()) + "}"
    return ["repa.weight=0.5", f"repa.depth={depth}", f"repa.encoder={REPA_ENCODER}", f"repa.encoder_weights={weights}",
            f"repa.encoder_kwargs={kwargs}", "repa.projector_dim=16"]


def reset_accelerate() -> None:
    """AcceleratorState is a process-wide singleton: reset it between in-process runs."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@contextmanager
def accelerate_state() -> Iterator[None]:
    """A fresh Accelerate state for the block, reset again when it ends (an error included): for a
    test that runs several trainers or commands in one process, each in its own block. The
    fresh_accelerate fixture is this around a whole test."""
    reset_accelerate()
    try:
        yield
    finally:
        reset_accelerate()


def deterministic_draws(self, x: torch.Tensor):
    """Replaces the trainer's random t / noise by a function of each sample alone, so runs with
    different process layouts see the same draws for the same sample."""
    flat = x.flatten(1)
    t = ((flat + 1.0) * 0.5 * torch.arange(1, flat.shape[1] + 1)).sum(1).round().long() % self.objective.num_timesteps
    noise = torch.sin(x * 12.9898 + torch.arange(x[0].numel()).view(x.shape[1:]) * 78.233) * 1.5
    return t, noise


def subprocess_env() -> dict[str, str]:
    """Environment for a child python (train.py, torchrun): this checkout's code, one thread, CPU."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    env.pop("ANCRE_DEBUG", None)
    return env


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and two threads spin-wait on a 2-core machine with other load;
    one thread also makes CPU results equal to those of a torchrun worker (OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_script(path: Path) -> ModuleType:
    """Imports a command script (sample.py, scripts/extract_latents.py) by its path, to call its main()."""
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_forked_ranks(target, world_size: int, *args, timeout: float = 300) -> None:
    """Runs ``target(*args)`` as the ranks of one gloo job, each a process forked from this one
    with the environment torchrun gives its ranks (world_size 1: one plain process). A forked rank
    starts with everything imported, where each process of a torchrun launch first imports torch,
    its compiler and ours: the tests whose subject is not the launcher run their multi-process jobs
    this way (the launchers themselves are tested in test_preemption.py, test_distributed.py,
    test_rank_decisions.py, test_latents.py and test_sampling.py)."""
    port = free_port()
    ranks = [_fork(_rank_main, rank, world_size, port, target, args) for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    try:  # until all end, or one fails (the others would wait for it in a collective)
        while any(r.is_alive() for r in ranks) and not any(r.exitcode for r in ranks) and time.monotonic() < deadline:
            multiprocessing.connection.wait([r.sentinel for r in ranks if r.is_alive()], timeout=1.0)
    finally:
        for rank in ranks:
            if rank.is_alive():
                rank.kill()
                rank.join()
    assert [rank.exitcode for rank in ranks] == [0] * world_size, \
        f"rank exit codes {[rank.exitcode for rank in ranks]} (a traceback is on stderr)"


def script_main(script: Path, *argv: str) -> Callable[[], None]:
    """``python script argv...`` as a function to run in a forked process: the script's main under
    run_cli with that argv (it sets sys.argv), so exit codes are the shell's (2 for a bad input).
    A target for run_forked_ranks; fork_command starts one."""
    from ancre_dit.cli import run_cli

    module = load_script(script)

    def main() -> None:
        sys.argv = [str(script), *argv]
        run_cli(module.main)

    return main


def fork_command(script: Path, *argv: str, stderr: Path | None = None) -> multiprocessing.Process:
    """Starts ``python script argv...`` (script_main) as a process forked from this one, with this
    checkout's code on one CPU thread; ``stderr``: a file for what it prints there. For the tests
    whose subject is what a command leaves behind (kill -9, two trainings on one folder), not the
    interpreter's start-up."""
    return _fork(_command_main, script_main(script, *argv), stderr)


def run_command(script: Path, *argv: str, timeout: float = 600) -> None:
    """fork_command to its end; asserts exit code 0."""
    proc = fork_command(script, *argv)
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, f"{script.name} exited with {proc.exitcode} (its stderr is above)"


def _fork(target, *args) -> multiprocessing.Process:
    import torch._dynamo  # noqa: F401 - every optimizer imports it (seconds): once here, not in each child

    proc = multiprocessing.get_context("fork").Process(target=target, args=args)
    proc.start()
    return proc


def _as_child() -> None:
    """What subprocess_env gives a child python, and a state of its own (not the parent's)."""
    os.environ.update(OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    os.environ.pop("ANCRE_DEBUG", None)
    torch.set_num_threads(1)
    reset_accelerate()
    # Locks of its own for the progress bars (every tqdm class keeps one): the inherited ones hold a
    # semaphore shared with the parent, which a child killed mid-draw would leave held for good,
    # and a thread lock that was held by one of the parent's threads at the fork.
    import threading

    from tqdm import tqdm
    classes = [tqdm]
    while classes:
        cls = classes.pop()
        cls._lock = threading.RLock()
        classes += cls.__subclasses__()


def _rank_main(rank: int, world_size: int, port: int, target, args) -> None:
    if world_size > 1:  # one process: no job environment, as `accelerate launch --num_processes 1` starts it
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _as_child()
    target(*args)


def _command_main(main: Callable[[], None], stderr: Path | None) -> None:
    if stderr is not None:
        sys.stderr = open(stderr, "w", buffering=1)  # noqa: SIM115 - open until the process ends
        os.dup2(sys.stderr.fileno(), 2)
    _as_child()
    main()


def train_tiny(*overrides: str, resume: str | None = None) -> None:
    """What tests/_dist_train.py runs in each rank: the tiny config with the per-sample draws."""
    from ancre_dit.training import Trainer

    real_draws, Trainer.draw_timesteps_and_noise = Trainer.draw_timesteps_and_noise, deterministic_draws
    try:
        Trainer(load_config(None, [*TINY_TRAIN, *overrides]), resume=resume).run()
    finally:
        Trainer.draw_timesteps_and_noise = real_draws
