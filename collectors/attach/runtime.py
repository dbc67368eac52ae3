"""Inside every process of an attached job: find step boundaries, profile the chosen windows, write facts.

``install()`` (called by ``boot/sitecustomize.py``) imports no torch. It registers post-import hooks; the patches
happen when the job itself imports ``torch.optim.optimizer``, ``torch.distributed.pipelining.schedules`` or the
``--step-fn`` module. Until a window's warm-up step, a step boundary costs one call and one integer compare.

Step boundaries, by priority (a higher one, once seen, replaces a lower one for the rest of the process):

1. ``--step-fn module:qualname``: each (outermost) call starts a step;
2. a ``torch.distributed.pipelining`` schedule's ``step``: each outermost call starts a step;
3. ``torch.optim``: the end of each ``step`` of the first optimizer that steps starts the next step.

Step ``k`` is the k-th step counted from 0. A window [a, b) starts the profiler at the boundary of step
``a - warmup`` (warm-up: running, nothing kept), records steps a … b-1 as ``ProfilerStep#a`` … and writes the trace
at the boundary of step b (or when the process exits normally inside the window).

Nothing here may stop or slow training beyond the window: every hook catches everything, and after a failure of
traceana's own code the process stops profiling (one line on stderr) and trains on.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.abc
import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from collectors.attach import ENV, FACTS_DIR, FAIL_ENV, Config, windows_at

SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"
# Other frameworks' pipelines, read without changing them (issue 36): megatron-core's schedules (their calls carry
# the micro-batch count and size; parallel_state the layout) and DeepSpeed's PipelineEngine (its stage, stages,
# micro-batches and grid).
MEGATRON_SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
MEGATRON_SCHEDULES = {"forward_backward_pipelining_without_interleaving": "1f1b",
                      "forward_backward_pipelining_with_interleaving": "interleaved-1f1b"}
DEEPSPEED_ENGINE_MODULE = "deepspeed.runtime.pipe.engine"
OPTIMIZER_MODULE = "torch.optim.optimizer"
PRIORITY = {"optimizer": 1, "schedule": 2, "step_fn": 3}
SOURCE_TEXT = {
    "optimizer": "torch.optim optimizer step (post-hook)",
    "schedule": "torch.distributed.pipelining schedule.step",
    "step_fn": "--step-fn",
}

_state: _State | None = None


def install() -> None:
    """Turn the runtime on in this process when ``TRACEANA_ATTACH`` is set (idempotent)."""
    global _state
    text = os.environ.get(ENV)
    if not text or _state is not None:
        return
    config = Config.from_env(text)
    _state = _State(config)
    hooks: dict[str, Callable[[Any], None]] = {
        OPTIMIZER_MODULE: _state.patch_optimizer,
        SCHEDULES_MODULE: _state.patch_schedules,
        MEGATRON_SCHEDULES_MODULE: _state.patch_megatron,
        DEEPSPEED_ENGINE_MODULE: _state.patch_deepspeed,
    }
    if config.step_fn:
        module, _, _ = config.step_fn.partition(":")
        hooks[module] = _state.patch_step_fn
    finder = _PostImport(hooks)
    sys.meta_path.insert(0, finder)
    for name in list(hooks):  # already imported (a job that imports torch from its own sitecustomize, say)
        if name in sys.modules:
            finder.fire(name, sys.modules[name])
    atexit.register(_state.at_exit)


def _warn(message: str) -> None:
    try:
        print(f"traceana attach: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not break the job either
        pass


# --- post-import hooks -------------------------------------------------------------------------------------------
class _PostImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after the named modules are first imported (then forgets them)."""

    def __init__(self, callbacks: dict[str, Callable[[Any], None]]) -> None:
        self.callbacks = dict(callbacks)
        self._busy: set[str] = set()

    def find_spec(self, name, path, target=None):
        if name not in self.callbacks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except Exception:  # noqa: BLE001 - let the normal import report it
            return None
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, functools.partial(self.fire, name))
        return spec

    def fire(self, name: str, module: Any) -> None:
        callback = self.callbacks.pop(name, None)
        if callback is None:
            return
        try:
            callback(module)
        except Exception as e:  # noqa: BLE001
            _warn(f"could not hook {name} ({type(e).__name__}: {e}); this process is not profiled")
            if _state is not None:
                _state.disable()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, after: Callable[[Any], None]) -> None:
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec.loader = self._inner  # the module keeps its real loader
        module.__loader__ = self._inner
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# --- the state machine -------------------------------------------------------------------------------------------
class _State:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.fail = os.environ.get(FAIL_ENV, "")
        self.source: str | None = None
        self.count = {"step_fn": 0, "schedule": 0, "optimizer": 1}  # index of the step the next boundary starts
        self.plan = windows_at(config)
        self.window: tuple[int, int] | None = next(self.plan, None)
        self.trigger = self._start_boundary()  # the boundary index at which something happens next
        self.active: _Window | None = None
        self.schedule: Any = None  # the pipelining schedule, the optimizer: for facts
        self.optimizer: Any = None
        self.optimizer_hook: Any = None
        self.in_schedule_step = False
        self.in_step_fn = False
        self.framework: dict[str, Any] | None = None  # megatron-core's schedule call (patch_megatron)
        self.deepspeed_engine: Any = None  # DeepSpeed's PipelineEngine (patch_deepspeed)

    def _start_boundary(self) -> float:
        """The boundary that starts the current window's warm-up."""
        if self.window is None:
            return float("inf")
        return self.window[0] - min(self.config.warmup, self.window[0])

    def disable(self) -> None:
        """Stop for good (after a failure of traceana's own code); never raises."""
        self.window, self.trigger = None, float("inf")
        active, self.active = self.active, None
        if active is not None:
            try:
                active.close(problem="traceana's hook failed; the window was cut short")
            except Exception:  # noqa: BLE001 - closing is what failed: the trace is lost, training goes on
                pass
        self._remove_optimizer_hook()

    # ---- patches (run once, when the job imports the module) ------------------------------------------------
    def patch_optimizer(self, module: Any) -> None:
        # Also with --step-fn: the first optimizer is where parameters are counted (the hook then goes).
        self.optimizer_hook = module.register_optimizer_step_post_hook(self._optimizer_post_hook)

    def patch_schedules(self, module: Any) -> None:
        base = module._PipelineSchedule
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, base) and "step" in vars(value):
                step = vars(value)["step"]
                if getattr(step, "__isabstractmethod__", False):
                    continue
                value.step = self._wrap_schedule_step(step)

    def patch_megatron(self, module: Any) -> None:
        """Record the schedule megatron-core runs and its keywords (num_microbatches, micro_batch_size) at each
        call; get_forward_backward_func returns these module attributes by name, so the wrapped ones run."""
        for name, schedule in MEGATRON_SCHEDULES.items():
            fn = getattr(module, name, None)
            if callable(fn) and not getattr(fn, "_traceana", False):
                setattr(module, name, self._wrap_megatron(fn, name, schedule))

    def _wrap_megatron(self, fn: Callable, name: str, schedule: str) -> Callable:
        state = self

        @functools.wraps(fn)
        def traceana_megatron_schedule(*args, **kwargs):
            try:
                state.framework = {"framework": "megatron-core", "schedule_class": f"megatron-core {name}",
                                   "schedule": schedule, "num_microbatches": kwargs.get("num_microbatches"),
                                   "microbatch_size": kwargs.get("micro_batch_size")}
            except Exception:  # noqa: BLE001 - facts only: the job's call goes on
                pass
            return fn(*args, **kwargs)

        traceana_megatron_schedule._traceana = True
        return traceana_megatron_schedule

    def patch_deepspeed(self, module: Any) -> None:
        """Keep the PipelineEngine whose train_batch runs, for its stage, stages, micro-batches and grid."""
        engine = getattr(module, "PipelineEngine", None)
        train = getattr(engine, "train_batch", None) if engine is not None else None
        if train is None or getattr(train, "_traceana", False):
            return
        state = self

        @functools.wraps(train)
        def traceana_train_batch(engine_self, *args, **kwargs):
            state.deepspeed_engine = engine_self
            return train(engine_self, *args, **kwargs)

        traceana_train_batch._traceana = True
        engine.train_batch = traceana_train_batch

    def patch_step_fn(self, module: Any) -> None:
        _, _, qualname = self.config.step_fn.partition(":")
        owner: Any = module
        *path, last = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = vars(owner)[last] if isinstance(owner, type) else getattr(owner, last)
        wrapped: Any
        if isinstance(fn, (staticmethod, classmethod)):
            wrapped = type(fn)(self._wrap_step_fn(fn.__func__))
        else:
            wrapped = self._wrap_step_fn(fn)
        setattr(owner, last, wrapped)

    def _wrap_schedule_step(self, step: Callable) -> Callable:
        state = self

        @functools.wraps(step)
        def traceana_step(schedule, *args, **kwargs):
            if state.in_schedule_step:  # a subclass's step calling its parent's: one step
                return step(schedule, *args, **kwargs)
            state.in_schedule_step = True
            try:
                state.boundary("schedule", schedule=schedule, args=args)
                return step(schedule, *args, **kwargs)
            finally:
                state.in_schedule_step = False

        return traceana_step

    def _wrap_step_fn(self, fn: Callable) -> Callable:
        state = self

        @functools.wraps(fn)
        def traceana_step_fn(*args, **kwargs):
            if state.in_step_fn:
                return fn(*args, **kwargs)
            state.in_step_fn = True
            try:
                state.boundary("step_fn")
                return fn(*args, **kwargs)
            finally:
                state.in_step_fn = False

        return traceana_step_fn

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
            if self._wrap_optimizer_class(type(optimizer)):
                self._remove_optimizer_hook()  # from the next step on, the class's step marks the boundary
        elif optimizer is not self.optimizer:
            return  # a second optimizer of the same step
        self.boundary("optimizer")

    def _wrap_optimizer_class(self, cls: type) -> bool:
        """Mark the boundary after the optimizer's ``Optimizer.step#…`` span has closed, not inside it (as a post-hook
        would): the profiler then starts and stops between spans, and the window's last optimizer step is whole."""
        step = getattr(cls, "step", None)
        if step is None or getattr(step, "_traceana", False) or not getattr(step, "hooked", False):
            return False  # not torch's hooked step (it keeps the post-hook then)
        state = self

        @functools.wraps(step)  # keeps ``hooked``: torch must not wrap it a second time for a new instance
        def traceana_optimizer_step(optimizer, *args, **kwargs):
            out = step(optimizer, *args, **kwargs)
            if optimizer is state.optimizer:
                state.boundary("optimizer")
            return out

        traceana_optimizer_step._traceana = True
        cls.step = traceana_optimizer_step
        return True

    def _remove_optimizer_hook(self) -> None:
        if self.optimizer_hook is not None:
            try:
                self.optimizer_hook.remove()
            except Exception:  # noqa: BLE001
                pass
            self.optimizer_hook = None

    # ---- boundaries -----------------------------------------------------------------------------------------
    def boundary(self, source: str, *, schedule: Any = None, args: tuple = ()) -> None:
        """Step ``count[source]`` starts now. Never raises."""
        try:
            if source != self.source:
                if self.config.step_fn and source != "step_fn":
                    if schedule is not None and self.schedule is None:
                        self.schedule = schedule  # for facts
                    if source == "optimizer":
                        self._remove_optimizer_hook()  # it was only needed to find the optimizer
                    return
                if self.source is not None and PRIORITY[source] < PRIORITY[self.source]:
                    if source == "optimizer":
                        self._remove_optimizer_hook()  # it has found the optimizer (for facts): off the hot path
                    return
                self._switch(source)
            if schedule is not None:
                self.schedule = schedule
            k = self.count[source]
            self.count[source] = k + 1
            if k < self.trigger:
                return
            self._act(k, args)
        except Exception as e:  # noqa: BLE001
            _warn(f"step hook failed ({type(e).__name__}: {e}); profiling stops, training goes on")
            self.disable()

    def _switch(self, source: str) -> None:
        if self.active is not None:  # a better boundary appeared mid-window: that window's steps are wrong
            self.active.close(problem=f"step boundaries changed to {SOURCE_TEXT[source]} inside the window")
            self.active = None
            self.window = next(self.plan, None)
            self.trigger = self._start_boundary() if self.window is not None else float("inf")
        self.source = source
        if source != "optimizer" and self.optimizer is not None:
            self._remove_optimizer_hook()

    def _act(self, k: int, args: tuple) -> None:
        if self.fail == "hook":
            raise RuntimeError(f"injected by {FAIL_ENV}=hook")
        if self.active is not None:
            self.active.step()
            if k < self.active.end:
                self.trigger = k + 1
                return
            self.active.close()  # step ``end`` starts: the window's trace was written by that step()
            self.active = None
            self.window = next(self.plan, None)
        while self.window is not None and k > self._start_boundary():
            start, end = self.window
            if start - k >= 1:
                break  # later than planned (the first boundary this source gives), but a warm-up step still fits
            _warn(f"steps {start}–{end - 1} cannot be profiled with {SOURCE_TEXT[self.source]} boundaries "
                  f"(step {k} is the first this process saw in time); skipping them")
            self.window = next(self.plan, None)
        if self.window is None:
            self.trigger = float("inf")
            self._remove_optimizer_hook()  # nothing left to profile: only the schedule's counter stays
            return
        self.trigger = self._start_boundary()
        if k < self.trigger:
            return
        start, end = self.window
        window = _Window(self, start, end, first=k, args=args)
        if window.running:
            self.active, self.trigger = window, k + 1
        else:  # refused or failed to start: this window is given up, the next ones are still tried
            window.close()
            self.window = next(self.plan, None)
            self.trigger = self._start_boundary()

    def at_exit(self) -> None:
        """A window still open when the process exits normally: write what it recorded."""
        if self.active is not None:
            try:
                self.active.close(problem="the process exited inside the window; the trace holds the steps "
                                  "recorded until then")
            except Exception:  # noqa: BLE001
                pass
            self.active = None


# --- one window --------------------------------------------------------------------------------------------------
class _Window:
    """The profiler of one window in this process, and the facts it records."""

    def __init__(self, state: _State, start: int, end: int, *, first: int, args: tuple) -> None:
        import torch

        self.state, self.start, self.end = state, start, end
        self.dir = state.config.window_dir(start, end)
        self.profiler: Any = None
        self.running = False
        self.facts = detect_facts(state, args)
        self.rank = self.facts["rank"]
        self.facts.update(window=[start, end], first_boundary=first, warmup=start - first,
                          step_source=SOURCE_TEXT[state.source], started_at=time.time())
        self._annotated = False
        if torch.autograd.profiler._is_profiler_enabled:
            self.facts["problem"] = ("the job's own profiler was running at this window's start; traceana does not "
                                     "start a second one (it would take the first one's events)")
            self._write_facts()
            return
        self._annotate()
        try:
            self.profiler = _WindowProfiler(
                # stage and pp stay None without pipeline stages: a DP job's rank is not known to be "stage 0"
                self.dir, rank=self.rank, stage=min(self.facts["stages"]) if self.facts.get("stages") else None,
                world_size=self.facts["world_size"], pp=self.facts.get("num_stages"),
                schedule=self.facts.get("schedule") or "unknown", first_step=first, warmup=start - first,
                active=end - start, fail_start=state.fail == "start",
                metadata={"collector": "traceana attach", "window": [start, end],
                          "stages": self.facts.get("stages"), "step_source": self.facts["step_source"]},
            )
            self.profiler.__enter__()
            self.running = self.profiler._prof is not None
        except Exception as e:  # noqa: BLE001
            self.facts["problem"] = f"the profiler did not start ({type(e).__name__}: {e})"
        if not self.running and "problem" not in self.facts:
            warnings = self.profiler.warnings if self.profiler is not None else []
            self.facts["problem"] = warnings[-1] if warnings else "the profiler did not start"
        self._write_facts()

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def close(self, problem: str | None = None) -> None:
        if problem:
            self.facts["problem"] = problem
        if self.profiler is not None and self.running:
            self.profiler.__exit__(None, None, None)
            self.facts["trace_written"] = self.profiler.written is not None
            if self.profiler.warnings:
                self.facts["profiler_warnings"] = list(self.profiler.warnings)
            self.running = False
        self._unannotate()
        self.facts["closed_at"] = time.time()
        self._write_facts()

    # PP: spans for schedules that emit none (Schedule1F1B, ScheduleGPipe), only while the window runs.
    def _annotate(self) -> None:
        schedule = self.state.schedule
        if schedule is None:
            return
        try:
            from collectors import pipelining

            already = any(getattr(st, pipelining._MARK, False) for st in pipelining.stages_of(schedule))
            if not pipelining.emits_pp_annotations(schedule) and not already:
                pipelining.annotate(schedule)
                self._annotated = True
                self.facts["annotated"] = "PP: spans added by collectors.pipelining.annotate for this window"
        except Exception as e:  # noqa: BLE001
            self.facts.setdefault("notes", []).append(f"could not annotate the schedule ({type(e).__name__}: {e})")

    def _unannotate(self) -> None:
        if not self._annotated:
            return
        from collectors import pipelining

        for stage in pipelining.stages_of(self.state.schedule):
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", pipelining._MARK):
                vars(stage).pop(name, None)  # the instance's wrappers go: the class's methods show through
        self._annotated = False

    def _write_facts(self) -> None:
        path = self.dir / FACTS_DIR / f"rank{self.rank}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.facts, indent=1, default=str))
            os.replace(tmp, path)
        except OSError as e:
            _warn(f"rank {self.rank}: could not write {path} ({e.strerror or e}); run.json will lack its facts")


def _profiler_classes():
    from collectors.profiler import PipelineProfiler

    class _WindowProfiler(PipelineProfiler):
        """``PipelineProfiler`` whose steps carry the job's own step numbers (``ProfilerStep#{k}``)."""

        stands_down_under_attach = False  # it is attach's profiler

        def __init__(self, out_dir, *, first_step: int, fail_start: bool = False, **kwargs) -> None:
            super().__init__(out_dir, wait=0, repeat=1, manifest=None, **kwargs)
            self._first = first_step
            base = self._options["schedule"]
            self._options["schedule"] = lambda step: base(max(step - first_step, 0))
            if fail_start:
                self._options["schedule"] = _injected_failure

        def __enter__(self):
            super().__enter__()
            if self._prof is not None:
                self._prof.step_num = self._first  # its warm-up step; the next step() is first + 1
            return self

    return _WindowProfiler


def _injected_failure(step: int):
    raise RuntimeError(f"injected by {FAIL_ENV}=start")


def _WindowProfiler(*args, **kwargs):  # noqa: N802 - built lazily: collectors.profiler imports torch
    return _profiler_classes()(*args, **kwargs)


# --- facts -------------------------------------------------------------------------------------------------------
def detect_facts(state: _State, args: tuple) -> dict[str, Any]:
    """What this rank can tell about the job; facts it cannot tell are left out (``facts.py`` lists them)."""
    import torch

    facts: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "torch_version": torch.__version__}
    rank, world = 0, 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            facts["rank_from"] = "torch.distributed"
            try:
                facts["backend"] = str(dist.get_backend())
            except Exception:  # noqa: BLE001
                pass
        elif "RANK" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
            facts["rank_from"] = "RANK/WORLD_SIZE environment"
        else:
            facts["rank_from"] = "not distributed: rank 0 of 1"
    except Exception as e:  # noqa: BLE001
        facts["rank_from"] = f"unknown ({type(e).__name__}); rank 0 of 1 assumed"
    facts["rank"], facts["world_size"] = rank, world
    params: list[Any] = []
    schedule = state.schedule
    if schedule is not None:
        facts["schedule_class"] = type(schedule).__name__
        facts["schedule"] = schedule_name(type(schedule))
        facts["num_microbatches"] = getattr(schedule, "_n_microbatches", None)
        try:
            from collectors.pipelining import stages_of

            stages = stages_of(schedule)
            facts["stages"] = sorted(int(s.stage_index) for s in stages)
            facts["num_stages"] = int(stages[0].num_stages)
            for s in stages:
                params.extend(s.submod.parameters())
        except Exception as e:  # noqa: BLE001
            facts.setdefault("notes", []).append(f"stages not readable ({type(e).__name__}: {e})")
        mbs = _microbatch_size(schedule, args)
        if mbs is not None:
            facts["microbatch_size"] = mbs
    facts.update(framework_facts(state))
    if not params and state.optimizer is not None:
        params = [p for g in state.optimizer.param_groups for p in g["params"]]
        facts["parameters_from"] = f"{type(state.optimizer).__name__} param_groups"
    elif params:
        facts["parameters_from"] = "the pipeline stages' submodules"
    if params:
        unique = {id(p): p for p in params}.values()
        facts["parameters"] = int(sum(p.numel() for p in unique))
        first = next(iter(unique))
        facts["dtype"] = str(first.dtype).removeprefix("torch.")
        facts["device"] = first.device.type
    return facts


def framework_facts(state: _State) -> dict[str, Any]:
    """The pipeline of an unmodified megatron-core or DeepSpeed job, as the framework itself holds it: megatron-core's
    parallel_state (pipeline rank and size, virtual stages, tensor and data parallel sizes) and the schedule call it
    made (``_State.framework``); DeepSpeed's PipelineEngine (stage_id, num_stages, micro_batches, micro_batch_size,
    its grid's data and model parallel sizes). Only modules the job imported are read; never raises."""
    out: dict[str, Any] = {}
    try:
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            p, r = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
            v = ps.get_virtual_pipeline_model_parallel_world_size() or 1
            out.update(framework="megatron-core", stages=[r + i * p for i in range(v)], num_stages=p * v,
                       tp=ps.get_tensor_model_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
                       stages_from="megatron-core's parallel_state (pipeline rank, size, virtual size)")
            if state.framework:
                out.update({k: v for k, v in state.framework.items() if v is not None})
        engine = state.deepspeed_engine
        if engine is not None:
            grid = engine.grid
            out.update(framework="deepspeed", stages=[int(engine.stage_id)], num_stages=int(engine.num_stages),
                       schedule="1f1b", schedule_class="deepspeed PipelineEngine (TrainSchedule)",
                       num_microbatches=int(engine.micro_batches), microbatch_size=int(engine.micro_batch_size),
                       dp=int(grid.data_parallel_size), tp=int(getattr(grid, "model_parallel_size", 1) or 1),
                       stages_from="DeepSpeed's PipelineEngine (stage_id, num_stages)")
    except Exception as e:  # noqa: BLE001 - a framework version with other names: say so, keep the rest
        out.setdefault("notes", []).append(f"framework layout not readable ({type(e).__name__}: {e})")
    return out


def _microbatch_size(schedule: Any, args: tuple) -> int | None:
    """The whole batch's size along the split dimension over the number of micro-batches (first stage's rank)."""
    import torch

    n = getattr(schedule, "_n_microbatches", None)
    if not args or not isinstance(args[0], torch.Tensor) or not n:
        return None
    spec = getattr(schedule, "_args_chunk_spec", None)
    dim = getattr(spec[0], "split_dim", 0) if spec else 0
    size = args[0].shape[dim]
    return size // n if size % n == 0 else None


# torch.distributed.pipelining schedule class → run.json's schedule name (traceana.core.manifest.SCHEDULES)
_SCHEDULE_NAMES = {
    "ScheduleGPipe": "gpipe",
    "Schedule1F1B": "1f1b",
    "ScheduleInterleaved1F1B": "interleaved-1f1b",
    "ScheduleInterleavedZeroBubble": "zero-bubble",
    "ScheduleZBVZeroBubble": "zero-bubble",
}


def schedule_name(cls: type) -> str:
    for klass in cls.__mro__:  # a user's subclass of Schedule1F1B is still 1F1B
        if klass.__name__ in _SCHEDULE_NAMES:
            return _SCHEDULE_NAMES[klass.__name__]
    return "unknown"
