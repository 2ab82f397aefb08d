"""Datasets on disk (tfds array_record, no TensorFlow): the record format (`records`) and
prompts with reference answers read from the files users keep (JSONL, Parquet, CSV,
`datasets.save_to_disk` directories: `task_files`) for the `dataset_task` environment
(`text_tasks`, `word_problems`). Datasets recorded by playing an environment (evaluation
task sets, scripted demonstrations) are in `arl.rollout.episode_datasets`."""

from arl.data.task_files import read_task_file
from arl.data.text_tasks import TextTasks, build_text_tasks, cached_text_tasks, load_text_tasks

__all__ = ["TextTasks", "build_text_tasks", "cached_text_tasks", "load_text_tasks",
           "read_task_file"]
