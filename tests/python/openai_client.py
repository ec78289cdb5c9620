"""Checks the gateway with the official `openai` package: streaming and non-streaming chat,
completions, `n` choices, embeddings, the model list and one model, usage chunks and error mapping, compared with the backend itself.

Run by the Rust end-to-end tests; exits non-zero with a message on the first difference.
"""

import argparse
import sys

import openai
from openai import OpenAI


def chat_stream(client, prompt, include_usage=False):
    kwargs = {}
    if include_usage:
        kwargs["stream_options"] = {"include_usage": True}
    stream = client.chat.completions.create(
        model="sim-model",
        stream=True,
        max_tokens=20,
        messages=[{"role": "user", "content": prompt}],
        **kwargs,
    )
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    return "".join(text), finish, usage


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gateway", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args()

    gw = OpenAI(base_url=a.gateway, api_key=a.key, max_retries=0, timeout=20)
    direct = OpenAI(base_url=a.backend, api_key="unused", max_retries=0, timeout=20)

    for prompt in ["hello from the openai client", "a second, different prompt"]:
        via = chat_stream(gw, prompt)
        want = chat_stream(direct, prompt)
        assert via == want, f"stream differs: {via!r} != {want!r}"
        assert via[0], "no text streamed"

    text, finish, usage = chat_stream(gw, "usage please", include_usage=True)
    assert usage is not None and usage.completion_tokens == 20, f"usage: {usage!r}"

    r = gw.chat.completions.create(
        model="sim-model", max_tokens=10, messages=[{"role": "user", "content": "whole"}]
    )
    d = direct.chat.completions.create(
        model="sim-model", max_tokens=10, messages=[{"role": "user", "content": "whole"}]
    )
    assert r.choices[0].message.content == d.choices[0].message.content
    assert r.usage.completion_tokens == 10

    c = gw.completions.create(model="sim-model", prompt="Once upon", max_tokens=5)
    assert c.choices[0].text, "empty completion"

    r = gw.chat.completions.create(
        model="sim-model", n=2, max_tokens=4, messages=[{"role": "user", "content": "two"}]
    )
    assert [ch.index for ch in r.choices] == [0, 1], r.choices
    assert r.choices[0].message.content != r.choices[1].message.content

    # The package asks for base64 unless told otherwise and decodes it itself.
    inputs = ["an embedding", "another one"]
    e = gw.embeddings.create(model="sim-model", input=inputs)
    d = direct.embeddings.create(model="sim-model", input=inputs)
    assert [x.embedding for x in e.data] == [x.embedding for x in d.data], "embeddings differ"
    assert len(e.data) == 2 and len(e.data[0].embedding) > 0, e
    norm = sum(x * x for x in e.data[0].embedding)
    assert abs(norm - 1.0) < 1e-4, norm
    f = gw.embeddings.create(model="sim-model", input="an embedding", encoding_format="float")
    assert all(abs(a - b) < 1e-6 for a, b in zip(f.data[0].embedding, e.data[0].embedding))
    assert e.usage.prompt_tokens > 0, e.usage

    ids = [m.id for m in gw.models.list()]
    assert "sim-model" in ids, ids
    m = gw.models.retrieve("sim-model")
    assert m.id == "sim-model" and m.object == "model", m
    try:
        gw.models.retrieve("no-such-model")
        raise AssertionError("retrieving an unknown model succeeded")
    except openai.NotFoundError as e:
        assert e.body and e.body.get("code") == "model_not_found", e.body

    bad = OpenAI(base_url=a.gateway, api_key="wrong", max_retries=0, timeout=20)
    try:
        bad.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError:
        pass

    try:
        gw.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.body and e.body.get("code") == "model_not_found", e.body

    print("openai client: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
