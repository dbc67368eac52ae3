"""Run an unmodified training command with a window of its steps profiled in every rank.

  traceana attach -o runs/x --window 10:12 -- torchrun --nproc-per-node 4 train.py --lr 3e-4

Every Python process the command starts profiles steps 10 and 11 (counted from 0; the end is excluded, like a
Python slice) and writes rank{R}.pt.trace.json.gz; run.json holds what could be detected (world size, rank → stage,
schedule, micro-batches, parameters, torch version) and lists what could not. Steps are found without changing the
script: torch.distributed.pipelining's schedule.step, else the optimizer's step, or --step-fn module:qualname.
The command's output and exit status pass through unchanged; traceana's own lines go to stderr.

The job runs in its own process group: Ctrl-C (SIGINT) and SIGTERM sent to attach are forwarded to every process of
that group; a second one sends SIGTERM; if the job has not ended --kill-after seconds after the first, its group is
killed (SIGKILL). Processes the job leaves behind in its group when it exits are stopped the same way, so nothing
outlives attach (a process that starts its own session escapes any group). A job killed by a signal is reported by
the signal's name, and attach exits as the shell would (128 + the signal's number).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from traceana.core.errors import ConfigError

POLL_S = 0.5
GRACE_S = 10.0  # --kill-after's default: time a job gets to stop after a forwarded signal before SIGKILL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from traceana.commands import options

    options.output(parser, type=Path, required=True, metavar="DIR",
                   help="new (or empty) directory: the run directory (one per window with several windows) (required)")
    # A range of step numbers (collect's --profile-steps is a count); --steps is the old spelling, kept hidden.
    parser.add_argument("--window", "--steps", dest="window", default="10:12", metavar="A:B[,C:D…]",
                        help="the steps to profile, counted from 0, B excluded (default 10:12: steps 10 and 11); "
                             "several windows: one run directory each, OUT/steps{A}-{B-1}")
    parser.add_argument("--every", type=int, metavar="N",
                        help="repeat the last window every N steps for as long as the job runs")
    # As collect's --warmup-steps; --warmup is the old spelling, kept hidden.
    parser.add_argument("--warmup-steps", "--warmup", dest="warmup", type=int, default=1, metavar="N",
                        help="steps run before each window, the profiler warming up (nothing kept)")
    parser.add_argument("--step-fn", metavar="MODULE:QUALNAME",
                        help="a call of this function starts a step (instead of schedule.step / optimizer.step); "
                             "it must live in an imported module, not in the script run as __main__")
    parser.add_argument("--kill-after", type=float, default=GRACE_S, metavar="SECONDS",
                        help="after a SIGINT/SIGTERM forwarded to the job, or once the job exits leaving processes "
                             "behind, kill the job's process group (SIGKILL) when it has not ended within this long")
    parser.add_argument("--live", action="store_true",
                        help="print each window's per-stage attribution as it lands (as traceana watch does)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND …",
                        help="the training command, after --")


def parse_windows(text: str) -> tuple[tuple[int, int], ...]:
    """``"10:12,20:22"`` → ((10, 12), (20, 22)); refused unless each is A:B with 1 ≤ A < B, in order, disjoint."""
    windows = []
    for part in text.split(","):
        a, sep, b = part.strip().partition(":")
        try:
            start, end = int(a), int(b)
        except ValueError:
            raise ConfigError(f"--window {text!r}: {part.strip()!r} is not A:B", fix="write e.g. --window 10:12") from None
        if not sep or start < 1 or end <= start:
            raise ConfigError(f"--window {text!r}: {part.strip()!r} must be A:B with 1 ≤ A < B",
                              fix="step 0 has no boundary before it to start the profiler at; e.g. --window 10:12")
        if windows and start < windows[-1][1]:
            raise ConfigError(f"--window {text!r}: windows overlap or are out of order",
                              fix="list disjoint windows in increasing order")
        windows.append((start, end))
    return tuple(windows)


def _config(args: argparse.Namespace):
    from collectors.attach import Config

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command to run", fix="put the training command after --, e.g. "
                          "traceana attach -o runs/x -- torchrun --nproc-per-node 2 train.py")
    windows = parse_windows(args.window)
    if args.warmup < 1:
        raise ConfigError(f"--warmup-steps must be at least 1, got {args.warmup}",
                          fix="the warm-up step absorbs the profiler's start-up cost; keep --warmup-steps 1")
    if any(start < args.warmup for start, _ in windows):
        raise ConfigError(f"--window {args.window}: a window starts before step {args.warmup} (--warmup-steps)",
                          fix="start the window later or lower --warmup-steps")
    if args.every is not None and args.every < windows[-1][1] - windows[-1][0] + args.warmup:
        raise ConfigError(f"--every {args.every} is shorter than a window plus its warm-up",
                          fix=f"use --every ≥ {windows[-1][1] - windows[-1][0] + args.warmup}")
    if args.step_fn is not None:
        module, sep, qualname = args.step_fn.partition(":")
        if not sep or not module or not qualname or module == "__main__":
            raise ConfigError(f"--step-fn {args.step_fn!r} is not MODULE:QUALNAME of an importable module",
                              fix="e.g. --step-fn mytrainer.loop:train_step")
    out = args.output.resolve()
    made = _check_out(out)
    split = len(windows) > 1 or args.every is not None
    return Config(out=str(out), windows=windows, every=args.every, warmup=args.warmup, step_fn=args.step_fn,
                  split=split), command, made


def _check_out(out: Path) -> bool:
    """The run directory must be new or empty (nothing the user has is overwritten) and writable; True if made here."""
    made = not out.exists()
    try:
        if out.exists() and any(out.iterdir()):
            raise ConfigError("the output directory is not empty", path=out,
                              fix="choose a new -o/--out directory (traceana never overwrites a run)")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".traceana-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return made
    except OSError as e:
        raise ConfigError(f"cannot write to the output directory ({e.strerror or e})", path=out,
                          fix="choose a writable -o/--out directory") from None


def child_env(config, base: dict[str, str] | None = None) -> dict[str, str]:
    """The job's environment: ``boot/`` first on PYTHONPATH, the configuration in TRACEANA_ATTACH."""
    from collectors.attach import BOOT_DIR, ENV, PACKAGE_ROOT

    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + rest if rest else "")
    env[ENV] = config.to_env()
    env["TRACEANA_ATTACH_ROOT"] = str(PACKAGE_ROOT)
    return env


def window_dirs(config) -> list[Path]:
    """The window directories that exist so far (one: OUT itself unless windows are split)."""
    out = Path(config.out)
    if not config.split:
        return [out]
    from collectors.attach import parse_window_dir

    try:
        return sorted((p for p in out.iterdir() if p.is_dir() and parse_window_dir(p.name)),
                      key=lambda p: parse_window_dir(p.name))
    except OSError:
        return []


class _Finisher:
    """Writes each window's run.json once all its ranks' traces landed (polling: no collective in the job)."""

    def __init__(self, config) -> None:
        self.config = config
        self.done: set[Path] = set()

    def poll(self) -> None:
        from collectors.attach.facts import finalize_window

        for d in window_dirs(self.config):
            if d in self.done:
                continue
            manifest, complete = finalize_window(d)
            if manifest is not None and complete:
                self.done.add(d)
                say(f"window {manifest.attach['steps']}: {manifest.world_size} trace(s) in {d}")

    def finish(self, job: dict) -> list[tuple[Path, object]]:
        from collectors.attach.facts import finalize_window

        return [(d, finalize_window(d, job=job)[0]) for d in window_dirs(self.config)]


def say(message: str) -> None:
    print(f"traceana attach: {message}", file=sys.stderr, flush=True)


class _Job:
    """The job's process group: signals to attach are forwarded to it, escalated, and nothing of it outlives attach."""

    def __init__(self, proc: subprocess.Popen, grace_s: float) -> None:
        self.proc, self.pgid, self.grace_s = proc, proc.pid, grace_s
        self.received: list[int] = []
        self.kill_at: float | None = None
        self.killed = False

    def forward(self, signum: int, frame=None) -> None:
        """SIGINT/SIGTERM to attach: the first is forwarded as it came, a second as SIGTERM, a third as SIGKILL."""
        self.received.append(signum)
        n = len(self.received)
        sig = signum if n == 1 else signal.SIGTERM if n == 2 else signal.SIGKILL
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace_s
            say(f"{signal.Signals(signum).name}: passed on to the job's processes; they are killed if they have not "
                f"ended within {self.grace_s:g} s (--kill-after)")
        self._signal(sig)

    def _signal(self, sig: int) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def tick(self) -> None:
        """Past the grace period after a forwarded signal: SIGKILL to the whole group."""
        if self.kill_at is not None and not self.killed and time.monotonic() >= self.kill_at:
            self.killed = True
            say(f"the job did not end within {self.grace_s:g} s of the signal: killing its processes (SIGKILL)")
            self._signal(signal.SIGKILL)

    def leftovers(self) -> None:
        """After the job's own process ended: its group's other processes are stopped (SIGTERM, then SIGKILL after
        the grace period), so that nothing it started keeps running after attach."""
        if not self._signal(0):
            return
        say("the job's command ended but left processes of its group running: stopping them (SIGTERM)")
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if not self._signal(0) or not _live_members(self.pgid):
                return
        say(f"they did not end within {self.grace_s:g} s: killing them (SIGKILL)")
        self._signal(signal.SIGKILL)


def _live_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies waiting for init to reap them are not)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def describe_exit(code: int) -> str:
    """``exited with status 3`` or ``was killed by SIGSEGV (signal 11)``."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name} (signal {-code})"


def run(args: argparse.Namespace) -> int:
    config, command, made = _config(args)
    if not args.kill_after >= 0:
        raise ConfigError(f"--kill-after must be 0 or more seconds, got {args.kill_after}", fix="e.g. --kill-after 10")
    finisher = _Finisher(config)
    live = _Live(config) if args.live else None
    started = time.time()
    try:  # its own process group: what attach receives reaches every process the job starts, and none outlives it
        proc = subprocess.Popen(command, env=child_env(config), process_group=0)
    except OSError as e:
        if made:
            Path(config.out).rmdir()  # the empty directory made above: leave nothing behind
        raise ConfigError(f"cannot start {command[0]!r} ({e.strerror or e})", fix="check the command after --") from None
    job = _Job(proc, args.kill_after)
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, job.forward)
        except (ValueError, OSError):  # not the main thread (tests): a KeyboardInterrupt below is forwarded
            pass
    code: int | None = None
    try:
        while code is None:
            try:
                try:
                    code = proc.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    finisher.poll()
                job.tick()
            except KeyboardInterrupt:  # (raised by a caller's handler, or in a test)
                job.forward(signal.SIGINT)
        job.leftovers()
    finally:
        if proc.poll() is None:  # attach itself failed: the job does not outlive it
            job._signal(signal.SIGKILL)
            proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    interrupted = bool(job.received)
    first_signal = job.received[0] if job.received else None
    job = {"exit_code": code, "command": command, "seconds": round(time.time() - started, 1),
           "interrupted": interrupted}
    results = finisher.finish(job)
    if live is not None:
        live.stop()
    written = [(d, m) for d, m in results if m is not None]
    if not written:
        say(f"no process reached the window (--window {args.window}); nothing was profiled"
            f"{'' if code == 0 else f' (the command {describe_exit(code)})'}")
    elif code < 0:
        say(f"the command {describe_exit(code)}")
    for d, m in written:
        a = m.attach
        missing = a["ranks_without_trace"]
        line = f"steps {a['steps']}: {len(m.ranks_written)} of {m.world_size} rank traces in {d}"
        if missing:
            line += f"; no trace from ranks {missing} (run.json says so)"
        say(line)
        for r, p in a["problems"].items():
            say(f"rank {r}: {p}")
    if written:
        say(f"next: traceana analyze {written[0][0]}" if len(written) == 1 else f"next: traceana watch {config.out}")
    if interrupted:
        return 128 + first_signal  # 130 (SIGINT) or 143 (SIGTERM), as the shell reports a signalled program
    return code if code >= 0 else 128 - code


class _Live:
    """``--live``: traceana watch on the output directory, in a thread, until the job ends."""

    def __init__(self, config) -> None:
        from traceana.commands import watch

        self.stop_event = threading.Event()

        def target() -> None:
            try:
                watch.watch(Path(config.out), stop=self.stop_event, interval_s=POLL_S)
            except Exception as e:  # noqa: BLE001 - watching must not take the job's launcher down
                say(f"--live stopped ({type(e).__name__}: {e}); traceana watch {config.out} picks up from here")

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=120)

