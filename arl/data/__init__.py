"""Datasets on disk (tfds array_record, no TensorFlow): fixed evaluation task sets,
scripted demonstrations for the SFT term, and prompts with reference answers read from
JSONL for the `dataset_task` environment (`text_tasks`)."""

from arl.data.datasets import (Demonstrations, TaskSet, build_demonstrations, build_task_set,
                               load_demonstrations, load_task_set, sample_demonstrations)
from arl.data.text_tasks import (TextTasks, build_text_tasks, cached_text_tasks,
                                 load_text_tasks, read_jsonl)

__all__ = [
    "Demonstrations", "TaskSet", "TextTasks", "build_demonstrations", "build_task_set",
    "build_text_tasks", "cached_text_tasks", "load_demonstrations", "load_task_set",
    "load_text_tasks", "read_jsonl", "sample_demonstrations",
]
