"""``traceana describe``: what a foreign run's traces show, checked against the jobs' real configuration (the
scripts that made them, tests/data/README.md: megatron-core 1F1B and interleaved 1F1B over 2 ranks, 2 model chunks a
rank in the interleaved one, DeepSpeed's PipelineEngine 1F1B over 2 stages; 4 micro-batches each), and the run.json
template it writes (issue 36)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import traceana
from traceana.cli import main
from traceana.commands.describe import describe
from traceana.core.manifest import Manifest
from stripped_runs import as_defaults

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    root = tmp_path_factory.mktemp("describe")
    return {name: as_defaults(DATA / name / "run", root / name.replace("/", "_"))
            for name in ("megatron_pipe/1f1b", "deepspeed_pipe/1f1b")}


def _describe(path):
    return describe(traceana.load_and_analyze(str(path), cache=False))


def test_megatron_profiled_with_the_defaults(defaults):
    d = _describe(defaults["megatron_pipe/1f1b"])
    f = d["facts"]
    assert {k: f[k] for k in ("world_size", "pp", "tp", "dp", "stage_of_rank", "num_microbatches", "schedule",
                              "trainer")} == {"world_size": 2, "pp": 2, "tp": 1, "dp": 1, "stage_of_rank": [0, 1],
                                              "num_microbatches": 4, "schedule": "1f1b", "trainer": "megatron-core"}
    assert "PIPELINE_MODEL_PARALLEL_GROUP" in d["how"]["pp"]
    assert {"model", "microbatch_size", "peak_flops"} <= set(d["missing"])  # never in a trace
    assert "with_stack off" in d["seen"]["profiler"] and "record_shapes off" in d["seen"]["profiler"]


def test_deepspeed_profiled_with_the_defaults_is_described_without_a_framework_name(defaults):
    d = _describe(defaults["deepspeed_pipe/1f1b"])
    f = d["facts"]
    assert (f["stage_of_rank"], f["pp"], f["num_microbatches"], f["schedule"]) == ([0, 1], 2, 4, "1f1b")
    assert "trainer" not in f and d["seen"]["framework"].startswith("not recognised")
    assert "P2P call order" in d["how"]["stage_of_rank"]


def test_interleaved_megatron_with_its_stages_known():
    d = _describe(DATA / "megatron_pipe" / "interleaved" / "run")
    f = d["facts"]
    assert (f["pp"], f["virtual_stages"], f["stages_of_rank"], f["num_microbatches"], f["schedule"]) == \
        (4, 2, [[0, 2], [1, 3]], 4, "interleaved-1f1b")


def test_the_template_is_a_run_json_and_the_run_reads_it(defaults, tmp_path, capsys):
    run = defaults["megatron_pipe/1f1b"]
    out = tmp_path / "run.json"
    assert main(["describe", str(run), "--no-cache", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "microbatch_size: sequences in one micro-batch" in text
    m = Manifest.read(out)
    assert (m.world_size, m.pp, m.schedule, m.num_microbatches, m.stage_of_rank) == (2, 2, "1f1b", 4, (0, 1))
    assert set(json.loads(out.read_text())["_describe"]["to_fill"]) >= {"model", "microbatch_size"}
    copy = tmp_path / "with_run_json"
    shutil.copytree(run, copy)
    shutil.copy(out, copy / "run.json")
    a = traceana.load_and_analyze(str(copy), cache=False)
    assert set(a.stages["stage_source"]) == {"run.json"}


def test_describe_never_writes_over_an_input(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DATA / "deepspeed_pipe" / "1f1b" / "run", run)
    assert main(["describe", str(run), "-o", str(run / "run.json")]) == 2
    assert "the output is an input file" in capsys.readouterr().err
    assert not (run / "run.json").exists()


def test_without_run_json_the_model_asks_for_its_keys(defaults):
    from traceana.core.errors import ConfigError

    a = traceana.load_and_analyze(str(defaults["deepspeed_pipe/1f1b"]), cache=False)
    with pytest.raises(ConfigError) as e:
        a.config.training_config(path=a.run.path)
    msg = str(e.value)
    assert "there is no run.json" in msg and "run.json lacks" not in msg
    assert "model (the model shape" in msg and "microbatch_size (sequences in one micro-batch)" in msg
    assert "traceana describe" in msg and msg.count("in run.json") == 0
    mfu = next(n for n in a.notes if n.startswith("MFU not computed"))
    assert "microbatch_size" in mfu and "there is no run.json" in mfu
