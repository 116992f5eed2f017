"""Constrained decoding (hybrid.grammar over llguidance) on the bundled model: every sampled reply
is text the schema accepts, checked here by parsing it and testing each field by hand."""
import json

import pytest

import hybrid
from hybrid.errors import HybridError
from hybrid.events import Done, Token
from hybrid.generate import generate_tokens
from hybrid.grammar import Constraint, json_schema_grammar
from hybrid.sampling import Sampler, SamplerConfig

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def model():
    return hybrid.load(threads=1)


def reply(model, grammar, temperature, seed, max_tokens=64):
    ids = model.encode_chat_text(model.chat_template.render([{"role": "user", "content": "Describe a list"}]))
    sampler = Sampler(SamplerConfig(temperature=temperature, seed=seed))
    text, stop = [], None
    constraint = Constraint(model.tokenizer, grammar) if grammar is not None else None
    for ev in model.with_fresh_state(lambda st: list(generate_tokens(
            model.forward, st, model.tokenizer, ids, max_tokens=max_tokens, sampler=sampler, n_ctx=model.n_ctx,
            constraint=constraint))):
        if isinstance(ev, Token):
            text.append(ev.text)
        elif isinstance(ev, Done):
            text.append(ev.text)
            stop = ev.stats.stop_reason
    return "".join(text), stop


@pytest.mark.parametrize("seed", range(4))
def test_sampled_replies_follow_the_schema(model, seed):
    text, stop = reply(model, json_schema_grammar(SCHEMA), temperature=1.0, seed=seed)
    assert stop == "eog", (stop, text)          # the grammar finished, then only end-of-generation was allowed
    value = json.loads(text)
    assert set(value) == {"name", "tags", "ok"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
    assert isinstance(value["ok"], bool)


def test_the_constraint_changes_what_the_model_says(model):
    free, _ = reply(model, None, temperature=0, seed=0, max_tokens=12)
    constrained, _ = reply(model, json_schema_grammar({"type": "object"}), temperature=0, seed=0, max_tokens=12)
    assert not free.startswith("{") and constrained.startswith("{")


def test_bad_schemas_are_one_clear_error(model):
    with pytest.raises(HybridError, match="required"):
        Constraint(model.tokenizer, json_schema_grammar({"type": "object", "required": 5}))
    with pytest.raises(HybridError, match="does not compile"):
        Constraint(model.tokenizer, json_schema_grammar({"type": "no-such-type"}))


def generated(model, grammar, draft, temperature, seed):
    ids = model.encode_chat_text(model.chat_template.render([{"role": "user", "content": "Describe a list"}]))
    text, done = [], None
    for ev in model.generate(ids, max_tokens=64, temperature=temperature, seed=seed, draft=draft, grammar=grammar):
        if isinstance(ev, Token):
            text.append(ev.text)
        elif isinstance(ev, Done):
            text.append(ev.text)
            done = ev
    return "".join(text), done


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (1.0, 1), (1.0, 2)])
def test_drafting_under_a_grammar_prints_plain_constrained_decodings_text(model, temperature, seed):
    """Drafts are verified against the grammar, each verify row masked by the grammar's state
    after the tokens emitted before it: the reply is plain constrained decoding's, token for
    token, greedy or seeded, whatever the depth; and at a fixed depth drafts were made and kept
    (auto's depth depends on the machine's timing)."""
    grammar = json_schema_grammar(SCHEMA)
    plain, done = generated(model, grammar, 0, temperature, seed)
    assert done.stats.stop_reason == "eog" and json.loads(plain)
    for draft in (1, 3, "auto"):
        text, done = generated(model, grammar, draft, temperature, seed)
        assert text == plain, draft
        assert done.stats.stop_reason == "eog"
        if draft != "auto":
            assert done.stats.draft["drafted"] > 0 and done.stats.draft["accepted"] > 0


def test_drafts_the_grammar_refuses_are_not_verified(model):
    """`allowed_prefix` cuts a draft at the first token the grammar would refuse, consuming
    nothing: inside a digits-only string a letter ends it, and the grammar's state is unchanged."""
    grammar = json_schema_grammar({"type": "object", "required": ["id"], "additionalProperties": False,
                                   "properties": {"id": {"type": "string", "pattern": "^[0-9]{8}$"}}})
    c = Constraint(model.tokenizer, grammar)
    for tok in model.tokenizer.encode('{"id":"12'):
        c.accept(tok)
    digits, letter = model.tokenizer.encode("3"), model.tokenizer.encode("x")
    draft = [*digits, *digits, *letter, *digits]
    assert c.allowed_prefix(draft) == [*digits, *digits]
    assert c.allowed_prefix(draft) == [*digits, *digits]           # nothing was consumed
    text, done = generated(model, grammar, 3, 1.0, 5)
    value = json.loads(text)
    assert list(value) == ["id"] and value["id"].isdigit() and len(value["id"]) == 8
