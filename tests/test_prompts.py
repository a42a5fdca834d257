"""Per-model instruction templates: application, unknown names, validation, loading."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from embedfleet.deployments.common.errors import UnsupportedParameter
from embedfleet.deployments.common.prompts import QWEN3_EMBEDDING_DEFAULT_TASK, PromptTemplates


@pytest.fixture
def qwen3() -> PromptTemplates:
    return PromptTemplates.qwen3_embedding()


def test_qwen3_query_gets_the_instruction_documents_do_not(qwen3):
    assert qwen3.apply("query", "what is vLLM?") == (
        f"Instruct: {QWEN3_EMBEDDING_DEFAULT_TASK}\nQuery:what is vLLM?")
    assert qwen3.apply("query", "what is vLLM?", task="Find legal precedents") == (
        "Instruct: Find legal precedents\nQuery:what is vLLM?")
    assert qwen3.apply("document", "vLLM is an inference engine.") == "vLLM is an inference engine."
    assert qwen3.apply(None, "no prompt requested") == "no prompt requested"
    assert qwen3.apply_all("query", ["a", "b"], task="T") == [
        "Instruct: T\nQuery:a", "Instruct: T\nQuery:b"]


def test_unknown_prompt_name_is_a_400_naming_the_known_ones(qwen3):
    with pytest.raises(UnsupportedParameter) as err:
        qwen3.apply("passage", "x")
    assert err.value.status == 400 and err.value.param == "prompt_name"
    assert "'passage'" in err.value.message
    assert "document, query" in err.value.message
    with pytest.raises(UnsupportedParameter, match="known prompt names: none"):
        PromptTemplates().apply("query", "x")


def test_braces_in_user_text_and_task_stay_literal(qwen3):
    assert qwen3.apply("query", "x {task} {text} {{y}}", task="t {text}") == (
        "Instruct: t {text}\nQuery:x {task} {text} {{y}}")
    literal = PromptTemplates(templates={"json": 'Embed {{"k": 1}} then {text}'})
    assert literal.apply("json", "z") == 'Embed {"k": 1} then z'


def test_prefix_templates_and_default_prompt_name():
    p = PromptTemplates(templates={"query": "query: ", "passage": "passage: "},
                        default_prompt_name="passage")
    assert p.apply("query", "hi") == "query: hi"
    assert p.apply(None, "hi") == "passage: hi"
    assert p.names == ["passage", "query"]


@pytest.mark.parametrize("kwargs,fragment", [
    ({"templates": {"q": "Instruct: {instruction}\nQuery:{text}"}, "default_task": "t"},
     "{instruction}"),
    ({"templates": {"q": "Instruct: {task}\nQuery:{text}"}}, "no default_task"),
    ({"templates": {"q": "{text} and {text}"}}, "more than once"),
    ({"templates": {"q": "{text}"}, "default_prompt_name": "query"}, "default_prompt_name"),
    ({"templates": {}, "prompts": {}}, "extra"),
])
def test_bad_templates_fail_at_config_time(kwargs, fragment):
    with pytest.raises(ValidationError, match=fragment.replace("{", r"\{").replace("}", r"\}")):
        PromptTemplates(**kwargs)


def test_from_sentence_transformers_config(tmp_path):
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "Instruct: Given a query\nQuery:", "document": "",
                    "odd": "keep {braces} "},
        "default_prompt_name": None}))
    p = PromptTemplates.from_sentence_transformers(tmp_path)
    assert p.apply("query", "q") == "Instruct: Given a query\nQuery:q"
    assert p.apply("document", "d") == "d"
    assert p.apply("odd", "x") == "keep {braces} x"
    assert p.apply(None, "x") == "x"
    assert PromptTemplates.from_sentence_transformers(tmp_path / "missing").names == []


def test_minilm_declares_no_prompts(minilm_path):
    assert PromptTemplates.from_sentence_transformers(minilm_path).names == []


def test_instruction_tokens_are_part_of_the_input(qwen3, minilm_tokenizer):
    """Usage counts what is tokenised, and the template is applied before tokenisation."""
    bare = minilm_tokenizer("what is vLLM?")["input_ids"]
    prompted = minilm_tokenizer(qwen3.apply("query", "what is vLLM?"))["input_ids"]
    assert len(prompted) > len(bare) + 10
    content = bare[1:-1]
    assert prompted[-len(content) - 1:-1] == content  # the query itself, after the instruction
