"""The generated reference docs match the code they are generated from.

``docs/configuration.md`` (the config schema's fields and descriptions), ``docs/openapi.json``
(the Router's OpenAPI document) and the route reference inside ``docs/api.md`` are written by
``python -m embedfleet.cluster.gen_docs``; a change to the schema or the API without re-running it
fails here, naming the command.
"""

from __future__ import annotations

import json

import pytest

from embedfleet.cluster import gen_docs
from tests.conftest import ROOT

REGENERATE = f"stale: run `{gen_docs.COMMAND}` and commit the result"


@pytest.fixture(scope="module")
def wanted() -> dict:
    return gen_docs.rendered()


@pytest.mark.parametrize("name", ["configuration.md", "openapi.json", "api.md"])
def test_generated_doc_is_current(wanted, name):
    path = ROOT / "docs" / name
    assert path.exists(), f"docs/{name} is missing: {REGENERATE}"
    assert path.read_text() == wanted[path], f"docs/{name} is {REGENERATE}"


def test_generation_is_deterministic(wanted):
    assert gen_docs.rendered() == wanted


def test_configuration_lists_every_schema_field_with_its_description():
    """Every field of every section is a row, and each description the code gives is in it: a
    field added to the schema cannot be missing from the reference."""
    text = gen_docs.configuration_md()
    for path, model in gen_docs.config_sections():
        assert f"## {model.__name__}" in text
        for name, field in model.model_fields.items():
            row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
            assert row is not None, f"{model.__name__}.{name} has no row"
            if field.description:
                assert " ".join(field.description.split()).replace("|", "\\|") in text


def test_configuration_reaches_nested_sections():
    sections = {path: model.__name__ for path, model in gen_docs.config_sections()}
    assert sections[""] == "EmbedfleetConfig"
    assert sections["models[]"] == "ModelConfig"
    assert sections["models[].routing"] == "RoutingConfig" and "router" in sections


def test_openapi_json_is_the_document_the_router_serves():
    committed = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert committed == gen_docs.openapi_document()
    assert "/v1/embeddings" in committed["paths"]


def test_api_md_keeps_its_prose_and_lists_every_route():
    text = (ROOT / "docs" / "api.md").read_text()
    head, _, rest = text.partition(gen_docs.BEGIN)
    assert head.strip() and gen_docs.END in rest
    for path, ops in gen_docs.openapi_document()["paths"].items():
        for method in ops:
            assert f"### `{method.upper()} {path}`" in rest


def test_check_flag_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale_md = tmp_path / "configuration.md"
    stale_md.write_text("# out of date\n")
    monkeypatch.setattr(gen_docs, "CONFIGURATION_MD", stale_md)
    assert gen_docs.main(["--check"]) == 1
    assert "configuration.md" in capsys.readouterr().err
