"""The training state laid out on the mesh: pipeline stages and their schedules (pipeline.py),
the parameter and optimizer-state layout with ZeRO, the TrainState and Progress
(train_state.py).

Layer 3: imports layers 0-2 (config, mesh, model, optim) only.
"""
