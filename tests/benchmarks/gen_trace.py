"""Write large, realistic Kineto traces quickly, for ingest benchmarks (never committed: generated on demand).

Two styles, both formatted the way Kineto writes (one key per line group, 2-space indented events):
- ``gpu``: CPU ops launching kernels (cuda_runtime + kernel pairs with correlation ids), NCCL SendRecv kernels with
  their ``record_param_comms`` ops, memcpy/memset, flow events and ProfilerStep annotations;
- ``cpu``: a CPU/gloo pipeline rank: aten cpu_ops with record_shapes args, ``c10d::send``/``c10d::recv_`` with
  Concrete Inputs, ``gloo:send``/``gloo:recv`` annotations and ``[memory]`` instants.

    python tests/benchmarks/gen_trace.py OUT.json --mb 200 --style gpu --rank 0 --world-size 8

Times are µs relative to ``baseTimeNanoseconds`` with nanosecond (3-decimal) resolution, as Kineto writes them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

BASE_NS = 1_790_857_026_000_000_000
_OPS = ("aten::mm", "aten::add", "aten::gelu", "aten::layer_norm", "aten::softmax", "aten::view", "aten::empty",
        "aten::copy_", "aten::addmm", "aten::linear", "aten::t", "aten::transpose", "aten::mul", "aten::zero_")
_KERNELS = (
    "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4::Params)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*, float const*, float const*, float*, float*, float*)",
    "ampere_sgemm_128x64_tn",
)


def _header(rank: int, world_size: int, backend: str) -> str:
    info = {"backend": backend, "rank": rank, "world_size": world_size, "pg_count": 1,
            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": f"cpu:{backend}",
                           "pg_size": world_size, "ranks": list(range(world_size))}]}
    dev = [] if backend == "gloo" else [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85028126720,
                                         "computeMajor": 9, "computeMinor": 0, "numSms": 132}]
    return (
        '{\n  "schemaVersion": 1,\n  "deviceProperties": ' + json.dumps(dev) + ',\n'
        f'  "distributedInfo": {json.dumps(info)},\n'
        f'  "traceana": {json.dumps({"rank": rank, "stage": rank, "pp": world_size, "world_size": world_size})},\n'
        '  "record_shapes": 1,\n  "displayTimeUnit": "ms",\n'
        f'  "baseTimeNanoseconds": {BASE_NS},\n  "traceEvents": [\n'
    )


def _x(cat: str, name: str, pid, tid, ts: float, dur: float, args: str) -> str:
    return (f'  {{\n    "ph": "X", "cat": "{cat}", "name": {json.dumps(name)}, "pid": {pid}, "tid": {tid},\n'
            f'    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      {args}\n    }}\n  }}')


def _gpu_events(rng: random.Random, step: int, t: float, ext: int, corr: int, rank: int, world_size: int):
    out = [_x("user_annotation", f"ProfilerStep#{step}", 1234, 1234, t, 50_000.0, f'"External id": {ext}')]
    t += 1.0
    for i in range(400):
        ext += 1
        corr += 1
        op = _OPS[i % len(_OPS)]
        out.append(_x("cpu_op", op, 1234, 1234, t, 12.345, f'"External id": {ext}, "Record function id": 0, '
                      f'"Sequence number": {i}, "Fwd thread id": 0, "Ev Idx": {ext}'))
        out.append(_x("cuda_runtime", "cudaLaunchKernel", 1234, 1234, t + 2.0, 5.125,
                      f'"External id": {ext}, "cbid": 211, "correlation": {corr}'))
        out.append(f'  {{\n    "ph": "f", "id": {corr}, "pid": 0, "tid": 7, "ts": {t + 20.0:.3f}, "cat": "ac2g", '
                   f'"name": "ac2g", "bp": "e"\n  }}')
        kname = _KERNELS[rng.randrange(len(_KERNELS))]
        out.append(_x("kernel", kname, 0, 7, t + 20.0, 30.5 + rng.random(),
                      f'"External id": {ext}, "queued": 0, "device": 0, "context": 1, "stream": 7, '
                      f'"correlation": {corr}, "registers per thread": 64, "shared memory": 49152, '
                      f'"blocks per SM": 1.5, "warps per SM": 12.0, "grid": [264, 1, 1], "block": [256, 1, 1], '
                      f'"est. achieved occupancy %": 12'))
        if i % 50 == 0:
            ext += 1
            corr += 1
            peer = (rank + 1) % world_size
            out.append(_x("cpu_op", "record_param_comms", 1234, 1234, t + 8.0, 20.0,
                          f'"External id": {ext}, "Collective name": "send", "dtype": "BFloat16", '
                          f'"In msg nelems": 4194304, "Out msg nelems": 4194304, "Group size": {world_size}, '
                          f'"Process Group Name": "0", "Process Group Description": "default_pg", '
                          f'"Dst Rank": {peer}, "Rank": {rank}'))
            out.append(_x("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0, 20,
                          t + 30.0, 800.25, f'"External id": {ext}, "device": 0, "context": 1, "stream": 20, '
                          f'"correlation": {corr}'))
        if i % 40 == 0:
            out.append(_x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 0, 7, t + 25.0, 3.5,
                          f'"External id": {ext}, "device": 0, "context": 1, "stream": 7, "correlation": {corr}, '
                          f'"bytes": 4096, "memory bandwidth (GB/s)": 1.17'))
        t += 40.0 + rng.random()
    return out, t, ext, corr


def _cpu_events(rng: random.Random, step: int, t: float, ext: int, corr: int, rank: int, world_size: int):
    out = [_x("user_annotation", f"ProfilerStep#{step}", 1234, 1234, t, 50_000.0, f'"External id": {ext}')]
    t += 1.0
    alloc = 1 << 20
    for i in range(300):
        ext += 1
        op = _OPS[i % len(_OPS)]
        out.append(_x("cpu_op", op, 1234, 1234, t, 12.345,
                      f'"External id": {ext}, "Sequence number": {i}, "Fwd thread id": 0, "Record function id": 0, '
                      f'"Concrete Inputs": ["", "", ""], "Input type": ["float", "float", "Scalar"], '
                      f'"Input Strides": [[512, 1], [512, 1], []], "Input Dims": [[64, 512], [64, 512], []], '
                      f'"Ev Idx": {ext}'))
        delta = 131072 if i % 2 == 0 else -131072
        alloc += delta
        out.append(f'  {{\n    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1234, '
                   f'"tid": 1234,\n    "ts": {t + 1.0:.3f},\n    "args": {{\n      "Total Reserved": 0, '
                   f'"Total Allocated": {alloc}, "Bytes": {delta}, "Device Id": -1, "Device Type": 0, '
                   f'"Addr": 94080362587264, "finished": false, "Ev Idx": {ext}\n    }}\n  }}')
        if i % 30 == 0:
            peer = (rank + 1) % world_size
            for op_name, ann in (("c10d::send", "gloo:send"), ("c10d::recv_", "gloo:recv")):
                ext += 1
                out.append(_x("cpu_op", op_name, 1234, 1234, t + 2.0, 60.0,
                              f'"External id": {ext}, "Record function id": 0, "Concrete Inputs": ["", "", "{peer}", '
                              f'"0"], "Input type": ["TensorList", "", "Scalar", "Scalar"], '
                              f'"Input Strides": [[[512, 1]], [], [], []], "Input Dims": [[[64, 512]], [], [], []], '
                              f'"Ev Idx": {ext}'))
                ext += 1
                out.append(_x("user_annotation", ann, 1234, 1234, t + 50.0, 400.0,
                              f'"External id": {ext}, "Record function id": 0, "Concrete Inputs": [""], '
                              f'"Input type": ["float"], "Input Strides": [[512, 1]], "Input Dims": [[64, 512]], '
                              f'"Ev Idx": {ext}'))
        t += 40.0 + rng.random()
    return out, t, ext, corr


def write_trace(path: str | Path, *, mb: float, style: str = "gpu", rank: int = 0, world_size: int = 8,
                seed: int = 0) -> Path:
    """Write a trace of about ``mb`` MB of raw JSON (gzipped when the name ends in .gz) and return its path."""
    path = Path(path)
    rng = random.Random(seed + rank)
    backend = "nccl" if style == "gpu" else "gloo"
    make = _gpu_events if style == "gpu" else _cpu_events
    target = int(mb * 1e6)
    opener = (lambda: gzip.open(path, "wt", compresslevel=1)) if path.suffix == ".gz" else (lambda: open(path, "w"))
    with opener() as out:  # streamed: the generator itself stays small, so it does not skew RSS measurements
        head = _header(rank, world_size, backend)
        out.write(head)
        size = len(head)
        t, ext, corr, step = 5_173_640_931_213.347 + rank * 3.0, 1, 1, 0
        while size < target:
            events, t, ext, corr = make(rng, step, t, ext, corr, rank, world_size)
            chunk = ("" if step == 0 else ",\n") + ",\n".join(events)
            out.write(chunk)
            size += len(chunk)
            step += 1
        out.write('\n  ],\n  "traceName": "rank%d.pt.trace.json"\n}\n' % rank)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mb", type=float, default=200.0)
    p.add_argument("--style", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=8)
    a = p.parse_args()
    write_trace(a.out, mb=a.mb, style=a.style, rank=a.rank, world_size=a.world_size)


if __name__ == "__main__":
    main()
