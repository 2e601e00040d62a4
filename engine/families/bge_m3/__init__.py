"""bge-m3: dense, sparse and ColBERT outputs from one pass."""
