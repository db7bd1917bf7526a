"""Hardware and model-shape data for the roofline cost model (:mod:`cpd.policy.cost_model`).

A neutral layer: pure data and arithmetic, no I/O beyond reading the shipped JSON model
configs. Imported by the routing policy and by the simulator, imports neither.

* :mod:`cpd.costmodel.hardware` — per-GPU figures (peak FLOP/s, HBM, NVLink, PCIe, NIC).
* :mod:`cpd.costmodel.model_shapes` — transformer shapes from Hugging Face ``config.json``.
"""
