"""What makes runs to analyse (imports torch; above traceana's layers, importing them only downward, never
reports/): ``traceana collect`` (``command``: its flags generated from ``trainer.config.CollectConfig``'s and
``traceana.core.manifest.Workload``'s fields; ``launch``: one process per stage, or in-process under torchrun)
running the reference pipeline trainer (``trainer/``) or torch.distributed.pipelining's schedules
(``pipelining_example``; their per-micro-batch annotations: ``pipelining``) under the profiler (``profiler``,
``annotations``), with BPipe (``bpipe``); writing run.json (``manifest``); the prepared GPU check (``gpu_check``); and
``traceana attach`` (``attach/``: profile a window of steps of an unmodified job)."""
