"""The restore pipeline of ``TieredStore.load``: chunks read on the store's loop (``pipeline``) or
without it (``direct``), one chunk in flight (``chunk``), verify+scatter fanned out over helper
threads (``fanout``, ``helper_pools``), and where a restore spent its time (``stages``).
"""
