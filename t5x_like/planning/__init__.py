"""Planning a run without a GPU: the analytical cost model behind `plan --estimate/--search`
(cost_model.py) and the peak-memory breakdown from XLA's buffer assignment (memory_report.py).

Layer 6: imports layers 0-5 only.
"""
