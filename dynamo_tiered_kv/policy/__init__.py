"""Decisions the store applies, kept apart from the mechanism: admission and TTL (``admission``),
retention classes (``retention``), who is told where a block lives (``residency``), and how much of
each engine step a restore's CPU work may take (``pacing``).
"""
