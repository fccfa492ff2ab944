"""``dtkv plan``: capacity, cost and time-to-first-token planning for tiered KV storage.

models     model KV shapes (presets) and bytes per token, raw and as stored records
hardware   GPU and tier presets, the price table
model      the arithmetic (minutes of context, $/month, restore vs recompute TTFT)
spindles   HDD spindles a restore needs within a target time (seeks vs streaming)
scenarios  named scenarios, among them ``seed`` (the seed study's figures)
report     text tables and JSON
"""

from .model import Plan, Scenario, plan
from .report import format_text, to_dict
from .scenarios import SEED_ASSUMPTIONS, scenario

__all__ = ["SEED_ASSUMPTIONS", "Plan", "Scenario", "format_text", "plan", "scenario", "to_dict"]
