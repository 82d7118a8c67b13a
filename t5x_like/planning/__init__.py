"""Planning a run without a GPU: the analytical cost model behind `plan --estimate/--search`
(cost_model.py), the peak-memory breakdown from XLA's buffer assignment (memory_report.py), and
the one parser of XLA's optimized HLO text that the breakdown and the GPU benchmarks' profile
and traffic counts share (hlo_text.py), and the GPUs described to XLA for compiling without one
(gpu_target.py: `plan --gpu`).

Layer 6: imports layers 0-5 only.
"""
