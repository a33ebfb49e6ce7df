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
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ferrylm.config import EngineConfig
from ferrylm.engine.parallel.group import TPGroup
from ferrylm.engine.parallel.step_sync import ABANDON, KIND_NAMES, SHUTDOWN, StepHeader, StepReceiver, host_step

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


class FollowerRunner:
    """Runs rank 0's steps on this rank's shard.

    Args:
        model: this rank's shard of the model, its layers attached to the group's all-reduce.
        executor: its routed-expert executor (None: dense).
        group: the rank group.
        dtype: the KV pool's dtype (the model's activations).
        attention: the resolved attention backend name (``triton`` / ``torch``), as rank 0's.
    """

    def __init__(self, model, executor, group: TPGroup, dtype: torch.dtype, attention: str):
        self.model = model
        self.executor = executor
        self.group = group
        self.dtype = dtype
        self.attention = attention
        self.receiver = StepReceiver(group)
        self.pool = None
        self._runner = None
        self._budget = -1
        self._copied = None   # CUDA event: the last step's inputs left the receive buffer
        self.steps = 0

    def serve(self) -> int:
        """Run steps until a final header; returns its kind (``SHUTDOWN`` or ``ABANDON``). Raises
        TensorParallelError when rank 0 is lost."""
        while True:
            if self._copied is not None:
                self._copied.synchronize()   # the receive buffer is about to be overwritten
            header, packed = self.receiver.recv()
            if packed is None:
                return header.kind
            self.run(header, packed)

    def _pool_for(self, header: StepHeader):
        if header.runner != self._runner:
            from ferrylm.engine.kv_cache import KVLayout, KVPool

            self.pool = None   # the previous runner's pool goes first (the boot warmup's is small)
            self.pool = KVPool(layout=KVLayout.of(self.model.config), num_pages=header.num_pages,
                               page_size=header.page_size, dtype=self.dtype, device=self.group.device)
            self._runner = header.runner
            log.info("tensor parallel rank %d: KV pool of %d pages x %d tokens (runner %d)", self.group.rank,
                     header.num_pages, header.page_size, header.runner)
        if header.expert_budget != self._budget and hasattr(self.executor, "reserve"):
            self.executor.reserve(header.expert_budget if header.expert_budget >= 0 else None)
            self._budget = header.expert_budget
        return self.pool

    @torch.inference_mode()
    def run(self, header: StepHeader, packed: torch.Tensor) -> None:
        """One forward of ``header.num_tokens`` tokens; the hidden states are dropped (rank 0 samples)."""
        from ferrylm.engine.attention import make_backend
        from ferrylm.engine.model_runner import step_metadata
        from ferrylm.engine.step_inputs import bind_routing_keys

        pool = self._pool_for(header)
        begin = getattr(self.executor, "begin_step", None)
        if begin is not None:
            begin(header.num_tokens)
        host = host_step(header, packed)
        device = self.group.device
        if device.type == "cuda":
            dev = packed.to(device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            dev = packed
        v = header.layout.views(dev)
        attn = make_backend(self.attention, pool, step_metadata(host, v, device, self.attention, pool), device)
        bind_routing_keys(self.model, v["routing_keys"])
        self.model(v["input_ids"], v["positions"], attn)
        self.steps += 1


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


def build_follower(model_path: str, config: EngineConfig, group: TPGroup) -> FollowerRunner:
    """Load this rank's shard as rank 0's ``build_engine`` loads its own (same dtype, backend, seed)."""
    from ferrylm.engine.attention import resolve_backend
    from ferrylm.engine.engine import resolve_dtype
    from ferrylm.engine.factory import apply_memory_limit, expert_options, resolve_auto
    from ferrylm.models.loader import load_model
    from ferrylm.models.synthetic import is_synthetic_folder
    from ferrylm.models.tensor_parallel import attach_reduce

    config.validate()
    device = group.device
    dtype = resolve_dtype(config.dtype, device)
    if config.dtype == "auto" and is_synthetic_folder(model_path):
        dtype = torch.bfloat16
    apply_memory_limit(device, config.gpu_memory_limit)   # --gpu-memory-limit caps every rank
    options = resolve_auto(model_path, config, device, dtype, expert_options(config))
    torch.manual_seed(config.seed)
    loaded = load_model(model_path, device=device, dtype=dtype, moe_backend=options, tp=group.shard)
    attach_reduce(loaded.model, group.all_reduce)
    return FollowerRunner(loaded.model, loaded.executor, group, dtype,
                          resolve_backend(config.attention_backend, device))


def follower_main(spec_dict: dict) -> None:
    """Entry point of a follower process (``spawn`` target). Exit codes: 0 after SHUTDOWN, 1 otherwise."""
    from ferrylm.engine.worker import STACK_DUMP_SIGNAL, _die_with_parent

    spec = FollowerSpec(**spec_dict)
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the frontend owns our life (see engine_main)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    from ferrylm.engine.engine import resolve_device
    from ferrylm.engine.parallel.group import init_group
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
