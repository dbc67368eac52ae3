"""The run summary: the facts a run recorded (run.json), what the analysis had to infer, and the headline numbers."""

from __future__ import annotations

import json

from reports import html as H
from traceana.core.manifest import LIFTED
from traceana.core.run_config import TRACE
from traceana.core.units import NS_PER_MS
from traceana.measure.analysis import Analysis
from traceana.measure.summary import STEP_TIME_LABEL


def summary_facts(a: Analysis) -> list[tuple[str, object]]:
    m = a.run.manifest
    rows: list[tuple[str, object]] = [("run directory", a.run.path)]
    if m is None:
        rows.append(("run.json", "absent: every fact below was inferred from the traces"))
        rows.append(("world size", a.run.world_size))
        backends = a.run.traces["backend"].drop_nulls().unique().to_list()
        if backends:
            rows.append(("backend", ", ".join(map(str, backends))))
        return rows
    if m.model is not None:
        s = m.model
        kv = f", {s.n_kv_heads} KV heads" if s.kv_heads else ""
        rows.append(
            ("model", f"{s.name + ' — ' if s.name else ''}{s.family}, {s.layers} layers, hidden {s.hidden}, "
                      f"{s.heads} heads{kv}, FFN {s.ffn_dim}, vocab {s.vocab}, sequence {s.seq}")
        )
    pp = m.pp if m.pp is not None else "?"
    rows.append(("parallelism", f"world {m.world_size} = PP {pp} × DP {m.dp} × TP {m.tp}"))
    if m.stage_of_rank is not None:
        rows.append(("stage of each rank", ", ".join(f"r{r}→s{s}" for r, s in enumerate(m.stage_of_rank))))
    rows.append(("schedule", m.schedule))
    mb = [f"{m.num_microbatches} micro-batches" if m.num_microbatches else None,
          f"of {m.microbatch_size} samples" if m.microbatch_size else None,
          f"(global batch {m.global_batch})" if m.global_batch else None]
    if any(mb):
        rows.append(("micro-batching", " ".join(x for x in mb if x)))
    rows.append(("BPipe", "off" if not m.bpipe else "on — evictor→acceptor stage pairs "
                 + ", ".join(f"{e}→{c}" for e, c in m.bpipe)))
    rows.append(("attention", m.attention or "not recorded"))
    rows.append(("recompute", m.recompute or "not recorded"))
    for label, value in (("dtype", m.dtype), ("device", m.device), ("torch", m.torch_version)):
        if value:
            rows.append((label, value))
    if m.peak_flops:
        rows.append(("peak FLOP/s per device", f"{m.peak_flops:.3g}"))
    if m.profiler:
        rows.append(("profiler schedule", ", ".join(f"{k}={v}" for k, v in sorted(m.profiler.items()))))
    lifted = {k: getattr(m, k) for k in LIFTED}  # run.json's facts older files kept under extra, then the unknown
    for k, v in sorted({**m.extra, **lifted}.items()):
        if v is not None:
            rows.append((k.replace("_", " "), v if isinstance(v, str) else json.dumps(v)))
    traced = [f"{k.replace('_', ' ')} {getattr(a.config, k)}" for k in ("schedule", "num_microbatches")
              if a.config.source(k) == TRACE]
    if traced:
        rows.append(("from the traces", f"{', '.join(traced)} (run.json said otherwise: see the notes)"))
    return rows


def inferred_notes(a: Analysis) -> list[str]:
    """Everything the analysis had to infer or could not determine, in the analysis' own words."""
    notes = list(a.notes) + [w for w in a.run.warnings if w not in a.notes]
    if a.schedule.height and "source" in a.schedule.columns:
        sources = a.schedule["source"].drop_nulls().unique().sort().to_list()
        if sources and sources != ["annotated"]:
            notes.append(f"schedule spans come from: {', '.join(sources)} (not only from annotations)")
    if "rank_source" in a.run.traces.columns:
        rs = a.run.traces["rank_source"].drop_nulls().unique().sort().to_list()
        if rs and set(rs) - {"distributedInfo", "traceana_meta"}:
            notes.append(f"rank numbers taken from: {', '.join(rs)}")
    offsets = a.clock_offsets
    if offsets.height and "offset_ns" in offsets.columns and offsets["offset_ns"].abs().max():
        worst = offsets["offset_ns"].abs().max() / NS_PER_MS
        notes.append(f"clocks corrected per rank (largest offset {H.num(worst)} ms), estimated from P2P pairs")
    return notes


def kpis(a: Analysis, *, side: tuple[float, int] | None = None) -> str:
    """The card's headline figures. ``side``: (its side's step time, runs) when the run was repeated: the card then
    leads with that (traceana.measure.noise's statistic, the A/B table's figure) and labels this run's own as such."""
    from traceana.measure.noise import STATISTIC

    s = a.summary
    act = (f"{H.num(s.largest_activation_peak_mib)} MiB (stage {s.largest_activation_stage})"
           if s.largest_activation_peak_mib is not None else "–")
    items = [
        (H.num(s.step_ms) + " ms" if s.step_ms is not None else "–", STEP_TIME_LABEL),
        (H.num(100 * s.bubble_fraction, digits=3) + " %" if s.bubble_fraction is not None else "–",
         "bubble (warm-up + stall + cool-down) of all ranks' step time"),
        (H.num(s.bpipe_ms) + " ms" if s.bpipe_ms is not None else "–",
         "exposed BPipe transfer per step (largest stage)"),
        (act, "largest activation peak"),
        (H.num(s.memory_balance, digits=3) + "×" if s.memory_balance else "–", "memory imbalance (max/min stage peak)"),
        (str(len(s.steps)), "measured steps"),
    ]
    # MFU only where the analysis could compute it (run.json with the model and the device's peak FLOP/s)
    mfu = a.stages["mfu"].drop_nulls() if "mfu" in a.stages.columns else None
    if mfu is not None and len(mfu):
        items.insert(2, (H.num(100 * float(mfu.mean()), digits=2) + " %",
                         "MFU (model FLOPs, recompute not counted), mean over stages"))
    if side is not None and side[1] > 1:  # the side's figure first; every other one is this run's own
        items = [(v, f"{label} (this run)") for v, label in items]
        items[0] = (H.num(side[0]) + " ms", f"{STEP_TIME_LABEL}, {STATISTIC}: {side[1]} runs")
        items.insert(1, (H.num(s.step_ms) + " ms" if s.step_ms is not None else "–",
                         f"{STEP_TIME_LABEL}: this run alone (the first)"))
    cells = "".join(f'<div class="kpi"><b>{H.esc(v)}</b><span>{H.esc(label)}</span></div>' for v, label in items)
    # who holds the step back, and what it costs: the what-if's line (traceana.causal.whatif), never raw step times
    verdict = (H.para(f"Bottleneck (what-if: the measured step replayed with work made ideal): {s.diagnosis}",
                      css_class="lead") if s.diagnosis else "")
    return f'<div class="kpis">{cells}</div>{verdict}'
