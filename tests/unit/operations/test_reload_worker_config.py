"""A reload in worker i of `serve --workers N` (issue 20): the worker runs its metrics on
`server.metrics_listen`'s port plus i, so the reloader compares the file's config after the same
adjustment (extproc.operations.workers.worker_config): an unchanged metrics_listen is no
restart-only change, a changed one still is (the running value stays, with a warning)."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import yaml

from extproc.config import Config, parse_config
from extproc.operations.reload import ConfigReloader
from extproc.operations.workers import worker_config
from tests.support.configs import small_config_data

BASE = 9464


class Receiver:
    """The running server, as far as the reloader sees it."""

    def __init__(self, config: Config):
        self.config = config
        self.applied: list[Config] = []

    def apply_config(self, new: Config) -> None:
        self.config = new
        self.applied.append(new)


def data(metrics_port: int = BASE, slots: int = 4) -> dict:
    config = small_config_data(server={"listen": "127.0.0.1:50051", "metrics_listen": f"127.0.0.1:{metrics_port}"})
    config["providers"][0]["models"]["m"]["limits"]["max_global_in_flight_request_slots"] = slots
    return config


def restart_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "extproc.operations.reload" and "needs a restart" in r.getMessage()]


@pytest.mark.parametrize("index", [0, 1, 3])
def test_a_reload_compares_metrics_listen_as_the_worker_runs_it(tmp_path, caplog, index):
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump(data()))
    adjust = partial(worker_config, index=index)
    receiver = Receiver(adjust(parse_config(data())))
    assert receiver.config.server.metrics_listen == f"127.0.0.1:{BASE + index}"
    reloader = ConfigReloader(receiver, path, adjust=adjust)
    caplog.set_level(logging.INFO, logger="extproc.operations.reload")

    # A change of no restart-only field: applied, no restart warning, the worker's port kept.
    path.write_text(yaml.safe_dump(data(slots=2)))
    assert reloader.reload(path.read_bytes())
    assert restart_warnings(caplog) == []
    assert receiver.config.providers[0].models["m"].limits.max_global_in_flight_request_slots == 2
    assert receiver.config.server.metrics_listen == f"127.0.0.1:{BASE + index}"

    # The file's metrics_listen really moves: a restart is needed, the running value stays.
    path.write_text(yaml.safe_dump(data(metrics_port=BASE + 100, slots=3)))
    assert reloader.reload(path.read_bytes())
    assert len(restart_warnings(caplog)) == 1 and "server.metrics_listen changed" in restart_warnings(caplog)[0]
    assert receiver.config.server.metrics_listen == f"127.0.0.1:{BASE + index}"
    assert receiver.config.providers[0].models["m"].limits.max_global_in_flight_request_slots == 3
    assert len(receiver.applied) == 2


def test_worker_config_moves_only_the_metrics_port():
    config = parse_config(data())
    assert worker_config(config, 0) == config
    moved = worker_config(config, 2)
    assert moved.server.metrics_listen == f"127.0.0.1:{BASE + 2}"
    assert moved.model_copy(update={"server": config.server}) == config
    without = parse_config(small_config_data())
    assert worker_config(without, 2) == without
