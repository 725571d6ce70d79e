"""The front door's first-token split: which requests take the prefill's token as their
first, and how the decode's continuation reads as one completion (the id, the token
ids, the prompt without the appended token, usage)."""

from __future__ import annotations

import pytest

from pdgrpc.integrations.vllm.first_token import continuation, first_event, merge_answer, rewrite_event

PROMPT_IDS = [5, 6, 7]


def _prefill(text: str = " Paris", token: int = 42, finish: str = "length") -> dict:
    return {"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "token_ids": [token], "prompt_token_ids": PROMPT_IDS,
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": {"pdgrpc_room": 9}}


def test_the_decode_continues_after_the_prefills_token():
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}
    rest = continuation(body, _prefill())
    assert rest is not None
    assert rest["prompt"] == [*PROMPT_IDS, 42] and rest["max_tokens"] == 7 and rest["return_token_ids"] is True
    assert body["max_tokens"] == 8, "the client's body is left as it was"


@pytest.mark.parametrize("change", [
    {"stop": ["."]}, {"logprobs": 1}, {"echo": True}, {"seed": 3}, {"n": 2}, {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5}, {"min_tokens": 3}, {"max_tokens": 1}, {"max_tokens": None},
    {"prompt": ["a", "b"]}, {"prompt": [[1, 2]]},
])
def test_a_request_the_split_could_change_goes_the_usual_way(change):
    body = {"model": "m", "prompt": "x", "max_tokens": 8, **change}
    if change.get("max_tokens", 0) is None:
        del body["max_tokens"]  # vLLM's default applies: left to the decode
    assert continuation(body, _prefill()) is None


@pytest.mark.parametrize("prefill", [_prefill(finish="stop"), _prefill(text=""), _prefill(text="\ufffd")])
def test_a_first_token_that_ends_the_answer_or_splits_a_character_goes_the_usual_way(prefill):
    assert continuation({"model": "m", "prompt": "x", "max_tokens": 8}, prefill) is None


def test_a_streamed_answer_starts_with_the_prefills_token_and_reads_as_one_completion():
    first = _prefill()
    head = first_event(first, want_ids=True)
    assert head["id"] == "cmpl-p" and head["choices"][0]["text"] == " Paris"
    assert head["choices"][0]["token_ids"] == [42] and head["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    event = {"id": "cmpl-d", "choices": [{"index": 0, "text": ".", "token_ids": [13],
                                          "prompt_token_ids": [*PROMPT_IDS, 42]}],
             "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    out = rewrite_event(event, first, want_ids=True)
    assert out["id"] == "cmpl-p" and "prompt_token_ids" not in out["choices"][0]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    plain = rewrite_event(event, first, want_ids=False)
    assert "token_ids" not in plain["choices"][0] and "token_ids" not in first_event(first, False)["choices"][0]
    error = {"error": {"message": "boom"}}
    assert rewrite_event(error, first, want_ids=True) == error


def test_a_whole_answer_has_the_prefills_token_in_front():
    decode = {"id": "cmpl-d", "choices": [{"index": 0, "text": " is big.", "token_ids": [7, 8, 9],
                                           "prompt_token_ids": [*PROMPT_IDS, 42], "finish_reason": "length"}],
              "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
    out = merge_answer(decode, _prefill(), want_ids=True)
    choice = out["choices"][0]
    assert out["id"] == "cmpl-p" and choice["text"] == " Paris is big." and choice["token_ids"] == [42, 7, 8, 9]
    assert choice["prompt_token_ids"] == PROMPT_IDS and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert "token_ids" not in merge_answer(decode, _prefill(), want_ids=False)["choices"][0]
