"""SPLADE: a masked-LM head pooled into one sparse vocabulary vector per text
(embed_sparse). loading.py loads it, plan.py plans it, rules.py holds its rule on
use_activation; the pooling itself runs in models/pooling.py's splade()."""

from pooling_server.engine.families import Family, FamilyRules
from pooling_server.engine.families.splade.plan import plan
from pooling_server.engine.families.splade.rules import unsaturated_weights

FAMILY = Family(
    name="splade",
    plan=plan,
    loading=f"{__name__}.loading",
    rules=FamilyRules(params=(unsaturated_weights,)),
)
