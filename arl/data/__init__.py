"""Datasets on disk (tfds array_record, no TensorFlow): the record format (`records`) and
prompts with reference answers read from JSONL for the `dataset_task` environment
(`text_tasks`, `word_problems`). Datasets recorded by playing an environment (evaluation
task sets, scripted demonstrations) are in `arl.rollout.episode_datasets`."""

from arl.data.text_tasks import (TextTasks, build_text_tasks, cached_text_tasks,
                                 load_text_tasks, read_jsonl)

__all__ = ["TextTasks", "build_text_tasks", "cached_text_tasks", "load_text_tasks", "read_jsonl"]
