"""Classifiers and cross-encoders: a sequence-classification head, one logit row per text
or pair (classify; score where it has one label)."""

from pooling_server.engine.families import Family
from pooling_server.engine.requests.plans import plan_text

FAMILY = Family(name="cross_encoder", plan=plan_text, loading=f"{__name__}.loading")
