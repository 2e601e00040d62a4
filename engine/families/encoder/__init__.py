"""The pooled text encoder: a transformer's token states pooled into one vector per text
(embed, token_embed, score by cosine; late chunking is a plan over it, in requests/).
loading.py loads it (with sentence-transformers' Dense modules), plan.py plans it;
settings.py holds its facts and the score refusal of a decoder LM without a template."""

from pooling_server.engine.families import Family
from pooling_server.engine.families.encoder.plan import plan
from pooling_server.engine.families.encoder.settings import EncoderSettings, score_refusal

FAMILY = Family(
    name="encoder",
    plan=plan,
    loading=f"{__name__}.loading",
    settings=EncoderSettings,
    task_refusal=score_refusal,
)
