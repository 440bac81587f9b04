"""Worker for tests/test_rank_decisions.py under torchrun: each rank is shown its own view of the run
folder (BASE/view<rank>, as stale caches of a shared filesystem would), and writes what it was told to
BASE/told<rank>.jsonl: a file per rank, since the ranks' lines on one shared stdout can interleave."""
import json
import sys
from pathlib import Path

from ancre_dit.cli import job_processes, run_cli
from ancre_dit.errors import UserError
from ancre_dit.training.rank_decisions import agree_on_resume
from ancre_dit.training.run_evaluation import agree_on_evaluated


def main() -> int:
    base = Path(sys.argv[1])
    with job_processes(cpu=True) as state, (base / f"told{state.process_index}.jsonl").open("w") as told:
        view = base / f"view{state.process_index}"
        done = agree_on_evaluated(state, view, {"num_samples": 4})
        resume = agree_on_resume(state, "auto", view / "empty-or-damaged", warn=lambda *a: None)
        print(json.dumps({"rank": state.process_index, "evaluated": sorted(done), "resume": resume}), file=told, flush=True)
        try:
            agree_on_resume(state, "auto", base / "view0" / "damaged", warn=lambda *a: None)  # a UserError everywhere
        except UserError as err:
            print(json.dumps({"rank": state.process_index, "error": str(err)}), file=told, flush=True)
            raise
    return 0


if __name__ == "__main__":
    run_cli(main)
