"""A run of an experiment: the experiment loop (`experiment.run`), evaluation of a
checkpoint, the checkpoints themselves and the metric writers. Nothing here runs inside
the compiled step."""
