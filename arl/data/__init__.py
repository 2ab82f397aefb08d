"""Datasets on disk (tfds array_record, no TensorFlow): fixed evaluation task sets and
scripted demonstrations for the SFT term."""

from arl.data.datasets import (Demonstrations, TaskSet, build_demonstrations, build_task_set,
                               load_demonstrations, load_task_set, sample_demonstrations)

__all__ = [
    "Demonstrations", "TaskSet", "build_demonstrations", "build_task_set",
    "load_demonstrations", "load_task_set", "sample_demonstrations",
]
