"""The server's private IPC directory: made at start, swept when a dead server left one, and removed even when
the frontend is SIGKILLed.

The zmq endpoints live in ``<tmp>/ferrylm-<pid>-<random>/`` (0700). A clean shutdown removes it. A SIGKILLed
frontend cannot, and its engine cannot either: the kernel SIGKILLs the engine the moment the frontend dies
(``PR_SET_PDEATHSIG``, so that an engine stuck in C code never outlives it), before any of its threads could run.
So each server starts a *janitor* (:class:`IpcDir`): a tiny interpreter (``python -I -S``, no imports beyond
``os``/``shutil``, ~5 MB) that holds the read end of a pipe whose write end only the frontend holds. When the
frontend dies, by any signal, the kernel closes that end, the janitor reads EOF, removes the directory and exits.
It ignores SIGINT/SIGTERM and has its own session, so a terminal's Ctrl-C to the group does not end it before the
frontend. As a second line, a new server sweeps the directories of servers whose pid is gone
(:func:`sweep_stale_ipc_dirs`).

This module must not import torch.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

log = logging.getLogger("ferrylm.supervisor")

IPC_PREFIX = "ferrylm-"
_NAME_RE = re.compile(rf"{IPC_PREFIX}(\d+)-\w+")

# The janitor's whole program (argv: the pipe's read fd, the directory). It removes only a directory whose name
# is an IPC directory's, and only after EOF (the frontend is gone, or closed the pipe at its own clean exit).
_JANITOR = r"""
import os, re, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd, path = int(sys.argv[1]), sys.argv[2]
while True:
    try:
        if not os.read(fd, 64):
            break
    except InterruptedError:
        continue
    except OSError:
        break
if re.fullmatch(r"ferrylm-\d+-\w+", os.path.basename(path)):
    shutil.rmtree(path, ignore_errors=True)
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_ipc_dirs(tmpdir: str | None = None) -> int:
    """Remove IPC dirs left by servers whose pid is gone (and that hold nothing but IPC endpoints, and are ours).
    Returns how many were removed."""
    n = 0
    for d in glob.glob(os.path.join(tmpdir or tempfile.gettempdir(), f"{IPC_PREFIX}*-*")):
        m = _NAME_RE.fullmatch(os.path.basename(d))
        if not m or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        try:
            if os.stat(d).st_uid != os.getuid() or not all(re.fullmatch(r"(in|out)-\d+", f) for f in os.listdir(d)):
                continue  # not ours, or not only IPC endpoints: leave it alone
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        n += 1
    return n


class IpcDir:
    """The private IPC directory of this server and its janitor.

    Args:
        janitor: start the janitor process (False in tests that make many supervisors in one process).
        tmpdir: where to make the directory (default: the system temp dir).

    Attributes:
        path: the directory.
    """

    def __init__(self, *, janitor: bool = True, tmpdir: str | None = None):
        swept = sweep_stale_ipc_dirs(tmpdir)
        if swept:
            log.info("removed %d IPC dirs left by servers that are gone", swept)
        self.path = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-", dir=tmpdir)
        self._wfd: int | None = None
        self._janitor: subprocess.Popen | None = None
        if janitor:
            self._start_janitor()

    def _start_janitor(self) -> None:
        r, w = os.pipe()   # NOTE: both non-inheritable: the engine (spawned later) must never hold the write end
        try:
            self._janitor = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _JANITOR, str(r), self.path], pass_fds=(r,),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
            self._wfd = w
        except OSError as e:   # no janitor: a SIGKILLed server's dir is then swept by the next server
            log.warning("could not start the IPC dir janitor (%s); a SIGKILLed server leaves %s behind", e,
                        self.path)
            os.close(w)
        finally:
            os.close(r)

    @property
    def janitor_pid(self) -> int | None:
        return None if self._janitor is None else self._janitor.pid

    def remove(self, wait_s: float = 2.0) -> None:
        """Remove the directory now and let the janitor go (it sees EOF). Idempotent; ``wait_s``: how long to
        wait for the janitor to exit (it is reaped; 0 = do not wait)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._wfd is not None:
            os.close(self._wfd)
            self._wfd = None
        if self._janitor is not None and wait_s > 0:
            try:
                self._janitor.wait(wait_s)
            except subprocess.TimeoutExpired:
                log.warning("the IPC dir janitor %d did not exit", self._janitor.pid)
