"""``traceana attach`` on unmodified megatron-core and DeepSpeed pipeline jobs (issue 36): the layout each framework
holds (megatron-core's parallel_state and schedule call, DeepSpeed's PipelineEngine) becomes run.json, checked
against the scripts' own configuration (tests/attach_megatron_script.py: 2 ranks, interleaved 1F1B with 2 chunks a
rank, so stages [[0, 2], [1, 3]], 4 micro-batches of 2 sequences; tests/attach_deepspeed_script.py: 2 stages, 1F1B,
4 micro-batches of 8).

The end-to-end runs need megatron-core / deepspeed in the Python that runs them (TRACEANA_FRAMEWORKS_PYTHON, else
this one) and are skipped without; the reading of the frameworks' objects and the run.json it makes are checked
here on stand-ins with the frameworks' own attribute names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from collectors.attach import runtime
from collectors.attach.facts import window_manifest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("TRACEANA_FRAMEWORKS_PYTHON", sys.executable)


def _has(module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    return subprocess.run([PYTHON, "-c", code], capture_output=True).returncode == 0


def _facts(rank: int, **more) -> dict:
    return {"rank": rank, "world_size": 2, "rank_from": "torch.distributed", "window": [3, 5], "warmup": 1,
            "step_source": "optimizer", **more}


def test_megatron_parallel_state_and_schedule_call_are_read(monkeypatch):
    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: True
    ps.get_pipeline_model_parallel_world_size = lambda: 2
    ps.get_pipeline_model_parallel_rank = lambda: 1
    ps.get_virtual_pipeline_model_parallel_world_size = lambda: 2
    ps.get_tensor_model_parallel_world_size = lambda: 1
    ps.get_data_parallel_world_size = lambda: 1
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    state = types.SimpleNamespace(framework={"framework": "megatron-core", "schedule": "interleaved-1f1b",
                                             "schedule_class": "megatron-core forward_backward_pipelining_with_"
                                                               "interleaving", "num_microbatches": 4,
                                             "microbatch_size": 2}, deepspeed_engine=None)
    f = runtime.framework_facts(state)
    # pipeline rank 1 of 2 with 2 chunks holds stages 1 and 3 (megatron's virtual stage v·p + r)
    assert (f["stages"], f["num_stages"], f["schedule"], f["num_microbatches"], f["microbatch_size"]) == \
        ([1, 3], 4, "interleaved-1f1b", 4, 2)


def test_deepspeed_engine_is_read():
    grid = types.SimpleNamespace(data_parallel_size=1, model_parallel_size=1)
    engine = types.SimpleNamespace(stage_id=0, num_stages=2, micro_batches=4, micro_batch_size=8, grid=grid)
    f = runtime.framework_facts(types.SimpleNamespace(framework=None, deepspeed_engine=engine))
    assert (f["framework"], f["stages"], f["num_stages"], f["num_microbatches"], f["microbatch_size"], f["dp"]) == \
        ("deepspeed", [0], 2, 4, 8, 1)


def test_a_frameworks_facts_make_its_run_json():
    common = dict(framework="megatron-core", num_stages=4, schedule="interleaved-1f1b", num_microbatches=4,
                  microbatch_size=2, tp=1, dp=1, stages_from="megatron-core's parallel_state",
                  schedule_class="megatron-core forward_backward_pipelining_with_interleaving")
    m = window_manifest({0: _facts(0, stages=[0, 2], **common), 1: _facts(1, stages=[1, 3], **common)}, (0, 1))
    assert (m.pp, m.stage_of_rank, m.stages_of_rank, m.schedule, m.num_microbatches, m.microbatch_size, m.trainer) \
        == (4, (0, 1), ((0, 2), (1, 3)), "interleaved-1f1b", 4, 2, "megatron-core")
    assert "tensor-parallel degree" not in m.attach["not_detected"] and m.attach["detected"]["tp"]


def _attach(tmp_path: Path, script: str, *extra: str) -> dict:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([PYTHON, "-m", "traceana", "attach", "-o", str(out), "--steps", "3:5", "--", PYTHON, "-m",
                        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / script),
                        *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "run.json").read_text())


@pytest.mark.skipif(not _has("megatron.core"), reason="megatron-core is not installed (TRACEANA_FRAMEWORKS_PYTHON)")
@pytest.mark.multiprocess
def test_attach_on_an_unmodified_megatron_core_job(tmp_path):
    m = _attach(tmp_path, "attach_megatron_script.py", "--interleaved")
    assert {k: m[k] for k in ("world_size", "pp", "tp", "dp", "stage_of_rank", "stages_of_rank", "schedule",
                              "num_microbatches", "microbatch_size", "trainer")} == {
        "world_size": 2, "pp": 4, "tp": 1, "dp": 1, "stage_of_rank": [0, 1], "stages_of_rank": [[0, 2], [1, 3]],
        "schedule": "interleaved-1f1b", "num_microbatches": 4, "microbatch_size": 2, "trainer": "megatron-core"}


@pytest.mark.skipif(not _has("deepspeed"), reason="deepspeed is not installed (TRACEANA_FRAMEWORKS_PYTHON)")
@pytest.mark.multiprocess
def test_attach_on_an_unmodified_deepspeed_job(tmp_path):
    m = _attach(tmp_path, "attach_deepspeed_script.py")
    assert {k: m[k] for k in ("world_size", "pp", "dp", "stage_of_rank", "schedule", "num_microbatches",
                              "microbatch_size", "trainer")} == {
        "world_size": 2, "pp": 2, "dp": 1, "stage_of_rank": [0, 1], "schedule": "1f1b", "num_microbatches": 4,
        "microbatch_size": 8, "trainer": "deepspeed"}
