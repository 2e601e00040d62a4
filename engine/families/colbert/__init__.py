"""ColBERT (MultiVectorEncoder): one vector per token, scored by MaxSim."""

from pooling_server.engine.families import Family, deferred

FAMILY = Family(
    name="colbert",
    plan=deferred("pooling_server.engine.requests.plans", "plan_colbert"),
    loading=f"{__name__}.loading",
    backends=("torch",),  # the exports know nothing of its projection and expansion mask
    title="a multi-vector model",
)
