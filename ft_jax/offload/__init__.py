"""Offload machinery: host banks, the FFI ops, the slot cache and its policies, the offloaded expert backend."""
