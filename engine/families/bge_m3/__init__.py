"""bge-m3: dense, sparse and ColBERT outputs from one pass."""

from pooling_server.engine.families import Family, deferred

FAMILY = Family(
    name="bge_m3",
    plan=deferred("pooling_server.engine.requests.plans", "plan_bge_m3"),
    loading=f"{__name__}.loading",
    backends=("torch",),  # the exports know nothing of its sparse and ColBERT heads
    title="a multi-output (bge-m3) model",
)
