"""Build schema.EVENTS frames (and a Run) directly, in integer microseconds, for attribution tests.

Shaped like ingest's output for real traces (docs/field-notes.md): a CPU/gloo P2P message is a short ``c10d::send`` /
``c10d::recv_`` cpu_op carrying peer and tag, plus a ``gloo:send`` / ``gloo:recv`` user annotation from the post to
the return of wait(); a GPU message is a ``record_param_comms`` op plus an ``ncclDevKernel_SendRecv`` kernel.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from traceana.core.manifest import Manifest
from traceana.core.schema import EVENTS, MEMORY, TRACES, conform
from traceana.ingest import Run

US = 1000  # ns per µs


class EventsBuilder:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.mem: list[dict] = []
        self._ext = 0

    def _add(self, rank: int, cat: str, name: str, start: float, end: float, *, tid: str = "main", **kw) -> dict:
        self._ext += 1
        gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
        row = {"rank": rank, "pid": "gpu" if gpu else "100", "tid": tid, "cat": cat, "name": name,
               "track": f"gpu:0:{tid}" if gpu else f"cpu:100:{tid}", "is_gpu": gpu,
               "ts_ns": int(start * US), "dur_ns": int((end - start) * US), "ext_id": self._ext}
        row.update(kw)
        self.rows.append(row)
        return row

    def step(self, rank: int, n: int, start: float, end: float) -> None:
        self._add(rank, "user_annotation", f"ProfilerStep#{n}", start, end)

    def op(self, rank: int, name: str, start: float, end: float, *, tid: str = "main") -> None:
        self._add(rank, "cpu_op", name, start, end, tid=tid)

    def ann(self, rank: int, name: str, start: float, end: float, *, tid: str = "main") -> None:
        self._add(rank, "user_annotation", name, start, end, tid=tid)

    def send(self, rank: int, peer: int, post: float, end: float, *, tag: int = 0, nbytes: int = 128) -> None:
        self._add(rank, "cpu_op", "c10d::send", post, min(post + 1, end), peer=peer, tag=tag, nbytes=nbytes)
        self._add(rank, "user_annotation", "gloo:send", post, end)

    def recv(self, rank: int, peer: int, post: float, end: float, *, tag: int = 0, nbytes: int = 128) -> None:
        self._add(rank, "cpu_op", "c10d::recv_", post, min(post + 1, end), peer=peer, tag=tag, nbytes=nbytes)
        self._add(rank, "user_annotation", "gloo:recv", post, end)

    def kernel(self, rank: int, name: str, start: float, end: float, *, stream: int = 7, launch: float | None = None,
               **kw) -> dict:
        corr = self._ext + 1000
        if launch is not None:
            self._add(rank, "cuda_runtime", "cudaLaunchKernel", launch, launch + 0.5, corr_id=corr)
        return self._add(rank, "kernel", name, start, end, tid=f"stream {stream}", device=0, stream=stream,
                         corr_id=corr, ext_id=None, **kw)

    def nccl(self, rank: int, op: str, peer: int, *, launch: float, start: float, end: float) -> None:
        """record_param_comms (send/recv, peer) on the CPU and its SendRecv kernel on the NCCL stream."""
        cpu = self._add(rank, "cpu_op", "record_param_comms", launch, launch + 1, coll=op, peer=peer, nbytes=256)
        k = self.kernel(rank, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", start, end, stream=20,
                        launch=launch)
        k["ext_id"] = cpu["ext_id"]

    def memory(self, rank: int, ts: float, allocated: int, delta: int, *, device: int = -1) -> None:
        self.mem.append({"rank": rank, "ts_ns": int(ts * US), "device": device, "allocated_bytes": allocated,
                         "delta_bytes": delta})

    def events(self) -> pl.DataFrame:
        return conform(pl.DataFrame(self.rows, infer_schema_length=None), EVENTS)

    def run(self, manifest: Manifest | None = None, *, events: pl.DataFrame | None = None) -> Run:
        ev = self.events() if events is None else events
        ranks = sorted(set(ev["rank"].to_list()))
        traces = conform(pl.DataFrame({"rank": ranks, "world_size": [len(ranks)] * len(ranks)}), TRACES)
        memory = conform(pl.DataFrame(self.mem, schema=MEMORY) if self.mem else pl.DataFrame(), MEMORY)
        return Run(path=Path("synthetic"), events=ev, memory=memory, traces=traces, manifest=manifest)


def table(rows: list[tuple], columns: list[str], schema: dict) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={c: schema[c] for c in columns}, orient="row")
