"""Block identity and bytes: keys (``keys``), engine and canonical layouts (``layout``), the record
format on the host (``codec``) and on the device (``device_codec``). No medium, no store: these
modules say what a block is and how its bytes look, never where they live.
"""
