"""Two towers (CLIP, SigLIP): texts and images into one space."""

from pooling_server.engine.families import Family, deferred

FAMILY = Family(
    name="towers",
    plan=deferred("pooling_server.engine.families.towers.towers", "plan_towers"),
    loading=f"{__name__}.loading",
)
