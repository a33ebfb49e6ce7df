"""Placement policies and building blocks: the hybrid split (FreeToken q*), the auto choice, host banks, the
prefill double buffer, options."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts import ExpertOptions, build_executor, check_backend, expert_home
from ferrylm.experts.auto import choose_backend, expected_misses, predict_step_times
from ferrylm.experts.banks import HostBanks
from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.hybrid import cpu_effective_rate, split_misses
from ferrylm.experts.options import Bandwidths
from ferrylm.experts.resident import ResidentExecutor
from ferrylm.experts.stream import LayerStreamer, expert_runs
from ferrylm.experts.transfer import HostCopyEngine

GB = 1e9


def _layers(n_layers=2, e=4, h=8, i=6, seed=0) -> dict[int, LayerExperts]:
    g = torch.Generator().manual_seed(seed)
    return {2 * j: LayerExperts(gate=torch.randn(e, i, h, generator=g), up=torch.randn(e, i, h, generator=g),
                                down=torch.randn(e, h, i, generator=g)) for j in range(n_layers)}


@pytest.mark.parametrize("m", [1, 5, 8, 40])
def test_hybrid_split_is_freetoken_q_star_when_cpu_is_host_bound(m):
    bw = Bandwidths(pcie=55 * GB, host=87 * GB, cpu=60 * GB, hbm=4000 * GB)  # B_cpu >= B_host - B_pcie
    assert cpu_effective_rate(bw) == pytest.approx(32 * GB)
    n = split_misses(m, bw)
    assert abs(n - m * 55 / 87) <= 1  # q* = m B_pcie / B_host, rounded to the better integer
    t = lambda k: max(k / bw.pcie, (m - k) / cpu_effective_rate(bw))  # noqa: E731
    assert t(n) == min(t(k) for k in range(m + 1))


def test_hybrid_split_extremes():
    assert split_misses(0, Bandwidths(1, 3, 1, 1)) == 0
    assert split_misses(6, Bandwidths(pcie=100, host=1000, cpu=1e-3, hbm=1)) == 6  # CPU hopeless: fetch all
    assert split_misses(6, Bandwidths(pcie=1e-3, host=1000, cpu=100, hbm=1)) == 0  # PCIe hopeless: CPU all
    assert split_misses(4, Bandwidths(pcie=1, host=3, cpu=1, hbm=1)) == 2


def test_auto_resident_when_it_fits_else_offload_unless_no_layer_fits():
    """auto: resident when every expert fits; else offload whenever the slots hold one layer of a token's experts,
    whatever the (noisy) bandwidth probe predicts, so repeated boots agree; cpu below that."""
    kw = dict(expert_bytes=10, num_layers=4, num_experts=8, top_k=2, stream_bytes=0)
    assert choose_backend(expert_bytes_total=320, budget_bytes=320, bandwidths=None, **kw).backend == "resident"
    assert choose_backend(expert_bytes_total=320, budget_bytes=None, bandwidths=None, **kw).backend == "resident"
    fast_pcie = Bandwidths(pcie=100, host=110, cpu=1, hbm=1000)     # the CPU adds min(1, 110 - 100) = 1
    fast_cpu = Bandwidths(pcie=1, host=1000, cpu=100, hbm=1000)
    for bw in (fast_pcie, fast_cpu):  # the prediction is reported, the pick does not follow the probe
        choice = choose_backend(expert_bytes_total=320, budget_bytes=100, bandwidths=bw, **kw)
        assert choice.backend == "offload", choice
        assert set(choice.predicted) == {"offload", "hybrid", "cpu"}
    assert choose_backend(expert_bytes_total=320, budget_bytes=20, bandwidths=fast_pcie, **kw).backend == "offload"
    assert choose_backend(expert_bytes_total=320, budget_bytes=19, bandwidths=fast_pcie, **kw).backend == "cpu"
    assert choose_backend(expert_bytes_total=320, budget_bytes=5, bandwidths=fast_cpu, **kw).backend == "cpu"
    m = expected_misses(num_layers=4, num_experts=8, top_k=2, slots=16, batch=1)
    assert m == pytest.approx(4 * 2 * 0.5)
    t = predict_step_times(m, 10, fast_pcie)
    assert t == pytest.approx({"offload": 40 / 100, "hybrid": 40 / 101, "cpu": 40 / 1})


def test_host_banks_pack_rows_and_rewrite_views():
    layers = _layers()
    ref = {i: LayerExperts(le.gate.clone(), le.up.clone(), le.down.clone()) for i, le in layers.items()}
    banks = HostBanks.from_layers(layers, pin=False)
    assert banks.layers == (0, 2) and banks.num_experts == 4 and not banks.pinned
    lay = banks.layout
    assert lay == ExpertLayout(hidden=8, inter=6, dtype=torch.float32) and lay.nbytes == 3 * 8 * 6 * 4
    for i, le in ref.items():
        for e in range(4):
            g, u, d = lay.views(banks.row(i, e))
            assert torch.equal(g, le.gate[e]) and torch.equal(u, le.up[e]) and torch.equal(d, le.down[e])
        assert torch.equal(layers[i].gate, le.gate)  # the caller's objects now view the banks
        assert layers[i].gate.untyped_storage().data_ptr() == banks.packed[i].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="another shape"):
        HostBanks.from_layers({0: _layers()[0], 1: _layers(h=4)[0]}, pin=False)


def test_streamer_double_buffer_reuses_and_alternates():
    banks = HostBanks.from_layers(_layers(n_layers=3), pin=False)
    copier = HostCopyEngine()
    copies = []
    plain = copier.copy
    copier.copy = lambda dst, src, after=None: (copies.append(dst.shape[0]), plain(dst, src, after))
    s = LayerStreamer(banks, torch.device("cpu"), copier)
    idx0, n0 = s.acquire(0, [3, 1, 3])
    assert n0 == 2 and idx0 == 0 and copies == [1, 1]
    assert s.prefetch(2, [0, 1, 2, 3]) == 4 and copies[2:] == [4]  # the other buffer; one run, one copy
    copier.wait(s.ready[1])
    assert all(torch.equal(s.buffers[1][e], banks.row(2, e)) for e in range(4))
    assert expert_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)] and expert_runs([]) == []
    idx1, n1 = s.acquire(2, [0, 3])  # already there: nothing copied
    assert idx1 == 1 and n1 == 0
    assert s.prefetch(4, [0]) == 1 and s.layer[0] == 4  # overwrote layer 0's buffer, not the running one
    copier.wait(s.ready[0])
    assert torch.equal(s.buffers[0][0], banks.row(4, 0))
    copier.close()


def test_options_and_names():
    assert check_backend("offload") == "offload"
    with pytest.raises(ValueError, match="unknown MoE backend"):
        ExpertOptions(backend="gpu").validate()
    with pytest.raises(ValueError, match="--moe-cache-size"):
        ExpertOptions(backend="offload", cache_size=-1).validate()
    with pytest.raises(ValueError, match="--moe-cpu-threads"):
        ExpertOptions(backend="cpu", cpu_threads=0).validate()
    assert expert_home("offload", "cuda").type == "cpu" and expert_home("fused", "cpu").type == "cpu"
    with pytest.raises(ValueError, match="resolved before loading"):   # one resolver: the boot's
        build_executor("auto", _layers(), "cpu")


def test_offload_needs_a_slot_and_budget_is_checked():
    from ferrylm.errors import InsufficientMemory

    ex = build_executor(ExpertOptions(backend="offload", stream_prefill=False), _layers(), "cpu")
    per = ex.layout.nbytes
    with pytest.raises(InsufficientMemory, match="needs >= 1"):
        ex.reserve(per - 1)
    assert ex.reserve(5 * per + 3) == 5
    ex2 = build_executor(ExpertOptions(backend="cpu", cache_size=4), _layers(), "cpu")
    assert ex2.reserve(4 * per) == 0  # the two prefill layer buffers (8 experts) come first; cpu works without
    assert ex2.reserve(11 * per) == 3 and ex2.reserve(None) == 4  # the budget wins, then --moe-cache-size
    ex.close()
    ex2.close()


def test_measure_bandwidths_on_the_cpu_reports_rates_and_cpu_job_latency():
    from ferrylm.experts.bandwidth import measure_bandwidths

    layout = ExpertLayout(hidden=64, inter=32, dtype=torch.float32)
    bw = measure_bandwidths("cpu", layout, size_bytes=1 << 20, num_experts=2, reps=1)
    assert all(v > 0 and v != float("inf") for v in bw.as_dict().values())
    assert set(bw.as_dict()) == {"pcie", "host", "cpu", "hbm"}
    assert isinstance(bw.cpu_latency, float) and bw.cpu_latency < 5.0  # seconds beyond the job's bytes


def test_streamer_refills_a_buffer_behind_the_compute_that_read_it():
    """Two MoE layers ahead: after layer 0's compute, layer 4 goes into layer 0's buffer (its copy ordered after
    that compute's fence), while layer 2 is in the other; acquiring 2 and then 4 copies nothing more."""
    banks = HostBanks.from_layers(_layers(n_layers=3), pin=False)   # MoE layers 0, 2, 4
    copier = HostCopyEngine()
    waits = []
    plain = copier.copy
    copier.copy = lambda dst, src, after=None: (waits.append(after), plain(dst, src, after))
    s = LayerStreamer(banks, torch.device("cpu"), copier)
    idx0, _ = s.acquire(0, [0, 1, 2, 3])
    assert s.prefetch(2, [0, 1, 2, 3]) == 4
    fence = copier.fence()   # stands for the fence of layer 0's compute
    s.done_reading(idx0, fence)
    waits.clear()
    assert s.refill(idx0, 4, [0, 1, 2, 3]) == 4 and s.layer[idx0] == 4 and waits == [fence]
    idx2, n2 = s.acquire(2, [0, 1])
    assert idx2 != idx0 and n2 == 0
    idx4, n4 = s.acquire(4, [2, 3])
    assert idx4 == idx0 and n4 == 0
    copier.wait(s.ready[idx4])
    assert all(torch.equal(s.buffers[idx4][e], banks.row(4, e)) for e in range(4))
    copier.close()
