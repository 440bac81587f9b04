"""What `scripts/study.py run|status|report` do; each validates every run's config first."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import UserError
from .ownership import check_folder, claim_folder, recorded
from .runner import LocalRunner, usable_cores
from .spec import Job, Study, validate
from .status import RunStatus, format_table, run_status, status_table


def dry_run(study: Study, check_paths: bool = True, rate=None) -> str:
    """Validates every config and the folder, writes nothing; returns the job table and each arm's bill at `rate`."""
    from ..training.config_checks import validate_config
    from .costs import compute_rate, config_flops_per_step, format_bill

    configs = validate(study, check_paths)
    check_folder(study)
    rows, unchecked, bill = [], {}, {}
    for job in study.jobs:
        c = configs[job.name]
        unchecked.update(dict.fromkeys([] if check_paths else validate_config(c, check_paths=False)))
        rows.append((job.name, job.arm, job.seed, c.model.topology, c.train.max_steps,
                     ", ".join(f"{k}={v}" for k, v in study.arms[job.arm].items()) or "-"))
        runs, per_step, _ = bill.get(job.arm) or (0, config_flops_per_step(c), None)
        bill[job.arm] = (runs + 1, per_step, c.train.max_steps)
    table = format_table(("run", "arm", "seed", "topology", "max_steps", "arm overrides"), rows)
    note = (f"\nnot checked (missing here, --no-check-paths): {', '.join(unchecked)}" if unchecked else "")
    bill_text = format_bill([(arm, *row) for arm, row in bill.items()], rate or compute_rate())
    return (f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds = {len(rows)} runs, all configs "
            f"valid; baseline {study.baseline_label}; runs would go to {study.runs_dir}{note}\n\n{table}\n\n{bill_text}")


def statuses(study: Study, configs: dict | None = None) -> list[RunStatus]:
    """Every run's state; configs (for max_steps) are validated without path checks unless given."""
    configs = configs or validate(study, check_paths=False)
    return [run_status(job, configs[job.name].train.max_steps) for job in study.jobs]


def show_status(study: Study) -> str:
    check_folder(study)
    return f"study {study.name} ({study.out}):\n\n{status_table(statuses(study))}"


def write_report(study: Study) -> Path:
    from .report import write_study_report

    check_folder(study)
    if recorded(study) is None:
        raise UserError(f"{study.out} holds no run of this study yet; start it with python scripts/study.py run "
                        f"{study.source}")
    configs = validate(study, check_paths=False)
    batch = {job.arm: configs[job.name].train.global_batch_size for job in study.jobs}
    return write_study_report(study, statuses(study, configs), batch)


def _to_run(study: Study, check_paths: bool, force: bool) -> tuple[dict[str, int], list[Job]]:
    """Validates and claims the folder; returns (run name -> max_steps, the unfinished runs). A run running or
    queued elsewhere is a UserError unless `force` (two trainings would overwrite checkpoints)."""
    configs = validate(study, check_paths)
    claim_folder(study)
    max_steps = {job.name: configs[job.name].train.max_steps for job in study.jobs}
    todo = []
    for job in study.jobs:
        state = run_status(job, max_steps[job.name]).state
        if state in ("running", "submitted") and not force:
            raise UserError(f"run {job.name} is {state} (python scripts/study.py status {study.source}); wait for it, "
                            f"or, if its process or job is gone, pass --force")
        if state != "done":
            todo.append(job)
    return max_steps, todo


def run_local(study: Study, train_script: Path, slots: int, check_paths: bool = True, force: bool = False,
              say: Callable[[str], None] = print) -> int:
    """Runs every unfinished run, `slots` at a time; 0 when all finished, else 1."""
    from tqdm.auto import tqdm

    max_steps, todo = _to_run(study, check_paths, force)
    say(f"study {study.name}: {len(study.jobs)} runs, {len(study.jobs) - len(todo)} finished already (skipped), "
        f"{len(todo)} to run, {slots} at a time ({max(1, usable_cores() // slots)} thread(s) each); each run's "
        f"output: <run>/study.log under {study.runs_dir}")
    if not todo:
        return 0
    runner = LocalRunner(study, train_script, slots,
                         is_done=lambda job: run_status(job, max_steps[job.name]).state == "done")

    def progress(outcome) -> None:
        bar.update(1)
        if outcome.state != "done":
            bar.write(f"{outcome.job.name}: {outcome.state} (exit code {outcome.exit_code})"
                      + (f": {outcome.error}" if outcome.error else ""))

    with tqdm(total=len(todo), desc=f"study {study.name}", unit="run", dynamic_ncols=True) as bar:
        outcomes = runner.run(todo, progress)
    failed = [o for o in outcomes if o.state != "done"]
    say(f"{len(outcomes) - len(failed)} of {len(outcomes)} launched runs finished"
        + (f"; not finished: {', '.join(f'{o.job.name} ({o.state})' for o in failed)} (see <run>/study.log)"
           if failed else ""))
    return 1 if failed else 0


def run_cluster(study: Study, train_script: Path, options, cluster: str, wait: bool, check_paths: bool = True,
                force: bool = False, say: Callable[[str], None] = print) -> int:
    """Submits every unfinished run through submitit; with `wait`, waits (0 = all finished)."""
    from .cluster import submit

    max_steps, todo = _to_run(study, check_paths, force)
    say(f"study {study.name}: {len(study.jobs)} runs, {len(study.jobs) - len(todo)} finished already, "
        f"submitting {len(todo)} to {cluster}")
    if not todo:
        return 0
    threads = max(1, usable_cores() // len(todo)) if cluster == "local" else None
    handles = submit(study, todo, train_script, options, cluster=cluster, threads=threads, max_steps=max_steps)
    say("submitted: " + ", ".join(f"{job.name} (job {h.job_id})" for job, h in zip(todo, handles))
        + f"; submitit's logs: {study.out / 'submitit'}")
    if not wait:
        return 0
    failures = [f"{job.name}: {' '.join(str(error).split())[-300:]}" for job, handle in zip(todo, handles)
                if (error := handle.exception()) is not None]
    done = sum(run_status(job, max_steps[job.name]).state == "done" for job in todo)
    say(f"{done} of {len(todo)} submitted runs finished" + (f"; failed: {'; '.join(failures)}" if failures else ""))
    return 0 if done == len(todo) else 1
