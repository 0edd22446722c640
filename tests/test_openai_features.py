"""The OpenAI features clients send, through the official openai client against ``fallbackgate serve`` on
127.0.0.1: the four prompt forms, stop strings (whole and streamed), logprobs, echo with prompt
log-probabilities, top_p and the refused fields."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.test_server import MODEL, Server

TEXTS = ["Once upon a time", "The king said", "Alice was"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(str(tmp_path_factory.mktemp("features") / "ledger.sqlite"), "--audit-workers", "0")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(CHECKPOINT_DIR))


def _greedy(client: openai.OpenAI, prompt, max_tokens: int = 12, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs)


def test_the_four_prompt_forms_give_one_indexed_choice_per_prompt(server: Server, tokenizer) -> None:
    client = server.client()
    alone = [_greedy(client, t).choices[0].text for t in TEXTS]
    token_ids = [tokenizer.encode(t) for t in TEXTS]
    many = _greedy(client, TEXTS)
    assert [c.index for c in many.choices] == [0, 1, 2] and [c.text for c in many.choices] == alone
    assert many.usage.completion_tokens == 36 and many.usage.prompt_tokens == sum(len(t) for t in token_ids)
    assert _greedy(client, token_ids[1]).choices[0].text == alone[1]
    by_ids = _greedy(client, token_ids)
    assert [c.text for c in by_ids.choices] == alone
    extra = by_ids.model_extra["fallbackgate"]
    assert [c["request_id"] for c in extra["choices"]] == [f"{by_ids.id}-{i}" for i in range(3)]
    with pytest.raises(openai.BadRequestError, match=r"prompt 1: token ids must be in \[0, 4096\)"):
        _greedy(client, [[1, 2], [3, 4096]])


def _stop_inside(text: str) -> str:
    """A stop string that first occurs in the middle of `text` (two characters from its middle on)."""
    for start in range(len(text) // 2, len(text) - 2):
        stop = text[start : start + 2]
        if stop.strip() and text.find(stop) >= 3:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_request_and_are_never_sent(server: Server) -> None:
    client = server.client()
    free = _greedy(client, TEXTS[0], max_tokens=24).choices[0].text
    stop = _stop_inside(free)
    expected = free[: free.find(stop)]
    whole = _greedy(client, TEXTS[0], max_tokens=24, stop=[stop, "zzzz"])
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 24  # it ended in the engine, not after 24 tokens
    chunks = list(_greedy(client, TEXTS[0], max_tokens=24, stop=stop, stream=True))
    sent = [c.choices[0].text for c in chunks]
    assert "".join(sent) == expected and chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in s for s in sent)
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat_free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chat_stop = _stop_inside(chat_free.choices[0].message.content)
    chat_expected = chat_free.choices[0].message.content.split(chat_stop)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=chat_stop)
    assert chat.choices[0].message.content == chat_expected and chat.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=[chat_stop], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_expected


def test_completion_logprobs_and_echo_with_prompt_logprobs(server: Server, tokenizer) -> None:
    client = server.client()
    out = _greedy(client, TEXTS[1], max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value <= 0 and value == max(top.values()) and top[token] == value  # greedy
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-6
    echo = _greedy(client, TEXTS[1], max_tokens=5, logprobs=1, echo=True)
    elp = echo.choices[0].logprobs
    prompt_ids = tokenizer.encode(TEXTS[1])
    assert echo.choices[0].text == TEXTS[1] + out.choices[0].text
    assert len(elp.tokens) == len(prompt_ids) + 5 and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    # the same tokens; the first one's logits come from a prefill that keeps more rows (other matmul shapes)
    assert elp.token_logprobs[len(prompt_ids) :] == pytest.approx(lp.token_logprobs, rel=1e-5)
    assert all(v is not None and v < 0 for v in elp.token_logprobs[1:])
    assert elp.text_offset[: len(prompt_ids)] == [len(tokenizer.decode(prompt_ids[:i])) for i in range(len(prompt_ids))]
    zero = _greedy(client, TEXTS[1], max_tokens=2, logprobs=0).choices[0].logprobs
    assert zero.top_logprobs == [{}, {}] and zero.token_logprobs == pytest.approx(lp.token_logprobs[:2], rel=1e-5)


def test_chat_logprobs_with_top_logprobs(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Hello"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True)
    assert [c.logprob for c in plain.choices[0].logprobs.content] == [c.logprob for c in content]
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_top_p_is_nucleus_sampling(server: Server) -> None:
    client = server.client()
    greedy = _greedy(client, TEXTS[2]).choices[0].text
    nucleus = (
        client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=12, temperature=1.0, top_p=1e-6, seed=3)
        .choices[0]
        .text
    )
    assert nucleus == greedy  # a nucleus of one token: the argmax, whatever the seed
    drawn = {
        client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=12, temperature=1.0, top_p=0.9, seed=s)
        .choices[0]
        .text
        for s in range(4)
    }
    assert len(drawn) > 1


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty", "only 0 is supported"),
        ({"frequency_penalty": -1.0}, "frequency_penalty", "only 0 is supported"),
        ({"best_of": 2}, "best_of", "1"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"logprobs": 21}, "logprobs", "20"),
        ({"logprobs": 2, "stream": True}, "logprobs", "not implemented with stream"),
        ({"echo": True, "stream": True}, "echo", "not implemented with stream"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt", "several prompts"),
        ({"stop": [""]}, "stop", "at least 1 character"),
    ],
)
def test_refused_fields_are_400s_naming_the_field(server: Server, kwargs: dict, param: str, needle: str) -> None:
    reply = httpx.post(
        f"{server.base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2} | kwargs, timeout=60
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param) and needle in error["message"], error


def test_chat_top_logprobs_need_logprobs(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}
    reply = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"
