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


def one_card_min_and_zero(tmp_path):
    """The issue's cluster: one card, mini-a at min 1 (max 1), mini-b scale-to-zero (max 1)."""
    path = two_models_on(1, tmp_path)
    data = yaml.safe_load(path.read_text())
    data["models"][0]["replicas"] = {"min_replicas": 1, "max_replicas": 1}
    data["models"][1]["replicas"] = {"min_replicas": 0, "max_replicas": 1}
    path.write_text(yaml.safe_dump(data))
    return path


class Started(Exception):
    pass


def test_up_warns_by_name_about_a_max_replicas_the_cards_never_reach(tmp_path, capsys,
                                                                        monkeypatch):
    def started(*a, **k):
        raise Started
    monkeypatch.setattr(local, "start_head", started)
    monkeypatch.setattr(local, "ensure_token_auth", lambda: None)
    with pytest.raises(Started):  # accepted: its minimums fit; the warning comes first
        cli.main(["up", "--config", str(one_card_min_and_zero(tmp_path))])
    err = capsys.readouterr().err
    assert "warning: model 'mini-b' can never reach max_replicas=1" in err, err
    assert "(mini-a: 1)" in err and "never gets a card" in err and "'mini-a' can" not in err


def test_up_does_not_warn_when_every_max_fits(tmp_path, capsys, monkeypatch):
    def started(*a, **k):
        raise Started
    monkeypatch.setattr(local, "start_head", started)
    monkeypatch.setattr(local, "ensure_token_auth", lambda: None)
    with pytest.raises(Started):
        cli.main(["up", "--config", str(one_card_min_and_zero(tmp_path)), "--cards", "2"])
    assert "warning" not in capsys.readouterr().err


def test_deploy_warns_on_a_cluster_that_cannot_grow(tmp_path, capsys, monkeypatch):
    import ray

    from embedfleet.cluster import status
    from embedfleet.deployments.fleet import placement

    deployed = []
    grows = {"now": False}
    monkeypatch.setattr(local, "ensure_token_auth", lambda: None)
    monkeypatch.setattr(status, "connect", lambda address=None: None)  # STAND-IN cluster: 1 card
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "NPU": 1.0})
    monkeypatch.setattr(placement, "cluster_can_grow", lambda resource, total: grows["now"])
    monkeypatch.setattr(cli, "_deploy_and_wait", lambda *a: deployed.append(a))
    path = str(one_card_min_and_zero(tmp_path))
    assert cli.main(["deploy", "--address", "http://127.0.0.1:8265", "--config", path]) == 0
    err = capsys.readouterr().err
    assert deployed and "warning: model 'mini-b' can never reach max_replicas=1" in err, err
    assert "the cluster's 1 NPU card(s) cannot grow" in err, err  # the running cluster's cards
    grows["now"] = True  # an autoscaler may add cards: nothing to warn about
    assert cli.main(["deploy", "--address", "http://127.0.0.1:8265", "--config", path]) == 0
    assert "warning" not in capsys.readouterr().err
