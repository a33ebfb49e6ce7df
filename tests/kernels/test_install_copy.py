"""The table path's install copy (``experts/kernels/installs.copy_rows``) as ``ferry bench kernels`` times it
(``bench/kernels._install_copy``): the chosen experts' rows land, whole, in the first slot rows; the rest are not
touched. Interpreter on CPU (host pointers stand in for the mapped ones), compiled on a GPU."""

from __future__ import annotations

import torch

from tests.kernels.interp import kernel_device, load_kernels


def test_install_copy_moves_the_chosen_rows_whole():
    load_kernels("ferrylm.experts.kernels.installs")
    from ferrylm.bench.kernels import _install_copy

    dev = kernel_device()
    e, n = 6, 20000  # bf16 elements per row: 40000 bytes, one whole 32 KiB chunk and a part
    host = torch.randn(e, n).to(torch.bfloat16)
    host = host.pin_memory() if dev.type == "cuda" else host
    ref = torch.zeros(1, n, dtype=torch.bfloat16, device=dev)
    if dev.type == "cuda":
        from ferrylm.experts.slot_table import device_address

        haddr = device_address(host, dev)
    else:
        haddr = host.data_ptr()
    rb = n * 2
    off_host = torch.arange(e, device=dev, dtype=torch.int64) * rb + (haddr - ref.data_ptr())
    dst = torch.full((e, n), -1.0, dtype=torch.bfloat16, device=dev)
    for programs in (1, 3, 64):  # one program walks every chunk; more programs than chunks idle
        dst.fill_(-1.0)
        _install_copy(ref, [4, 1, 3], off_host, dst, rb, e, programs)()
        got = dst.cpu()
        assert torch.equal(got[0], host[4]) and torch.equal(got[1], host[1]) and torch.equal(got[2], host[3])
        assert torch.all(got[3:] == -1.0)
