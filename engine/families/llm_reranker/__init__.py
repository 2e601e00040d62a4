"""LLM rerankers: a decoder LM scoring a pair through its score template."""

from pooling_server.engine.families import Family, deferred

FAMILY = Family(
    name="llm_reranker",
    plan=deferred("pooling_server.engine.requests.plans", "plan_llm_reranker"),
    loading=f"{__name__}.loading",
    # The exports hand back full logits, where the scorer reads two rows of the head at
    # one position.
    backends=("torch",),
    title="an LLM reranker (score template)",
)
