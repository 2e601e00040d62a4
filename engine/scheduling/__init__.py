"""Where jobs wait and run: the engine of served models, the per-model batching queue, and the
clients that reach an engine in this process or another.
"""
