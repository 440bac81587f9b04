"""Stop signals: SIGTERM, SIGINT and SIGUSR1 ask for a clean stop (finish the step, checkpoint, exit).

The rank's DataLoader workers get the signal too (same process group): rather than die (the loader
would raise, losing the steps since the last checkpoint) they pass it on to the rank as SIGUSR1 and keep
serving. A second Ctrl-C more than REPEAT_SECONDS after the first interrupts at once; copies of one
request (SIGUSR1, a SIGINT torchrun forwards too) never escalate. Ranks agree on stopping every
`check_every` steps over a CPU (gloo) group, which never waits on the GPU queue.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UserError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
REPEAT_SECONDS = 2.0


class StopSignals:
    """Context manager: while active, a stop signal sets `requested` instead of killing the process."""

    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None
        self._first_sigint: float | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (some notebook runners): no handler
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > REPEAT_SECONDS:
                raise KeyboardInterrupt
            self._first_sigint = self._first_sigint or now
        self.requested = True
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # After a stop the work is saved and the process is leaving: a scheduler's repeated SIGTERM
            # must not turn that exit into a kill (SIGINT is given back for Ctrl-C).
            signal.signal(sig, signal.SIG_IGN if self.requested and sig != signal.SIGINT else handler)
        self._previous.clear()


def _forward_to_parent(signum, frame) -> None:
    try:
        os.kill(os.getppid(), signal.SIGUSR1)
    except ProcessLookupError:  # the rank is gone: the worker ends with the loader's own checks
        pass


def worker_signal_handlers(worker_id: int) -> None:
    """DataLoader worker_init_fn: stop signals are passed on to the rank, never fatal here."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _forward_to_parent)


GLOO_HINT = ("set GLOO_SOCKET_IFNAME to the network interface the nodes reach each other on (the one NCCL uses, "
             "e.g. GLOO_SOCKET_IFNAME=ib0 or eth0; `ip -brief addr` lists them)")


def check_gloo_address() -> None:
    """Refuses a multi-node job whose gloo group would bind to a loopback address (with no
    GLOO_SOCKET_IFNAME, the host name's: on many clusters 127.0.1.1, so the group would hang)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= int(os.environ.get("LOCAL_WORLD_SIZE", world)) or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        raise UserError(f"the host name {host} does not resolve, so gloo (the stop agreement) cannot bind; "
                        f"{GLOO_HINT}") from None
    if ipaddress.ip_address(address).is_loopback:
        raise UserError(f"this job spans nodes but the host name {host} resolves to {address}, a loopback address "
                        f"the other nodes cannot reach, and gloo (the stop agreement) would bind there; {GLOO_HINT}")


class StopAgreement:
    """`should_stop(step, signals)`: whether every rank stops after this step. Collective where
    `step % check_every == 0` and at `force=True` calls; elsewhere False without communicating."""

    def __init__(self, num_processes: int, check_every: int, timeout_s: float = 1800.0):
        self.num_processes, self.check_every = num_processes, max(1, check_every)
        self._group = None
        if num_processes == 1:
            return
        if dist.get_backend() == "gloo":
            self._group = dist.group.WORLD
            return
        # Gloo even when training uses NCCL: this flag must not queue behind GPU work (a device sync).
        check_gloo_address()
        try:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.agree(False)  # the first exchange: a rank that cannot reach the others fails here, at start-up
        except (RuntimeError, dist.DistBackendError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise UserError(f"the ranks could not connect over gloo for the stop agreement ({first}); "
                            f"{GLOO_HINT}") from None

    def should_stop(self, step: int, signals: StopSignals | None, force: bool = False) -> bool:
        local = bool(signals is not None and signals.requested)
        if self.num_processes == 1:
            return local
        return (force or step % self.check_every == 0) and self.agree(local)

    def agree(self, local: bool) -> bool:
        """True on every rank when any rank's flag is set (a host-side all-reduce of one integer)."""
        flag = torch.tensor([int(local)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
