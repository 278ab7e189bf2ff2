"""Decoder models as people run them: `use_cache=True` (the default) returns a DynamicCache,
and a decoding step passes it back in. Small configs with random weights, no network."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch

import opweave
from opweave.frontends.program import OpweaveFallbackWarning

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64))


_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                   max_position_embeddings=64)

BUILDERS = {
    "gpt2": _gpt2,
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_LIKE)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_LLAMA_LIKE)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_LLAMA_LIKE)),
}
# what each model may run in eager (anything else falling back is a regression)
ALLOWED_FALLBACKS: dict[str, set] = {}


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    ids = torch.randint(0, 512, (1, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (ids,), name=name)
    return model, compiled, ids, [str(w.message) for w in caught]


def _assert_same_cache(got, want):
    assert type(got) is DynamicCache
    assert [type(layer) for layer in got.layers] == [type(layer) for layer in want.layers]
    assert got.get_seq_length() == want.get_seq_length()
    for mine, theirs in zip(got.layers, want.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_prompt_call_matches_eager_logits_and_cache(name):
    model, compiled, ids, _ = _compiled(name)
    with torch.no_grad():
        got, want = compiled(ids), model(ids)
    torch.testing.assert_close(got.logits, want.logits)
    _assert_same_cache(got.past_key_values, want.past_key_values)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoder_runs_inside_opweave(name):
    _, compiled, _, caught = _compiled(name)
    assert compiled.capture == "export", compiled.capture_error
    coverage = compiled.coverage
    assert coverage.share > 0.9 and coverage.segments >= 1
    assert set(coverage.fallback) <= ALLOWED_FALLBACKS.get(name, set())
    if coverage.fallback:  # ... and said so when compiling
        assert any(op in message for message in caught for op in coverage.fallback)
    assert not any("could not capture" in message for message in caught)


def _greedy(model, ids, steps: int):
    out = model(ids)
    cache, tokens = out.past_key_values, []
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token.item())
        out = model(token, past_key_values=cache)
        assert out.past_key_values is cache  # updated in place, as eager does
    return tokens, out.logits, cache


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_decode_matches_eager(name):
    model, compiled, ids, _ = _compiled(name)
    with torch.no_grad():
        want_tokens, want_logits, want_cache = _greedy(model, ids, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OpweaveFallbackWarning)
            got_tokens, got_logits, got_cache = _greedy(compiled, ids, 3)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits)
    _assert_same_cache(got_cache, want_cache)
    # the first step with a cache compiled; the next, with a longer cache, ran in eager
    # and said so, once
    lengths = [str(w.message) for w in caught if "cache of another length" in str(w.message)]
    assert len(lengths) == 1
    assert any(isinstance(key, tuple) and len(key) == 2 for key in compiled._cache)


def test_decoding_step_with_a_cache_compiles():
    model, compiled, ids, _ = _compiled("llama")
    with torch.no_grad():
        prompt = compiled(ids)
        token = prompt.logits[:, -1].argmax(-1, keepdim=True)
        step = compiled(token, past_key_values=prompt.past_key_values)
        assert compiled.capture == "export"  # the step ran a compiled program
        eager_prompt = model(ids)
        want = model(token, past_key_values=eager_prompt.past_key_values)
    torch.testing.assert_close(step.logits, want.logits)
    _assert_same_cache(step.past_key_values, want.past_key_values)


@pytest.mark.parametrize("make_cache", [DynamicCache, "config"])
def test_an_empty_cache_passed_in_is_filled_like_eager(make_cache):
    model, compiled, ids, _ = _compiled("llama")

    def fresh():
        return DynamicCache(config=model.config) if make_cache == "config" else DynamicCache()

    mine, theirs = fresh(), fresh()
    with torch.no_grad():
        got = compiled(ids, past_key_values=mine)
        want = model(ids, past_key_values=theirs)
    assert compiled.capture == "export"
    assert got.past_key_values is mine  # the caller's object, filled in place
    torch.testing.assert_close(got.logits, want.logits)
    _assert_same_cache(mine, theirs)


def test_compiled_for_a_call_with_a_cache():
    """The example itself passes a cache: the same call later runs that program."""
    model, _, ids, _ = _compiled("llama")
    with torch.no_grad():
        prompt = model(ids)
        token = prompt.logits[:, -1].argmax(-1, keepdim=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OpweaveFallbackWarning)
            compiled = opweave.compile(model, (token,),
                                       example_kwargs={"past_key_values": prompt.past_key_values})
        assert len(compiled._cache) == 1
        mine = DynamicCache(zip([layer.keys for layer in prompt.past_key_values.layers],
                                [layer.values for layer in prompt.past_key_values.layers]))
        got = compiled(token, past_key_values=mine)
        assert compiled.capture == "export" and len(compiled._cache) == 1  # no second compile
        want = model(token, past_key_values=prompt.past_key_values)
    assert got.past_key_values is mine
    torch.testing.assert_close(got.logits, want.logits)
    _assert_same_cache(mine, want.past_key_values)


class _Box:
    """A result type no capture can flatten."""

    def __init__(self, tensor):
        self.tensor = tensor


class _Opaque(torch.nn.Module):
    def forward(self, x):
        return _Box(x * 2)


def test_explain_says_when_nothing_was_captured():
    report = opweave.explain(_Opaque(), (torch.ones(3),), graph_breaks=False)
    text = str(report)
    assert report.capture == "eager" and report.share is None
    assert "nothing runs in opweave" in text and "coverage: n/a" in text
    assert "100.0%" not in text and "fallbacks: none" not in text
    assert "_Box" in text  # the reason capture failed
