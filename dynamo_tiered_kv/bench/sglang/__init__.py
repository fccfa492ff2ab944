"""sglang: SGLang HiCache page set/get through our backend against the raw tier, same run.

``hicache`` measures and builds the result, ``host`` builds SGLang's own host KV pools and our
backend the way SGLang does (also used by the tests).
"""

from .hicache import add_arguments, format_result, run

__all__ = ["add_arguments", "format_result", "run"]
