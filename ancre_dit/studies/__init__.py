"""Studies: a set of training runs (arms x seeds) that settles one question, with a report that
says how sure the answer is.

    spec      the study file -> arms, seeds, runs; every run's config validated up front
    folder    study.json: the folder belongs to one study; a rerun continues it
    runner    local executor: one train.py subprocess per run, N at a time, cores split between them
    cluster   submitit executor (SLURM, or submitit's local executor): requeue on time limit / preemption
    status    each run's state from its checkpoints, logs and launch records
    costs     training FLOPs per step of each arm (for curves at equal compute)
    run_curves  the curves runs logged (metrics.jsonl, evals.jsonl), loaded and grouped
    comparison  steps to a target, paired speedups with intervals, verdicts (compare_runs.py, report)
    report    report.md + curves with seed intervals, paired speedups and verdicts
    actions   the commands of scripts/study.py, put together
"""
from .spec import Job, Study, load_study, validate

__all__ = ["Job", "Study", "load_study", "validate"]
