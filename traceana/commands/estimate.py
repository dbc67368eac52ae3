"""Estimate memory per pipeline stage, whether it fits, the step time and MFU, and whether BPipe would help.

Give a model preset (--model llama-65b) or an explicit shape (--family/--layers/--hidden/--heads/...), the parallel
layout and the batch. The step time comes from the schedule simulator fed with FLOPs at an efficiency E(b): measured
points (--efficiency 1:0.45,2:0.50) or an assumed saturating curve, which the output says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from traceana.errors import ConfigError
from traceana.manifest import ATTENTIONS, FAMILIES, RECOMPUTES, ModelShape
from traceana.model.bpipe import EfficiencyCurve, Network, bpipe_verdict, estimate_step
from traceana.model.config import MODEL_SCHEDULES, PRECISIONS, TrainingConfig
from traceana.model.memory import estimate_stage_memory, reserve_bytes
from traceana.model.presets import DEVICES, MODELS, TINY_MODELS, Device, device_preset, model_preset

GiB = 2**30
DEFAULT_DEVICE = "a100-80gb"


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    m.add_argument("--family", choices=FAMILIES)
    for f in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        m.add_argument(f"--{f}", type=int, help="override or give the shape explicitly")
    r = p.add_argument_group("training")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--pp", type=int, default=1)
    r.add_argument("--dp", type=int, default=1)
    r.add_argument("--microbatch-size", type=int, default=1)
    r.add_argument("--num-microbatches", type=int, help="per pipeline per step")
    r.add_argument("--global-batch", type=int, help="sequences per step (sets the micro-batch count)")
    r.add_argument("--schedule", choices=MODEL_SCHEDULES, default="1f1b")
    r.add_argument("--virtual-stages", type=int, default=1)
    r.add_argument("--attention", choices=ATTENTIONS, default="sdpa", help="naive keeps s×s scores; sdpa/flash not")
    r.add_argument("--recompute", choices=RECOMPUTES, default="none")
    r.add_argument("--bpipe", action="store_true", help="balance activations between stage s and p−1−s")
    r.add_argument("--sequence-parallel", action="store_true")
    r.add_argument("--distributed-optimizer", action="store_true")
    r.add_argument("--precision", choices=PRECISIONS, default="mixed-adam")
    d = p.add_argument_group("device and network")
    d.add_argument("--device", default=DEFAULT_DEVICE, help=f"one of {', '.join(DEVICES)}")
    d.add_argument("--device-memory-gib", type=float)
    d.add_argument("--peak-tflops", type=float)
    d.add_argument("--reserve-gib", type=float, help="memory to keep free (allocator, workspaces); default 10%% of it")
    d.add_argument("--efficiency", help="measured compute efficiency per micro-batch size, e.g. 1:0.42,2:0.47")
    d.add_argument("--efficiency-from", nargs="+", metavar="RUN_DIR",
                   help="measure the efficiency curve from traced runs at different micro-batch sizes (the BPipe "
                        "re-evaluation's method), on the device given by --device/--peak-tflops")
    d.add_argument("--p2p-gbps", type=float, default=25.0, help="GB/s for pipeline messages")
    d.add_argument("--bpipe-gbps", type=float, default=25.0, help="GB/s for BPipe evictions")
    d.add_argument("--bpipe-blocking", action="store_true", help="BPipe transfers do not overlap compute")
    p.add_argument("--bpipe-baseline", default="best-without-bpipe",
                   choices=("as-configured", "best-without-bpipe", "full-recompute"),
                   help="what the BPipe verdict compares with (full-recompute: the BPipe paper's Megatron baseline)")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="take the model and configuration from a collected run's run.json (its device: the CPU "
                        "trainer's eager activations); what validate then compares with the measured peaks")
    p.add_argument("--no-verdict", action="store_true", help="skip the BPipe search")
    p.add_argument("--json", action="store_true", help="machine-readable output")


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
    """The configuration a collected run's run.json describes, as validate reads it (config_from_manifest)."""
    from pathlib import Path

    from traceana.errors import BadInputError
    from traceana.manifest import MANIFEST_NAME, Manifest
    from traceana.model.config import config_from_manifest

    path = Path(args.from_run)
    path = path / MANIFEST_NAME if path.is_dir() else path
    if not path.is_file():
        raise BadInputError("no run.json here", path=path, fix="give a run directory written by `traceana collect`")
    return config_from_manifest(Manifest.read(path))


def build(args: argparse.Namespace) -> tuple[TrainingConfig, Device, EfficiencyCurve, Network]:
    if args.from_run:
        cfg = _from_run(args)
        return cfg, _device(args), _curve(args.efficiency), _network(args)
    model = _shape(args)
    if args.num_microbatches is None:
        if args.global_batch is None:
            m = args.pp
        else:
            per = args.global_batch // args.dp
            if args.global_batch % (args.dp * args.microbatch_size):
                raise ConfigError(
                    f"global batch {args.global_batch} is not a multiple of dp × micro-batch size",
                    fix="choose a global batch divisible by dp·b",
                )
            m = per // args.microbatch_size
    else:
        m = args.num_microbatches
    cfg = TrainingConfig(
        model=model, pp=args.pp, tp=args.tp, dp=args.dp, microbatch_size=args.microbatch_size, num_microbatches=m,
        schedule=args.schedule, attention=args.attention, recompute=args.recompute, bpipe=args.bpipe,
        virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel,
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
    from traceana.analysis_cache import load_and_analyze
    from traceana.validation import measured_efficiency

    points = [measured_efficiency(load_and_analyze(d, progress=False), peak_flops=peak_flops) for d in run_dirs]
    return EfficiencyCurve.measured(points, source="measured from " + ", ".join(run_dirs))


def _network(args: argparse.Namespace) -> Network:
    return Network(args.p2p_gbps * 1e9, args.bpipe_gbps * 1e9, not args.bpipe_blocking)


def _device_total(args: argparse.Namespace) -> tuple[Device, float]:
    """The device preset (the CPU for a collected run, unless --device is given: no memory limit, no peak) and its
    whole memory (--device-memory-gib overrides)."""
    if args.from_run and args.device == DEFAULT_DEVICE:
        dev = Device("cpu", float("inf"), 0.0, "collected run")
    else:
        dev = device_preset(args.device)
    return dev, args.device_memory_gib * GiB if args.device_memory_gib else dev.memory_bytes


def _device(args: argparse.Namespace) -> Device:
    """The device with its usable memory: its memory less the reserve (``reserve_of``)."""
    dev, total = _device_total(args)
    return Device(dev.name, total - reserve_of(args, total),
                  args.peak_tflops * 1e12 if args.peak_tflops else dev.peak_flops, dev.source)


def reserve_of(args: argparse.Namespace, total: float) -> float:
    """Memory kept free: --reserve-gib, else memory.reserve_bytes's default (10 % of the device); none without a
    memory limit."""
    if total == float("inf"):
        return 0.0
    return reserve_bytes(total, None if args.reserve_gib is None else args.reserve_gib * GiB)


def report(cfg: TrainingConfig, dev: Device, curve: EfficiencyCurve, net: Network, *, verdict: bool,
           baseline: str = "best-without-bpipe", reserve: float = 0.0) -> dict:
    """``dev.memory_bytes`` is what is usable: the device's memory less ``reserve``."""
    stages = estimate_stage_memory(cfg)
    step = estimate_step(cfg, device=dev, curve=curve, network=net) if dev.peak_flops else None
    out = {
        "model": dataclasses.asdict(cfg.model),
        "config": {
            k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "precision")
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
        "step": None if step is None else {"seconds": step.step_s, "mfu": step.mfu, "efficiency": step.efficiency,
                                           "efficiency_source": curve.source, "terms_s": step.terms},
    }
    if verdict and step is not None and cfg.schedule == "1f1b" and cfg.virtual_stages == 1 and cfg.pp > 1:
        v = bpipe_verdict(cfg, device=dev, curve=curve, network=net, baseline=baseline)
        out["bpipe"] = {
            "baseline": v.baseline, "why": v.why,
            "helps": v.helps, "speedup": v.speedup, "deciding_term": v.deciding_term, "deltas_s": v.deltas,
            "sentence": v.sentence, "assumptions": list(v.assumptions),
            "reference": v.reference.describe(), "with_bpipe": v.with_bpipe.describe() if v.with_bpipe else None,
        }
    return out


def render(out: dict) -> str:
    m, c = out["model"], out["config"]
    lines = [
        f"{m['name'] or m['family']}: {m['family']}, {m['layers']} layers, h {m['hidden']}, {m['heads']} heads"
        f"{'' if not m['kv_heads'] else ' (' + str(m['kv_heads']) + ' kv)'}, ffn {m['ffn'] or 'default'}, "
        f"vocab {m['vocab']}, seq {m['seq']}"
        f" on {out['device']['name']} ({_usable(out['device'])})",
        f"tp {c['tp']} · pp {c['pp']} · dp {c['dp']} · {c['schedule']}"
        f"{' v=' + str(c['virtual_stages']) if c['virtual_stages'] > 1 else ''} · b {c['microbatch_size']} · "
        f"m {c['num_microbatches']} · global batch {c['global_batch']} · attention {c['attention']} · "
        f"recompute {c['recompute']} · BPipe {'on' if c['bpipe'] else 'off'} · {c['precision']}",
        "",
    ]
    big = max(s["total_bytes"] for s in out["stages"]) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", 2**20)
    lines.append(
        f"{'stage':>5} {'layers':>6} {'params':>9} {'state ' + unit:>9} {'act/mb ' + unit:>10} {'in flight':>9} "
        f"{'act ' + unit:>8} {'peak ' + unit:>8} {'total ' + unit:>9}  fits"
    )
    for s in out["stages"]:
        state = (s["weight_bytes"] + s["grad_bytes"] + s["optimizer_bytes"]) / div
        held = f"{s['in_flight']:g}" + (f"+{s['foreign_in_flight']:g}" if s["foreign_in_flight"] else "")
        params = f"{s['params'] / 1e9:.2f}B" if s["params"] >= 1e8 else f"{s['params'] / 1e6:.2f}M"
        lines.append(
            f"{s['stage']:>5} {s['layers']:>6} {params:>9} {state:>9.1f} "
            f"{s['activation_per_microbatch'] / div:>10.2f} {held:>9} {s['activation_bytes'] / div:>8.1f} "
            f"{s['activation_peak_bytes'] / div:>8.2f} {s['total_bytes'] / div:>9.1f}  {'yes' if s['fits'] else 'NO'}"
        )
    lines += ["", "act: saved activations in flight; peak: act + one layer's backward (and recompute) working memory,"
              " what validate compares with a run's measured activation peak; total: + weights, gradients, optimizer"]
    st = out["step"]
    if st is None:
        lines += ["", f"fits: {'yes' if out['fits'] else 'NO'}",
                  "step time: not estimated (no peak FLOP/s for this device; pass --peak-tflops)"]
        return "\n".join(lines)
    sec = (lambda x: f"{x:.3f} s") if st["seconds"] >= 1 else (lambda x: f"{x * 1e3:.2f} ms")
    terms = ", ".join(f"{k} {sec(v)}" for k, v in st["terms_s"].items())
    lines += [
        "",
        f"fits: {'yes' if out['fits'] else 'NO'}",
        f"step time {sec(st['seconds'])}, MFU {st['mfu']:.1%} (compute efficiency {st['efficiency']:.1%}, "
        f"{st['efficiency_source']}); stage 0: {terms}",
    ]
    if "bpipe" in out:
        lines += ["", out["bpipe"]["sentence"], out["bpipe"]["why"], "assumptions: " + "; ".join(out["bpipe"]["assumptions"])]
    return "\n".join(lines)


def _usable(device: dict) -> str:
    usable, reserve = device["memory_bytes"], device.get("reserve_bytes", 0.0)
    if usable is None:
        return "no memory limit"
    return f"{(usable + reserve) / GiB:.0f} GiB, {reserve / GiB:.1f} GiB kept free, {usable / GiB:.1f} GiB usable"


def run(args: argparse.Namespace) -> int:
    cfg, dev, curve, net = build(args)
    out = report(cfg, dev, curve, net, verdict=not args.no_verdict, baseline=args.bpipe_baseline,
                 reserve=reserve_of(args, _device_total(args)[1]))
    print(json.dumps(out, indent=2, default=str) if args.json else render(out))
    return 0
