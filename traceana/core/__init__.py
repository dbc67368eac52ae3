"""The ground floor, imported by every layer above and importing none of them: errors, units, file safety,
memory limits, the table schemas, the annotation names, interval algebra, the schedules' names
(``schedule_names``) and the pipeline rules, the run's configuration (``manifest``: run.json; ``run_config``: the
reconciled facts; ``training_config``: the model's view; ``flags``: how a field is a command-line flag; ``flops``:
the FLOPs count) and the terminal tables. Layers: core → ingest → measure → causal → model → validation → commands."""
