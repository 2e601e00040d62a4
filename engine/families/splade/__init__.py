"""SPLADE: a masked-LM head pooled into one sparse vocabulary vector per text
(embed_sparse). settings.py holds its pooling (ModelInfo.settings) and the saturation,
loading.py loads it, pooling.py pools its logits on the device (the runner's pool_logits),
plan.py plans it, rules.py holds its rule on use_activation."""

from pooling_server.engine.families import Family, FamilyRules
from pooling_server.engine.families.splade.plan import plan
from pooling_server.engine.families.splade.rules import unsaturated_weights
from pooling_server.engine.families.splade.settings import SpladeSettings

FAMILY = Family(
    name="splade",
    plan=plan,
    loading=f"{__name__}.loading",
    rules=FamilyRules(params=(unsaturated_weights,)),
    settings=SpladeSettings,
)
