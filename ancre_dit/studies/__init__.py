"""Studies: a set of training runs (arms x seeds) that settles one question, with a report that
says how sure the answer is.

    spec, ownership     the study file -> runs; study.json: the folder belongs to one study
    runner, cluster     executors: local subprocesses N at a time, or submitit (SLURM) with requeues
    status, costs       each run's state from disk; training FLOPs per step of each arm
    run_curves, comparison, report   curves loaded and grouped; paired speedups, verdicts; report.md
    actions             the commands of scripts/study.py, put together
"""
from .spec import Job, Study, load_study, validate

__all__ = ["Job", "Study", "load_study", "validate"]
