"""What a job on many nodes meets first: the process groups wait train.collective_timeout_s (not
NCCL's 10 minutes) while the main rank works alone, and a stop agreement that could not connect
across nodes fails at start-up in one line instead of hanging."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import run_forked_ranks, tiny_config

from ancre_dit.errors import UserError
from ancre_dit.training import stopping


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _train_and_check_timeouts(run_dir: str) -> None:
    """A rank: builds the trainer; its process group and its stop agreement's wait 77 s."""
    from ancre_dit.training import Trainer

    real_backend = dist.get_backend
    # As under NCCL: the stop agreement makes a gloo group of its own.
    stopping.dist.get_backend = lambda group=None: "nccl"
    try:
        trainer = Trainer(tiny_config(run_dir, "train.collective_timeout_s=77", "train.max_steps=2"))
    finally:
        stopping.dist.get_backend = real_backend
    assert _timeout(dist.group.WORLD) == timedelta(seconds=77)
    agreement = trainer.stop_agreement
    assert agreement._group is not dist.group.WORLD and _timeout(agreement._group) == timedelta(seconds=77)
    assert agreement.agree(dist.get_rank() == 1)  # one rank's flag reaches both
    trainer.run()


@pytest.mark.slow
def test_the_collective_timeout_reaches_the_process_groups(tmp_path):
    run_forked_ranks(_train_and_check_timeouts, 2, str(tmp_path / "run"))
    assert (tmp_path / "run" / "checkpoints" / "0000002").is_dir()


@pytest.mark.parametrize("env, address, refused", [
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, "127.0.1.1", True),   # Debian's /etc/hosts, on two nodes
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GLOO_SOCKET_IFNAME": "ib0"}, "127.0.1.1", False),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, "10.1.2.3", False),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, "127.0.1.1", False),   # one node: loopback is right
])
def test_a_multi_node_stop_agreement_on_a_loopback_address_is_refused(monkeypatch, env, address, refused):
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(socket, "gethostname", lambda: "node17")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: address)
    if not refused:
        stopping.check_gloo_address()
        return
    with pytest.raises(UserError, match=r"host name node17 resolves to 127\.0\.1\.1, a loopback address .* "
                                        r"set GLOO_SOCKET_IFNAME to the network interface"):
        stopping.check_gloo_address()


def test_a_gloo_group_that_cannot_connect_is_one_line(monkeypatch):
    """The group's creation or first exchange fails (a peer on an unreachable address): the error
    names the fix, at start-up."""
    monkeypatch.setattr(stopping, "check_gloo_address", lambda: None)
    monkeypatch.setattr(stopping.dist, "get_backend", lambda group=None: "nccl")

    def unreachable(**kwargs):
        raise RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc:446] Connection refused\nmore")

    monkeypatch.setattr(stopping.dist, "new_group", unreachable)
    with pytest.raises(UserError, match=r"could not connect over gloo for the stop agreement \(\[enforce fail.*"
                                        r"Connection refused\); set GLOO_SOCKET_IFNAME"):
        stopping.StopAgreement(2, 10, timeout_s=60)


def _job_with_timeout() -> None:
    from ancre_dit.cli import job_processes

    with job_processes(cpu=True, timeout_s=77) as state:
        state.wait_for_everyone()  # both ranks connected before either leaves
        assert state.num_processes == 2 and _timeout(dist.group.WORLD) == timedelta(seconds=77)
        state.wait_for_everyone()


@pytest.mark.slow
def test_a_commands_collective_timeout_reaches_its_process_group():
    run_forked_ranks(_job_with_timeout, 2)


def test_sample_py_passes_its_collective_timeout_on(tmp_path, monkeypatch):
    from helpers import ROOT, load_script

    sample = load_script(ROOT / "sample.py")
    seen = []
    monkeypatch.setattr(sample, "run_job", lambda settings: seen.append(settings))
    sample.main(["--ckpt", str(tmp_path), "--num-samples", "4", "--out", str(tmp_path / "s.npz"),
                 "--collective-timeout-s", "77"])
    sample.main(["--ckpt", str(tmp_path), "--num-samples", "4", "--out", str(tmp_path / "s.npz")])
    assert [s.collective_timeout_s for s in seen] == [77.0, 1800.0]
