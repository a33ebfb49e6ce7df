"""The fused MoE kernels reading each expert through a byte-offset table (``row_offset``): the offloading backends'
one launch per layer, where an expert is a slot-cache row or a host bank row in another allocation (on a GPU: mapped
pinned memory read over PCIe). Plain and quantized rows, decode and prefill tiles, against the torch reference.
CPU: Triton's interpreter in float32; GPU: bfloat16 (tests/gpu runs this file too)."""

from __future__ import annotations

import pytest
import torch

from ferrylm.experts.executor import ExpertLayout
from ferrylm.experts.executor import LayerExperts
from ferrylm.experts.quantized import ExpertQuant, QuantFormat, random_quant
from ferrylm.experts.resident import run_grouped
from tests.kernels.interp import kernel_device, load_kernels

QUANTS = {
    "plain": None,
    "int4-mins/int8": ExpertQuant(QuantFormat("int4", 16, torch.float32, mins=True),
                                  QuantFormat("int8", 32, torch.float16)),
    "nvfp4": ExpertQuant(QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True),
                         QuantFormat("fp4", 16, torch.float8_e4m3fn, row_scale=True)),
    "fp8": ExpertQuant(QuantFormat("fp8", 32, torch.float32), QuantFormat("fp8", 32, torch.float32)),
}


def _layer(name: str, e: int, i: int, h: int, dtype, gen) -> LayerExperts:
    q = QUANTS[name]
    if q is None:
        return LayerExperts(*(torch.randn(e, *s, generator=gen).div(s[1] ** 0.5).to(dtype)
                              for s in ((i, h), (i, h), (h, i))))
    return LayerExperts(gate=random_quant(q.gate_up, (e,), i, h, generator=gen, std=h ** -0.5, dtype=dtype),
                        up=random_quant(q.gate_up, (e,), i, h, generator=gen, std=h ** -0.5, dtype=dtype),
                        down=random_quant(q.down, (e,), h, i, generator=gen, std=i ** -0.5, dtype=dtype))


@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.parametrize("t", [1, 3, 40], ids=["decode1", "decode3", "prefill"])
def test_row_offset_reads_experts_from_two_allocations(name, t):
    """Half the experts in a 'slot' buffer (scattered rows), half in a separate 'host' buffer: one launch, the
    reference's result. The offsets are byte distances from the slot buffer's row 0, negative ones included."""
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, k, h, i = 8, 2, 128, 64
    gen = torch.Generator().manual_seed(t + 7 * len(name))
    le = _layer(name, e, i, h, dtype, gen)
    lay = ExpertLayout.of(le)
    rows = torch.zeros(e, lay.numel, dtype=lay.row_dtype)
    lay.pack(rows, le)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    ref = run_grouped(lay.layer_views(rows), x, ids, w).double()
    other = torch.zeros(e + 2, lay.numel, dtype=lay.row_dtype)  # allocated first: often below the slots' address
    slots = torch.zeros(e // 2 + 3, lay.numel, dtype=lay.row_dtype, device=dev)
    if dev.type == "cuda":  # the 'host' rows: pinned host memory the kernel reads over PCIe
        other = other.pin_memory()
    where = torch.randperm(slots.shape[0], generator=gen)[:e // 2]
    row_bytes = lay.nbytes
    offsets = []
    for j in range(e):
        if j % 2 == 0:  # in a slot
            s = int(where[j // 2])
            slots[s].copy_(rows[j])
            offsets.append(s * row_bytes)
        else:  # in the other allocation, row j + 1
            other[j + 1].copy_(rows[j])
            offsets.append(other[j + 1].data_ptr() - slots.data_ptr())
    v = lay.layer_views(slots)
    out = m.fused_moe(x.to(dev), v.gate, v.up, v.down, ids.to(dev), w.to(dev),
                      row_offset=torch.tensor(offsets, dtype=torch.int64, device=dev))
    assert out.dtype == dtype and out.shape == (t, h)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel


def test_row_offset_and_slot_of_are_exclusive():
    m = load_kernels("ferrylm.experts.kernels.fused_moe")
    dev = kernel_device()
    x = torch.zeros(1, 16, device=dev)
    g = torch.zeros(2, 8, 16, device=dev)
    d = torch.zeros(2, 16, 8, device=dev)
    ids = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="not both"):
        m.fused_moe(x, g, g, d, ids, torch.ones(1, 1, device=dev), slot_of=torch.zeros(2, dtype=torch.int32,
                                                                                         device=dev),
                    row_offset=torch.zeros(2, dtype=torch.int64, device=dev))
