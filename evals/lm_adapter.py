"""The lm-evaluation-harness model ``fallbackgate``: every request goes through the engine, batched.

From Python::

    lm = FallbackgateLM(pretrained=MODEL_DIR, policy="policy.yaml", ledger="sqlite:///ledger.db")
    results = lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=TaskManager(include_path=...))
    verdict = lm.finish()

From a command: ``fallbackgate lm-eval --model_args pretrained=DIR,policy=FILE,ledger=URL --tasks fg_cloze``
(lm-eval's own CLI with this model registered and the shipped tasks on the include path), or
``simple_evaluate(model="fallbackgate", ...)`` after ``import fallbackgate`` (which registers it lazily).

Tokenisation, truncation, rolling windows and stop-sequence handling mirror lm-eval's own ``hf`` model,
so on the exact policy the two give the same scores. Log-likelihoods come from the engine's prefill logits
(``num_scored_tokens``), so they carry every fallback the policy takes.
"""

from __future__ import annotations

import atexit
import itertools
import json
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from fallbackgate.audit.gate import RunVerdict
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.model.scoring import Submission, run_requests, score
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.evals.engine_setup import EngineSetup, build_setup
from fallbackgate.evals.recorder import EvalRecorder


@register_model("fallbackgate")
class FallbackgateLM(TemplateLM):
    """An lm-eval model backed by a fallbackgate engine under a policy (the exact baseline when none)."""

    instances: list[FallbackgateLM] = []  # every model made in this process, in order

    def __init__(
        self,
        pretrained: str | None = None,
        policy: str | None = None,
        device_budget_mb: float | None = None,
        ledger: str | None = None,
        batch_size: int | str = 64,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        force: str | list[str] | None = None,
        exact_baseline: bool = False,
        note: str = "",
        setup: EngineSetup | None = None,
        chunk_tokens: int | None = None,
        **_ignored: Any,
    ) -> None:
        """`pretrained`: checkpoint directory (default: the policy's model, else the bundled tiny MoE);
        `policy`: policy YAML (None: exact baseline); `ledger`: SQLAlchemy URL / SQLite path, "none" for no
        ledger (default: the policy's, else $FALLBACKGATE_LEDGER); `batch_size`: requests in flight at once;
        `force`: fallback tags forced on an exact_lru policy (testing); `setup`: a prebuilt engine setup."""
        super().__init__()
        FallbackgateLM.instances.append(self)  # `fallbackgate lm-eval` finishes and reports them after lm-eval
        forced = force.split("|") if isinstance(force, str) else list(force or [])
        self.setup = setup or build_setup(
            pretrained, policy, device_budget_mb, forced, bool(exact_baseline), chunk_tokens=int(chunk_tokens or 4096)
        )
        self.engine: Engine = self.setup.engine
        self.tokenizer = self.engine.tokenizer
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.batch_size_per_call = 64 if batch_size in ("auto", None) else int(str(batch_size).split(":")[0])
        limit = min(self.engine.config.max_model_len, int(self.engine.model_config.max_position_embeddings))
        self._max_length = int(max_length) if max_length else limit - 1  # the engine also needs the emitted slot
        self._ids = itertools.count()
        url = ledger if ledger is not None else self.setup.ledger_url
        self.is_recording = str(url).lower() != "none"
        self.ledger_url = url if self.is_recording else None  # None while recording: $FALLBACKGATE_LEDGER / default
        self.recorder: EvalRecorder | None = None
        self.start_run(note or "lm-eval")

    def start_run(self, note: str = "lm-eval") -> int | None:
        """Finish the current ledger run (if any) and start a new one; returns its id (None without a ledger)."""
        self.finish()
        if not self.is_recording:
            return None
        self.recorder = EvalRecorder(self.setup.assembly, self.ledger_url, note=note)
        atexit.register(self.finish)
        return self.recorder.run_id

    # --- tokens ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Encode as lm-eval's hf model does (BOS only when the tokenizer or `add_bos_token` adds it)."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        left = kwargs.get("left_truncate_len")
        return encoding[-left:] if left else encoding

    # --- requests ----------------------------------------------------------------------------
    def _hooks(self) -> dict[str, Any]:
        if self.recorder is None:
            return {}
        return {"on_step": self.recorder.on_step, "on_finish": self.recorder.on_finish}

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum log p, is greedy) of each continuation, all requests batched through the engine."""
        items = []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens; must be 1..{self.max_length}")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            items.append((whole[: -len(continuation)], list(continuation)))
        scored = score(
            self.engine,
            items,
            id_prefix=f"ll{next(self._ids)}",
            request_class=self.setup.request_class,
            max_in_flight=self.batch_size_per_call,
            **self._hooks(),
        )
        return [(s.logprob, s.is_greedy) for s in scored]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihoods from disjoint rolling windows (as lm-eval's hf model cuts them)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            doc_windows = [(None, *make_disjoint_window(w)) for w in rolling]
            windows += doc_windows
            counts.append(len(doc_windows))
        results = self._loglikelihood_tokens(windows)
        out, start = [], 0
        for n in counts:
            out.append(sum(r[0] for r in results[start : start + n]))
            start += n
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or seeded sampled) generation, batched per distinct generation settings."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), 256)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen} must be below the model length {self.max_length}")
            temperature = float(kwargs.get("temperature", 0.0) or 0.0) if kwargs.get("do_sample") else 0.0
            params = SamplingParams(
                max_new_tokens=max_gen, temperature=temperature, stop_token_ids=(self.eot_token_id,)
            )
            subs = [
                Submission(self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen), 0, params)
                for i in indices
            ]
            finished = run_requests(
                self.engine,
                subs,
                id_prefix=f"gen{next(self._ids)}",
                request_class=self.setup.request_class,
                max_in_flight=self.batch_size_per_call,
                **self._hooks(),
            )
            for j, output in finished:
                text = self.tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
                out[indices[j]] = postprocess_generated_text(text, until, None)
        return [s if s is not None else "" for s in out]

    # --- the run -----------------------------------------------------------------------------
    @property
    def run_id(self) -> int | None:
        """The ledger run this model writes to (None without a ledger)."""
        return self.recorder.run_id if self.recorder is not None else None

    def finish(self) -> RunVerdict | None:
        """Finish the ledger run and return the gate's verdict (None without a ledger or audits)."""
        if self.recorder is None:
            return None
        atexit.unregister(self.finish)
        recorder, self.recorder = self.recorder, None
        return recorder.finish()
