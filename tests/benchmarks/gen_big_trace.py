"""Stream large GPU pipeline-parallel Kineto traces to disk, for the HTA comparison and the multi-GB test.

Why a second generator beside ``gen_trace.py`` (ingest's): this one *streams* (a 4 GB trace is written step by step
in constant memory, gzipped on the fly with isal) and shapes each rank as one stage of a GPipe pipeline on a GPU:
``PP:{stage}F{mb}`` / ``PP:{stage}B{mb}`` annotations around cpu_ops that launch kernels on compute stream 7
(cudaLaunchKernel ↔ kernel pairs by correlation id, ``ac2g`` flows), NCCL ``record_param_comms`` send/recv ops with
their ``ncclDevKernel_SendRecv`` kernels on stream 20 between neighbouring stages, a data-parallel all-reduce and an
optimizer step per iteration, and CUDA ``[memory]`` instants. Ranks of one run share a wall clock and their sends and
receives line up, so attribution has real bubbles and transfers to find, and HolisticTraceAnalysis (which needs GPU
kernels for its temporal breakdown) reads the same files.

    python tests/benchmarks/gen_big_trace.py OUT_DIR --ranks 4 --mb 200          # rank{R}.pt.trace.json.gz, ~200 MB raw each
    python tests/benchmarks/gen_big_trace.py OUT_DIR --ranks 1 --mb 4200 --plain # one ~4.2 GB uncompressed rank0.pt.trace.json

Event text follows Kineto's layout (2-space indented objects, µs with 3 decimals, ``distributedInfo`` before
``traceEvents`` so HTA's rank regex finds it in the first lines). Sizes are of the raw (uncompressed) JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

BASE_NS = 1_790_857_026_000_000_000
# Kineto's ``ts`` is µs on the profiler's clock (baseTimeNanoseconds aside); keep it small enough that the 3
# written decimals are exact in a float64, as in real traces (e.g. 5173640931213.347).
BASE_US = 5_173_640_931_000.0
CPU_TID = 4242
COMPUTE_STREAM, COMM_STREAM = 7, 20

_FWD_OPS = ("aten::linear", "aten::layer_norm", "aten::gelu", "aten::scaled_dot_product_attention", "aten::add",
            "aten::dropout", "aten::view", "aten::matmul")
_KERNELS = (
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>("
    "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)"
    "::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
    "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, "
    "false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
)
_SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
_ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


class _Writer:
    """Formats Kineto events for one rank; keeps the running ids and the CUDA allocator total."""

    def __init__(self, rank: int, pp: int, rng: random.Random, *, dp: int = 1) -> None:
        # Megatron's layout (tp = 1): global rank = stage * dp + replica; a pipeline is one replica's stages.
        self.rank, self.pp, self.dp, self.rng = rank, pp, dp, rng
        self.stage, self.replica = divmod(rank, dp)
        self.pid = 1000 + rank
        self.ext = 0
        self.corr = 0
        self.allocated = 8 << 30
        self.out: list[str] = []

    def _x(self, cat: str, name: str, pid, tid, ts: float, dur: float, args: str) -> None:
        self.out.append(
            f'  {{\n    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": {pid}, "tid": {tid},\n'
            f'    "ts": {BASE_US + ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      {args}\n    }}\n  }}'
        )

    def annotation(self, name: str, ts: float, dur: float) -> None:
        self.ext += 1
        self._x("user_annotation", name, self.pid, CPU_TID, ts, dur, f'"External id": {self.ext}, "Record function id": 0, "Ev Idx": {self.ext}')

    def memory(self, ts: float, delta: int) -> None:
        self.allocated += delta
        self.out.append(
            f'  {{\n    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": {self.pid}, '
            f'"tid": {CPU_TID},\n    "ts": {BASE_US + ts:.3f},\n    "args": {{\n      "Total Reserved": 21474836480, '
            f'"Total Allocated": {self.allocated}, "Bytes": {delta}, "Device Id": 0, "Device Type": 1, '
            f'"Addr": 139872450560000, "Ev Idx": {self.ext}\n    }}\n  }}'
        )

    def launch(self, op: str, kernel: str, cpu_ts: float, gpu_ts: float, gpu_dur: float, *, stream: int,
               op_args: str = "") -> None:
        """cpu_op → cudaLaunchKernel → kernel, linked by External id and correlation, as Kineto writes them."""
        self.ext += 1
        self.corr += 1
        ext, corr = self.ext, self.corr
        self._x("cpu_op", op, self.pid, CPU_TID, cpu_ts, 9.125,
                f'"External id": {ext}, "Record function id": 0, "Sequence number": {corr}, "Fwd thread id": 0, '
                f'"Ev Idx": {ext}{op_args}')
        self._x("cuda_runtime", "cudaLaunchKernel", self.pid, CPU_TID, cpu_ts + 2.5, 4.875,
                f'"External id": {ext}, "cbid": 211, "correlation": {corr}')
        self.out.append(f'  {{\n    "ph": "s", "id": {corr}, "pid": {self.pid}, "tid": {CPU_TID}, '
                        f'"ts": {BASE_US + cpu_ts + 2.5:.3f}, "cat": "ac2g", "name": "ac2g"\n  }}')
        self.out.append(f'  {{\n    "ph": "f", "id": {corr}, "pid": 0, "tid": {stream}, '
                        f'"ts": {BASE_US + gpu_ts:.3f}, "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }}')
        self._x("kernel", kernel, 0, stream, gpu_ts, gpu_dur,
                f'"External id": {ext}, "queued": 0, "device": 0, "context": 1, "stream": {stream}, '
                f'"correlation": {corr}, "registers per thread": 128, "shared memory": 49152, '
                f'"blocks per SM": 1.94, "warps per SM": 7.76, "grid": [256, 1, 1], "block": [128, 1, 1], '
                f'"est. achieved occupancy %": 12')

    def comm(self, coll: str, peer: int | None, ts: float, gpu_ts: float, gpu_dur: float, nelems: int) -> None:
        key = "" if peer is None else (f', "Dst Rank": {peer}' if coll == "send" else f', "Src Rank": {peer}')
        args = (f', "Collective name": "{coll}", "In msg nelems": {nelems}, "Out msg nelems": {nelems}, '
                f'"Group size": {self.pp}, "dtype": "BFloat16", "In split size": "[]", "Out split size": "[]", '
                f'"Process Group Name": "0", "Process Group Description": "default_pg", "Rank": {self.rank}{key}')
        self.launch("record_param_comms", _ALLREDUCE if coll == "allreduce" else _SENDRECV, ts, gpu_ts, gpu_dur,
                    stream=COMM_STREAM, op_args=args)

    def peer(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's pipeline."""
        return stage * self.dp + self.replica

    def block(self, ts: float, n_kernels: int, kernel_us: float) -> float:
        """``n_kernels`` compute launches back to back on the GPU from ``ts``; returns the GPU end time."""
        t = ts
        for i in range(n_kernels):
            dur = kernel_us * (0.6 + 0.8 * self.rng.random())
            self.launch(_FWD_OPS[i % len(_FWD_OPS)], _KERNELS[i % len(_KERNELS)], t - 5.0, t, dur,
                        stream=COMPUTE_STREAM)
            t += dur + 1.0
        return t


def _step(w: _Writer, step: int, t0: float, *, microbatches: int, kernels: int, kernel_us: float,
          transfer_us: float, nelems: int, overlap_optimizer: bool = False) -> float:
    """One GPipe iteration of stage ``w.stage`` starting at ``t0`` (µs); returns its end. ``overlap_optimizer``:
    the optimizer's kernels (compute stream) start 188 µs into the all-reduce's (communication stream), which runs
    on beside them for 192 µs: a rank running two operations at once on two streams."""
    r, pp, m = w.stage, w.pp, microbatches
    t_f = kernels * (kernel_us * 1.4 + 1.0) + transfer_us + 30.0  # one forward slot, including its hand-over
    t_b = 2 * kernels * (kernel_us * 1.4 + 1.0) + transfer_us + 30.0
    fwd_end = t0 + (m + pp - 1) * t_f
    step_end = fwd_end + (m + pp - 1) * t_b + 900.0  # all-reduce, then the optimizer
    start = len(w.out)
    for mb in range(m):
        slot = t0 + (r + mb) * t_f
        w.annotation(f"PP:{r}F{mb}", slot, t_f - 5.0)
        t = slot + 2.0
        if r > 0:  # the activation from the previous stage arrives during this slot's first transfer_us
            w.comm("recv", w.peer(r - 1), t, t, transfer_us, nelems)
            t += transfer_us
        t = w.block(t + 6.0, kernels, kernel_us)
        w.memory(t, 64 << 20)
        if r < pp - 1:
            w.comm("send", w.peer(r + 1), t, t + 1.0, transfer_us, nelems)
    for i in range(m):  # GPipe backward: micro-batches in reverse order, the last stage first
        mb = m - 1 - i
        slot = fwd_end + (i + (pp - 1 - r)) * t_b
        w.annotation(f"PP:{r}B{mb}", slot, t_b - 5.0)
        t = slot + 2.0
        if r < pp - 1:
            w.comm("recv", w.peer(r + 1), t, t, transfer_us, nelems)
            t += transfer_us
        t = w.block(t + 6.0, 2 * kernels, kernel_us)
        w.memory(t, -(64 << 20))
        if r > 0:
            w.comm("send", w.peer(r - 1), t, t + 1.0, transfer_us, nelems)
    t = fwd_end + (m + pp - 1) * t_b
    w.comm("allreduce", None, t, t + 2.0, 380.0, nelems)  # data-parallel gradient sync
    at = 190.0 if overlap_optimizer else 395.0
    w.annotation("Optimizer.step#AdamW.step", t + at - 5.0, 500.0)
    w.block(t + at, 4, 100.0)
    # The ProfilerStep annotation encloses the iteration; Kineto writes it before its children.
    w.ext += 1
    w.out.insert(start, (
        f'  {{\n    "ph": "X", "cat": "user_annotation", "name": "ProfilerStep#{step}", "pid": {w.pid}, '
        f'"tid": {CPU_TID},\n    "ts": {BASE_US + t0 - 10.0:.3f}, "dur": {step_end - t0 + 20.0:.3f},\n'
        f'    "args": {{\n      "External id": {w.ext}, "Record function id": 0, "Ev Idx": {w.ext}\n    }}\n  }}'
    ))
    return step_end + 50.0


def _header(rank: int, pp: int, dp: int = 1) -> str:
    world = pp * dp
    info = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1,
            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                           "pg_size": world, "ranks": list(range(world))}],
            "nccl_version": "2.21.5"}
    dev = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85028126720, "computeMajor": 9,
            "computeMinor": 0, "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,
            "regsPerBlock": 65536, "warpSize": 32, "sharedMemPerBlock": 49152, "numSms": 132}]
    meta = {"rank": rank, "stage": rank // dp, "pp": pp, "world_size": world, "schedule": "gpipe", "bpipe": False}
    return (
        '{\n  "schemaVersion": 1,\n'
        f'  "distributedInfo": {json.dumps(info)},\n'
        f'  "deviceProperties": {json.dumps(dev)},\n'
        f'  "traceana": {json.dumps(meta)},\n'
        '  "record_shapes": 1,\n  "with_stack": 0,\n  "displayTimeUnit": "ms",\n'
        f'  "baseTimeNanoseconds": {BASE_NS},\n  "traceEvents": [\n'
    )


def _open(path: Path):
    if path.suffix == ".gz":
        from isal import igzip  # fast gzip (level 1) so writing does not dominate the benchmark's setup

        return igzip.open(path, "wb", compresslevel=1)
    return open(path, "wb")


def write_rank(path: str | Path, *, rank: int, pp: int, mb: float, microbatches: int = 8, kernels: int = 48,
               kernel_us: float = 40.0, transfer_us: float = 150.0, seed: int = 0,
               progress: bool = False, dp: int = 1, overlap_optimizer: bool = False) -> dict:
    """Write one rank's trace of about ``mb`` MB raw JSON (gz if the name ends in .gz); return its size facts.

    ``dp`` data-parallel replicas of the ``pp``-stage pipeline: global rank = stage * dp + replica (Megatron's
    order), P2P only within a replica, the all-reduce across replicas. ``overlap_optimizer``: ``_step``'s."""
    path = Path(path)
    rng = random.Random(seed * 1009 + rank)
    w = _Writer(rank, pp, rng, dp=dp)
    target = int(mb * 1e6)
    written, steps, t = 0, 0, 0.0
    t_start = time.perf_counter()
    with _open(path) as fh:
        head = _header(rank, pp, dp).encode()
        fh.write(head)
        written += len(head)
        while written < target:
            w.out.clear()
            t = _step(w, steps, t, microbatches=microbatches, kernels=kernels, kernel_us=kernel_us,
                      transfer_us=transfer_us, nelems=4 << 20, overlap_optimizer=overlap_optimizer)
            chunk = ((",\n" if steps else "") + ",\n".join(w.out)).encode()
            fh.write(chunk)
            written += len(chunk)
            steps += 1
            if progress and steps % 50 == 0:
                print(f"\r  rank {rank}: {written / 1e6:8.0f} / {target / 1e6:.0f} MB", end="", file=sys.stderr)
        tail = f'\n  ],\n  "traceName": "rank{rank}.pt.trace.json"\n}}\n'.encode()
        fh.write(tail)
        written += len(tail)
    if progress:
        print(f"\r  rank {rank}: {written / 1e6:8.0f} MB in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return {"path": str(path), "raw_bytes": written, "steps": steps, "file_bytes": path.stat().st_size}


def write_run(out_dir: str | Path, *, ranks: int, mb: float, gz: bool = True, progress: bool = False,
              dp: int = 1, **kw) -> list[dict]:
    """Write ``ranks`` stages (× ``dp`` replicas) as ``rank{R}.pt.trace.json[.gz]`` (no run.json: HTA would read it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = ".pt.trace.json.gz" if gz else ".pt.trace.json"
    return [write_rank(out_dir / f"rank{r}{suffix}", rank=r, pp=ranks, dp=dp, mb=mb, progress=progress, **kw)
            for r in range(ranks * dp)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--ranks", type=int, default=4, help="pipeline stages, one trace each")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (ranks x dp traces)")
    p.add_argument("--mb", type=float, default=200.0, help="raw JSON MB per rank")
    p.add_argument("--plain", action="store_true", help="write .json instead of .json.gz")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--kernels", type=int, default=48, help="compute kernels per forward (backward: 2x)")
    p.add_argument("--overlap-optimizer", action="store_true",
                   help="the optimizer's kernels start while the all-reduce still runs on its stream (two streams "
                        "at once)")
    a = p.parse_args()
    facts = write_run(a.out_dir, ranks=a.ranks, dp=a.dp, mb=a.mb, gz=not a.plain, progress=a.dp == 1,
                      microbatches=a.microbatches, kernels=a.kernels, overlap_optimizer=a.overlap_optimizer)
    for f in facts:
        print(f"{f['path']}: {f['raw_bytes'] / 1e6:.0f} MB raw, {f['file_bytes'] / 1e6:.0f} MB on disk, {f['steps']} steps")


if __name__ == "__main__":
    main()
