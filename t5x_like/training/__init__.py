"""The training loop and its parts: the Trainer (trainer.py) calling hooks (hooks.py), the jitted
steps (step.py), the per-iteration batches (batches.py) and schedule (schedule.py), where a run
starts (startup.py, resume.py), checkpoints (run_checkpoints.py), incidents and stops
(incidents.py, runtime.py), alerts, metrics and their writers (metrics.py, summaries.py),
evaluation during training (evaluation.py), profiles, the workdir (workdir.py), the replay of
any iteration's batch (replay.py) and what a device's memory holds (device_memory.py).

Layer 5: imports layers 0-4 only.
"""
