"""fallbackgate: a joint-offload MoE engine whose every fallback is tagged, recorded and gated.

One import name holds every part: ``fallbackgate.engine`` (mechanism), ``fallbackgate.ledger`` (SQL
record), the policy side in this package's sub-packages, ``fallbackgate.evals`` (lm-eval) and
``fallbackgate.dashboard`` (Streamlit). The engine's vocabulary is re-exported here.
"""

from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, ObjectKind, Tag, Tier

__all__ = ["TAG_EXACTNESS", "Exactness", "ObjectKind", "Tag", "Tier", "register_lm_eval_model"]

LM_EVAL_TARGET = "fallbackgate.evals.lm_adapter:FallbackgateLM"


def register_lm_eval_model() -> bool:
    """Register the lm-eval model ``fallbackgate`` (lazily: the adapter and the engine load on first use);
    False when lm-eval is not installed. Runs on ``import fallbackgate``."""
    try:
        import lm_eval.models  # noqa: F401 - lm-eval's own models first (its registry fills itself only when empty)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return False
    if "fallbackgate" not in model_registry.keys():
        model_registry.register("fallbackgate", target=LM_EVAL_TARGET)
    return True


register_lm_eval_model()
