"""The network: the BLOOM / GPT-2 transformer (transformer.py), its attention implementations
(attention.py) and its losses (losses.py). It names logical axes; mesh/partitioning.py maps them
onto the mesh.

Layer 2: imports layers 0-1 (config, errors, kernels, mesh) only.
"""
