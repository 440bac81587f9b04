#!/usr/bin/env python3
"""Runs a study (arms x seeds of training runs from one YAML file), shows where it stands, reports it.

    python scripts/study.py run STUDY.yaml [--jobs N] [--executor local|slurm|submitit-local] [--dry-run [--mfu F]]
    python scripts/study.py status STUDY.yaml
    python scripts/study.py report STUDY.yaml            # <out>/report/report.md + curves_*.png

`run` trains every run not finished yet (`train.py --resume auto`: a rerun continues), N at a time
on this machine, or as SLURM jobs through submitit (--partition, --gpus-per-node, --nodes,
--time-min, --account, --slurm-array-parallelism; defaults from the study's slurm: section).
--dry-run validates every run's config and prints the runs and each arm's training compute in GPU-hours
(--mfu, --gpu / --gpu-peak-tflops, --gpu-check gpu_check.json), creating nothing; --no-check-paths
leaves out the checks that the paths the configs name exist (a machine without the data).
"""
from __future__ import annotations

from pathlib import Path

from ancre_dit.cli import CommandParser, run_cli
from ancre_dit.errors import UserError

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"


def parse_args(argv: list[str] | None = None):
    p = CommandParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("run", "status", "report"))
    p.add_argument("study", help="study YAML file (studies/*.yaml)")
    p.add_argument("--dry-run", action="store_true", help="validate every run's config and print the runs; write nothing")
    bill = p.add_argument_group("--dry-run's compute bill (GPU-hours = FLOPs / (MFU x peak); default 40% of an "
                                "H100/H200's 989 TFLOP/s)")
    bill.add_argument("--mfu", type=float, help="model FLOP utilisation as a fraction, e.g. 0.4")
    bill.add_argument("--gpu-peak-tflops", type=float, help="the GPU's dense bf16 peak, TFLOP/s")
    bill.add_argument("--gpu", help="the GPU by name (A100, H100, H200, B200, ...): its peak from the device table")
    bill.add_argument("--gpu-check", help="a gpu_check.json: the trainer MFU (and peak) the GPU check measured")
    p.add_argument("--no-check-paths", action="store_true",
                   help="do not require the paths the configs name (data, references, weights, topology files) to "
                        "exist here")
    p.add_argument("--jobs", type=int, default=1, help="local executor: runs at once (cores split between them)")
    p.add_argument("--executor", choices=("local", "slurm", "submitit-local"), default="local",
                   help="local: subprocesses here; slurm: submitit jobs; submitit-local: submitit's local executor")
    p.add_argument("--force", action="store_true",
                   help="launch runs that status shows as running or submitted (their process or job is gone)")
    p.add_argument("--wait", action="store_true", help="slurm: wait for the jobs to end (submitit-local always waits)")
    cluster = p.add_argument_group("cluster (slurm / submitit-local; default: the study's slurm: section)")
    cluster.add_argument("--partition")
    cluster.add_argument("--account")
    cluster.add_argument("--gpus-per-node", type=int)
    cluster.add_argument("--nodes", type=int)
    cluster.add_argument("--time-min", type=int, help="time limit of one job in minutes (it requeues itself past it)")
    cluster.add_argument("--slurm-array-parallelism", type=int, dest="array_parallelism",
                         help="jobs of the study running at once")
    cluster.add_argument("--cpus-per-task", type=int)
    args = p.parse_args(argv)
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    from ancre_dit.studies.cluster import MINIMUM, check_cluster_value

    for key in MINIMUM:  # the flags are ClusterOptions' fields; array_parallelism's says it is SLURM's
        flag = "slurm_array_parallelism" if key == "array_parallelism" else key
        check_cluster_value(key, getattr(args, key), f"--{flag.replace('_', '-')}")
    if not args.dry_run and any(v is not None for v in (args.mfu, args.gpu_peak_tflops, args.gpu, args.gpu_check)):
        raise UserError("--mfu, --gpu-peak-tflops, --gpu and --gpu-check price a --dry-run; add --dry-run")
    if args.command != "run" and (args.dry_run or args.jobs != 1 or args.executor != "local" or args.force):
        raise UserError(f"--dry-run, --jobs, --executor and --force apply to run, not {args.command}")
    if args.jobs != 1 and args.executor != "local":
        raise UserError("--jobs applies to --executor local; on a cluster, --slurm-array-parallelism sets how many "
                        "runs go at once")
    return args


def cluster_options(args, study):
    from dataclasses import fields

    from ancre_dit.studies.cluster import ClusterOptions

    given = {f.name: getattr(args, f.name) for f in fields(ClusterOptions)}
    defaults = {"gpus_per_node": 0} if args.executor == "submitit-local" else {}
    merged = {**defaults, **study.slurm, **{k: v for k, v in given.items() if v is not None}}
    return ClusterOptions(**merged)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ancre_dit.studies import actions, load_study  # after argparse: --help stays fast

    study = load_study(args.study)
    check_paths = not args.no_check_paths
    if args.command == "status":
        print(actions.show_status(study))
        return 0
    if args.command == "report":
        path = actions.write_report(study)
        print(f"report written to {path} (+ summary.json, curves_*.png)")
        return 0
    if args.dry_run:
        from ancre_dit.studies.costs import compute_rate

        rate = compute_rate(args.mfu, args.gpu_peak_tflops, args.gpu, args.gpu_check)
        print(actions.dry_run(study, check_paths, rate))
        return 0
    if not TRAIN_SCRIPT.is_file():
        raise UserError(f"{TRAIN_SCRIPT} not found: run studies from a checkout of ancre-dit")
    if args.executor == "local":
        return actions.run_local(study, TRAIN_SCRIPT, args.jobs, check_paths, args.force)
    cluster = "slurm" if args.executor == "slurm" else "local"
    return actions.run_cluster(study, TRAIN_SCRIPT, cluster_options(args, study), cluster,
                               wait=args.wait or cluster == "local", check_paths=check_paths, force=args.force)


if __name__ == "__main__":
    run_cli(main)
