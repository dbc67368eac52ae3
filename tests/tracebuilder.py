"""Build tiny synthetic Kineto traces by hand, shaped like the real ones (see docs/field-notes.md).

Times are given in microseconds, as Kineto writes them. Used across the suite:

    tb = TraceBuilder(rank=0, world_size=2)
    tb.step(0, 0, 100)
    tb.annotation("PP:0F0", 0, 10)
    tb.cpu_op("aten::mm", 1, 8)
    tb.send(peer=1, tag=0, ts=10, dur=2, shape=(4, 8))
    tb.write(tmp_path / "rank0.pt.trace.json.gz")
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

BASE_US = 1_700_000_000_000_000.0  # a realistic absolute wall-clock µs origin
DTYPE_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8, "int": 4}


class TraceBuilder:
    def __init__(
        self,
        *,
        rank: int | None = 0,
        world_size: int | None = 1,
        backend: str = "gloo",
        pid: int | str = 1000,
        tid: int | str = 1000,
        base_us: float = BASE_US,
        distributed_info: bool = True,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.pid, self.tid, self.base_us = pid, tid, base_us
        self.distributed_info = distributed_info
        self.meta = meta
        self.events: list[dict[str, Any]] = []
        self._ext = 0
        self.extra_top: dict[str, Any] = {}

    # --- low level -----------------------------------------------------------------------------------------------
    def event(self, **ev: Any) -> dict[str, Any]:
        self.events.append(ev)
        return ev

    def _x(self, cat: str, name: str, ts: float, dur: float, *, tid=None, args=None, pid=None) -> dict[str, Any]:
        self._ext += 1
        a = {"External id": self._ext}
        if args:
            a.update(args)
        return self.event(
            ph="X", cat=cat, name=name, pid=self.pid if pid is None else pid, tid=self.tid if tid is None else tid,
            ts=self.base_us + ts, dur=dur, args=a,
        )

    # --- CPU side ------------------------------------------------------------------------------------------------
    def step(self, n: int, ts: float, end: float) -> dict[str, Any]:
        return self._x("user_annotation", f"ProfilerStep#{n}", ts, end - ts)

    def annotation(self, name: str, ts: float, dur: float, *, tid=None) -> dict[str, Any]:
        return self._x("user_annotation", name, ts, dur, tid=tid)

    def cpu_op(self, name: str, ts: float, dur: float, *, tid=None, args=None) -> dict[str, Any]:
        return self._x("cpu_op", name, ts, dur, tid=tid, args=args)

    def _p2p(self, op: str, peer: int, tag: int, ts: float, dur: float, shape, dtype: str, wait_dur: float | None):
        dims = [list(shape)]
        self.cpu_op(
            f"c10d::{op}", ts, min(dur, 5.0),
            args={"Concrete Inputs": ["", "", str(peer), str(tag)], "Input type": ["TensorList", "", "Scalar", "Scalar"],
                  "Input Dims": [dims, [], [], []]},
        )
        # gloo:send / gloo:recv spans from posting to the return of wait(): they need not nest. The span ends at
        # ts + dur, when the thread's next work may begin.
        return self.annotation(
            f"gloo:{'send' if op == 'send' else 'recv'}", ts + 0.5, (dur if wait_dur is None else wait_dur) - 0.5,
        ) | {}

    def send(self, *, peer: int, tag: int = 0, ts: float, dur: float, shape=(4, 8), dtype="float", wait_dur=None):
        """c10d::send cpu_op (peer and tag in Concrete Inputs) plus a gloo:send span of length ``dur``."""
        return self._p2p("send", peer, tag, ts, dur, shape, dtype, wait_dur)

    def recv(self, *, peer: int, tag: int = 0, ts: float, dur: float, shape=(4, 8), dtype="float", wait_dur=None):
        return self._p2p("recv_", peer, tag, ts, dur, shape, dtype, wait_dur)

    def memory(self, ts: float, total_allocated: int, delta: int, *, device: int = -1,
               addr: int | None = None) -> dict[str, Any]:
        """An allocator instant; ``addr``: the block's address (Kineto's "Addr"), left out when None (as a trace
        without addresses: the activation peak then falls back to peak − step start, traceana.measure.memory)."""
        return self.event(
            ph="i", s="t", cat="cpu_instant_event", name="[memory]", pid=self.pid, tid=self.tid,
            ts=self.base_us + ts,
            args={"Total Reserved": 0, "Total Allocated": total_allocated, "Bytes": delta, "Device Id": device,
                  "Device Type": 0 if device < 0 else 1, **({} if addr is None else {"Addr": addr})},
        )

    # --- GPU side ------------------------------------------------------------------------------------------------
    def kernel(self, name: str, ts: float, dur: float, *, stream: int = 7, device: int = 0,
               correlation: int | None = None, ext_id: int | None = None, args=None) -> dict[str, Any]:
        a = {"device": device, "stream": stream, "correlation": correlation or 0, "External id": ext_id or 0}
        if args:
            a.update(args)
        return self.event(
            ph="X", cat="kernel", name=name, pid=device, tid=f"stream {stream}", ts=self.base_us + ts, dur=dur, args=a,
        )

    def launch(self, ts: float, dur: float, *, correlation: int, ext_id: int = 0) -> dict[str, Any]:
        return self._x("cuda_runtime", "cudaLaunchKernel", ts, dur, args={"correlation": correlation,
                                                                        "External id": ext_id})

    def nccl_p2p(self, op: str, *, peer: int, ts: float, dur: float, kernel_ts: float, kernel_dur: float,
                 nelems: int = 32, dtype: str = "Float", stream: int = 20, correlation: int = 0, pg: str = "0"):
        """A record_param_comms cpu_op for a NCCL send/recv and its ncclDevKernel_SendRecv kernel."""
        ext = self._ext + 1
        key = "Dst Rank" if op == "send" else "Src Rank"
        self.cpu_op(
            "record_param_comms", ts, dur,
            args={"Collective name": op, "In msg nelems": nelems, "Out msg nelems": nelems, "dtype": dtype,
                  "Group size": self.world_size, "Process Group Name": pg, key: peer, "Rank": self.rank},
        )
        return self.kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", kernel_ts, kernel_dur,
                           stream=stream, correlation=correlation, ext_id=ext)

    # --- output --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [], "baseTimeNanoseconds": 1_700_000_000_000_000}
        if self.distributed_info:
            info: dict[str, Any] = {"backend": self.backend}
            if self.rank is not None:
                info["rank"] = self.rank
            if self.world_size is not None:
                info["world_size"] = self.world_size
                info["pg_count"] = 1
                info["pg_config"] = [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": self.world_size,
                                      "ranks": list(range(self.world_size))}]
            d["distributedInfo"] = info
        if self.meta is not None:
            d["traceana"] = self.meta
        d.update(self.extra_top)
        d["traceEvents"] = self.events
        d["traceName"] = f"rank{self.rank}"
        return d

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        data = self.to_bytes()
        path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
        return path


def write_two_stage_run(directory: str | Path, *, f0_dur: float = 20) -> Path:
    """A tiny annotated two-stage pipeline step, one gzipped trace per rank (µs):
    stage 0: F0 then send; stage 1: recv, F0, B0, send grad; stage 0: recv grad, B0."""
    directory = Path(directory)
    r0 = TraceBuilder(rank=0, world_size=2, pid=10, tid=10)
    r0.step(5, 0, 100)
    r0.annotation("PP:0F0", 0, f0_dur)
    r0.cpu_op("aten::mm", 2, f0_dur - 4)
    r0.send(peer=1, ts=20, dur=5)
    r0.recv(peer=1, ts=30, dur=40)
    r0.annotation("PP:0B0", 70, 20)
    r0.cpu_op("autograd::engine::evaluate_function: MmBackward0", 72, 16)
    r0.memory(1, 4096, 4096)
    r0.memory(75, 8192, 4096)
    r1 = TraceBuilder(rank=1, world_size=2, pid=11, tid=11)
    r1.step(5, 0, 100)
    r1.recv(peer=0, ts=5, dur=21)
    r1.annotation("PP:1F0", 26, 14)
    r1.cpu_op("aten::mm", 27, 12)
    r1.annotation("PP:1B0", 40, 20)
    r1.cpu_op("autograd::engine::evaluate_function: MmBackward0", 41, 18)
    r1.send(peer=0, ts=60, dur=5)
    r0.write(directory / "rank0.pt.trace.json.gz")
    r1.write(directory / "rank1.pt.trace.json.gz")
    return directory
