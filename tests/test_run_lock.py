"""The claim on a run folder (run_lock.py) and a checkpoint save that meets a full disk, without
training: a second holder of the lock is another open file, a full disk an injected ENOSPC."""
from __future__ import annotations

import errno
import fcntl
from pathlib import Path

import pytest
import torch

from ancre_dit.errors import UserError
from ancre_dit.training import checkpointing as ckpt
from ancre_dit.training.run_lock import LOCK_FILE, abandon_new_run_dir, acquire_run_dir, release_run_dir


def test_a_claimed_folder_is_refused_to_another_holder_and_freed_on_release(tmp_path):
    run = tmp_path / "run"
    stale = run / "checkpoints" / ".tmp-0000008"
    stale.mkdir(parents=True)
    torn_config = run / "config.yaml.tmp4242"  # a kill -9 during an atomic write
    torn_config.write_text("model: {na")
    (run / "notes.tmpl").write_text("mine")
    try:
        acquire_run_dir(run)
        assert not stale.exists()  # a dead run's temporary checkpoint, removed once claimed
        assert not torn_config.exists() and (run / "notes.tmpl").exists()
        acquire_run_dir(run)  # the same process again (a second training in a notebook)
        with open(run / LOCK_FILE) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel lock is really held
    finally:
        release_run_dir(run)
    other = open(run / LOCK_FILE, "a+")
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.truncate(0)
        other.write("pid 77 on elsewhere\n")
        other.flush()
        stale.mkdir(parents=True)
        with pytest.raises(UserError, match=r"is in use by another training \(pid 77 on elsewhere\)"):
            acquire_run_dir(run)
        assert stale.exists()  # not ours to clean while another training holds the folder
    finally:
        other.close()


def test_a_refused_start_removes_only_the_folder_it_created(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("kept")
    for folder in (new, old):
        acquire_run_dir(folder)
        (folder / "log.txt").write_text("started\n")
        abandon_new_run_dir(folder)
    assert not new.exists()
    assert sorted(p.name for p in old.iterdir()) == [LOCK_FILE, "log.txt", "notes.txt"]


class _OneProcess:
    is_main_process, num_processes, process_index = True, 1, 0

    def __init__(self, fail_in: str):
        self.fail_in = fail_in

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, output_dir: str) -> None:
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 1000)
        if self.fail_in == "save_state":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 330240 vs 330128")


@pytest.mark.parametrize("fail_in", ["save_state", "write_files"])
def test_a_full_disk_during_a_save_is_one_error_and_leaves_no_temporary_folder(tmp_path, monkeypatch, fail_in):
    def write_files(folder: Path) -> None:
        if fail_in == "write_files":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10})())
    with pytest.raises(UserError, match=r"no space left on the device while writing the checkpoint .*\.tmp-0000004 "
                                        r"\(a checkpoint needs over 0\.0 MiB, 0\.0 MiB free in"):
        ckpt.save_checkpoint(_OneProcess(fail_in), tmp_path, 4, torch.Generator(), write_files, {"step": 4})
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_failed_save_that_is_no_file_system_error_keeps_its_traceback(tmp_path):
    def write_files(folder: Path) -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        ckpt.save_checkpoint(_OneProcess(""), tmp_path, 4, torch.Generator(), write_files, {"step": 4})


def test_only_the_main_rank_prints_a_user_error(monkeypatch, capsys):
    from ancre_dit.cli import run_cli

    def refuse():
        raise UserError("run_dir x is in use")

    for rank, printed in (("1", ""), ("0", "error: run_dir x is in use\n")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            run_cli(refuse)
        assert exit_info.value.code == 2 and capsys.readouterr().err == printed


def test_metrics_never_print_as_minus_zero():
    from ancre_dit.training.run_evaluation import format_eval
    from ancre_dit.evaluation.pipeline import display

    assert display(-1e-9) == "0.0000" and display(-0.0) == "0.0000" and display(-0.5) == "-0.5000"
    assert format_eval({"step": 1, "metrics": {"fid": -0.0}, "seconds": 1.0}) == "step 1: evaluation fid 0 (1.0 s)"


def test_config_yaml_is_rewritten_only_when_it_changes(tmp_path):
    from helpers import tiny_config
    from ancre_dit.training.config import save_config

    path = tmp_path / "config.yaml"
    save_config(tiny_config(tmp_path, "train.max_steps=2"), path)
    inode = path.stat().st_ino
    save_config(tiny_config(tmp_path, "train.max_steps=2"), path)
    assert path.stat().st_ino == inode  # the same bytes: not written again
    save_config(tiny_config(tmp_path, "train.max_steps=3"), path)
    assert path.stat().st_ino != inode and "max_steps: 3" in path.read_text()  # a new file renamed over it
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
