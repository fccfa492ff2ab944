"""SGLang's own host KV pools on CPU tensors, for tests of the SGLang backend: the module
``dtkv bench sglang`` builds them with (``dynamo_tiered_kv.bench.sglang.host``)."""

from ..bench.sglang.host import (
    SGLANG_VERSION,
    Sglang,
    attach,
    backend_extra,
    load_sglang,
    mha_host_pool,
    mla_host_pool,
    page_hashes,
    storage_config,
)

__all__ = ["SGLANG_VERSION", "Sglang", "attach", "backend_extra", "load_sglang", "mha_host_pool", "mla_host_pool",
           "page_hashes", "storage_config"]
