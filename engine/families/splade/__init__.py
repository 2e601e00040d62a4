"""SPLADE: a masked-LM head pooled into one sparse vocabulary vector per text (embed_sparse)."""

from pooling_server.engine.families import Family
from pooling_server.engine.requests.plans import plan_text

FAMILY = Family(name="splade", plan=plan_text, loading=f"{__name__}.loading")
