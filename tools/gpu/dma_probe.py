"""Misses of a one-token decode step inside one captured CUDA graph: copied by DMA (the copy engine) on request of
the device, against read by the SMs from mapped host memory. The design question of c1 decode (issue 40): the SMs
read host memory at ~0.6 of the copy engine's rate, but a DMA needs the host to issue it.

  python3 tools/gpu/dma_probe.py [K] [LAYERS] [EXPERT_MIB]   (default 3 misses a layer, 40 layers, 6 MiB experts)

Modes, each one graph replay per step, LAYERS layers of K misses (the miss ids change every step):
  sm    a kernel per layer copies the K experts from pinned (mapped) host memory into a device buffer, then a
        "compute" kernel reads the buffer;
  dma   a kernel per layer posts the K ids to a mapped mailbox (system-scope release), a host thread sees them and
        issues K cuMemcpyHtoDAsync on a copy stream plus cuStreamWriteValue32 of the layer's sequence number; the
        graph's next kernel spins on that word, then the compute kernel reads the buffer;
  post  as dma with no bytes copied (the round trip's own latency).
Prints ms per step, GB/s of miss bytes, and writes $OUT/dma_probe.json.
"""
import ctypes
import json
import os
import sys
import threading
import time

import torch
import triton
import triton.language as tl

K = int(sys.argv[1]) if len(sys.argv) > 1 else 3
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
EXPERT = (int(sys.argv[3]) if len(sys.argv) > 3 else 6) << 20
BANK = 64                                          # experts in the host bank
cuda = ctypes.CDLL("libcuda.so.1")


@triton.jit
def _copy_rows(src_ptr, ids_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    """dst[j] = src[ids[j]] for the layer's K experts (int64 words), program (j, block)."""
    j = tl.program_id(0)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + j).to(tl.int64)
    m = off < n_words
    tl.store(dst_ptr + j * n_words + off, tl.load(src_ptr + e * n_words + off, mask=m), mask=m)


@triton.jit
def _post(ids_ptr, box_ptr, seq_ptr, base_ptr, layer1, kk, KP: tl.constexpr):
    """Write the layer's ``kk`` miss ids to the mapped mailbox, then publish its sequence number ``base + layer1``
    (system-scope release). ``KP``: ``kk`` rounded up to a power of two."""
    k = tl.arange(0, KP)
    tl.store(box_ptr + k, tl.load(ids_ptr + k, mask=k < kk), mask=k < kk)
    tl.atomic_xchg(seq_ptr, tl.load(base_ptr) + layer1, sem="release", scope="sys")


@triton.jit
def _wait(flag_ptr, base_ptr, layer1):
    """Spin until the copy stream wrote the layer's sequence number (or more) to the device word ``flag``."""
    seq = tl.load(base_ptr) + layer1
    v = tl.load(flag_ptr, volatile=True)
    while v < seq:
        v = tl.load(flag_ptr, volatile=True)
    tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")   # the copies' bytes before the consumer's reads


@triton.jit
def _bump(base_ptr, n):
    """The next step's sequence numbers follow this one's."""
    tl.store(base_ptr, tl.load(base_ptr) + n)


@triton.jit
def _consume(buf_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """Read the layer's K copied experts (a stand-in for the expert GEMMs' reads)."""
    j = tl.program_id(0)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(buf_ptr + j * n_words + off, mask=off < n_words, other=0)
    tl.atomic_add(out_ptr, tl.sum(x & 1))


class Poller(threading.Thread):
    """The host side of the dma / post modes: watches the mailbox's sequence word and, for each new layer, issues
    its copies and the completion write on ``stream`` (raw driver calls; no torch on this thread)."""

    def __init__(self, ctx, box, seq_word, bank, buf, flag, stream, copy_bytes: bool):
        super().__init__(daemon=True)
        self.ctx, self.box, self.seq, self.bank, self.buf, self.flag = ctx, box, seq_word, bank, buf, flag
        self.stream, self.copy_bytes, self.stop, self.seen = stream, copy_bytes, False, 0

    def run(self) -> None:
        assert cuda.cuCtxSetCurrent(self.ctx) == 0   # the driver calls below need the context on this thread
        seq_p = ctypes.cast(self.seq.data_ptr(), ctypes.POINTER(ctypes.c_int32))
        box_p = ctypes.cast(self.box.data_ptr(), ctypes.POINTER(ctypes.c_int64))
        words = EXPERT // 8
        while not self.stop:
            s = seq_p[0]
            if s == self.seen:
                time.sleep(0)   # lets the main thread take the GIL (replay, synchronize) at once
                continue
            self.seen = s
            layer = (s - 1) % LAYERS
            if self.copy_bytes:
                for j in range(K):
                    dst = self.buf.data_ptr() + (layer * K + j) * EXPERT
                    src = self.bank.data_ptr() + box_p[j] * words * 8
                    assert cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dst), ctypes.c_void_p(src),
                                                     ctypes.c_size_t(EXPERT), self.stream) == 0
            assert cuda.cuStreamWriteValue32_v2(self.stream, ctypes.c_uint64(self.flag.data_ptr()),
                                                ctypes.c_uint32(s), 0) == 0


def main() -> None:
    dev = torch.device("cuda")
    words = EXPERT // 8
    bank = torch.randint(0, 1 << 30, (BANK, words), dtype=torch.int64).pin_memory()
    ids = torch.zeros(LAYERS, K, dtype=torch.int64, device=dev)
    buf = torch.zeros(LAYERS * K, words, dtype=torch.int64, device=dev)   # a buffer per layer: no reuse hazard
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    box = torch.zeros(K, dtype=torch.int64).pin_memory()
    seq_word = torch.zeros(1, dtype=torch.int32).pin_memory()
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    block = 1024
    grid = (K, triton.cdiv(words, block))
    results = {"k": K, "layers": LAYERS, "expert_bytes": EXPERT, "device": torch.cuda.get_device_name()}

    def new_ids():
        ids.copy_(torch.stack([torch.randperm(BANK)[:K] for _ in range(LAYERS)]))

    base = torch.zeros(1, dtype=torch.int32, device=dev)
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value
    for mode in ("sm", "post", "dma"):
        copy_stream = ctypes.c_void_p()
        assert cuda.cuStreamCreate(ctypes.byref(copy_stream), 1) == 0   # non-blocking
        base.zero_()
        flag.zero_()
        seq_word.zero_()
        torch.cuda.synchronize()
        poller = None
        if mode != "sm":
            poller = Poller(ctx, box, seq_word, bank, buf, flag, copy_stream, copy_bytes=(mode == "dma"))
            poller.start()

        def body() -> None:
            for layer in range(LAYERS):
                if mode == "sm":
                    _copy_rows[grid](bank, ids[layer], buf[layer * K:], words, BLOCK=block)
                else:
                    _post[(1,)](ids[layer], box, seq_word, base, layer + 1, K, KP=triton.next_power_of_2(K))
                    _wait[(1,)](flag, base, layer + 1)
                _consume[grid](buf[layer * K:], out, words, BLOCK=block)
            _bump[(1,)](base, LAYERS)

        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            body()   # warm-up: compiles every kernel
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            body()
        times = []
        for _ in range(12):
            new_ids()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if poller is not None:
            poller.stop = True
            poller.join(5)
        times.sort()
        ms = times[len(times) // 2] * 1e3
        moved = LAYERS * K * EXPERT
        results[mode] = {"ms_per_step": ms, "gb_s": moved / (ms / 1e3) / 1e9 if mode != "post" else None}
        print(f"{mode:5s} {ms:8.2f} ms/step  {moved / 2**20:7.0f} MiB of misses"
              + (f"  {moved / (ms / 1e3) / 1e9:6.1f} GB/s" if mode != "post" else ""), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"dma_probe_k{K}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
