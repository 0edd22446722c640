"""fallbackgate: a joint-offload MoE engine whose every fallback is tagged, recorded and gated.

One import name holds every part: ``fallbackgate.engine`` (mechanism), ``fallbackgate.ledger`` (SQL
record), the policy side in this package's sub-packages, ``fallbackgate.evals`` (lm-eval) and
``fallbackgate.dashboard`` (Streamlit). The engine's vocabulary is re-exported here.
"""

from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, ObjectKind, Tag, Tier

__all__ = ["TAG_EXACTNESS", "Exactness", "ObjectKind", "Tag", "Tier"]
