"""The pooled text encoder: a transformer's token states pooled into one vector per text
(embed, token_embed, score by cosine; late chunking is a plan over it)."""

from pooling_server.engine.families import Family
from pooling_server.engine.requests.plans import plan_encoder

FAMILY = Family(name="encoder", plan=plan_encoder, loading=f"{__name__}.loading")
