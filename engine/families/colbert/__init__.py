"""ColBERT (MultiVectorEncoder): one vector per token, scored by MaxSim."""
