"""NIXL transports: `nixl-ucx` (one-sided READs over UCX) and `nixl` (RNGD -> ATOM with hetero-npu-p2p)."""
