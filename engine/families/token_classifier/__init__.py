"""Token classifiers: a token-classification head, one class row per token
(token_classify). loading.py loads it, plan.py plans it."""

from pooling_server.engine.families import Family
from pooling_server.engine.families.token_classifier.plan import plan

FAMILY = Family(name="token_classifier", plan=plan, loading=f"{__name__}.loading")
