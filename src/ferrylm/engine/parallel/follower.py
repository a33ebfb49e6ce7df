"""A follower rank (``r > 0``) of a tensor-parallel engine: its shard of the model and a KV pool of its heads, running
every forward rank 0 broadcasts (``step_sync.py``), logits never computed.

It has no scheduler, sampler or IPC of its own: rank 0 is the engine the frontend talks to, and everything a
follower computes reaches rank 0 through the all-reduces. Its life (process ``ferrylm-engine-tp<r>``, spawned by the
supervisor):

* dies with the frontend (``PR_SET_PDEATHSIG``, as the engine) and with rank 0 (a watch thread on rank 0's pid: a
  collective waiting on a dead peer does not reliably fail by itself; the supervisor also kills the followers when
  rank 0 exits);
* ``SHUTDOWN`` -> exit 0; ``ABANDON``, a lost rank 0, or any error of its own -> exit 1 (logged): the supervisor
  restarts the whole group;
* ``SIGUSR1`` dumps its Python stacks (faulthandler), as the engine does.

This module is the process (imported by the supervisor: no torch at import time); the runner is
``follower_runner.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ferrylm.config import EngineConfig

log = logging.getLogger("ferrylm.engine")

LEADER_WATCH_S = 0.5


@dataclass
class FollowerSpec:
    """What a follower process needs, as plain data (crosses ``spawn``).

    ``rendezvous``: the group's file store path; ``parent_pid``: the frontend's pid; ``leader_pid``: rank 0's."""

    model_path: str
    engine_config: dict
    rank: int
    size: int
    rendezvous: str
    parent_pid: int
    leader_pid: int
    log_level: str = "INFO"


def _watch_leader(leader_pid: int, parent_pid: int) -> None:
    """Exit when rank 0 or the frontend is gone (a follower blocked in an NCCL collective would wait forever)."""
    while True:
        try:
            os.kill(leader_pid, 0)
            alive = os.getppid() == parent_pid
        except ProcessLookupError:
            alive = False
        except PermissionError:   # a recycled pid of another user: rank 0 is gone
            alive = False
        if not alive:
            os._exit(1)
        time.sleep(LEADER_WATCH_S)


def follower_main(spec_dict: dict) -> None:
    """Entry point of a follower process (``spawn`` target). Exit codes: 0 after SHUTDOWN, 1 otherwise."""
    from ferrylm.engine.host_malloc import keep_freed_blocks
    from ferrylm.engine.worker import STACK_DUMP_SIGNAL, _die_with_parent, ignore_terminal_signals

    spec = FollowerSpec(**spec_dict)
    _die_with_parent(spec.parent_pid)
    ignore_terminal_signals()    # the frontend owns our life (see engine_main)
    threading.Thread(target=_watch_leader, args=(spec.leader_pid, spec.parent_pid), daemon=True,
                     name="leader-watch").start()
    try:
        import setproctitle

        setproctitle.setproctitle(f"ferrylm-engine-tp{spec.rank}")
    except Exception:  # pragma: no cover - cosmetic
        pass
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(faulthandler, "register"):
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s [engine tp{spec.rank}] %(name)s: %(message)s")
    keep_freed_blocks()
    from ferrylm.engine.engine import resolve_device
    from ferrylm.engine.parallel.follower_runner import build_follower
    from ferrylm.engine.parallel.group import init_group
    from ferrylm.engine.parallel.step_sync import ABANDON, KIND_NAMES, SHUTDOWN
    from ferrylm.models.tensor_parallel import TPShard

    config = EngineConfig(**spec.engine_config)
    code = 1
    try:
        group = init_group(TPShard(spec.rank, spec.size), resolve_device(config.device), spec.rendezvous)
        runner = build_follower(spec.model_path, config, group)
        kind = runner.serve()
        log.info("tensor parallel rank %d: %s from rank 0 after %d steps", spec.rank, KIND_NAMES[kind],
                 runner.steps)
        code = 0 if kind == SHUTDOWN else 1
        if kind == ABANDON:
            log.error("tensor parallel rank %d: rank 0 abandoned the group", spec.rank)
    except Exception as e:  # noqa: BLE001 - any failure ends this rank; the supervisor restarts the group
        log.error("tensor parallel rank %d failed: %r\n%s", spec.rank, e, traceback.format_exc())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
