"""Classifiers and cross-encoders: a sequence-classification head, one logit row per text
or pair (classify; score where it has one label). loading.py loads it, plan.py plans
classify and score, rules.py bounds the pairs it reads."""

from pooling_server.engine.families import Family, FamilyRules
from pooling_server.engine.families.cross_encoder.plan import plan
from pooling_server.engine.families.cross_encoder.rules import pairs_read_whole

FAMILY = Family(
    name="cross_encoder",
    plan=plan,
    loading=f"{__name__}.loading",
    rules=FamilyRules(shape=(pairs_read_whole,)),
)
