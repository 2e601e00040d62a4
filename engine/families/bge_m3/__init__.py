"""bge-m3: dense, sparse and ColBERT outputs from one pass.

multi_output.py holds the layout of its token rows and its scores (torch-free), rules.py
and plan.py its rows of the validation table and its plans, loading.py and
multi_output_module.py its torch side."""

from pooling_server.engine.families import Family, FamilyRules, RowSizes
from pooling_server.engine.families.bge_m3 import rules
from pooling_server.engine.families.bge_m3.multi_output import MultiOutputSettings
from pooling_server.engine.families.bge_m3.plan import plan

FAMILY = Family(
    name="bge_m3",
    plan=plan,
    loading=f"{__name__}.loading",
    rules=FamilyRules(
        shape=(rules.outputs_asked,),
        params=(rules.sparse_activation, rules.output_weights),
        elsewhere=(rules.output_weights_elsewhere,),
    ),
    backends=("torch",),  # the exports know nothing of its sparse and ColBERT heads
    title="a multi-output (bge-m3) model",
    settings=MultiOutputSettings,
    task_hint=rules.task_hint,
    rows=RowSizes(rules.rows_bytes),
)
