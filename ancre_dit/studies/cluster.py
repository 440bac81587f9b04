"""A study's runs as a submitit job array (SLURM, or submitit's local executor: the same code path).
Each job runs train.py, or torchrun over its GPUs and nodes. On a time limit or preemption, `checkpoint()`
sends SIGTERM (train.py checkpoints within GRACE_S) and the requeued job resumes with `--resume auto`.
"""
from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from submitit.helpers import Checkpointable, DelayedSubmission

from ..errors import UserError
from .runner import run_logged, train_command
from .spec import Job, Study
from .status import LOG, finished_at, record_event, record_exit

MAX_TIMEOUTS = 100  # requeues after time limits (not preemptions): 400K-step runs outlast most limits
# SLURM signals SIGNAL_DELAY_S before a time limit (submitit's --signal=USR2@N); the training gets GRACE_S
# to checkpoint, torchrun included (its default 30 s --shutdown-timeout would SIGKILL its workers sooner),
# the rest is for the requeue. See docs/cluster.md.
SIGNAL_DELAY_S = 180
GRACE_S = 120

MINIMUM = {"gpus_per_node": 0, "nodes": 1, "time_min": 1, "array_parallelism": 1, "cpus_per_task": 1}


def check_cluster_value(key: str, value: Any, name: str) -> None:
    """The one rule for a cluster count, whether from a flag or the study's slurm: section."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < MINIMUM[key]):
        raise UserError(f"{name} must be a whole number >= {MINIMUM[key]}, got {value!r}")


@dataclass
class ClusterOptions:
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int = 1
    nodes: int = 1
    time_min: int = 60 * 24
    array_parallelism: int = 16
    cpus_per_task: int | None = None

    def __post_init__(self) -> None:  # flags were checked as flags; what is left came from slurm:
        for key in MINIMUM:
            check_cluster_value(key, getattr(self, key), f"slurm.{key}")


def _ignore_submitit_signal() -> None:
    """In the training child, before exec: SLURM's early signal (submitit's USR2) reaches every process of the
    step and would kill the training before any checkpoint; ignored across exec, the job answers it with SIGTERM."""
    from submitit.core.job_environment import JobEnvironment

    signal.signal(getattr(signal, f"SIG{JobEnvironment.USR_SIG}"), signal.SIG_IGN)


@dataclass(eq=False)
class StudyRun(Checkpointable):
    """One run as a submitit job; pickled without its running child."""
    name: str
    run_dir: str
    train_args: list[str]
    gpus_per_node: int
    threads: int | None = None
    grace_s: float = GRACE_S
    max_steps: int | None = None
    _child = None  # the running child (subprocess.Popen); the class's None where an unpickled copy has none

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_child"}

    def command(self, env: Any) -> list[str]:
        script, *args = self.train_args
        nodes, gpus = env.num_nodes, max(1, self.gpus_per_node)
        if nodes == 1 and gpus == 1:
            return [sys.executable, script, *args]
        port = 20000 + int(hashlib.sha256(str(env.job_id).encode()).hexdigest(), 16) % 20000  # per job on a node
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={gpus}",
                f"--node_rank={env.node}", f"--master_addr={env.hostnames[0]}", f"--master_port={port}",
                f"--shutdown-timeout={math.ceil(self.grace_s)}", script, *args]

    def __call__(self) -> dict[str, Any]:
        import submitit

        env = submitit.JobEnvironment()
        run_dir, main = Path(self.run_dir), env.global_rank == 0
        run_dir.mkdir(parents=True, exist_ok=True)
        child_env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.threads:
            child_env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))

        def started(child: subprocess.Popen) -> None:
            self._child = child
            if main:
                record_event(run_dir, "started", pid=child.pid, job_pid=os.getpid(), executor="submitit",
                             job_id=str(env.job_id))

        code = run_logged(self.command(env), run_dir / (LOG if main else f"study.node{env.node}.log"),
                          f"job {env.job_id}", started, env=child_env, preexec_fn=_ignore_submitit_signal)
        if not main:
            return {"run": self.name, "exit_code": code}
        # not finished at exit code 0: SIGTERM reached train.py directly (preemption)
        finished = self.max_steps is None or finished_at(run_dir, self.max_steps) is not None
        state, error = record_exit(run_dir, code, finished, job_id=str(env.job_id))
        if state == "failed":
            raise RuntimeError(f"run {self.name} failed with exit code {code}: {error}")
        return {"run": self.name, "exit_code": 0, "finished": finished}

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Time limit or preemption: SIGTERM (train.py checkpoints), then requeue."""
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        record_event(Path(self.run_dir), "stopped", reason="time limit or preemption: requeued")
        return DelayedSubmission(self)


def submit(study: Study, jobs: Sequence[Job], train_script: Path, options: ClusterOptions, cluster: str,
           threads: int | None, max_steps: dict[str, int]) -> list[Any]:
    """Submits the jobs as one array; returns submitit's handles. `max_steps`: run name -> train.max_steps."""
    import submitit

    try:
        executor = submitit.AutoExecutor(folder=study.out / "submitit", cluster=cluster,
                                         slurm_max_num_timeout=MAX_TIMEOUTS, local_max_num_timeout=MAX_TIMEOUTS)
    except RuntimeError as err:  # no srun here
        raise UserError(f"--executor {cluster}: {' '.join(str(err).split())} (submit from a SLURM login node, or use "
                        f"--executor local)") from None
    params: dict[str, Any] = dict(name=f"study-{study.name}", timeout_min=options.time_min, tasks_per_node=1)
    optional = {"gpus_per_node": options.gpus_per_node, "cpus_per_task": options.cpus_per_task}
    if cluster == "slurm":
        params.update(nodes=options.nodes, slurm_array_parallelism=options.array_parallelism,
                      slurm_signal_delay_s=SIGNAL_DELAY_S)
        optional.update(slurm_partition=options.partition, slurm_account=options.account)
    executor.update_parameters(**params, **{key: value for key, value in optional.items() if value})
    for job in jobs:  # before submitting: a job that starts at once must not be followed by this record
        record_event(job.run_dir, "submitted", executor=cluster)
    try:
        with executor.batch():  # StudyRun gets the train.py arguments: the command but its interpreter
            handles = [executor.submit(StudyRun(job.name, str(job.run_dir), train_command(study, job, train_script)[1:],
                                                options.gpus_per_node, threads, max_steps=max_steps[job.name]))
                       for job in jobs]
    except Exception as err:  # noqa: BLE001 - sbatch refused (partition, account, limits): say so per run
        problem = " ".join(str(err).split())[:300]
        for job in jobs:
            record_event(job.run_dir, "failed", exit_code=None, error=f"submission failed: {problem}")
        raise UserError(f"{cluster} submission failed: {problem}") from None
    return handles
