"""Staging memory between an engine and the tiers: page-aligned host slabs (``slabs``), device slabs
for the GPU-direct path (``device_slabs``), and the batched device copies (``device_copy``) in the
order ``device_order`` prescribes.
"""
