"""Workload generators give the lengths they promise, counted with the bundled model's tokenizer."""

from __future__ import annotations

import pytest

from bench.workloads import (
    DEFAULT_PROMPTS,
    WordTokens,
    WorkloadSpec,
    fixed_requests,
    load_prompts,
    multi_turn_conversations,
    random_requests,
    shared_prefix_requests,
    turn_messages,
)


@pytest.fixture(scope="module")
def tok():
    from jaxserve.loader import bundled_model_path
    from jaxserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf(bundled_model_path())


@pytest.fixture(scope="module")
def words(tok):
    return WordTokens(tok)


def test_random_image_requests(tok, words):
    """vLLM's random-mm: chat messages holding distinct random images of the asked size before the text."""
    import base64
    import io

    from PIL import Image

    spec = WorkloadSpec(name="random", num_prompts=3, random_input_len=20, output_len=4, random_images=2,
                        random_image_size=(40, 30))
    reqs = spec.build(tok)
    urls = []
    for r in reqs:
        (msg,) = r.messages
        *images, text = msg["content"]
        assert r.is_chat and len(images) == 2 and len(tok.encode(text["text"])) == r.prompt_len == 20
        for part in images:
            url = part["image_url"]["url"]
            assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (40, 30)
            urls.append(url)
    assert len(set(urls)) == 6
    assert spec.to_dict()["random_images"] == 2 and "random_images" not in WorkloadSpec(name="random").to_dict()
    with pytest.raises(ValueError, match="go with the random workload"):
        WorkloadSpec(name="fixed", random_images=1)


def test_random_prompts_have_exact_token_lengths(tok, words):
    reqs = random_requests(tok, 40, 200, 64, range_ratio=0.5, seed=3, words=words)
    ins = [r.prompt_len for r in reqs]
    assert all(100 <= n <= 300 for n in ins) and len(set(ins)) > 10  # spread over the range
    assert all(32 <= r.output_len <= 96 for r in reqs)
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len
        assert not r.is_chat
    fixed = random_requests(tok, 5, 17, 9, seed=0, words=words)
    assert [(len(tok.encode(r.prompt)), r.output_len) for r in fixed] == [(17, 9)] * 5
    assert random_requests(tok, 3, 50, 5, seed=7, words=words) == random_requests(tok, 3, 50, 5, seed=7, words=words)


def test_shipped_prompts_are_varied_chats_of_100_to_300_tokens(tok):
    convs = load_prompts(DEFAULT_PROMPTS)
    assert len(convs) >= 32
    assert len({c[-1]["content"] for c in convs}) == len(convs)
    lens = [len(tok.encode_chat(c)) for c in convs]
    assert all(100 <= n <= 300 for n in lens), lens
    reqs = fixed_requests(tok, len(convs) + 3, 128)
    assert [r.prompt_len for r in reqs[: len(convs)]] == lens
    assert reqs[len(convs)].messages == reqs[0].messages  # cycles
    assert all(r.output_len == 128 and r.is_chat for r in reqs)


def test_shared_prefix_groups_share_exactly_their_system_prompt(tok, words):
    reqs = shared_prefix_requests(tok, num_groups=3, prompts_per_group=4, system_len=120, question_len=16,
                                  output_len=8, seed=1, words=words)
    assert len(reqs) == 12
    systems: dict[int, set] = {}
    for r in reqs:
        system, user = r.messages
        assert (system["role"], user["role"]) == ("system", "user")
        assert len(tok.encode(system["content"])) == 120
        assert len(tok.encode(user["content"])) == 16
        assert r.prompt_len == len(tok.encode_chat(list(r.messages)))
        systems.setdefault(r.group, set()).add(system["content"])
    assert sorted(systems) == [0, 1, 2]
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 3
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # interleaved


def test_multi_turn_resends_the_history(tok, words):
    convs = multi_turn_conversations(tok, 2, num_turns=3, input_len=20, output_len=5, seed=0, system="Be brief.",
                                     words=words)
    assert len(convs) == 2 and all(len(c.user_turns) == 3 for c in convs)
    assert all(len(tok.encode(t)) == 20 for c in convs for t in c.user_turns)
    msgs = turn_messages(convs[0], 2, ["first reply", "second reply"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == "first reply" and msgs[5]["content"] == convs[0].user_turns[2]


def test_spec_builds_each_workload_and_checks_fields(tok):
    spec = WorkloadSpec(name="shared-prefix", gsp_num_groups=2, gsp_prompts_per_group=2, gsp_system_prompt_len=8,
                        gsp_question_len=4, output_len=3)
    assert len(spec.build(tok)) == 4
    assert "gsp_system_prompt_len" in spec.to_dict() and "random_input_len" not in spec.to_dict()
    assert len(WorkloadSpec(name="fixed", num_prompts=5).build(tok)) == 5
    with pytest.raises(ValueError):
        WorkloadSpec(name="sharegpt")
    with pytest.raises(ValueError):
        WorkloadSpec(num_prompts=0)
