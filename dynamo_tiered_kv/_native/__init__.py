"""Optional compiled helpers; every caller has a pure-Python fallback (``AVAILABLE`` is False)."""
