"""The official openai and anthropic SDKs against a running server with the demo model
(random weights: the text is gibberish, so the tests check structure, usage and limits)."""

import anthropic
import httpx
import openai
import pytest


@pytest.fixture
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


MSG = [{"role": "user", "content": "Say hello."}]


def test_models_lists_the_loaded_model(oai):
    models = oai.models.list().data
    assert len(models) == 1 and models[0].id == "demo"


def test_chat_max_tokens_and_usage(oai):
    r = oai.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=5, temperature=0)
    assert r.model == "demo"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_usage(oai):
    chunks = list(oai.chat.completions.create(model="x", messages=MSG, max_tokens=4, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 0


def test_chat_same_seed_same_text(oai):
    kw = dict(model="x", messages=MSG, max_tokens=6, temperature=1.0, seed=1234)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert a.choices[0].message == b.choices[0].message


def test_chat_stop_sequence_cuts_text(oai):
    # Greedy text is deterministic: take its 3rd character as a stop string.
    base = oai.chat.completions.create(model="x", messages=MSG, max_tokens=12, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = base.choices[0].message.content
    assert len(text) >= 3
    stop = text[2:4]
    r = oai.chat.completions.create(model="x", messages=MSG, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)].lstrip()


def test_chat_errors(oai, base_url):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="x", messages=MSG, temperature=-1)
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b"{oops")
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        oai.get("/nope", cast_to=object)


def test_responses_non_stream_and_stream(oai):
    r = oai.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=5, reasoning={"effort": "none"})
    assert r.status == "incomplete"
    assert r.usage.output_tokens == 5
    assert r.usage.total_tokens == r.usage.input_tokens + 5
    events = list(oai.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=4, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 4


def test_responses_input_tokens_match_usage(oai, base_url):
    n = httpx.post(f"{base_url}/v1/responses/input_tokens", json={"model": "x", "input": "hi"}).json()["input_tokens"]
    r = oai.responses.create(model="x", input="hi", max_output_tokens=1)
    assert r.usage.input_tokens == n


def test_messages_non_stream(claude):
    m = claude.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=MSG)
    assert m.model == "demo" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 5
    assert m.content[0].type == "text"


def test_messages_stream_and_count_tokens(claude):
    with claude.messages.stream(model="claude-haiku", max_tokens=4, messages=MSG,
                                system="x-anthropic-billing-header: cc_version=1;\nBe brief.") as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.usage.output_tokens == 4 and final.stop_reason == "max_tokens"
    assert text == final.content[0].text
    n = claude.messages.count_tokens(model="x", messages=MSG, system="Be brief.").input_tokens
    assert n == final.usage.input_tokens


def test_messages_stop_sequence(claude):
    base = claude.messages.create(model="x", max_tokens=12, messages=MSG, extra_body={"temperature": 0})
    text = base.content[0].text
    stop = text[2:4]
    m = claude.messages.create(model="x", max_tokens=12, messages=MSG, stop_sequences=[stop], extra_body={"temperature": 0})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert (m.content[0].text if m.content else "") == text[: text.index(stop)].lstrip()


def test_messages_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="x", max_tokens=2, messages=[{"role": "user", "content": "word " * 3000}])
    assert "prompt is too long" in str(e.value)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="x", max_tokens=2, messages=[{"role": "robot", "content": "x"}])
