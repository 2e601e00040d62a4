"""A model folder read and loaded: its spec, its facts, the runner of its forward pass and what
it shares with every family.
"""
