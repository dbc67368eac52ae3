"""What the layer spans cost (docs/naming.md "Layer spans"): tiny-gpt's stage 1 of 2 (4 blocks, head and loss), one
micro-batch's forward and backward on one CPU thread, with the stage runner's pass set (layer spans recorded while
a profiler records) and without, interleaved; median CPU time (time.process_time) a forward and backward.

    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/bench_layer_spans.py            # no profiler
    PYTHONPATH=$PWD .venv/bin/python tests/benchmarks/bench_layer_spans.py --profiler # under torch.profiler
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from collectors import annotations as ann
from collectors.trainer.model import GPT, Stage
from traceana.core import names
from traceana.model.presets import TINY_MODELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiler", action="store_true", help="run under torch.profiler.profile()")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = TINY_MODELS["tiny-gpt"]
    torch.manual_seed(0)
    stage = Stage(GPT(shape), stage=1, stages=2)
    x = torch.randn(1, shape.seq, shape.hidden, requires_grad=True)
    t = torch.randint(0, shape.vocab, (1, shape.seq))

    def once(spans: bool) -> None:
        if not spans:
            stage(x, t).backward()
            return
        with ann.running(1, names.FORWARD, 0):
            y = stage(x, t)
        with ann.running(1, names.BACKWARD, 0):
            y.backward()

    n = 10 if args.profiler else 40
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.profiler.profile() if args.profiler else contextlib.nullcontext():
        for _ in range(10):
            once(True), once(False)
        for _ in range(args.repeats):
            for spans in (False, True):
                c0 = time.process_time()
                for _ in range(n):
                    once(spans)
                times[spans].append((time.process_time() - c0) / n * 1e3)
    for spans, v in times.items():
        print(f"{'with layer spans' if spans else 'without':17s} {'(profiler)' if args.profiler else '':10s} "
              f"median {statistics.median(v):.3f} ms CPU a forward + backward (range {min(v):.3f}–{max(v):.3f})")


if __name__ == "__main__":
    main()
