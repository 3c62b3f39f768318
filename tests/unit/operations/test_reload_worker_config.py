"""A reload in worker i of `serve --workers N` (issues 20, 22): worker 0 serves every worker's
metrics on `server.metrics_listen`, the others none, so the reloader compares the file's config
after the same adjustment (extproc.operations.workers.worker_config): an unchanged metrics_listen
is no restart-only change; a changed one still is in worker 0 (the running value stays, with a
warning) and is nothing to the others."""

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
    served = f"127.0.0.1:{BASE}" if index == 0 else None
    assert receiver.config.server.metrics_listen == served
    reloader = ConfigReloader(receiver, path, adjust=adjust)
    caplog.set_level(logging.INFO, logger="extproc.operations.reload")

    # A change of no restart-only field: applied, no restart warning, the worker's metrics kept.
    path.write_text(yaml.safe_dump(data(slots=2)))
    assert reloader.reload(path.read_bytes())
    assert restart_warnings(caplog) == []
    assert receiver.config.providers[0].models["m"].limits.max_global_in_flight_request_slots == 2
    assert receiver.config.server.metrics_listen == served

    # The file's metrics_listen really moves: worker 0 needs a restart (the running value
    # stays); the others serve no metrics, so nothing changed for them.
    path.write_text(yaml.safe_dump(data(metrics_port=BASE + 100, slots=3)))
    assert reloader.reload(path.read_bytes())
    if index == 0:
        assert len(restart_warnings(caplog)) == 1 and "server.metrics_listen changed" in restart_warnings(caplog)[0]
    else:
        assert restart_warnings(caplog) == []
    assert receiver.config.server.metrics_listen == served
    assert receiver.config.providers[0].models["m"].limits.max_global_in_flight_request_slots == 3
    assert len(receiver.applied) == 2


def test_worker_config_leaves_the_metrics_to_worker_0():
    config = parse_config(data())
    assert worker_config(config, 0) == config
    other = worker_config(config, 2)
    assert other.server.metrics_listen is None
    assert other.model_copy(update={"server": config.server}) == config
    without = parse_config(small_config_data())
    assert worker_config(without, 2) == without


@pytest.mark.parametrize("flag", [2, None], ids=["--workers 2", "server.workers"])
def test_a_reload_keeps_the_workers_count_the_server_runs(tmp_path, caplog, flag):
    """`server.workers` is restart-only. With `serve --workers 2` the flag's count replaces the
    file's at every reload (the file moving to 3 is nothing to the running workers, no warning);
    without the flag, the file's move to 3 needs a restart and 2 stays (server.workers 2 at start)."""
    start = data()
    start["server"]["workers"] = 2
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump(start))
    adjust = partial(worker_config, index=1, workers=flag)
    receiver = Receiver(adjust(parse_config(start)))
    reloader = ConfigReloader(receiver, path, adjust=adjust)
    caplog.set_level(logging.INFO, logger="extproc.operations.reload")
    moved = data(slots=2)
    moved["server"]["workers"] = 3
    path.write_text(yaml.safe_dump(moved))
    assert reloader.reload(path.read_bytes())
    assert receiver.config.server.workers == 2
    assert receiver.config.providers[0].models["m"].limits.max_global_in_flight_request_slots == 2
    warnings = restart_warnings(caplog)
    assert (warnings == []) if flag else (len(warnings) == 1 and "server.workers changed" in warnings[0])


def test_worker_config_takes_the_flags_workers_count():
    config = parse_config(data())
    assert worker_config(config, 0, workers=1) == config  # the file's count already
    three = worker_config(config, 2, workers=3)
    assert (three.server.workers, three.server.metrics_listen, three.server.listen) == (3, None, config.server.listen)
