"""Pinned memory (issue 26): the pin budget is probed before the banks are page-locked; banks beyond it stay
pageable from the start, with a warning that states the cost (never a failure half-way through the load)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from ferrylm.experts import banks as banks_mod
from ferrylm.experts.banks import HostBanks, pin_budget
from ferrylm.experts.executor import LayerExperts

GiB = 1 << 30


def _layers(n=2, e=4, h=8, i=6) -> dict[int, LayerExperts]:
    g = torch.Generator().manual_seed(0)
    return {j: LayerExperts(gate=torch.randn(e, i, h, generator=g), up=torch.randn(e, i, h, generator=g),
                            down=torch.randn(e, h, i, generator=g)) for j in range(n)}


def test_banks_over_the_budget_stay_pageable_and_say_the_cost(monkeypatch, caplog) -> None:
    calls = []
    monkeypatch.setattr(banks_mod, "register_host_memory", lambda t: calls.append(t) or None)
    with caplog.at_level(logging.WARNING, logger="ferrylm.experts"):
        b = HostBanks.from_layers(_layers(), pin=True, pin_budget_bytes=1000)
    assert not b.pinned and not calls   # nothing was page-locked, not even the first layer
    msg = caplog.text
    assert "exceed the host's pin budget" in msg and "a third of pinned speed" in msg and "19 vs 55 GB/s" in msg


def test_banks_within_the_budget_are_pinned(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(banks_mod, "register_host_memory", lambda t: calls.append(t) or None)
    monkeypatch.setattr(banks_mod, "_unregister", lambda ptrs: None)
    b = HostBanks.from_layers(_layers(), pin=True, pin_budget_bytes=GiB)
    assert b.pinned and len(calls) == 2


def test_pin_budget_keeps_memory_pageable(monkeypatch) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GiB, available=40 * GiB))
    budget, why = pin_budget(10 * GiB, stacks_on_host=True)
    # others use 24 - 10 (the stacks are ours) = 14 GiB; 6.4 GiB (10 %) kept pageable
    assert budget == 64 * GiB - 14 * GiB - int(6.4 * GiB) and "kept pageable" in why
    budget2, _ = pin_budget(10 * GiB, stacks_on_host=False)
    assert budget2 == budget - 10 * GiB
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * GiB, available=2 * GiB))
    assert pin_budget(GiB, stacks_on_host=False)[0] == 0
