"""The performance model, no measurement in it: memory per stage (``memory``), the reference trainer's and published
shapes (``presets``), BPipe as a policy of the causal layer's engine (``bpipe_policy``), the simulator on that
engine (``simulate``: the rules' planned orders → the measured tables' schemas) and the step-time estimate with the
BPipe verdict (``bpipe``). The configuration it reads and the FLOPs count are on the ground floor
(``traceana.core.training_config``, ``traceana.core.flops``): the measurement reads them too."""
