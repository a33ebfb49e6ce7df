"""A tensor-parallel follower's runner: rank 0's broadcast steps run on this rank's shard and KV pool
(``follower.py`` is the process around it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.attention import backend_factory, resolve_backend
from ferrylm.engine.cache.kv_pool import KVLayout, KVPool
from ferrylm.engine.model_runner import step_metadata
from ferrylm.engine.parallel.group import TPGroup
from ferrylm.engine.parallel.step_sync import StepHeader, StepReceiver, host_step
from ferrylm.engine.step_inputs import bind_routing_keys
from ferrylm.experts.executor import ExpertExecutor
from ferrylm.faults import NO_FAULTS
from ferrylm.models.tensor_parallel import attach_reduce

log = logging.getLogger("ferrylm.engine")


@dataclass(eq=False)
class FollowerRunner:
    """Runs rank 0's steps on this rank's shard.

    Attributes:
        model: this rank's shard of the model, its layers attached to the group's all-reduce.
        executor: its routed-expert executor (None: dense).
        group: the rank group.
        dtype: the model's activations (the KV pool's unless ``kv_cache_dtype`` is ``fp8``).
        attention: the resolved attention backend name (``triton`` / ``torch``), as rank 0's.
        kv_cache_dtype: ``--kv-cache-dtype``, as rank 0's.
        steps: forwards run so far.
    """

    model: Any
    executor: ExpertExecutor | None
    group: TPGroup
    dtype: torch.dtype
    attention: str
    kv_cache_dtype: str = "auto"
    steps: int = field(default=0, init=False)
    pool: KVPool | None = field(default=None, init=False)   # the current runner's KV pool
    _runner: int | None = field(default=None, init=False)   # which of rank 0's runners ``pool`` serves
    _budget: int = field(default=-1, init=False)            # the expert budget last reserved
    _copied: torch.cuda.Event | None = field(default=None, init=False)   # the last step's inputs left the buffer

    def __post_init__(self):
        self.receiver = StepReceiver(self.group)
        self._attention_backend = backend_factory(self.attention)

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
            self.pool = None   # the previous runner's pool goes first (the boot warmup's is small)
            self.pool = KVPool(layout=KVLayout.of(self.model.config), num_pages=header.num_pages,
                               page_size=header.page_size, dtype=self.dtype, device=self.group.device,
                               kv_cache_dtype=self.kv_cache_dtype)
            self._runner = header.runner
            log.info("tensor parallel rank %d: KV pool of %d pages x %d tokens (runner %d)", self.group.rank,
                     header.num_pages, header.page_size, header.runner)
        if header.expert_budget != self._budget and self.executor is not None:
            self.executor.reserve(header.expert_budget if header.expert_budget >= 0 else None)
            self._budget = header.expert_budget
        return self.pool

    @torch.inference_mode()
    def run(self, header: StepHeader, packed: torch.Tensor) -> None:
        """One forward of ``header.num_tokens`` tokens; the hidden states are dropped (rank 0 samples)."""
        pool = self._pool_for(header)
        if self.executor is not None:
            self.executor.begin_step(header.num_tokens)
        host = host_step(header, packed)
        device = self.group.device
        if device.type == "cuda":
            dev = packed.to(device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            dev = packed
        v = header.layout.views(dev)
        attn = self._attention_backend(pool, step_metadata(host, v, device, self.attention, pool), device, NO_FAULTS)
        bind_routing_keys(self.model, v["routing_keys"])
        self.model(v["input_ids"], v["positions"], attn)
        self.steps += 1


def build_follower(model_path: str, config: EngineConfig, group: TPGroup) -> FollowerRunner:
    """Load this rank's shard by the boot's own steps up to loading (``engine/boot.py``: same dtype, backend,
    seed)."""
    from ferrylm.engine.boot import load_weights, resolve_target
    from ferrylm.engine.expert_choice import resolve_expert_backend

    config.validate()
    target = resolve_target(model_path, config, group.device)   # --gpu-memory-limit caps every rank
    options = resolve_expert_backend(ModelConfig.from_folder(model_path), target.config, target.device, target.dtype)
    loaded, _ = load_weights(model_path, target, options, group.shard)
    attach_reduce(loaded.model, group.all_reduce)
    return FollowerRunner(loaded.model, loaded.executor, group, target.dtype,
                          resolve_backend(config.attention_backend, group.device), config.kv_cache_dtype)
