"""The result cache (docs/cache.md): per-item raw outputs keyed on everything that changes
them, kept in an in-memory LRU per engine process and, optionally, a shared Redis tier.

Torch-free: front ends compute a request's tag (key.py) and engine processes hold the tiers.
"""
