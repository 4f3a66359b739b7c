"""docker-compose.yml stays runnable: every service's command is a real `npu-pool` subcommand
whose flags parse, and every NPUPOOL_* variable names a real setting."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from npu_pool.cli import COMMANDS
from schemas.config import Settings

pytestmark = pytest.mark.fast

COMPOSE = Path(__file__).resolve().parent.parent / "docker-compose.yml"


def parser_for(command: str) -> argparse.ArgumentParser:
    if command == "batcher":
        from batcher.service import build_parser
    elif command == "worker":
        from npu_worker.service import build_parser
    elif command == "batch":
        from producer.batch.cli import build_parser
    elif command == "gateway":
        from producer.gateway.cli import build_parser
    else:
        pytest.fail(f"no flag check for `npu-pool {command}` yet")
    return build_parser()


def test_every_compose_service_runs_a_real_npu_pool_command_with_valid_flags() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    pool_services = {name: s for name, s in services.items() if "npu-pool" in s.get("command", [])}
    assert {"batcher", "worker-0", "worker-1", "batch-worker", "gateway"} <= set(pool_services)
    for name, service in pool_services.items():
        program, command, *flags = service["command"]
        assert program == "npu-pool" and command in COMMANDS, name
        try:
            parser_for(command).parse_args(flags)
        except SystemExit:
            pytest.fail(f"{name}: `npu-pool {command} {' '.join(flags)}` does not parse")
        for variable in service.get("environment", {}):
            if variable.startswith("NPUPOOL_") and variable != "NPUPOOL_HOME":
                setting = variable.removeprefix("NPUPOOL_").lower()
                assert setting in Settings.model_fields, f"{name}: {variable} is no setting"


def test_redis_service_keeps_an_append_only_file_and_a_healthcheck() -> None:
    redis_service = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
    assert "--appendonly" in redis_service["command"]
    assert "redis-cli" in " ".join(redis_service["healthcheck"]["test"])


def test_dockerfile_builds_a_cpu_image_by_default_and_has_an_ascend_target() -> None:
    stages = [
        line.split()[-1]
        for line in (COMPOSE.parent / "Dockerfile").read_text().splitlines()
        if line.startswith("FROM ")
    ]
    assert stages[-1] == "cpu" and "ascend" in stages
