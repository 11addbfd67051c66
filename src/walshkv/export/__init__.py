"""File formats walshkv writes for other tools (llama.cpp forks)."""

from walshkv.export.kv_mean_center import (
    KMeanBias,
    from_llamacpp_channel_order,
    read_kv_mean_center,
    to_llamacpp_channel_order,
    write_kv_mean_center,
)

__all__ = [
    "KMeanBias",
    "from_llamacpp_channel_order",
    "read_kv_mean_center",
    "to_llamacpp_channel_order",
    "write_kv_mean_center",
]
