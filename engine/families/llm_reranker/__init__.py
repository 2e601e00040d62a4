"""LLM rerankers: a decoder LM scoring a pair through its score template."""
