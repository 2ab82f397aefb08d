"""The host side of an experiment: the training loop, evaluation, checkpoints, metric
writers. Nothing here runs inside the compiled step."""
