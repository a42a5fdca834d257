"""`embedfleet up` refuses a config a local head can never make ready, before deploying anything."""

from __future__ import annotations

import copy

import pytest
import yaml

from embedfleet.cluster import cli, local
from embedfleet.deployments.config.schema import DEFAULT_CONFIG_PATH


def two_models_on(cards: int, tmp_path):
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    second = copy.deepcopy(data["models"][0])
    second["name"] = "mini-b"
    data["models"][0]["name"] = "mini-a"
    data["models"].append(second)
    data["cards"] = cards
    path = tmp_path / "two-models.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def no_cluster(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a Ray head was started for a config that cannot be placed")
    monkeypatch.setattr(local, "start_head", refuse)
    monkeypatch.setattr(local, "ensure_token_auth", lambda: None)


def test_up_refuses_more_min_replicas_than_cards(tmp_path, capsys, no_cluster):
    code = cli.main(["up", "--config", str(two_models_on(1, tmp_path))])
    err = capsys.readouterr().err
    assert code == 2
    assert "add up to 2 cards (mini-a: 1, mini-b: 1)" in err and "cards=1" in err, err


def test_more_cards_on_the_command_line_is_accepted(tmp_path):
    cfg = cli._config(cli.build_parser().parse_args(
        ["up", "--config", str(two_models_on(1, tmp_path)), "--cards", "2"]))
    assert cli.unplaceable(cfg) is None
    assert "add up to 2 cards" in cli.unplaceable(cfg.model_copy(update={"cards": 1}))
