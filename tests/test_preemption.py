"""Preemption under the real launchers: a stop signal, wherever it lands (the launcher, one rank, a
DataLoader worker, every process of the job), makes all ranks checkpoint the step they reached and
exit cleanly, and `--resume auto` then ends bitwise equal to an uninterrupted run.

One chain of launches covers every delivery: each launch is stopped by the next delivery and the
following one resumes it, so the final weights equal the straight run's only if every stop and
every resume was exact. The straight runs and the last resume are not the subject (a launch's stop
is, and the next launch's resume): their ranks are forked from the test (helpers.run_forked_ranks)."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT, free_port, run_forked_ranks, subprocess_env, train_tiny
from safetensors.torch import load_file

from ancre_dit.training.checkpointing import list_checkpoints

WORKER = Path(__file__).with_name("_dist_train.py")
STEPS = 30
SETTINGS = [f"train.max_steps={STEPS}", "train.ckpt_every=1000", "train.global_batch_size=16", "train.lr=1e-3",
            "data.num_workers=2", "train.stop_check_every=2", "model.learn_sigma=false", "model.class_dropout=0.0"]
STEP_SECONDS = "0.4"  # slow enough that a signal lands mid-run on a busy machine
# torchrun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT; a SIGUSR1 (SLURM's --signal=USR1) kills it,
# leaving the ranks running, unless it is named here too (docs/cluster.md).
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _torchrun(run: Path, *extra: str) -> subprocess.Popen:
    env = {**subprocess_env(), "ANCRE_TEST_STEP_SECONDS": STEP_SECONDS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--signals-to-handle", TORCHRUN_SIGNALS, str(WORKER), f"run_dir={run}", *SETTINGS, *extra]
    # A session of its own, as a job step has: a signal to "the job" is sent to its processes here.
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)


def _logged_steps(run: Path) -> int:
    path = run / "logs" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_steps(proc: subprocess.Popen, run: Path, at_least: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and _logged_steps(run) < at_least:
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before step {at_least}: {proc.stderr.read()[-3000:]}"
    assert _logged_steps(run) >= at_least, "the run made no progress"


def _ranks(launcher: psutil.Process) -> dict[int, psutil.Process]:
    ranks = {}
    for child in launcher.children(recursive=True):
        try:
            if str(WORKER) in " ".join(child.cmdline()) and child.parent().pid == launcher.pid:
                ranks[int(child.environ()["LOCAL_RANK"])] = child
        except (psutil.NoSuchProcess, KeyError):
            continue
    assert sorted(ranks) == [0, 1], ranks
    return ranks


def _loader_workers(rank: psutil.Process) -> list[psutil.Process]:
    workers = [p for p in rank.children() if p.is_running()]
    assert workers, "the rank has no DataLoader worker"
    return workers


def _deliver(how: str, proc: subprocess.Popen) -> None:
    launcher = psutil.Process(proc.pid)
    if how == "launcher SIGTERM":
        launcher.send_signal(signal.SIGTERM)
    elif how == "launcher SIGUSR1":
        launcher.send_signal(signal.SIGUSR1)
    elif how == "one rank SIGUSR1":
        _ranks(launcher)[1].send_signal(signal.SIGUSR1)
    elif how == "loader worker SIGTERM":
        _loader_workers(_ranks(launcher)[0])[0].send_signal(signal.SIGTERM)
    elif how == "every process SIGINT":  # what a job-wide signal does: the launcher, ranks and workers at once
        for p in [launcher, *launcher.children(recursive=True)]:
            try:
                p.send_signal(signal.SIGINT)
            except psutil.NoSuchProcess:
                pass
    else:
        raise AssertionError(how)


def _assert_ranks_clean(err: str) -> None:
    """The launchers report the signal they got with a traceback of their own (torchrun's
    SignalException, accelerate's KeyboardInterrupt); the trainer and its workers print none."""
    assert not any(word in err for word in ("ancre_dit", "DataLoader worker", "error:")), err[-3000:]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"{STEPS:07d}"
    return {f"{name}.{k}": v for name in ("model", "ema") for k, v in load_file(str(folder / f"{name}.safetensors")).items()}


@pytest.mark.slow
def test_every_delivery_checkpoints_and_resumes_bitwise(tmp_path):
    straight = tmp_path / "straight"
    run_forked_ranks(train_tiny, 2, f"run_dir={straight}", *SETTINGS)

    run = tmp_path / "chain"
    deliveries = ["launcher SIGTERM", "one rank SIGUSR1", "loader worker SIGTERM", "every process SIGINT",
                  "launcher SIGUSR1"]
    stopped_at = [0]
    for how in deliveries:
        proc = _torchrun(run, "--resume", "auto")
        try:
            _wait_for_steps(proc, run, stopped_at[-1] + 2)
            _deliver(how, proc)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        _assert_ranks_clean(err)
        newest = list_checkpoints(run)[-1][0]
        assert stopped_at[-1] + 2 <= newest < STEPS, f"{how}: the newest checkpoint is step {newest}"
        state = json.loads((run / "checkpoints" / f"{newest:07d}" / "trainer_state.json").read_text())
        assert state["num_processes"] == 2 and state["step"] == newest
        assert "stop requested" in (run / "log.txt").read_text()
        stopped_at.append(newest)
    run_forked_ranks(functools.partial(train_tiny, resume="auto"), 2, f"run_dir={run}", *SETTINGS)

    want, got = _final_weights(straight), _final_weights(run)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])][:5]
    # Every logged step of the chain is the straight run's step, bitwise (the loss of each step).
    rows = lambda r: {row["step"]: row["loss"] for row in map(json.loads, (r / "logs" / "metrics.jsonl").read_text().splitlines())}
    assert rows(run) == rows(straight)


@pytest.mark.slow
def test_accelerate_launch_with_loader_workers_stops_on_ctrl_c_and_resumes_bitwise(tmp_path):
    """The README's command, one process with loader workers, Ctrl-C (SIGINT to the terminal's
    whole process group: the launcher, the trainer and its workers)."""
    straight = tmp_path / "straight"
    run_forked_ranks(train_tiny, 1, f"run_dir={straight}", *SETTINGS)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(WORKER), f"run_dir={run}", *SETTINGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**subprocess_env(), "ANCRE_TEST_STEP_SECONDS": STEP_SECONDS}, start_new_session=True)
    try:
        _wait_for_steps(proc, run, 3)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _assert_ranks_clean(err)
    assert 3 <= list_checkpoints(run)[-1][0] < STEPS
    run_forked_ranks(functools.partial(train_tiny, resume="auto"), 1, f"run_dir={run}", *SETTINGS)
    want, got = _final_weights(straight), _final_weights(run)
    assert all(torch.equal(want[k], got[k]) for k in want)
