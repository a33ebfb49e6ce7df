"""In-process 8k prefill of a synthetic model at a cap: wall per prefill, then one profiled prefill's kernel and copy
counts and the top kernels by time. Usage: p8k_prof.py SPEC CAP_GIB TOKENS"""
import collections, json, os, sys, time
import torch
from ferrylm.llm import LLM
from ferrylm.engine.sampling_params import SamplingParams

spec, cap, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
llm = LLM(spec, gpu_memory_limit=cap)
print(f"boot {time.perf_counter() - t0:.1f} s", flush=True)
sp = SamplingParams(max_tokens=1, ignore_eos=True)
walls = []
for r in range(4):
    ids = [[(7 * i + 13 * r + 1) % 997 + 1 for i in range(n)]]
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate(ids, sp)
    torch.cuda.synchronize(); walls.append(time.perf_counter() - t)
print("walls", [round(w, 3) for w in walls], flush=True)
from torch.profiler import profile, ProfilerActivity
ids = [[(11 * i + 5) % 991 + 1 for i in range(n)]]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(ids, sp)
    torch.cuda.synchronize()
kern, copies, ktime = 0, 0, collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        if "Memcpy" in e.name or "Memset" in e.name:
            copies += 1
        else:
            kern += 1
            ktime[e.name[:60]] += e.device_time
print(f"cuda kernels {kern} copies {copies}")
for name, us in ktime.most_common(12):
    print(f"  {us / 1e3:8.1f} ms  {name}")
json.dump({"spec": spec, "cap": cap, "tokens": n, "walls": walls, "kernels": kern, "copies": copies,
           "top": ktime.most_common(20)}, open(os.path.join(os.environ.get("OUT", "/tmp"), f"p8k_{os.environ.get('TAG','x')}.json"), "w"))
