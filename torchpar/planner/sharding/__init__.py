"""Intra-operator sharding: specs, the alpha-beta cost model, strategies and the ILP."""
