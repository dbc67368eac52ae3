"""GPU ranks in the step graph (issue 32, Build 1: launch → kernel and stream order; traceana/causal/gpu_edges.py).

Hand-built GPU steps, written here as Kineto writes them (tests/tracebuilder.py: annotations, cudaLaunchKernel ↔
kernel by correlation id, NCCL record_param_comms with their kernels), read, analysed and made a graph by the same
code as a real run's. Each docstring works the timeline and the counterfactual out by hand (µs): a kernel waits for
its launch, for the kernel before it on its stream and for its inputs (a receive kernel, a collective's last
member); the CPU waiting in cudaDeviceSynchronize is held by the kernels it waits on, and what it does after it
returns is host work before the next kernel it launches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

from traceana.causal import graph, replay
from traceana.causal.whatif import _ideals, changed, parse_set
from traceana.measure.analysis_cache import load_and_analyze

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tracebuilder import TraceBuilder  # noqa: E402
from gen_big_trace import write_run  # noqa: E402
from engine_check import replayed_ns  # noqa: E402

US = 1_000
ZERO = ("forward=0", "backward=0", "optimizer=0", "collective=0", "p2p=0", "host=0")
GEMM = "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(Params)"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


class Gpu:
    """One GPU rank's trace: launches and kernels with running correlation ids."""

    def __init__(self, rank: int, world: int) -> None:
        self.tb = TraceBuilder(rank=rank, world_size=world, backend="nccl", pid=100 + rank, tid=100 + rank)
        self.corr = 0

    def kernel(self, launch_at: float, start: float, dur: float, *, name: str = GEMM, stream: int = 7,
               ext: int = 0) -> None:
        """cudaLaunchKernel at ``launch_at`` (4 µs, or up to the kernel's start) and its kernel."""
        self.corr += 1
        self.tb.launch(launch_at, min(4.0, max(start - launch_at, 0.5)), correlation=self.corr, ext_id=ext)
        self.tb.kernel(name, start, dur, stream=stream, correlation=self.corr, ext_id=ext)

    def p2p(self, op: str, peer: int, at: float, start: float, dur: float) -> None:
        """record_param_comms (``op``: send or recv) at ``at`` launching its SendRecv kernel on stream 20."""
        self.corr += 1
        ext = self.tb._ext + 1
        self.tb.nccl_p2p(op, peer=peer, ts=at, dur=3, kernel_ts=start, kernel_dur=dur, correlation=self.corr)
        self.tb.launch(at + 1, 1, correlation=self.corr, ext_id=ext)

    def allreduce(self, at: float, start: float, dur: float) -> None:
        self.tb.cpu_op("record_param_comms", at, 3, args={
            "Collective name": "allreduce", "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float",
            "Group size": 2, "Process Group Name": "0", "Rank": self.tb.rank})
        self.kernel(at + 1, start, dur, name=ALLREDUCE, stream=20, ext=self.tb._ext)

    def sync(self, at: float, end: float, name: str = "cudaDeviceSynchronize") -> None:
        self.tb._x("cuda_runtime", name, at, end - at, args={"correlation": 0})


def _write(tmp_path: Path, ranks: list[Gpu]) -> str:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    for g in ranks:
        g.tb.write(run / f"rank{g.tb.rank}.pt.trace.json.gz")
    return str(run)


def replayed_us(g: graph.StepGraph, sets: list[str]) -> float:
    """The step replayed with ``sets`` (µs), on the engine and on the batched evaluator (which must agree)."""
    ops, edges = _ideals(g)
    engine = replayed_ns(g, ops, edges, changed(ops, [parse_set(s) for s in sets]))
    (step,) = engine
    return step / US


def _waits(g: graph.StepGraph) -> int:
    return int(g.ops["wait_ns"].sum())


def test_a_kernel_made_shorter_frees_the_cpu_waiting_for_it_in_cuda_device_synchronize(tmp_path):
    """One GPU rank, the CPU ahead of its GPU. F0's kernel (launched at 12) runs 20-220, B0's (launched at 32,
    enqueued behind it) 220-620; the CPU waits in cudaDeviceSynchronize 50-622, runs Python until the optimizer's
    annotation at 650, launches its kernel at 660: it runs 670-770 (the GPU idle 620-670: launched late, host work);
    a last synchronize returns at 772. Step as replayed: 772 (the first 20 µs: the launch of F0's kernel, host).
    B0's kernel at 0 (backward=0): the synchronize returns at 222 instead of 622 and everything after it moves with
    it: the optimizer's kernel runs 270-370, the step is 372. F0's at 0: 572. Host work at 0 (the launches and the
    Python between the synchronize and the next launch, the 2 µs after the last kernel): 700. Nothing is a wait
    (each idle stretch of the GPU came before the launch of the kernel after it)."""
    r = Gpu(0, 1)
    r.tb.step(0, 0, 800)
    r.tb.annotation("PP:0F0", 10, 20)
    r.kernel(12, 20, 200)
    r.tb.annotation("PP:0B0", 30, 20)
    r.kernel(32, 220, 400)
    r.sync(50, 622)
    r.tb.annotation("Optimizer.step#SGD.step", 650, 50)
    r.kernel(660, 670, 100)
    r.sync(700, 772)
    g = graph.build(load_and_analyze(_write(tmp_path, [r]), cache=False))
    got = {a: (s / US, e / US, w / US, h / US) for a, s, e, w, h in
           g.ops.select("action", "start_ns", "end_ns", "work_ns", "gap_ns").with_columns(
               pl.col("start_ns", "end_ns") - g.ranks["start_ns"][0]).iter_rows()}
    assert got == {"F": (20, 220, 200, 20), "B": (220, 620, 400, 0), "O": (670, 770, 100, 50)}
    assert _waits(g) == 0 and g.consistent == (3, 3)
    assert replayed_us(g, []) == 772
    assert replayed_us(g, ["backward=0"]) == 372
    assert replayed_us(g, ["forward=0"]) == 572
    assert replayed_us(g, ["host=0"]) == 700
    assert replayed_us(g, list(ZERO)) == 0


def test_nccl_send_and_receive_kernels_are_the_messages_between_gpu_ranks(tmp_path):
    """pp 2 on two GPUs. Rank 0: F0's kernel 10-210 (launched at 2: the 10 µs before it are host work), its send
    kernel (stream 20) 210-231; the receive of the gradient, launched at 31, runs after it on stream 20, 231-552;
    B0's kernel, launched at 37, is enqueued behind the receive (its input): 552-952; the CPU's synchronize returns
    at 953. Rank 1: its receive (posted at 6) returns at 231, 21 µs after rank 0's send began; F0 231-331 and B0
    331-531 (launched at 7 and 17: they waited for the receive, not for the CPU); the gradient's send 531-551, the
    receive on rank 0 returning at 552. Step: 953.
    Rank 1's backward at half: the gradient leaves at 431 and arrives at 452, rank 0's B0 452-852: 853. Both
    forwards at 0: the activation arrives at 31, rank 1's B0 31-231, the gradient at 252, rank 0's B0 252-652: 653.
    Rank 0's F0 at twice: F0 10-410, its activation at 431, rank 1's F0 431-531 and B0 531-731, the gradient at
    752, rank 0's B0 752-1152: 1153."""
    r0, r1 = Gpu(0, 2), Gpu(1, 2)
    for r in (r0, r1):
        r.tb.step(0, 0, 1000)
    r0.tb.annotation("PP:0F0", 0, 20)
    r0.kernel(2, 10, 200)
    r0.p2p("send", 1, 20, 210, 21)
    r0.p2p("recv", 1, 30, 231, 321)
    r0.tb.annotation("PP:0B0", 35, 10)
    r0.kernel(37, 552, 400)
    r0.sync(45, 953)
    r1.p2p("recv", 0, 0, 6, 225)
    r1.tb.annotation("PP:1F0", 5, 10)
    r1.kernel(7, 231, 100)
    r1.tb.annotation("PP:1B0", 15, 10)
    r1.kernel(17, 331, 200)
    r1.p2p("send", 0, 25, 531, 20)
    r1.sync(30, 552)
    g = graph.build(load_and_analyze(_write(tmp_path, [r0, r1]), cache=False))
    assert g.edges.height == 2 and g.consistent == (4, 4)
    assert _waits(g) == 0
    assert replayed_us(g, []) == 953
    assert replayed_us(g, ["stage=1:backward*0.5"]) == 853
    assert replayed_us(g, ["forward=0"]) == 653
    assert replayed_us(g, ["stage=0:forward*2"]) == 1153
    assert replayed_us(g, list(ZERO)) == 0


def test_a_collective_kernel_waits_on_the_gpu_for_its_last_member(tmp_path):
    """Data parallel on two GPUs (both stage 0). Rank 0: F0 10-110, B0 110-310, its all-reduce kernel starts at 310
    and waits on the GPU for rank 1's, which starts at 500 (rank 1: F0 10-210, B0 210-500); both end at 520; each
    optimizer kernel (launched at 42, enqueued) 520-570; the synchronizes return at 571. Step: 571. Rank 1's backward
    at half (145 µs): it joins at 355, both all-reduces end at 375, the optimizers 375-425: 426. Rank 0's backward at
    0 changes nothing (rank 0 waits for rank 1 either way): 571."""
    ranks = [Gpu(0, 2), Gpu(1, 2)]
    for r, (f, b) in zip(ranks, [(100, 200), (200, 290)]):
        r.tb.step(0, 0, 600)
        r.tb.annotation("PP:0F0", 0, 10)
        r.kernel(2, 10, f)
        r.tb.annotation("PP:0B0", 10, 10)
        r.kernel(12, 10 + f, b)
        r.allreduce(30, 10 + f + b, 520 - (10 + f + b))
        r.tb.annotation("Optimizer.step#SGD.step", 40, 10)
        r.kernel(42, 520, 50)
        r.sync(50, 571)
    g = graph.build(load_and_analyze(_write(tmp_path, ranks), cache=False))
    coll = g.ops.filter(pl.col("action") == "C")
    assert coll.height == 2 and coll["members"].to_list() == [2, 2] and coll["work_ns"].to_list() == [20 * US] * 2
    assert _waits(g) == 0
    assert replayed_us(g, []) == 571
    assert replayed_us(g, ["rank=1:backward*0.5"]) == 426
    assert replayed_us(g, ["rank=0:backward=0"]) == 571
    assert replayed_us(g, list(ZERO)) == 0


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> graph.StepGraph:
    out = tmp_path_factory.mktemp("gpu") / "run"
    write_run(out, ranks=2, dp=2, mb=0.3, gz=False, microbatches=4, kernels=2)
    return graph.build(load_and_analyze(str(out), cache=False))


def test_the_synthetic_gpu_pipeline_has_no_wait_that_no_edge_explains(synthetic):
    """tests/benchmarks/gen_big_trace.py launches every kernel 5 µs before it starts and runs a block's kernels 1 µs
    apart: every idle stretch of a GPU is either before a kernel launched after it began (host) or the GPU's own
    1 µs between enqueued kernels (the operation's work). Before the GPU edges, every operation of those runs had a
    wait no edge explains (5.4–9.0 ms a rank over 5 steps of 4.4 ms): the graph took each operation's GPU span
    against its CPU's events. With every kind at 0 the replay is 0."""
    g = synthetic
    assert _waits(g) == 0
    assert not [n for n in g.notes if n.startswith("waits no edge explains")]
    assert g.consistent[0] == g.consistent[1]
    ops, edges = _ideals(g)
    zeroed = replay.replay_variants(g, ops, edges, [changed(ops, [parse_set(s) for s in ZERO])])[0]
    assert zeroed == [0] * len(g.steps)


def _one_rank(tmp_path: Path, b0_start: float, *, other: bool) -> graph.StepGraph:
    r = Gpu(0, 1)
    r.tb.step(0, 0, 500)
    r.tb.annotation("PP:0F0", 10, 10)
    r.kernel(12, 20, 100)
    if other:  # launched between the two passes' annotations: the work of no operation
        r.kernel(22, 120, 40)
    r.tb.annotation("PP:0B0", 30, 10)
    r.kernel(32, b0_start, 200)
    r.sync(40, b0_start + 201)
    return graph.build(load_and_analyze(_write(tmp_path, [r]), cache=False))


def test_gpu_work_of_no_operation_is_host_work_and_an_idle_gpu_with_the_kernel_launched_is_a_wait(tmp_path):
    """One GPU rank. F0's kernel 20-120 (launched at 12). A kernel launched at 22 outside both passes runs 120-160;
    B0's kernel, launched at 32, is enqueued behind it: 160-360; the synchronize returns at 361. B0's 40 µs before
    its work were the GPU running the work of no operation: host work, no wait; with host time at 0 the step is
    F0 0-100, B0 100-300: 300; with B0 at 0, 161.
    Without that kernel, B0's kernel (launched at 32) starting at 200 instead: the GPU sat idle 120-200 with it
    launched already (waiting on another stream's event, say, which the trace does not show): an 80 µs wait no edge
    explains, said in a note, and not work: it scales with the step's ratio (docs/whatif.md "No frozen time":
    measured work 300 + host gaps 20 = 320; with F0 at 0, 220, so ρ = 0.6875 and the wait 55): F0 at 20, B0
    75-275, the synchronize's 1 µs: 276."""
    g = _one_rank(tmp_path / "a", 160, other=True)
    assert _waits(g) == 0 and g.ops.filter(pl.col("action") == "B")["gap_ns"].to_list() == [40 * US]
    assert replayed_us(g, []) == 361
    assert replayed_us(g, ["host=0"]) == 300
    assert replayed_us(g, ["backward=0"]) == 161
    g = _one_rank(tmp_path / "b", 200, other=False)
    assert _waits(g) == 80 * US and g.ops.filter(pl.col("action") == "B")["gap_ns"].to_list() == [0]
    (note,) = [n for n in g.notes if n.startswith("waits no edge explains")]
    assert "rank 0 0.080 ms" in note and "GPU sat idle" in note
    assert replayed_us(g, []) == 401
    assert replayed_us(g, ["forward=0"]) == 276


def test_a_send_kernel_queued_behind_another_on_its_stream_waits_for_that_ones_message(tmp_path):
    """pp 2 on two GPUs, forwards only. Rank 0: F0's kernel 10-110; activation 0's send kernel (stream 20) 110-340:
    rank 1's CPU was busy until 305 (host work) and its receive kernel started at 310, the transfer took 30; F1's
    kernel (launched at 111) 112-212; activation 1's send, launched at 116, enqueued behind the first on stream 20,
    340-370; rank 0's CPU waits for its compute stream only (cudaStreamSynchronize until 213). Rank 1: both receive
    kernels launched at 305 and 307, the second after the first on its stream, 340-370; F0's kernel (launched at
    341) 342-442, F1's 442-542, synchronize until 543. Step: 543.
    Rank 1's host time at 0: its receives are posted at once, activation 0 is through at 140, activation 1's send
    starts when its input is there (212: its send kernel no longer queued behind a slow one) and is through at 242:
    rank 1's F0 140-240, F1 242-342: 342. Were the 128 µs activation 1's send kernel sat behind the first one rank
    0's host work (its lag after F1), it would still leave at 340: F1 370-470, 470."""
    r0, r1 = Gpu(0, 2), Gpu(1, 2)
    for r in (r0, r1):
        r.tb.step(0, 0, 800)
    r0.tb.annotation("PP:0F0", 0, 20)
    r0.kernel(2, 10, 100)
    r0.p2p("send", 1, 20, 110, 230)
    r0.tb.annotation("PP:0F1", 110, 5)
    r0.kernel(111, 112, 100)
    r0.p2p("send", 1, 115, 340, 30)
    r0.sync(120, 213, "cudaStreamSynchronize")
    r1.tb.cpu_op("aten::copy_", 0, 300)  # (loading data: host work)
    r1.p2p("recv", 0, 304, 310, 30)
    r1.p2p("recv", 0, 306, 340, 30)
    r1.tb.annotation("PP:1F0", 340, 4)
    r1.kernel(341, 342, 100)
    r1.tb.annotation("PP:1F1", 344, 6)
    r1.kernel(345, 442, 100)
    r1.sync(350, 543)
    g = graph.build(load_and_analyze(_write(tmp_path, [r0, r1]), cache=False))
    assert g.edges.height == 2 and g.consistent == (4, 4) and _waits(g) == 0
    assert g.after_receive is not None and g.after_receive.height == 2  # both sides of activation 1
    assert replayed_us(g, []) == 543
    assert replayed_us(g, ["rank=1:host=0"]) == 342
    assert replayed_us(g, list(ZERO)) == 0


def test_a_gpu_ranks_send_kernel_does_not_hold_the_compute_after_it(tmp_path):
    """pp 2 on two GPUs. Rank 0: F0 10-110, activation 0's send kernel 110-340 (rank 1's CPU busy until 305 posts
    its receive at 310; 30 µs through), the CPU busy until 344 too, F1's kernel (launched at 345) 350-450,
    activation 1's send 450-480. Rank 1: the receives (launched at 305, 307; the second queued behind the first on
    stream 20) 310-340 and 340-480, F0 342-442 (launched at 341), F1 480-580; synchronize until 581. Step: 581.
    Rank 1's host time doubled: its receive is posted at 620, activation 0 through at 650; rank 0's F1 does not
    wait for that send (it runs on the compute stream: 350-450, the send of activation 1 queued behind the first
    and through at 680); rank 1's F0 654-754 (its 2 µs of host doubled), F1 754-854, its 1 µs tail doubled: 856.
    Were a GPU send taken to block its sender as gloo's does (graph._blocking), rank 0's F1 would start after
    activation 0 arrived (660-760) and the step read 892."""
    r0, r1 = Gpu(0, 2), Gpu(1, 2)
    for r in (r0, r1):
        r.tb.step(0, 0, 800)
    r0.tb.annotation("PP:0F0", 0, 20)
    r0.kernel(2, 10, 100)
    r0.p2p("send", 1, 20, 110, 230)
    r0.tb.cpu_op("aten::copy_", 30, 314)  # (host work)
    r0.tb.annotation("PP:0F1", 344, 6)
    r0.kernel(345, 350, 100)
    r0.p2p("send", 1, 350, 450, 30)
    r0.sync(355, 451, "cudaStreamSynchronize")
    r1.tb.cpu_op("aten::copy_", 0, 300)
    r1.p2p("recv", 0, 304, 310, 30)
    r1.p2p("recv", 0, 306, 340, 140)
    r1.tb.annotation("PP:1F0", 340, 4)
    r1.kernel(341, 342, 100)
    r1.tb.annotation("PP:1F1", 344, 6)
    r1.kernel(345, 480, 100)
    r1.sync(350, 581)
    g = graph.build(load_and_analyze(_write(tmp_path, [r0, r1]), cache=False))
    assert g.edges.height == 2 and g.consistent == (4, 4) and _waits(g) == 0
    assert g.blocking is None or g.blocking.height == 0
    assert replayed_us(g, []) == 581
    assert replayed_us(g, ["rank=1:host*2"]) == 856


def test_a_gpu_rank_sending_with_gloo_from_its_cpu_is_held_by_its_blocking_send(tmp_path):
    """pp 2: rank 0 on a GPU sends with gloo from its CPU (host staging), rank 1 on a CPU. Rank 0: F0's kernel
    5-105, the CPU copies the activation out (a stream synchronize until 106) and sends it: gloo's send blocks it
    until rank 1, busy with an earlier backward until 295, has received it (295-305); only then does it launch F1's
    kernel (307): 310-410, synchronize until 411. Rank 1: F0 305-405. Step: 411. Rank 1's backward at 0: the
    receive is posted at once, the message through at 116, rank 0's F1 121-221 (the 5 µs from its send's return to
    its kernel, host work, kept), its synchronize until 222; rank 1's F0 116-216: 222. Without the blocking send's
    edge (as an NCCL send kernel has none: the test above) rank 0's F1 would stay at 310-410: 411."""
    r0 = Gpu(0, 2)
    r0.tb.backend = "gloo"
    r0.tb.step(0, 0, 500)
    r0.tb.annotation("PP:0F0", 0, 10)
    r0.kernel(2, 5, 100)
    r0.sync(10, 106, "cudaStreamSynchronize")
    r0.tb.send(peer=1, ts=106, dur=200)
    r0.tb.annotation("PP:0F1", 306, 4)
    r0.kernel(307, 310, 100)
    r0.sync(311, 411, "cudaStreamSynchronize")
    r1 = TraceBuilder(rank=1, world_size=2, pid=201, tid=201)
    r1.step(0, 0, 500)
    r1.annotation("PP:1B5", 0, 295)
    r1.cpu_op("autograd::engine::evaluate_function: MmBackward0", 1, 293)
    r1.recv(peer=0, ts=295, dur=10)
    r1.annotation("PP:1F0", 305, 100)
    r1.cpu_op("aten::mm", 306, 98)
    run = tmp_path / "run"
    run.mkdir()
    r0.tb.write(run / "rank0.pt.trace.json.gz")
    r1.write(run / "rank1.pt.trace.json.gz")
    g = graph.build(load_and_analyze(str(run), cache=False))
    assert g.edges.height == 1 and g.blocking is not None and g.blocking.height == 1
    assert replayed_us(g, []) == 411
    assert replayed_us(g, ["backward=0"]) == 222


def test_the_previous_steps_kernels_still_running_are_a_wait_not_host_work(tmp_path):
    """One GPU rank, the CPU ahead across the step boundary. Step 0's optimizer kernel runs 820-1100, 100 µs into
    step 1 (ProfilerStep 1000-2000), whose F0 kernel, launched at 1012, sits enqueued behind it: 1100-1400; B0
    1400-1700, the optimizer 1700-1900. The 100 µs before F0's work the GPU ran step 0's kernel: not host work of
    step 1 (its CPU had enqueued F0 by 1012) but a wait, the previous step's late end, scaled with the step's ratio as
    a late start is; step 1 as replayed: 900 (1000-1900). With host work at 0 it stays 900 (were those 100 µs host
    work: 800)."""
    r = Gpu(0, 1)
    gpu = {0: [(20, 300), (320, 500), (820, 280)], 1: [(1100, 300), (1400, 300), (1700, 200)],
           2: [(2020, 300), (2320, 300), (2620, 200)]}
    for step, kernels in gpu.items():
        o = 1000 * step
        r.tb.step(step, o, o + 1000)
        for (name, at), (start, dur) in zip([("PP:0F0", 10), ("PP:0B0", 30), ("Optimizer.step#SGD.step", 50)], kernels):
            r.tb.annotation(name, o + at, 10)
            r.kernel(o + at + 2, start, dur)
    g = graph.build(load_and_analyze(_write(tmp_path, [r]), cache=False))
    assert 1 in g.steps
    f = g.ops.filter((pl.col("step") == 1) & (pl.col("action") == "F"))
    assert (f["gap_ns"].item(), f["wait_ns"].item()) == (0, 100 * US)
    (note,) = [n for n in g.notes if n.startswith("waits no edge explains")]
    assert "rank 0 0.100 ms" in note
    ops, edges = _ideals(g)
    steps = dict(zip(g.steps, replay.replay_steps_ns(g)))
    zero_host = dict(zip(g.steps, replay.replay_steps_ns(g, ops=ops.with_columns(pl.lit(0, pl.Int64).alias("gap_ns")))))
    assert steps[1] == zero_host[1] == 900 * US
