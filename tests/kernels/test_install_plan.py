"""The table path's install decision (``experts/kernels/installs.plan_installs``) against a plain reference over
steps that need more experts than the layer's pool holds (a batch's union of routed experts): hits are stamped and
kept, the missed experts of lowest id take the least recently stamped slots, empty ones first, and the misses left
over keep their bank rows (the fused kernel reads them mapped). Interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import numpy as np
import torch
import triton

from tests.kernels.interp import kernel_device, load_kernels

E, POOL, NEVER = 32, 6, np.iinfo(np.int64).max


def _reference_step(pos: np.ndarray, stamp: np.ndarray, owner: np.ndarray, ids: np.ndarray, now: int) -> list[int]:
    """One step of the rule in place; returns the installed experts in rank order."""
    need = np.unique(ids)
    stamp[pos[need[pos[need] >= 0]]] = now
    order = np.lexsort((np.arange(len(stamp)), stamp))
    installed = []
    for r, e in enumerate(need[pos[need] < 0]):
        vp = order[r]
        if stamp[vp] >= now:
            break
        if owner[vp] >= 0:
            pos[owner[vp]] = -1
        owner[vp], stamp[vp], pos[e] = e, now, vp
        installed.append(int(e))
    return installed


def test_plan_installs_overflow_keeps_bank_rows():
    kernels = load_kernels("ferrylm.experts.kernels.installs")
    dev = kernel_device()
    e1 = E + 1
    stamp = np.full(e1, NEVER, dtype=np.int64)
    stamp[:POOL] = -1  # an empty pool
    home = 10**9 + 7 * np.arange(e1, dtype=np.int64)
    off = 1000 * np.arange(e1, dtype=np.int64)
    rows = {k: torch.from_numpy(v.copy()).to(dev) for k, v in dict(
        pos=np.full(e1, -1, dtype=np.int64), stamp=stamp, owner=np.full(e1, -1, dtype=np.int64), off=off,
        table=home, home=home).items()}
    ref_pos, ref_stamp, ref_owner = np.full(E, -1, dtype=np.int64), stamp[:E].copy(), np.full(E, -1, dtype=np.int64)
    now = torch.zeros(1, dtype=torch.int64, device=dev)
    scratch = torch.zeros(2, triton.next_power_of_2(e1), dtype=torch.int64, device=dev)
    sel = torch.empty(12, dtype=torch.int64, device=dev)
    count = torch.zeros(1, dtype=torch.int64, device=dev)
    rng = np.random.default_rng(0)
    overflowed = 0
    for step in range(1, 7):
        ids = np.stack([rng.choice(12 if step % 2 else E, 3, replace=False) for _ in range(4)])  # [T=4, k=3]
        kernels.plan_installs(torch.from_numpy(ids).to(dev), rows, now, scratch, sel, count, bump=True)
        want = _reference_step(ref_pos, ref_stamp, ref_owner, ids, step)
        assert int(count) == len(want) and [int(x) for x in sel[:len(want)].cpu()] == want  # ranks [0, count)
        pos = rows["pos"][:E].cpu().numpy()
        assert np.array_equal(pos, ref_pos)
        table = rows["table"][:E].cpu().numpy()
        assert np.array_equal(table, np.where(pos >= 0, off[np.maximum(pos, 0)], home[:E]))
        need = np.unique(ids)
        overflowed += int(np.sum(pos[need] < 0))
        assert np.sum(pos[need] >= 0) == min(len(need), POOL)  # the pool ends the step full of the step's experts
    assert overflowed > 0, "the trace must need more experts than the pool in some step"
