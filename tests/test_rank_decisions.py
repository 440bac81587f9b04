"""One process decides what every process must agree on (the checkpoint to resume, the steps
already evaluated); the others receive its answer, whatever they would have read themselves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, free_port, subprocess_env

from ancre_dit.cli import SingleProcess
from ancre_dit.errors import UserError
from ancre_dit.training.rank_decisions import agree_on_resume, main_decides
from ancre_dit.files import append_jsonl
from ancre_dit.training.run_evaluation import agree_on_evaluated, evals_path


def _damaged_checkpoint(run_dir: Path) -> None:
    folder = run_dir / "checkpoints" / "0000004"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")  # looks complete; its weights are missing


def _views(base: Path) -> None:
    """Rank 0 sees step 2 evaluated, an empty run, and one with only a damaged checkpoint; rank 1
    sees no evaluation and a damaged checkpoint where rank 0 sees none."""
    append_jsonl(evals_path(base / "view0"), {"step": 2, "settings": {"num_samples": 4}})
    append_jsonl(evals_path(base / "view0"), {"step": 3, "settings": {"num_samples": 9}})  # other settings: not this one
    (base / "view0" / "empty-or-damaged").mkdir()
    _damaged_checkpoint(base / "view0" / "damaged")
    (base / "view1").mkdir()
    _damaged_checkpoint(base / "view1" / "empty-or-damaged")


def test_one_process_decides_for_itself(tmp_path):
    _views(tmp_path)
    state = SingleProcess(cpu=True)
    assert agree_on_evaluated(state, tmp_path / "view0", {"num_samples": 4}) == {2}
    assert agree_on_resume(state, "auto", tmp_path / "view0" / "empty-or-damaged") is None
    warned = []
    with pytest.raises(UserError, match="every checkpoint"):
        agree_on_resume(state, "auto", tmp_path / "view1" / "empty-or-damaged", warn=warned.append)
    assert "skipping damaged checkpoint" in warned[0]
    assert main_decides(state, lambda: 7) == 7


@pytest.mark.slow
def test_every_rank_receives_the_main_rank_answer(tmp_path):
    _views(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(ROOT / "tests" / "_dist_agree.py"), str(tmp_path)],
                          capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=240)
    lines = [json.loads(line) for rank in (0, 1) if (tmp_path / f"told{rank}.jsonl").exists()
             for line in (tmp_path / f"told{rank}.jsonl").read_text().splitlines()]
    told = sorted((d for d in lines if "error" not in d), key=lambda d: d["rank"])
    errors = sorted((d["rank"], d["error"].split(" is damaged")[0]) for d in lines if "error" in d)
    # Rank 1 alone would have found nothing evaluated and refused its damaged checkpoint.
    assert told == [{"rank": 0, "evaluated": [2], "resume": None}, {"rank": 1, "evaluated": [2], "resume": None}], \
        proc.stderr[-3000:]
    # Rank 0's user error reaches both ranks (both exit 2, neither waits for the other); the main rank
    # alone prints it, as one line.
    assert proc.returncode != 0 and proc.stderr.count("error: --resume auto: every checkpoint") == 1, proc.stderr[-3000:]
    damaged = f"--resume auto: every checkpoint in {tmp_path / 'view0' / 'damaged' / 'checkpoints'}"
    assert errors == [(0, damaged), (1, damaged)], lines
    assert "terminate called" not in proc.stderr
