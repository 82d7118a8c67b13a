"""The datasets of the YAML tasks in this folder (`custom_dataset: !function local_json.load`).

lm_eval hands a task's `dataset_kwargs` to `datasets.load_dataset`, which resolves relative
`data_files` against the working directory; these are resolved against this folder, so the tasks
run from anywhere. The files are read with the `json` builder, as `dataset_path: json` says, and
nothing is fetched from the Hugging Face Hub.
"""

import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def load(data_files: dict[str, str], **_metadata) -> datasets.DatasetDict:
  """{split: dataset} of the task's `dataset_kwargs.data_files` (paths relative to this folder).
  The task's metadata (its version, the model's arguments) arrives too, and is not needed."""
  files = {split: os.path.join(HERE, name) for split, name in data_files.items()}
  return datasets.load_dataset('json', data_files=files)
