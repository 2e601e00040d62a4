"""LLM rerankers: a decoder LM scoring a pair through its score template.

score_template.py finds and binds the template; llm_scorer.py keeps the two rows of the LM
head it reads; loading.py loads the folder; plan.py reads each pair through the template;
rules.py bounds the pairs as the template builds them."""

from pooling_server.engine.families import Family, FamilyRules
from pooling_server.engine.families.llm_reranker.plan import plan
from pooling_server.engine.families.llm_reranker.rules import pairs_in_template
from pooling_server.engine.families.llm_reranker.score_template import ScoreTemplate

FAMILY = Family(
    name="llm_reranker",
    plan=plan,
    loading=f"{__name__}.loading",
    rules=FamilyRules(shape=(pairs_in_template,)),
    # The exports hand back full logits, where the scorer reads two rows of the head at
    # one position.
    backends=("torch",),
    title="an LLM reranker (score template)",
    instruction=True,
    settings=ScoreTemplate,
)
