"""lm-eval's own API models against ``fallbackgate serve`` on 127.0.0.1, on the exact policy: ``local-completions``
scores fg_cloze (with the empty-context requests behind its mutual-information score) and fg_rolling_ppl with
token-id prompts, ``echo`` and ``logprobs``, and generates fg_names with stop strings; ``local-chat-completions``
generates fg_names. Per-item log-likelihoods equal ``fallbackgate``'s own lm-eval model on the same items within
float32's numeric floor, generations exactly."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from fallbackgate.api_server.protocol import DEFAULT_CHAT_TEMPLATE
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.evals.parity import PPL_NUMERIC_FLOOR
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.test_server import MODEL, Server

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXACT_POLICY = ROOT / "fallbackgate" / "policies" / "exact.yaml"
TASKS = ["fg_cloze", "fg_rolling_ppl", "fg_names"]
LIMIT = 8
API_MAX_LENGTH = 1024  # the model's positions; lm-eval's API models keep one for the generated token and one more
OUR_MAX_LENGTH = API_MAX_LENGTH - 2  # so the rolling windows and truncation of both models are the same
LL_FLOOR = PPL_NUMERIC_FLOOR["float32"]  # relative: fp32 rounding between two packings of the same tokens
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _evaluate(model, tasks: list[str], **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from fallbackgate.evals.task_dir import render_include_dir

    manager = TaskManager(include_path=str(render_include_dir()), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=manager, limit=LIMIT, log_samples=True, **kwargs
    )


def _per_item(results: dict, task: str) -> list[tuple[int, list]]:
    return sorted((s["doc_id"], s["resps"]) for s in results["samples"][task])


def _log_likelihoods(results: dict, task: str) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc, request) -> (log-likelihood, is greedy); fg_cloze's requests are its 4 choices and their 4
    empty-context twins (the mutual-information score), fg_rolling_ppl's one per document."""
    out = {}
    for doc, resps in _per_item(results, task):
        for i, (resp,) in enumerate(resps):
            out[doc, i] = (float(resp[0]), bool(resp[1])) if isinstance(resp, tuple) else (float(resp), True)
    return out


@pytest.mark.slow
def test_lm_eval_api_models_against_serve_equal_the_fallbackgate_model(tmp_path: pathlib.Path) -> None:
    from fallbackgate.evals.lm_adapter import FallbackgateLM

    srv = Server(str(tmp_path / "ledger.sqlite"), "--audit-workers", "0", policy=EXACT_POLICY)
    try:
        args = f"base_url={srv.base}/v1/completions,model={MODEL},tokenizer={CHECKPOINT_DIR}"
        args += f",tokenizer_backend=huggingface,max_length={API_MAX_LENGTH},batch_size=4,max_retries=1"
        served = _evaluate("local-completions", TASKS, model_args=args)
        chat_args = f"base_url={srv.base}/v1/chat/completions,model={MODEL},max_retries=1"
        chat = _evaluate("local-chat-completions", ["fg_names"], model_args=chat_args, apply_chat_template=True)
    finally:
        out = srv.stop()
    assert "Traceback" not in out, out
    ours = FallbackgateLM(
        pretrained=str(CHECKPOINT_DIR), policy=str(EXACT_POLICY), ledger="none", max_length=OUR_MAX_LENGTH
    )
    own = _evaluate(ours, TASKS)
    for task in ("fg_cloze", "fg_rolling_ppl"):
        got, want = _log_likelihoods(served, task), _log_likelihoods(own, task)
        assert got.keys() == want.keys() and len({doc for doc, _ in got}) == LIMIT
        worst = max(abs(got[k][0] - want[k][0]) / abs(want[k][0]) for k in got)
        print(f"{task}: {len(got)} log-likelihoods, largest relative difference {worst:.1e}")
        assert worst <= LL_FLOOR, (task, worst)
        assert all(got[k][1] == want[k][1] for k in got)  # is-greedy, as lm-eval reads it from the top logprobs
    for key in ("acc,none", "acc_mutual_info,none"):
        assert served["results"]["fg_cloze"][key] == own["results"]["fg_cloze"][key], key
    assert _per_item(served, "fg_names") == _per_item(own, "fg_names")  # the server cuts at stops where lm-eval does
    _check_chat_generations(chat, ours)


def _check_chat_generations(chat: dict, ours) -> None:
    """Each chat generation is the engine's greedy continuation of the templated messages, cut at the first of
    the four stop strings local-chat-completions sends."""
    samples = chat["samples"]["fg_names"]
    assert len(samples) == LIMIT
    for sample in samples:
        ((chat_str, gen_kwargs),) = sample["arguments"]  # (the messages as JSON, lm-eval's generation kwargs)
        messages = json.loads(chat_str.prompt if hasattr(chat_str, "prompt") else chat_str[0])
        text = ours.tokenizer.apply_chat_template(
            messages, chat_template=DEFAULT_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        params = SamplingParams(
            max_new_tokens=gen_kwargs["max_gen_toks"], temperature=0.0, stop_token_ids=(ours.tokenizer.eos_token_id,)
        )
        (output,) = ours.engine.generate([ours.tokenizer.encode(text)], params)
        expected = ours.tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
        for stop in gen_kwargs["until"][:4]:
            expected = expected.split(stop)[0]
        assert sample["resps"] == [[expected]], (sample["resps"], expected)
