"""The effectful shell: the process settings (`process_settings.setup`, `arl.setup()`),
a run of an experiment (the loop, `experiment.run`), evaluation of a checkpoint, the
checkpoints themselves and the metric writers. Nothing here runs inside the compiled
step."""
