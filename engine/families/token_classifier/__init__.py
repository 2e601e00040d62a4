"""Token classifiers: a token-classification head, one logit row per token (token_classify)."""

from pooling_server.engine.families import Family
from pooling_server.engine.requests.plans import plan_text

FAMILY = Family(name="token_classifier", plan=plan_text, loading=f"{__name__}.loading")
