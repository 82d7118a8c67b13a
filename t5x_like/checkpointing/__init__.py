"""Checkpoints: Orbax saves and restores onto any mesh (checkpoints.py), their inspection
(inspection.py, behind `ckpt inspect/diff/verify/stats`), Hugging Face BLOOM conversion (hf.py)
and the software that wrote them (provenance.py).

Layer 4: imports layers 0-3 only.
"""
