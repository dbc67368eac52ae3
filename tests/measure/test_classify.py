"""Event kinds: one rule per test on hand-made events, then real third-party traces (HTA's test data)."""

from __future__ import annotations

import warnings

import polars as pl
import pytest
from attribution_builder import EventsBuilder

from traceana.ingest.run_dir import load_run
from traceana.measure.analysis import analyze
from traceana.measure.classify import classify


def kinds(b: EventsBuilder) -> list[tuple[str, str, str | None, str | None]]:
    c = classify(b.events())
    return c.select("name", pl.col("kind").cast(pl.String), "comm_dir", "channel").rows()


def test_gloo_p2p_posts_and_spans_are_p2p_with_a_direction():
    b = EventsBuilder()
    b.send(0, 1, 0, 5)
    b.recv(0, 1, 10, 15)
    assert kinds(b) == [("c10d::send", "p2p_send", "send", "p2p"), ("gloo:send", "p2p_send", "send", "p2p"),
                        ("c10d::recv_", "p2p_recv", "recv", "p2p"), ("gloo:recv", "p2p_recv", "recv", "p2p")]


def test_gloo_collectives_and_c10d_collectives_are_collective():
    b = EventsBuilder()
    b.op(0, "c10d::allreduce_", 0, 5)
    b.ann(0, "gloo:all_reduce", 1, 4, tid="runloop")
    b.op(0, "c10d::barrier", 6, 7)
    assert [k for _, k, _, _ in kinds(b)] == ["collective"] * 3


def test_steps_annotations_and_compute():
    b = EventsBuilder()
    b.step(0, 3, 0, 10)
    b.ann(0, "PP:0F1", 0, 5)
    b.ann(0, "Forward 1", 0, 5)
    b.op(0, "aten::mm", 1, 2)
    c = classify(b.events())
    assert c["kind"].cast(pl.String).to_list() == ["step", "annotation", "annotation", "compute"]
    assert c.select("pp_stage", "pp_action", "pp_microbatch").rows() == [(None, None, None), (0, "F", 1),
                                                                         (None, "F", 1), (None, None, None)]


def test_nccl_sendrecv_kernel_takes_direction_peer_and_size_from_its_launching_op():
    b = EventsBuilder()
    b.nccl(0, "send", 3, launch=0, start=5, end=9)
    b.kernel(0, "sgemm", 9, 12, launch=1)
    c = classify(b.events()).filter(pl.col("is_gpu"))
    assert c.select("kind", "comm_dir", "peer", "nbytes", "launch_ns").rows() == [
        ("p2p_send", "send", 3, 256, 0), ("compute", None, None, None, 1000)]


def test_nccl_sendrecv_kernel_of_a_collective_is_a_collective():
    b = EventsBuilder()
    b.nccl(0, "all_to_all", 3, launch=0, start=5, end=9)
    c = classify(b.events())
    assert c["kind"].cast(pl.String).to_list() == ["collective", "runtime", "collective"]


def test_traffic_inside_bpipe_spans_or_on_the_bpipe_group_is_bpipe():
    b = EventsBuilder()
    b.ann(0, "PP:0EVICT2", 0, 10)
    b.op(0, "aten::copy_", 1, 2)
    b.send(0, 3, 2, 9)
    b.send(0, 1, 20, 25)
    b.send(0, 3, 30, 35)
    b.rows[-2]["pg"] = "traceana_bpipe"
    c = classify(b.events())
    assert c.select("name", pl.col("kind").cast(pl.String), "channel").rows() == [
        ("PP:0EVICT2", "annotation", None), ("aten::copy_", "bpipe_transfer", None),
        ("c10d::send", "bpipe_transfer", "bpipe"), ("gloo:send", "bpipe_transfer", "bpipe"),
        ("c10d::send", "p2p_send", "p2p"), ("gloo:send", "p2p_send", "p2p"),
        ("c10d::send", "bpipe_transfer", "bpipe"), ("gloo:send", "p2p_send", "p2p"),
    ]


# --- real traces from other projects -------------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "trace_filter/sampled_rank-0.json.gz", "nccl_parser_config/nccl_data.json.gz",
    "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", "amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "call_stack/backward_thread.json", "rank_unavailable/rank_not_found.json.gz",
])
def test_third_party_traces_analyse_and_every_step_adds_up(third_party, name):
    with warnings.catch_warnings():  # ingest may warn (e.g. no rank in the trace): its business, not ours
        warnings.simplefilter("ignore")
        run = load_run(third_party / "hta" / name, cache=False)
    a = analyze(run)
    sums = a.attribution.group_by("rank", "step").agg(pl.col("ns").sum())
    check = a.steps.join(sums, on=["rank", "step"])
    assert check.height == a.steps.height and (check["ns"] == check["dur_ns"]).all()
    assert (a.attribution["ns"] >= 0).all()
    assert a.schedule.filter(pl.col("phase") != "optimizer").height == 0  # not pipelines: nothing invented


@pytest.mark.filterwarnings("ignore")
def test_nccl_collective_kernels_are_collectives_and_compute_kernels_busy(third_party):
    run = load_run(third_party / "hta" / "nccl_parser_config" / "nccl_data.json.gz", cache=False)
    c = classify(run.events)
    nccl = c.filter(pl.col("is_gpu") & pl.col("name").cast(pl.String).str.starts_with("ncclKernel"))
    assert nccl.height > 0 and set(nccl["kind"].cast(pl.String)) == {"collective"}
    assert c.filter(pl.col("is_gpu") & (pl.col("kind") == "compute")).height > 1000
    a = analyze(run)
    got = a.attribution.filter(pl.col("ns") > 0)["category"].cast(pl.String).unique().sort().to_list()
    assert got == ["collective", "host", "optimizer", "other_compute"]


@pytest.mark.filterwarnings("ignore")
def test_all_to_all_sendrecv_kernels_are_not_p2p(third_party):
    run = load_run(third_party / "hta" / "trace_filter" / "sampled_rank-0.json.gz", cache=False)
    c = classify(run.events)
    sr = c.filter(pl.col("name").cast(pl.String).str.contains("SendRecv"))
    assert sr.height > 0 and set(sr["kind"].cast(pl.String)) == {"collective"}


# --- communication kernels without one spelling (issue 26, item 1) ---------------------------------------------
FAMILIES = [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),  # NCCL
    ("rcclGenericKernel<1>(ncclDevComm*)", "collective"),  # RCCL
    ("mscclKernel_Sum_float_Simple_false(int, int)", "collective"),  # MSCCL
    ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*)", "collective"),  # DeepEP
    ("void my_ep::internode_ll::combine<__nv_bfloat16>(void*)", "collective"),  # a build in another namespace
    ("void ep::dispatch<4>(int4*)", "collective"),
    ("void moe::cached_notify_combine<8>(int*)", "collective"),  # the all-to-all's notify step, any namespace
    ("void fused_all_to_all_kernel<float>(float*)", "collective"),
    ("void comm::SendrecvKernel(int)", "collective"),
    ("void deep_ep::layout::get_dispatch_layout<256>(long*)", "compute"),  # the layout is local work
    ("cutlass::Kernel<step::dispatch>(Params)", "compute"),  # "step::" is no expert-parallel namespace
    ("void at::native::vectorized_elementwise_kernel<4>(int)", "compute"),
]


@pytest.mark.parametrize("name,kind", FAMILIES)
def test_communication_kernels_are_known_by_family_in_any_namespace(name, kind):
    b = EventsBuilder()
    b.kernel(0, name, 0, 5, launch=0)
    got = classify(b.events()).filter(pl.col("is_gpu"))["kind"].cast(pl.String).to_list()
    assert got == [kind]


def test_kernels_launched_inside_a_communication_call_are_communication():
    """A copy kernel launched inside an all-to-all's c10d op is the collective's; inside a P2P op (a NCCL send's
    record_param_comms) it is P2P's; launched outside any, or from another thread while one runs, or inside a gloo
    span (post → wait return: the thread computes meanwhile), it stays compute."""
    b = EventsBuilder()
    b.op(0, "c10d::alltoall_base_", 0, 10)
    b.kernel(0, "void at::native::copy_kernel(a)", 20, 25, launch=2)  # inside the all-to-all's op
    b.kernel(0, "void at::native::copy_kernel(b)", 26, 30, launch=12)  # after it
    b._add(0, "cpu_op", "record_param_comms", 40, 50, coll="send", peer=1, nbytes=64)
    b.kernel(0, "void at::native::pack_kernel(c)", 51, 55, launch=41)  # inside the send
    b.kernel(0, "void at::native::copy_kernel(d)", 56, 60, launch=3)
    runtime = b.rows[-2]
    runtime["tid"], runtime["track"] = "other", "cpu:100:other"  # launched by another thread during the all-to-all
    b.ann(0, "gloo:send", 70, 90)
    b.kernel(0, "sgemm", 91, 95, launch=75)
    got = dict(classify(b.events()).filter(pl.col("is_gpu")).select("name", pl.col("kind").cast(pl.String)).rows())
    assert got == {"void at::native::copy_kernel(a)": "collective", "void at::native::copy_kernel(b)": "compute",
                   "void at::native::pack_kernel(c)": "p2p_call", "void at::native::copy_kernel(d)": "compute",
                   "sgemm": "compute"}
