"""ColBERT (MultiVectorEncoder): one vector per token, scored by MaxSim.

multi_vector.py reads its folder's settings (torch-free), rules.py and plan.py are its
rows of the validation table and its plans, loading.py and multi_vector_module.py its
torch side."""

from pooling_server.engine.families import Family, RowSizes
from pooling_server.engine.families.colbert import rules
from pooling_server.engine.families.colbert.multi_vector import MultiVectorSettings
from pooling_server.engine.families.colbert.plan import plan

FAMILY = Family(
    name="colbert",
    plan=plan,
    loading=f"{__name__}.loading",
    backends=("torch",),  # the exports know nothing of its projection and expansion mask
    title="a multi-vector model",
    settings=MultiVectorSettings,
    task_hint=rules.task_hint,
    rows=RowSizes(rules.rows_bytes, rules.rows_cap),
)
