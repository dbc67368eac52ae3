"""The model against measurement, by job: ``measurement`` (what a run measured, to feed the simulator), ``replay``
(the simulator fed with the run's own durations: ``validate``), ``prediction`` (a run predicted from another:
``cross_run``, with the noise floor) and ``verdict`` (would BPipe help this run?)."""

from traceana.validation.measurement import Measured, measure, measured_efficiency
from traceana.validation.prediction import cross_run, noise_floor, predict
from traceana.validation.replay import Validation, validate
from traceana.validation.verdict import bpipe_verdict_from_run

__all__ = ["Measured", "Validation", "bpipe_verdict_from_run", "cross_run", "measure", "measured_efficiency", "noise_floor", "predict",
           "validate"]
