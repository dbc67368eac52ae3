"""Run the reference trainer: one process per stage, spawned here, or in-process under torchrun.

Python API (``traceana demo`` uses it)::

    from collectors.launch import collect
    from collectors.trainer.config import CollectConfig
    run_dir = collect(CollectConfig(preset="tiny-gpt", pp=4, num_microbatches=8, schedule="1f1b", bpipe=True),
                      "runs/bpipe", progress=print)

``collect`` validates the configuration (``ConfigError`` before any process starts), spawns ``pp`` processes
(gloo on CPU; NCCL when each rank has its own GPU; gloo with host staging when ranks share a GPU), waits for them and
(re)writes ``run.json`` with the ranks whose trace is really on disk. It returns the run directory.
Workers start from a forkserver, so a script calling ``collect`` needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.multiprocessing as mp

from collectors.manifest import finalize_manifest
from collectors.trainer.config import CollectConfig
from traceana.core.errors import ConfigError

Progress = Callable[[str], None]


def free_port() -> int:
    """A TCP port nobody listens on right now (parallel tests and runs must not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def workers_output_to(log: Path) -> Iterator[None]:
    """Send file descriptor 2 to ``log`` (appended) while the trainer runs.

    The trainer's processes inherit our stderr, and torch's profiler prints several lines per rank and step there
    (``USDT … profiler_start``, allocator warnings), which would bury what traceana says (``traceana demo``'s
    progress display draws on a duplicate of the terminal's stderr, taken before this redirect)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def check_out_dir(out_dir: Path) -> None:
    """``traceana collect`` refuses, before spawning, a directory it cannot write (the profiler itself would only warn)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".traceana-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write to the output directory ({e.strerror or e})", path=out_dir,
                          fix="choose a writable -o/--output directory") from None


def collect(config: CollectConfig, out_dir: str | Path, *, progress: Progress | None = None,
            timeout_s: float = 600.0) -> Path:
    """Train and profile ``config`` into ``out_dir``; returns ``out_dir`` (a run directory: run.json + traces)."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    started = time.time()
    say = progress or (lambda _msg: None)
    say(f"collecting {describe(config)} into {out_dir}")
    try:
        launch(config, out_dir, progress=say, timeout_s=timeout_s)
    finally:
        if config.profile:  # rank 0 wrote run.json; rewrite it from what is on disk in case a rank (or rank 0) died
            from collectors.trainer.train import choose_device, manifest_for

            manifest = manifest_for(config, choose_device(0, config.world_size))
            finalize_manifest(out_dir, manifest, since=started)
    say(f"collected {out_dir} in {time.time() - started:.1f} s")
    return out_dir


def describe(config: CollectConfig) -> str:
    bp = " + BPipe" if config.bpipe else ""
    dp = f" × dp={config.dp}" if config.dp > 1 else ""
    w = config.workload
    work = "" if w is None else (f", work=sleep F={w.forward_ms:g} B={w.backward_ms:g}"
                                 + (f" W={w.weight_ms:g}" if w.weight_ms else "") + " ms"
                                 + "".join(f" stage {i}×{f:g}" for i, f in w.slow_stages)
                                 + "".join(f" rank {i}×{f:g}" for i, f in w.slow_ranks))
    return (f"{config.preset} pp={config.pp}{dp} {config.schedule}{bp}, {config.num_microbatches}×{config.microbatch_size} "
            f"micro-batches, attention={config.attention}, recompute={config.recompute}, "
            f"{config.steps} profiled step(s){work}")


def launch(config: CollectConfig, out_dir: Path | None, *, progress: Progress | None = None,
           results_dir: Path | None = None, configs: list[CollectConfig] | None = None,
           timeout_s: float = 600.0) -> None:
    """Spawn ``config.world_size`` (pp × dp) worker processes and wait for them.

    ``configs`` runs several configurations (same ``pp``) one after the other in the same processes (tests use it to
    check many configurations for the cost of one start-up); ``results_dir`` receives each rank's ``RankResult``
    as ``{index}-rank{R}.pt``.
    """
    configs = configs or [config]
    if any((c.pp, c.dp) != (config.pp, config.dp) for c in configs):
        raise ConfigError("all configurations of one launch need the same --pp and --dp", fix="launch them separately")
    method = _start_method()
    ctx = multiprocessing.get_context(method)
    events = ctx.SimpleQueue() if progress else None
    init_method = f"tcp://127.0.0.1:{free_port()}"
    args = (configs, config.world_size, init_method, out_dir, results_dir, events,
            cores_to_pin(config.world_size), os.getpid())
    try:
        pc = mp.start_processes(_worker, args=args, nprocs=config.world_size, join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        while not pc.join(timeout=0.25):
            if events is not None:
                while not events.empty():
                    progress(events.get())
            if time.monotonic() > deadline:
                for p in pc.processes:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError(f"the trainer did not finish within {timeout_s:.0f} s; its processes were killed")
    except BaseException:  # Ctrl-C, SIGTERM (a scheduler's, sent to this process alone), a failed rank
        stop_workers(multiprocessing.active_children())  # (every rank started so far, even mid-start)
        raise
    finally:
        _stop_forkserver(method)
    if events is not None:
        while not events.empty():
            progress(events.get())


GRACE_S = 10.0  # what a rank gets to stop after SIGTERM before SIGKILL


def stop_workers(processes, grace_s: float = GRACE_S) -> None:
    """The ranks still running get SIGTERM, and SIGKILL if they have not ended within ``grace_s``: nothing is left
    running when collect exits (a SIGTERM sent to collect alone reached none of them before)."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _stop_forkserver(method: str) -> None:
    """The forkserver the ranks were forked from ends with the launch (it outlived collect by seconds, orphaned)."""
    if method != "forkserver":
        return
    try:
        from multiprocessing import forkserver

        stop = getattr(forkserver._forkserver, "_stop", None)  # (CPython's own: closes its pipe, reaps it)
        if stop is not None:
            stop()
    except Exception:  # noqa: BLE001 - best effort: it ends by itself once this process has gone
        pass


def _start_method() -> str:
    """forkserver with torch preloaded: one torch import for all ranks instead of one each (seconds on 2 cores).

    ``torch._dynamo`` is preloaded too: the optimizer's first step imports it (~800 modules, sympy included), which
    costs every rank several seconds otherwise.
    """
    if "forkserver" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized():
        try:
            multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "collectors.trainer.train"])
        except Exception:
            pass
        return "forkserver"
    return "spawn"


def _worker(rank: int, configs: list[CollectConfig], world_size: int, init_method: str, out_dir: Path | None,
            results_dir: Path | None, events, cores: list[int] | None = None, launcher: int | None = None) -> None:
    import torch.distributed as dist

    if launcher is not None:
        end_with_launcher(launcher)

    from collectors.trainer.train import choose_device, init_process_group, train

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pin_to_core(rank, cores)
    setup = choose_device(rank, world_size)
    init_process_group(setup, init_method)
    try:
        for index, config in enumerate(configs):
            report = None
            if events is not None and rank == 0:
                report = lambda step, total: events.put(f"step {step}/{total}")  # noqa: E731
            result = train(config, setup, out_dir, progress=report)
            if results_dir is not None:
                torch.save(dataclasses.asdict(result), Path(results_dir) / f"{index}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_launcher(launcher: int) -> None:
    """This rank gets SIGTERM from the kernel when the process it was forked from ends (the forkserver, which then
    ends with the launcher, or the launcher itself under spawn), and ends now if that already happened.

    Why: a SIGTERM reaching collect while it was starting the ranks could leave one forked but not yet registered, so
    collect's clean-up never stopped it; orphaned, it waited for its peers until the rendezvous timed out, holding
    collect's stdout and stderr open (CI: the caller's read of collect's output hung 180 s; by hand 1 in 9 tries at
    load 4). Each forkserver child inherits the pipe whose end tells the forkserver that the launcher has gone, so the
    forkserver outlived collect as long as such a rank lived; the rank closes it (it starts no processes of its own).
    Linux only; elsewhere the launcher's own clean-up is all there is."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # (CPython's: the fd is set in forkserver children only)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    if parent != launcher and _parent_of(parent) != launcher:  # the forkserver (or launcher) is gone already
        os._exit(128 + int(signal.SIGTERM))


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cores_to_pin(world_size: int) -> list[int] | None:
    """The cores the ranks get one each (rank r on the r-th), or None to leave them to the kernel: when the ranks
    outnumber the launcher's cores, or when other work already keeps them busy (the 1-minute load average leaves
    fewer free cores than ranks).

    Why the load matters: one configuration (pp 2, 4 micro-batches) collected ten times alternately, pinned and
    unpinned, while other jobs kept the 2-core machine's load at 8–10: pinned ranks took 1.4× as long (median
    551 vs 374 ms) and were no steadier (run-to-run CV 37 % vs 41 %, within a run 41 % vs 32 %), since a pinned rank
    cannot leave a core another job holds (docs/field-notes.md "Noise floor"). Pinning only prevents migrations
    between cores no one else wants."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if world_size > len(cores) or busy + world_size > len(cores) + 0.5:
        return None
    return cores[:world_size]


def pin_to_core(rank: int, cores: list[int] | None) -> int | None:
    """Keep torch to one intra- and one inter-op thread (one stage a process: more threads only fight each other)
    and pin this rank to its core of ``cores`` (``cores_to_pin``); returns the core, or None when not pinned. The
    run's ``host_cpus`` stays the launcher's mask (run.json is finalised by the launcher)."""
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # only settable before the first inter-op work
        torch.set_num_interop_threads(1)
    if cores is None:
        return None
    os.sched_setaffinity(0, {cores[rank]})
    return cores[rank]


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_under_torchrun(config: CollectConfig, out_dir: Path, *, progress: Progress | None = None) -> Path:
    """``torchrun --nproc-per-node P -m traceana collect …``: this process is one rank."""
    import torch.distributed as dist

    from collectors.trainer.train import choose_device, init_process_group, train

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != config.world_size:
        raise ConfigError(f"torchrun started {world_size} processes for --pp {config.pp} × --dp {config.dp}",
                          fix=f"use --nproc-per-node {config.world_size} (one stage per rank) or --pp {world_size}")
    local = int(os.environ.get("LOCAL_RANK", rank))
    setup = choose_device(rank, world_size, local)
    init_process_group(setup, "env://")
    try:
        report = (lambda step, total: progress(f"step {step}/{total}")) if progress and rank == 0 else None
        train(config, setup, out_dir, progress=report)
    finally:
        dist.destroy_process_group()
    return out_dir


