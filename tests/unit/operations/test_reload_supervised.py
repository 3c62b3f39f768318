"""Nothing ends hot reload (issue 29 item 9): an unexpected error while reloading (a bug, not a
bad file) fails that reload only, logged with its traceback and counted as a failure; the
watcher runs supervised (extproc.supervision, task `config_reload`), so even an error of the
watch itself is restarted and the next change of the file is applied."""

from __future__ import annotations

import asyncio
import logging

import yaml

from extproc import metrics
from extproc.config import Config, parse_config
from extproc.operations.reload import RELOAD_TASK, ConfigReloader
from tests.support.configs import small_config_data


class Receiver:
    """The running server, whose first `fail` swaps raise as a bug would."""

    def __init__(self, config: Config, fail: int = 0):
        self.config = config
        self.fail = fail

    def apply_config(self, new: Config) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("a bug while building the new config")
        self.config = new


def data(slots: int) -> dict:
    config = small_config_data(server={"reload_poll_seconds": 0.05})
    config["providers"][0]["models"]["m"]["limits"]["max_global_in_flight_request_slots"] = slots
    return config


def slots(receiver: Receiver) -> int:
    return receiver.config.providers[0].models["m"].limits.max_global_in_flight_request_slots


def failures() -> float:
    return metrics.CONFIG_RELOADS.labels("failure")._value.get()


def restarts() -> float:
    return metrics.RESTARTS.labels(RELOAD_TASK)._value.get()


async def until(predicate, within_seconds: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + within_seconds
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_an_unexpected_error_fails_one_reload_and_the_watcher_goes_on(tmp_path, caplog):
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump(data(4)))
    receiver = Receiver(parse_config(data(4)), fail=1)
    reloader = ConfigReloader(receiver, path)
    caplog.set_level(logging.INFO, logger="extproc.operations.reload")
    failed_before = failures()
    watcher = asyncio.create_task(reloader.run_forever())
    try:
        path.write_text(yaml.safe_dump(data(3)))
        assert await until(lambda: failures() == failed_before + 1)
        assert slots(receiver) == 4  # the running config stays
        [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "routing config not reloaded" in record.getMessage() and record.exc_info is not None
        path.write_text(yaml.safe_dump(data(2)))
        assert await until(lambda: slots(receiver) == 2)
        assert not watcher.done() and reloader.reloads == 1
    finally:
        watcher.cancel()


async def test_an_error_of_the_watch_itself_is_restarted(tmp_path, monkeypatch):
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump(data(4)))
    receiver = Receiver(parse_config(data(4)))
    reloader = ConfigReloader(receiver, path)
    real = reloader._signature
    broken = iter([RuntimeError("an unexpected error of the watch")])

    def signature():
        for error in broken:
            raise error
        return real()

    monkeypatch.setattr(reloader, "_signature", signature)
    restarted_before = restarts()
    watcher = asyncio.create_task(reloader.run_forever())
    try:
        assert await until(lambda: restarts() == restarted_before + 1)
        path.write_text(yaml.safe_dump(data(2)))
        assert await until(lambda: slots(receiver) == 2)
        assert not watcher.done()
    finally:
        watcher.cancel()
