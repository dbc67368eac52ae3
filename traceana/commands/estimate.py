"""Estimate memory per pipeline stage, whether it fits, the step time and MFU, and whether BPipe would help.

Give a model preset (--model llama-65b) or an explicit shape (--family/--layers/--hidden/--heads/...), the parallel
layout and the batch. The step time comes from the schedule simulator fed with FLOPs at an efficiency E(b): measured
points (--efficiency 1:0.45,2:0.50) or an assumed saturating curve, which the output says.
"""
# The modelled durations reach the engine through model.simulate.engine_inputs (model.bpipe.estimate_step), the path
# whatif's plans feed a run's measured durations through.

# Function-local imports here: cost. The model (and polars) is imported with the parser (estimate reads no run's
# traces, so no small-run setting waits for it); the measured analysis and validation (--efficiency-from), the
# tables' module (not for --json) and export only on the paths that use them.

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys

from traceana.commands import options
from traceana.commands.options import microbatch_count
from traceana.core.errors import BadInputError, ConfigError
from traceana.core.flops import HFU_COUNTS, MFU_COUNTS
from traceana.core.manifest import FAMILIES, MANIFEST_NAME, Manifest, ModelShape, check_peak_flops
from traceana.core.pipeline_rules import default_virtual_stages, stages_of_device, why_no_bpipe
from traceana.core.training_config import PRECISIONS, TrainingConfig
from traceana.core.units import GIB as GiB
from traceana.core.units import GB, MS_PER_S, bytes_text
from traceana.model.bpipe import EfficiencyCurve, Network, bpipe_verdict, estimate_step
from traceana.model.memory import estimate_stage_memory, reserve_bytes
from traceana.model.presets import DEVICES, MODELS, TINY_MODELS, Device, device_preset, model_preset

DEFAULT_DEVICE = "a100-80gb"


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    options.model(m, default=None, presets=MODELS, help="a model preset")
    m.add_argument("--family", choices=FAMILIES, help="model family, for an explicit shape (default: the preset's)")
    for f, what in (("layers", "transformer layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                    ("kv-heads", "key/value heads (grouped-query attention)"), ("ffn", "feed-forward size"),
                    ("vocab", "vocabulary size"), ("seq", "sequence length")):
        m.add_argument(f"--{f}", type=int, metavar="N", help=f"{what} (default: the preset's)")
    # The training configuration collect shares: options.py defines each flag and its default once.
    r = p.add_argument_group("training")
    r.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree")
    options.pp(r)
    options.dp(r)
    options.microbatch_size(r)
    options.microbatches(r)
    r.add_argument("--global-batch", type=int, metavar="N",
                   help="sequences per step, sets the micro-batch count instead of --microbatches (default: "
                        "--microbatches × micro-batch size × dp)")
    options.schedule(r)
    r.add_argument("--virtual-stages", type=int, default=None, metavar="N",
                   help="model chunks per device, for the multi-stage schedules (default: 2 for zbv and dualpipev, else 1)")
    options.attention(r)
    options.recompute(r)
    options.bpipe(r)
    r.add_argument("--sequence-parallel", action="store_true", help="shard activations across tensor-parallel ranks")
    r.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer state across dp ranks")
    r.add_argument("--precision", choices=PRECISIONS, default="mixed-adam", help="weights, gradients and optimizer")
    d = p.add_argument_group("device and network")
    d.add_argument("--device", default=DEFAULT_DEVICE, help=f"one of {', '.join(DEVICES)}")
    d.add_argument("--device-memory-gib", type=float, metavar="GIB", help="device memory (default: the device's)")
    options.peak_flops(d, help="peak FLOP/s per device, e.g. 312e12 (default: the device's)")
    d.add_argument("--reserve-gib", type=float, metavar="GIB",
                   help="memory to keep free (allocator, workspaces) (default: 10%% of the device's)")
    d.add_argument("--efficiency", metavar="B:E,...",
                   help="measured compute efficiency per micro-batch size, e.g. 1:0.42,2:0.47 (default: an assumed "
                        "saturating curve)")
    d.add_argument("--efficiency-from", nargs="+", metavar="RUN_DIR",
                   help="measure the efficiency curve from traced runs at different micro-batch sizes (the BPipe "
                        "re-evaluation's method), on the device given by --device/--peak-flops (default: none)")
    d.add_argument("--p2p-gbps", type=float, default=25.0, metavar="GB/S", help="GB/s for pipeline messages")
    d.add_argument("--bpipe-gbps", type=float, default=25.0, metavar="GB/S", help="GB/s for BPipe evictions")
    d.add_argument("--bpipe-blocking", action="store_true", help="BPipe transfers do not overlap compute")
    p.add_argument("--bpipe-baseline", default="best-without-bpipe",
                   choices=("as-configured", "best-without-bpipe", "full-recompute"),
                   help="what the BPipe verdict compares with (full-recompute: the BPipe paper's Megatron baseline)")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="take the model and configuration from a collected run's run.json (its device: the CPU "
                        "trainer's eager activations); what validate then compares with the measured peaks "
                        "(default: the flags above)")
    p.add_argument("--no-verdict", action="store_true", help="skip the BPipe search")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _shape(args: argparse.Namespace) -> ModelShape:
    overrides = {k: getattr(args, k.replace("-", "_")) for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq")}
    overrides["kv_heads"] = args.kv_heads
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.model:
        base = model_preset(args.model)
        if args.family:
            overrides["family"] = args.family
        return dataclasses.replace(base, **overrides)
    need = [f for f in ("layers", "hidden", "heads") if f not in overrides]
    if not args.family or need:
        raise ConfigError("no model given", fix="pass --model PRESET, or --family with --layers --hidden --heads")
    return ModelShape(args.family, **overrides)


def _curve(spec: str | None) -> EfficiencyCurve:
    if not spec:
        return EfficiencyCurve()
    try:
        pts = tuple((float(b), float(e)) for b, e in (item.split(":") for item in spec.split(",")))
    except ValueError:
        raise ConfigError(f"cannot read --efficiency {spec!r}", fix="write pairs b:efficiency, e.g. 1:0.42,2:0.47")
    return EfficiencyCurve(points=pts, source="measured")


def _from_run(args: argparse.Namespace) -> TrainingConfig:
    """The configuration a collected run's run.json describes, as validate reads it (``RunConfig``, without the
    traces: their analysis is validate's)."""
    from pathlib import Path

    from traceana.core.run_config import RunConfig  # (cost: the reconciled facts only for --from-run)

    path = Path(args.from_run)
    path = path / MANIFEST_NAME if path.is_dir() else path
    if not path.is_file():
        raise BadInputError("no run.json here", path=path, fix="give a run directory written by `traceana collect`")
    return RunConfig.from_manifest(Manifest.read(path)).training_config(path=path)  # refusals name run.json keys


def build(args: argparse.Namespace) -> tuple[TrainingConfig, Device, EfficiencyCurve, Network]:
    if args.from_run:
        cfg = _from_run(args)
        return cfg, _device(args), _curve(args.efficiency), _network(args)
    model = _shape(args)
    if args.microbatches is None:
        if args.global_batch is None:
            m = microbatch_count(args)  # the shared default (commands/options.py)
        else:
            per = args.global_batch // args.dp
            if args.global_batch % (args.dp * args.microbatch_size):
                raise ConfigError(
                    f"global batch {args.global_batch} is not a multiple of dp × micro-batch size",
                    fix="choose a global batch divisible by dp·b",
                )
            m = per // args.microbatch_size
    else:
        m = args.microbatches
    cfg = TrainingConfig(
        model=model, pp=args.pp, tp=args.tp, dp=args.dp, microbatch_size=args.microbatch_size, num_microbatches=m,
        schedule=args.schedule, attention=args.attention, recompute=args.recompute, bpipe=args.bpipe,
        virtual_stages=default_virtual_stages(args.schedule) if args.virtual_stages is None else args.virtual_stages,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer, precision=PRECISIONS[args.precision],
        # the tiny presets are the reference trainer's models: eager PyTorch, no dropout (collectors/trainer)
        eager=bool(args.model and args.model.lower() in TINY_MODELS),
        dropout=False if args.model and args.model.lower() in TINY_MODELS else None,
    )
    dev = _device(args)
    if args.efficiency_from and args.efficiency:
        raise ConfigError("--efficiency and --efficiency-from both give the efficiency curve", fix="pass one of them")
    curve = _measured_curve(args.efficiency_from, dev.peak_flops) if args.efficiency_from else _curve(args.efficiency)
    return cfg, dev, curve, _network(args)


def _measured_curve(run_dirs: list[str], peak_flops: float) -> EfficiencyCurve:
    """E(b) measured on each run (validation.measured_efficiency) at the device's peak FLOP/s."""
    from traceana.measure.analysis_cache import load_and_analyze
    from traceana.validation import measured_efficiency

    points = [measured_efficiency(load_and_analyze(d, progress=False), peak_flops=peak_flops) for d in run_dirs]
    return EfficiencyCurve.measured(points, source="measured from " + ", ".join(run_dirs))


def _network(args: argparse.Namespace) -> Network:
    return Network(args.p2p_gbps * GB, args.bpipe_gbps * GB, not args.bpipe_blocking)


def _device_total(args: argparse.Namespace) -> tuple[Device, float]:
    """The device preset (the CPU for a collected run, unless --device is given: no memory limit, no peak) and its
    whole memory (--device-memory-gib overrides)."""
    if args.from_run and args.device == DEFAULT_DEVICE:
        dev = Device("cpu", float("inf"), 0.0, "collected run")
    else:
        dev = device_preset(args.device)
    for flag, v in (("--device-memory-gib", args.device_memory_gib), ("--reserve-gib", args.reserve_gib)):
        if v is not None and not (math.isfinite(v) and (v > 0 if flag == "--device-memory-gib" else v >= 0)):
            raise ConfigError(f"{flag} must be a {'positive' if flag == '--device-memory-gib' else 'non-negative'} "
                              f"number of GiB, got {v}", fix=f"give {flag} in GiB, e.g. 80")
    total = args.device_memory_gib * GiB if args.device_memory_gib is not None else dev.memory_bytes
    if args.reserve_gib is not None and total != float("inf") and args.reserve_gib * GiB >= total:
        raise ConfigError(f"--reserve-gib {args.reserve_gib:g} keeps the whole device free ({total / GiB:g} GiB): "
                          "nothing would be left for the model", fix="give --reserve-gib less than the device memory")
    return dev, total


def _device(args: argparse.Namespace) -> Device:
    """The device with its usable memory: its memory less the reserve (``reserve_of``)."""
    check_peak_flops(args.peak_flops)
    dev, total = _device_total(args)
    return Device(dev.name, total - reserve_of(args, total),
                  args.peak_flops if args.peak_flops else dev.peak_flops, dev.source)


def reserve_of(args: argparse.Namespace, total: float) -> float:
    """Memory kept free: --reserve-gib, else memory.reserve_bytes's default (10 % of the device); none without a
    memory limit."""
    if total == float("inf"):
        return 0.0
    return reserve_bytes(total, None if args.reserve_gib is None else args.reserve_gib * GiB)


def report(cfg: TrainingConfig, dev: Device, curve: EfficiencyCurve, net: Network, *, verdict: bool,
           baseline: str = "best-without-bpipe", reserve: float = 0.0, on_progress=None) -> dict:
    """``dev.memory_bytes`` is what is usable: the device's memory less ``reserve``. ``on_progress(done, total)``:
    the BPipe verdict's simulated configurations."""
    stages = estimate_stage_memory(cfg)
    step = estimate_step(cfg, device=dev, curve=curve, network=net) if dev.peak_flops else None
    out = {
        "model": dataclasses.asdict(cfg.model),
        # (the JSON keeps its released key for TrainingConfig.bpipe_inflight, bpipe_keep: a format others read)
        "config": {
            {"bpipe_inflight": "bpipe_keep"}.get(k, k): v for k, v in dataclasses.asdict(cfg).items()
            if k not in ("model", "precision")
        } | {"precision": cfg.precision.name, "global_batch": cfg.global_batch},
        "device": {"name": dev.name, "memory_bytes": None if dev.memory_bytes == float("inf") else dev.memory_bytes,
                   "peak_flops": dev.peak_flops,
                   "reserve_bytes": reserve},
        "stages": [
            {
                "stage": s.stage, "layers": s.layers, "params": s.params, "weight_bytes": s.weight_bytes,
                "grad_bytes": s.grad_bytes, "optimizer_bytes": s.optimizer_bytes,
                "activation_per_microbatch": s.activation_per_microbatch, "in_flight": s.in_flight,
                "foreign_in_flight": s.foreign_in_flight, "activation_bytes": s.activation_bytes,
                "backward_working_bytes": s.backward_working_bytes,
                "recompute_working_bytes": s.recompute_working_bytes,
                "activation_peak_bytes": s.activation_peak_bytes, "total_bytes": s.total_bytes, "fits": s.total_bytes <= dev.memory_bytes,
            }
            for s in stages
        ],
        "fits": all(s.total_bytes <= dev.memory_bytes for s in stages),
        "step": None if step is None else {"seconds": step.step_s, "mfu": step.mfu, "mfu_counts": MFU_COUNTS,
                                           "hfu": step.hfu, "hfu_counts": HFU_COUNTS if step.hfu is not None else None,
                                           "fits": all(s.total_bytes <= dev.memory_bytes for s in stages),
                                           "efficiency": step.efficiency,
                                           "efficiency_source": curve.source, "terms_s": step.terms},
    }
    why_none = _no_verdict(cfg, verdict=verdict, step=step)
    if why_none is not None:
        out["bpipe"] = {"verdict": None, "why_none": why_none}
        return out
    whole = Device(dev.name, dev.memory_bytes + reserve, dev.peak_flops, dev.source)
    v = bpipe_verdict(cfg, device=whole, curve=curve, network=net, baseline=baseline, reserve_bytes=reserve,
                      on_progress=on_progress)
    out["bpipe"] = {
        "verdict": "helps" if v.helps else "does not help", "baseline": v.baseline, "why": v.why,
        "helps": v.helps, "speedup": v.speedup, "fits_without_bpipe": v.fits_without,
        "deciding_term": v.deciding_term, "deltas_s": v.deltas,
        "sentence": v.sentence, "assumptions": list(v.assumptions),
        "reference": v.reference.describe(), "reference_step_s": v.reference.step_s,
        "with_bpipe": v.with_bpipe.describe() if v.with_bpipe else None,
        "with_bpipe_step_s": v.with_bpipe.step_s if v.with_bpipe else None,
        "deciding_configuration": v.deciding_config, "margin_bytes": v.margin_bytes, "flips": v.flips,
        "flip_notes": v.flip_notes, "margin": v.margin_line(), "warnings": list(v.warnings),
    }
    return out


def _no_verdict(cfg: TrainingConfig, *, verdict: bool, step) -> str | None:
    """Why there is no BPipe verdict for this configuration (None: there is one); printed, never dropped silently."""
    if not verdict:
        return "skipped (--no-verdict)"
    if step is None:
        return "needs a step time, and there is none without the device's peak FLOP/s (pass --peak-flops)"
    why = why_no_bpipe(cfg.schedule, pp=cfg.pp, virtual_stages=cfg.virtual_stages)  # the rules' one predicate
    if why is not None:
        return why + ("" if cfg.pp < 2 else ": rerun with --schedule 1f1b to ask it of the same model")
    return None


def render(out: dict, *, console) -> None:
    """Print the estimate on ``console``: the configuration, one row per stage (memory in MiB), the step time (in one
    unit), and the BPipe verdict."""
    from traceana.core.tables import mib, plural, print_line, print_table

    m, c = out["model"], out["config"]
    kv = f" ({m['kv_heads']} kv)" if m["kv_heads"] else ""
    print_line(console, f"{m['name'] or m['family']}: {m['family']}, {plural(m['layers'], 'layer')}, h {m['hidden']}, "
               f"{plural(m['heads'], 'head')}{kv}, ffn {m['ffn'] or 'default'}, vocab {m['vocab']}, seq {m['seq']} "
               f"on {out['device']['name']} ({_usable(out['device'])})")
    print_line(console, f"tp {c['tp']} · pp {c['pp']} · dp {c['dp']} · {c['schedule']}"
               f"{' v=' + str(c['virtual_stages']) if c['virtual_stages'] > 1 else ''} · b {c['microbatch_size']} · "
               f"m {c['num_microbatches']} · global batch {c['global_batch']} · attention {c['attention']} · "
               f"recompute {c['recompute']} · BPipe {'on' if c['bpipe'] else 'off'} · {c['precision']}")
    v = c["virtual_stages"]
    # a device of a looped or V schedule holds several stages: the row says which (pipeline_rules' placement)
    label = (lambda d: "+".join(map(str, stages_of_device(c["schedule"], pp=c["pp"], device=d, virtual_stages=v)))
             ) if v > 1 else str
    headers = ["stages" if v > 1 else "stage", "layers", "params", "state\nMiB", "act per mb\nMiB", "in\nflight",
               "act\nMiB",
               "activation\npeak MiB", "total\nMiB", "fits"]
    rows = []
    for s in out["stages"]:
        held = f"{s['in_flight']:g}" + (f"+{s['foreign_in_flight']:g}" if s["foreign_in_flight"] else "")
        params = f"{s['params'] / 1e9:.2f}B" if s["params"] >= 1e8 else f"{s['params'] / 1e6:.2f}M"
        rows.append([label(s["stage"]), str(s["layers"]), params,
                     mib(s["weight_bytes"] + s["grad_bytes"] + s["optimizer_bytes"]),
                     mib(s["activation_per_microbatch"]), held, mib(s["activation_bytes"]),
                     mib(s["activation_peak_bytes"]), mib(s["total_bytes"]), "yes" if s["fits"] else "NO"])
    print_table(console, "Memory per stage", headers, rows, keys=1, justify=["right"] * 9 + ["left"])
    print_line(console, "act: saved activations in flight; activation peak: act + one layer's backward (and "
               "recompute) working memory, what validate compares with a run's measured activation peak; total: + "
               "weights, gradients, optimizer")
    print_line(console, f"fits: {'yes' if out['fits'] else 'NO'}")
    st = out["step"]
    if st is None:
        print_line(console, "step time: not estimated (no peak FLOP/s for this device; pass --peak-flops)")
        return
    sec = (lambda x: f"{x:,.3f} s") if st["seconds"] >= 1 else (lambda x: f"{x * MS_PER_S:,.2f} ms")
    terms = ", ".join(f"{k} {sec(v)}" for k, v in st["terms_s"].items())
    # a configuration that does not fit has no real step time: every line that gives one says so first
    unfit = "" if st["fits"] else "does NOT fit in memory; if it did: "
    hfu = "" if st["hfu"] is None else f", HFU {st['hfu']:.1%} ({st['hfu_counts']})"
    print_line(console, f"{unfit}step time {sec(st['seconds'])}, MFU {st['mfu']:.1%} ({st['mfu_counts']}){hfu}; "
               f"compute efficiency {st['efficiency']:.1%} ({st['efficiency_source']}); stage 0: {terms}")
    b = out.get("bpipe")
    if b is None:
        return
    if b["verdict"] is None:
        print_line(console, f"BPipe verdict: none — {b['why_none']}")
        return
    print_line(console, b["sentence"])
    print_line(console, b["why"])
    if b["margin"]:
        print_line(console, b["margin"])
    for w in b["warnings"]:
        print_line(console, w, prefix="warning: ")
    print_line(console, "assumptions: " + "; ".join(b["assumptions"]))


def _usable(device: dict) -> str:
    usable, reserve = device["memory_bytes"], device.get("reserve_bytes", 0.0)
    if usable is None:
        return "no memory limit"
    return f"{bytes_text(usable + reserve)}, {bytes_text(reserve)} kept free, {bytes_text(usable)} usable"


@contextlib.contextmanager
def _verdict_progress(enabled: bool):
    """A progress bar on stderr (a terminal only) over the verdict's simulated configurations: with thousands of
    micro-batches each takes seconds."""
    if not enabled:
        yield None
        return
    from traceana.core.tables import progress_bar

    with progress_bar("BPipe verdict: simulating configurations") as bar:
        task = bar.add_task("", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def run(args: argparse.Namespace) -> int:
    cfg, dev, curve, net = build(args)
    with _verdict_progress(sys.stderr.isatty()) as on_progress:
        out = report(cfg, dev, curve, net, verdict=not args.no_verdict, baseline=args.bpipe_baseline,
                     reserve=reserve_of(args, _device_total(args)[1]), on_progress=on_progress)
    if args.json:
        from traceana.commands.export import json_fractions

        print(json.dumps(json_fractions(out), indent=2, default=str))
    else:
        from traceana.core.tables import console

        render(out, console=console())
    return 0
