"""Offload machinery: host banks and their ExpertBanks bundle, the slot cache and its policies, the one cost model, the
bandwidth profile, the offloaded expert backend."""
